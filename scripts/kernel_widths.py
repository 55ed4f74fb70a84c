"""What a forward over w tokens costs with each commit's engine: the chain of #24 in one interleaved run.

    python scripts/kernel_widths.py --workspace WS --commit NAME=REV [...] [--depths 0,77] [--flash-attn off]
                                    [--repeats 2] [--threads 1] [--out F]

For a llama.cpp workspace that carries the engine's source: stock's engine and each commit's own build
(`workbench.engine_source.engine_tool`), alternating, under the machine's timing gate:
- `llama-bench -p W -n 0 -d DEPTH` at widths 1-16 (one forward over W prompt tokens after DEPTH tokens of
  context: the cost model's width profile; llama.cpp computes logits for the last position only there);
- the kernel bench's whole forward of matmuls per width (every position's logits, as verification computes).
A commit's binaries run in the sandbox and their timings are the candidate build's own account (a commit of
the kernel library, or any agent's). The fastest of each cell's repeats is reported, and each width's ratio
to width 1 of the same engine; on a noisy machine the median over passes of each pass's own ratio (w1 and wN
timed in the same llama-bench call) is the steadier figure, reported beside it (`ratio_median`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from costmodel.kernels import bench_args, parse_rows, run_bench, stock_bench
from decoder.engines.llamacpp_build import binary
from workbench.engine_source import engine_tool, engine_tree
from workbench.gate import measurement_lock
from workbench.kernel_check import run_sandboxed
from workbench.workspace import Workspace, WorkspaceError

WIDTHS = (1, 2, 3, 4, 8, 16)


def _llama_bench(ws, commit: str | None, exe: Path, depth: int, fa: str, threads: int) -> dict[int, float]:
    model = ws.config.target.resolve()
    cmd = [str(exe), "-m", str(model), "-p", ",".join(map(str, WIDTHS)), "-n", "0", "-d", str(depth), "-t",
           str(threads), "-r", "3", "-o", "json", "--repack", "0", "-fa", "1" if fa == "on" else "0"]
    if commit is None:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, stdin=subprocess.DEVNULL).stdout
    else:
        out = run_sandboxed(ws, exe, shlex.join(cmd) + " 2>/dev/null", 2**20).decode()
    rows = json.loads(out)
    return {int(r["n_prompt"]): min(float(x) for x in r["samples_ns"]) / 1e6 for r in rows}


def _kernel_forward(ws, commit: str | None, exe: Path, threads: int) -> dict[int, float]:
    if commit is None:
        rows = run_bench(exe, ws.config.target.resolve(), threads=threads, widths=WIDTHS, min_ms=80.0)
    else:
        args = bench_args(ws.config.target.resolve(), threads=threads, widths=WIDTHS, min_ms=80.0)
        rows = parse_rows(run_sandboxed(ws, exe, shlex.join([str(exe), *args]), 2**20).decode())
    return {int(r["width"]): float(r["us"]) / 1000.0 for r in rows if r["type"] == "forward"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workspace", required=True, type=Path)
    p.add_argument("--commit", action="append", default=[], metavar="NAME=REV")
    p.add_argument("--depths", default="0,77")
    p.add_argument("--flash-attn", default="off", help="off, on or off,on")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    try:
        ws = Workspace(args.workspace)
        commits: list[tuple[str, str | None]] = [("stock", None)]
        for item in args.commit:
            name, _, rev = item.partition("=")
            commits.append((name, ws.rev(rev)))
    except (WorkspaceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not ws.config.engine_source:
        print(f"error: {args.workspace} does not carry the engine's source (init --with-source)", file=sys.stderr)
        return 2
    stock_tree = engine_tree(ws, ws.stock_commit)
    tools = {}
    for name, rev in commits:  # built first (untimed): each commit's engine, or stock's cache build
        if rev is None or engine_tree(ws, rev) == stock_tree:
            tools[name] = (None, binary("llama-bench"), stock_bench())
        else:
            tools[name] = (rev, engine_tool(ws, rev, "llama-bench"), engine_tool(ws, rev, "ggml-matmul-bench"))
    depths = [int(d) for d in args.depths.split(",")]
    fas = args.flash_attn.split(",")
    best: dict[str, dict[str, dict[int, float]]] = {}
    per_pass: dict[str, dict[str, list[dict[int, float]]]] = {}
    with measurement_lock():
        for rep in range(args.repeats):
            for name, (rev, lb, kb) in tools.items():
                cells = {f"llama-bench d{d} fa-{fa}": _llama_bench(ws, rev, lb, d, fa, args.threads)
                         for d in depths for fa in fas}
                cells["matmuls (every position's logits)"] = _kernel_forward(ws, rev, kb, args.threads)
                for cell, ms in cells.items():
                    per_pass.setdefault(name, {}).setdefault(cell, []).append({w: v / ms[1] for w, v in ms.items()})
                    keep = best.setdefault(name, {}).setdefault(cell, {})
                    for w, v in ms.items():
                        keep[w] = min(v, keep.get(w, float("inf")))
                print(f"pass {rep + 1}/{args.repeats}: {name} measured", file=sys.stderr, flush=True)
    report = {"workspace": str(ws.path), "threads": args.threads, "widths": list(WIDTHS),
              "commits": {n: (r or ws.stock_commit) for n, r in commits}, "ms": {}, "ratio_to_w1": {},
              "ratio_median": {}, "passes": args.repeats}
    for name, cells in best.items():
        for cell, ms in cells.items():
            report["ms"].setdefault(name, {})[cell] = {str(w): round(v, 3) for w, v in sorted(ms.items())}
            report["ratio_to_w1"].setdefault(name, {})[cell] = {str(w): round(v / ms[1], 3)
                                                                  for w, v in sorted(ms.items())}
            med = {w: statistics.median(r[w] for r in per_pass[name][cell]) for w in sorted(ms)}
            report["ratio_median"].setdefault(name, {})[cell] = {str(w): round(v, 3) for w, v in med.items()}
            print(f"{name:10s} {cell:36s} " + "  ".join(f"w{w} {v:6.1f} ({v / ms[1]:.2f}x, median {med[w]:.2f}x)"
                                                         for w, v in sorted(ms.items())))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
