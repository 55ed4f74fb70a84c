"""`specpilot w12 stats --model DIR [--group-size G] [--json]`: what the lossless 12-bit format would give.

Wire into the main parser with `add_parser(subparsers)`; the subcommand sets `func(args) -> int`.
Runs on its own too: `python -m workbench.w12_cli stats --model DIR` is `specpilot w12 stats --model DIR`.
Errors a user can meet (no such directory, no safetensors, a bad group size) print one line
`error: ...` on stderr and return 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from workbench.cli_util import fail, positive_int, run_group


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f}"


def format_stats(report: dict) -> str:
    """A per-tensor table and the totals (all matrices, and the ones apply_w12 packs)."""
    rows = [("tensor", "shape", "escapes", "escape rate", "bits/w", "saved MiB", "packed")]
    for r in report["tensors"]:
        rows.append((r["name"], "x".join(map(str, r["shape"])), str(r["escapes"]), f"{r['escape_rate']:.2e}",
                     f"{r['bits_per_weight']:.3f}", _mb(r["bytes_saved"]), "yes" if r["swapped"] else "no"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    group = "per tensor" if report["group_size"] is None else f"groups of {report['group_size']}"
    for key, label in (("total", "all matrices"), ("swapped", "packed by apply_w12")):
        t = report[key]
        lines.append(f"{label}: {t['tensors']} tensors, {t['numel']:,} weights, escape rate {t['escape_rate']:.2e}, "
                     f"{t['bits_per_weight']:.3f} bits/weight, {_mb(t['bytes_bf16'])} -> {_mb(t['bytes_w12'])} MiB "
                     f"(saves {_mb(t['bytes_saved'])} MiB)")
    lines.append(f"exponent base: {group}")
    return "\n".join(lines)


def _cmd_stats(args: argparse.Namespace) -> int:
    from decoder.models import ModelLoadError
    from decoder.w12 import w12_stats

    try:
        report = w12_stats(args.model, args.group_size)
    except (ModelLoadError, ValueError, OSError) as e:
        return fail(str(e))
    print(json.dumps(report) if args.json else format_stats(report))
    return 0


def add_parser(subparsers) -> None:
    """Add the `w12` command and its `stats` subcommand to an argparse subparsers object."""
    w = subparsers.add_parser("w12", help="the lossless 12-bit weight format: checkpoint statistics")
    sub = w.add_subparsers(dest="w12_command", required=True, metavar="{stats}")
    p = sub.add_parser("stats", help="escape rate, bits per weight and bytes saved, per tensor and in total")
    p.add_argument("--model", required=True, help="a local checkpoint directory with *.safetensors files")
    p.add_argument("--group-size", type=positive_int, default=None,
                   help="weights per exponent group along a row (default: one base per tensor)")
    p.add_argument("--json", action="store_true", help="print JSON on stdout")
    p.set_defaults(func=_cmd_stats)


def main(argv: list[str] | None = None) -> int:
    """Run `specpilot w12 ARGS` on its own (ARGS start with the subcommand)."""
    return run_group("w12", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
