"""The executors (workbench/executor.py): the evaluation record and its checks, the one-line errors of
`--executor ray`, and, with Ray installed, a local multi-node cluster (a head and two worker nodes from
`ray.cluster_utils.Cluster`): a loop round through the ray executor keeps what the local one keeps, and a
worker's raylet killed mid-evaluation costs a retry, not the attempt. Without Ray those tests skip."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import needs_demo
from workbench.executor import (
    ExecutorError,
    ExecutorSettings,
    MalformedRecord,
    RayEvaluator,
    apply_record,
    check_record,
    evaluate_payload,
    evaluation_payload,
)
from workbench.workspace import init_demo

HAVE_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed (pip install -e .[ray])")
SMALL = {"forcing_max_new_tokens": 16, "prompt_limit": 4, "hidden": 1, "limits": {"request_s": 30, "start_s": 90},
         "bench": {"noise_pairs": 1}}


def _record(**over) -> dict:
    rec = {"version": 1, "branch": "b", "head": "h" * 40,
           "attempt": {"status": "discard", "reason": "forcing: 1 unexplained mismatch", "speedup": None,
                       "speedup_over_ar": None, "ci95": None, "points": None},
           "evaluations": [{"stage": "smoke", "status": "keep", "reason": "ok", "metrics": {}, "forcing": None},
                           {"stage": "forcing", "status": "discard", "reason": "1 unexplained", "metrics": {},
                            "forcing": {"match_rate": 0.9, "positions_checked": 10, "mismatches": []}}],
           "say": []}
    rec.update(over)
    return rec


def test_settings_come_from_flags_over_the_table_and_bad_values_are_named():
    s = ExecutorSettings.resolve(None, None, {"kind": "ray", "address": "10.0.0.1:6379", "resource": "h200"})
    assert (s.kind, s.address, s.resource, s.max_retries) == ("ray", "10.0.0.1:6379", "h200", 2)
    s = ExecutorSettings.resolve("local", None, {"kind": "ray"})
    assert s.kind == "local"
    assert ExecutorSettings.resolve(None, None, None).kind == "local"
    for table, word in (({"kind": "dask"}, "dask"), ({"max_retries": -1}, "max_retries = -1"),
                        ({"resource": ""}, "resource = ''"), ({"nodes": 3}, "nodes"), ("ray", "'ray'")):
        with pytest.raises(ExecutorError, match=word):
            ExecutorSettings.resolve(None, None, table)


def test_a_record_the_head_cannot_store_is_malformed():
    assert check_record(_record(), "b", "h" * 40)
    bad = [("a list", []), ("version", _record(version=2)), ("for 'c'", _record(branch="c")),
           ("known status", _record(attempt={"status": "won", "reason": "x"})),
           ("speedup", _record(attempt={**_record()["attempt"], "speedup": "fast"})),
           ("no evaluations", _record(evaluations=[])),
           ("stage/status", _record(evaluations=[{"stage": "smoke", "status": "keep"}])),
           ("the last stage says keep", _record(evaluations=_record()["evaluations"][:1]))]
    for word, rec in bad:
        with pytest.raises(MalformedRecord, match=word):
            check_record(rec, "b", "h" * 40)


@needs_demo
def test_a_candidate_round_trips_through_a_bundle_and_a_throwaway_workspace(tmp_path):
    """No Ray: the node's side called directly. A protected edit is rejected by the guard there, the
    record comes back whole, and the head stores its one stage once; the bundle holds git objects only."""
    from tests.test_forcing import make_branch

    ws = init_demo(tmp_path / "demo", **SMALL)
    make_branch(ws, "hostile", {"specpilot.toml": ("max_new_tokens = 16", "max_new_tokens = 1")}, "protected")
    # A candidate's worktree config never reaches the host's git: the bundle is made from the main repository.
    (ws.worktree_path("hostile") / ".git").write_text("gitdir: /nonexistent\n")
    payload = evaluation_payload(ws, "hostile", ws.stock_commit, 1.0, 5.0, 1.02)
    assert payload["bundle"].startswith(b"# v2 git bundle") and payload["stock"]
    rec = evaluate_payload(payload)
    check_record(rec, "hostile", ws.head("hostile"))
    assert rec["attempt"]["status"] == "rejected" and "protected" in rec["attempt"]["reason"]
    att = apply_record(ws, "hostile", ws.stock_commit, rec)
    assert att.status == "rejected"
    evals = ws.memory.list_evaluations(ws.branch("hostile").id)
    assert [(e.stage, e.status) for e in evals] == [("guard", "rejected")]
    ws.close()


def _auto(*argv: str, pre: str = "") -> subprocess.CompletedProcess:
    code = f"import sys\n{pre}\nfrom workbench.tui_entry import main\nsys.exit(main({list(argv)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@needs_demo
def test_executor_errors_are_one_line_with_a_documented_status(tmp_path):
    ws = init_demo(tmp_path / "demo", **SMALL)
    ws.close()
    base = ["--auto", "--workspace", str(ws.path), "--rounds", "1", "--no-global-memory"]
    r = _auto(*base, "--executor", "ray", pre="sys.modules['ray'] = None  # as if not installed")
    assert r.returncode == 6 and r.stderr.count("\n") == 1 and "pip install -e .[ray]" in r.stderr, r.stderr
    r = _auto(*base, "--ray-address", "127.0.0.1:1")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "only with --executor ray" in r.stderr, r.stderr
    (ws.path / "specpilot.toml").write_text((ws.path / "specpilot.toml").read_text() + "\n[executor]\nkind = \"k8s\"\n")
    r = _auto(*base)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "'k8s'" in r.stderr, r.stderr
    if HAVE_RAY:
        r = _auto(*base, "--executor", "ray", "--ray-address", "127.0.0.1:1")
        assert r.returncode == 6 and r.stderr.count("\n") == 1 and "cannot reach" in r.stderr, r.stderr


# -- a local multi-node cluster ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    """A head (no evaluation slot: the store and git stay there) and two worker nodes with one `cpu_eval`
    each; small, for a shared 2-core machine."""
    if not HAVE_RAY:
        pytest.skip("ray is not installed (pip install -e .[ray])")
    import ray
    from ray.cluster_utils import Cluster

    small = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
    c = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
    workers = [c.add_node(**small, resources={"cpu_eval": 1}) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, logging_level="ERROR")
    yield c, workers
    ray.shutdown()
    c.shutdown()


def _lines() -> tuple[list[str], callable]:
    out: list[str] = []
    return out, lambda m: (out.append(m), print(m, file=sys.stderr))


@pytest.mark.slow
@needs_demo
def test_a_round_on_the_cluster_keeps_what_the_local_executor_keeps(tmp_path, cluster):
    """One round, 2 tuner agents (seed 0), the same small demo: local, then through the ray executor."""
    from workbench.loop import Loop, LoopOptions

    opts = LoopOptions(rounds=1, agents=2, budget_minutes=60, use_global_memory=False, auto_accept=False)
    kept, minutes = {}, {}
    for kind in ("local", "ray"):
        ws = init_demo(tmp_path / kind, **SMALL)
        lines, say = _lines()
        ev = RayEvaluator(ExecutorSettings("ray"), say) if kind == "ray" else None
        t0 = time.monotonic()
        s = Loop(ws, opts, progress=say, evaluator=ev).run()
        minutes[kind] = (time.monotonic() - t0) / 60
        if ev is not None:
            ev.shutdown()
            assert any(ln.startswith("ray: running evaluations: node ") for ln in lines)
        r = s["rounds"][0]
        print(f"{kind}: " + "; ".join(f"{a['branch']} {a['status']} {a['speedup']}" for a in r["attempts"]),
              file=sys.stderr)
        # What the round keeps: the mechanisms merged into the new base and recorded. (An attempt's own keep
        # or discard near the threshold follows the timing noise of a loaded machine: in one run here the
        # drafting attempt measured 1.19x [0.99, 1.40] locally, discarded, and 1.22x [1.10, 1.34] on a
        # node, kept; the combination then lost to lean forward alone, so both rounds kept the same.)
        kept[kind] = sorted((m.gap_family, m.name) for m in ws.memory.list_mechanisms())
        ws.close()
    print(f"round minutes: {minutes}; kept: {kept}", file=sys.stderr)
    assert kept["ray"] == kept["local"] and kept["local"], kept


class _Lean:
    """A scripted agent: switches on the lean forward (a real, large gain) and commits."""

    name = "scripted"

    def run(self, ctx):
        from workbench.agents.base import AgentResult

        f = ctx.worktree / "system.toml"
        f.write_text(f.read_text().replace("lean_forward = false", "lean_forward = true"))
        g = ctx.git()
        g.add("system.toml")
        g.commit("-q", "-m", "lean forward")
        return AgentResult(True, "lean forward on", mechanism="lean-forward")


@pytest.mark.slow
@needs_demo
def test_a_worker_killed_mid_evaluation_costs_a_retry_not_the_attempt(tmp_path, cluster):
    from workbench.forcing import stock_reference
    from workbench.loop import Loop, LoopOptions

    c, workers = cluster
    ws = init_demo(tmp_path / "demo", **SMALL)
    stock_reference(ws, progress=False)
    lines, say = _lines()
    ev = RayEvaluator(ExecutorSettings("ray"), say)
    loop = Loop(ws, LoopOptions(rounds=1, agents=1, budget_minutes=60, use_global_memory=False,
                                auto_accept=False), progress=say, evaluator=ev)
    loop.make_agent = lambda: _Lean()
    loop._ensure_refs()
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("summary", loop.run_round(1)), daemon=True)
    t.start()
    victim = None
    deadline = time.monotonic() + 900
    while victim is None and time.monotonic() < deadline and t.is_alive():
        running = ev.poll()
        for _branch, (node, _ip) in running.items():
            victim = next((w for w in workers if w.node_id == node), None)
        time.sleep(1)
    assert victim is not None, "no evaluation reached a worker node"
    time.sleep(5)  # into the evaluation: its systems are running
    victim.kill_raylet()
    say(f"test: killed the raylet of node {victim.node_id[:8]}")
    t.join(timeout=1500)
    ev.shutdown()
    assert not t.is_alive(), "the round did not finish"
    s = out["summary"]
    assert len(s["attempts"]) == 1, s["attempts"]
    att = s["attempts"][0]
    assert att["status"] == "keep", att  # the retry on the other node ran the whole cascade
    b = ws.branch(att["branch"])
    stages = [e.stage for e in ws.memory.list_evaluations(b.id)]
    assert stages == ["smoke", "forcing", "bench"], stages  # recorded once
    nodes = {w.split()[0] for ln in lines if ln.startswith("ray: running evaluations: ")
             for w in ln.split("node ")[1:] if att["branch"] in w}
    assert len(nodes) == 2 and victim.node_id[:8] in nodes, nodes  # started on the killed node, ended on the other
    ws.close()
