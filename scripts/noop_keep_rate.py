"""How often the cascade keeps a candidate that changes nothing (issue #22: 0 of >= 20 must be kept).

Each no-op candidate is a branch from stock whose only commit adds a comment to decoder/generate.py;
it runs the whole cascade (guard, smoke, forcing, paired benchmark against stock, noise threshold)
exactly as an agent's branch would. Prints one line per candidate and a JSON summary at the end
(also written to --out): how many were kept, the keep threshold, the measured noise, every speedup.

    python scripts/noop_keep_rate.py --workspace build/noop-ws --n 20 --out build/noop.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from workbench.cascade import evaluate, noise_floor
from workbench.forcing import stock_reference
from workbench.workspace import STOCK_TAG, Workspace, init_demo


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workspace", type=Path, required=True, help="a demo workspace (created when missing)")
    ap.add_argument("--n", type=int, default=20, help="how many no-op candidates (default 20)")
    ap.add_argument("--out", type=Path, help="write the JSON summary here too")
    args = ap.parse_args()
    ws = Workspace(args.workspace) if (args.workspace / "specpilot.toml").exists() else init_demo(args.workspace)
    stock_reference(ws, progress=False)
    base = ws.rev(STOCK_TAG)
    t0 = time.time()
    noise = noise_floor(ws, base, progress=print)
    print(f"noise floor: {json.dumps(noise)}", flush=True)
    rows = []
    for i in range(args.n):
        name = f"noop-{int(t0)}-{i:02d}"
        ws.create_branch(name, agent="noop-experiment", direction="none")
        g = ws.worktree_git(name)
        f = ws.worktree_path(name) / "decoder" / "generate.py"
        f.write_text(f.read_text() + f"\n# no-op candidate {i}: changes nothing\n")
        g.add("decoder/generate.py")
        g.commit("-q", "-m", f"no-op {i}")
        att = evaluate(ws, name, base, 1.0, 1e9)
        rows.append({"branch": name, "status": att.status, "speedup": att.speedup, "ci95": att.ci95,
                     "reason": att.reason})
        print(f"{i:2d} {att.status:9s} {att.speedup or 0:.3f}x {att.ci95}  {att.reason[:110]}", flush=True)
    speedups = [r["speedup"] for r in rows if r["speedup"] is not None]
    summary = {"candidates": len(rows), "kept": sum(r["status"] == "keep" for r in rows),
               "statuses": {s: sum(r["status"] == s for r in rows) for s in {r["status"] for r in rows}},
               "noise_floor": noise, "speedups": speedups,
               "speedup_mean": statistics.fmean(speedups) if speedups else None,
               "speedup_max": max(speedups) if speedups else None,
               "minutes": (time.time() - t0) / 60, "rows": rows}
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
