"""One loop round's wall time on the local executor and on local Ray clusters (#20), one JSON.

    python scripts/ray_round_time.py --out bench/results/ray-round-time.json [--configs local,1x1,1x2,2x2]

Each config runs the same round on a fresh small demo workspace (4 visible prompts and 1 hidden, 16 forced
tokens, one noise pair): three scripted agents through the loop's agent interface on pinned directions
(the lean forward: a clear keep; `method = "ar"`: a lossless clear loss at the bench; a verifier that trusts
the drafter: discarded by forcing; `tests/test_ray.py`'s), so the verdicts do not follow timing noise and
what differs is where and how the evaluations run. `WxP` is W worker nodes (`ray.cluster_utils.Cluster`,
one `cpu_eval` each, the head offering none) with P evaluations at once per node (`[executor] per_node`).
Printed per config: minutes, verdicts, and whether an evaluation paused for another's timed run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_ray import LEAN, NO_DRAFTING, NO_VERIFY, SMALL, _Scripted  # noqa: E402 - the test's scripted agents
from workbench.agents.base import Direction  # noqa: E402
from workbench.executor import ExecutorSettings, RayEvaluator  # noqa: E402
from workbench.loop import Loop, LoopOptions  # noqa: E402
from workbench.workspace import init_demo  # noqa: E402

SCRIPT = {"host-overhead": LEAN, "drafting": NO_DRAFTING, "acceptance": NO_VERIFY}


def one_round(root: Path, config: str) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    ws = init_demo(root / config, **SMALL)
    lines: list[str] = []

    def say(m: str) -> None:
        lines.append(m)
        print(f"[{config}] {m}", file=sys.stderr, flush=True)

    cluster = ev = None
    if config != "local":
        workers, per_node = (int(x) for x in config.split("x"))
        small = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
        cluster = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
        for _ in range(workers):
            cluster.add_node(**small, resources={"cpu_eval": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
        ev = RayEvaluator(ExecutorSettings("ray", per_node=per_node), say)
    try:
        loop = Loop(ws, LoopOptions(rounds=1, agents=len(SCRIPT), budget_minutes=120, use_global_memory=False,
                                    auto_accept=False), progress=say, evaluator=ev)
        loop.make_agent = lambda: _Scripted(SCRIPT)
        loop.directions = lambda bd, _ex, _base=None: [Direction(f, 1.0, "pinned") for f in SCRIPT]
        t0 = time.monotonic()
        s = loop.run()
        minutes = (time.monotonic() - t0) / 60
    finally:
        if ev is not None:
            ev.shutdown()
        if cluster is not None:
            ray.shutdown()
            cluster.shutdown()
    r = s["rounds"][0]
    at_once = max((ln.count("node ") for ln in lines if ln.startswith("ray: running evaluations: node ")), default=1)
    out = {"config": config, "minutes": round(minutes, 2), "load_avg_1m": round(os.getloadavg()[0], 2),
           "verdicts": {a["branch"]: a["status"] for a in r["attempts"]},
           "merged": r["integration"]["merged"], "most_evaluations_at_once": at_once,
           "paused_for_a_timed_run": any("paused" in ln for ln in lines)}
    ws.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--configs", default="local,1x1,1x2,2x2")
    p.add_argument("--dir", default="/tmp/ray-round-time")
    args = p.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for config in args.configs.split(","):
        rows.append(one_round(root, config))
        print(json.dumps(rows[-1]), flush=True)
        Path(args.out).write_text(json.dumps({"what": __doc__.splitlines()[0], "cores": os.cpu_count(),
                                              "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
