"""Time decode configs side by side in one process, at one request and in batches, on a workspace's models.

A quick look before a loop or a paired benchmark: each config is a set of DecodeConfig keys over the workspace's
stock `system.toml`; every config decodes the same prompts (B = 1 one at a time through `generate`, B > 1 in
batches of B through the batched engine, as `decoder.serve` does), twice, the second pass in reverse order, and
the script prints seconds per pass, the ratio over the first config and over stock, whether every output equals
the first config's, target tokens per forward and where the time went (the decoder's own phase timer). In-process
and self-timed: the harness (`workbench/measure.py`), which times a system from outside, is what the loop trusts.

    python scripts/config_probe.py --workspace WS --configs CONFIGS.json --prompts PROMPTS.jsonl
        [--tokens 64] [--batch-sizes 1,8] [--threads 2] [--out OUT.json]

CONFIGS.json: {"name": {DecodeConfig keys}, ...}; the first is the reference (e.g. {"ar": {"method": "ar"}}),
and a config named "stock" with no keys is added when missing. PROMPTS.jsonl: one {"text": ...} per line (the
demo's timing prompts: decoder/assets/demo/prompts/code-timing.jsonl).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from decoder.batch import BatchEngine, BatchLM, Request
from decoder.config import ConfigError, DecodeConfig
from decoder.featdraft import FeatureHeads, drafters_dir
from decoder.generate import generate
from decoder.models import ModelLoadError, load_causal_lm, load_tokenizer, torch_dtype
from workbench.workspace import Workspace, WorkspaceError


def _run(cfg: DecodeConfig, prompts: list[list[int]], bs: int, models: dict) -> tuple[float, list, dict]:
    stats = {"tokens": 0, "forwards": 0, "phase_s": {}}

    def add(s) -> None:
        stats["tokens"] += s.new_tokens
        stats["forwards"] += s.target_forwards
        for k, v in s.phase_s.items():
            stats["phase_s"][k] = stats["phase_s"].get(k, 0.0) + v

    out: list = []
    t = time.perf_counter()
    if bs == 1:
        for p in prompts:
            g = generate(cfg, models["target"], p, models["drafter"], heads=models["heads"])
            out.append(g.tokens)
            add(g.stats)
    else:
        for lo in range(0, len(prompts), bs):
            run = BatchEngine(models["bt"], cfg, bs, models["bd"], heads=models["heads"]).run(
                [Request(p, 0.0, i) for i, p in enumerate(prompts[lo : lo + bs])])
            out += [r.tokens for r in run.results]
            add(run.stats)
    return time.perf_counter() - t, out, stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workspace", required=True, type=Path)
    ap.add_argument("--configs", required=True, type=Path, help="JSON: name -> DecodeConfig keys over stock")
    ap.add_argument("--prompts", required=True, type=Path, help="JSONL with a 'text' per line")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt (default 64, the loop's)")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--count", type=int, default=16, help="prompts at B = 1 (at B > 1: 4 x B, as many as there are)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    try:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        if not sizes or min(sizes) < 1 or args.tokens < 1 or args.count < 1 or args.threads < 1:
            raise ValueError
    except ValueError:
        print(f"error: --batch-sizes {args.batch_sizes!r}, --tokens, --count and --threads must be positive "
              f"integers (e.g. --batch-sizes 1,8)", file=sys.stderr)
        return 2
    try:
        ws = Workspace(args.workspace)
        stock = DecodeConfig.load(ws.path / ws.config.config_file)
        wanted = json.loads(args.configs.read_text())
        if not isinstance(wanted, dict) or not wanted:
            raise ValueError("a JSON object of name -> config keys")
        configs = {n: dataclasses.replace(stock, **{**keys, "max_new_tokens": args.tokens})
                   for n, keys in wanted.items()}
        configs.setdefault("stock", dataclasses.replace(stock, max_new_tokens=args.tokens))
        rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
        texts = [r["text"] for r in rows]
    except (WorkspaceError, ConfigError, OSError, ValueError, TypeError, KeyError) as e:
        print(f"error: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    dep = ws.config
    try:
        target = load_causal_lm(dep.target, "target", dep.dtype)
        drafter = load_causal_lm(dep.drafter, "drafter", dep.dtype) if dep.drafter else None
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = load_tokenizer(dep.tokenizer)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    heads = FeatureHeads(drafters_dir(dep.target), target.config, torch_dtype(dep.dtype), torch.device("cpu"))
    models = {"target": target, "drafter": drafter, "heads": heads, "bt": BatchLM(target),
              "bd": BatchLM(drafter) if drafter is not None else None}
    names = list(configs)
    report: dict = {"workspace": str(ws.path), "tokens": args.tokens, "threads": args.threads, "points": {}}
    for bs in sizes:
        ps = prompts[: args.count] if bs == 1 else prompts[: 4 * bs]
        for n in names:  # warm: packing, kernels, first shapes
            _run(configs[n], ps[:bs], bs, models)
        secs = dict.fromkeys(names, 0.0)
        outs: dict = {}
        stats: dict = {}
        for order in (names, names[::-1]):
            for n in order:
                dt, outs[n], stats[n] = _run(configs[n], ps, bs, models)
                secs[n] += dt / 2
        point = {}
        for n in names:
            same = sum(a == b for a, b in zip(outs[n], outs[names[0]], strict=True))
            point[n] = {"s": round(secs[n], 3), "x_first": round(secs[names[0]] / secs[n], 3),
                        "x_stock": round(secs["stock"] / secs[n], 3), "same_as_first": f"{same}/{len(ps)}",
                        "tokens_per_forward": round(stats[n]["tokens"] / max(1, stats[n]["forwards"]), 2),
                        "phase_s": {k: round(v, 2) for k, v in stats[n]["phase_s"].items() if v >= 0.01}}
            p = point[n]
            print(f"B={bs} {n:24s} {p['s']:7.2f} s  x{names[0]} {p['x_first']:.3f}  xstock {p['x_stock']:.3f}  "
                  f"same {p['same_as_first']}  tok/fw {p['tokens_per_forward']:.2f}  {p['phase_s']}", flush=True)
        report["points"][str(bs)] = point
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
