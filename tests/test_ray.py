"""The executors (workbench/executor.py): the evaluation record and its checks, the one-line errors of
`--executor ray`, and, with Ray installed, a local multi-node cluster (a head and two worker nodes from
`ray.cluster_utils.Cluster`): a loop round of scripted agents through the ray executor reaches the local
one's verdicts, a worker's raylet killed mid-evaluation costs a retry, not the attempt, and `--auto` killed
mid-evaluation resumes by evaluating the branch's commit again (also with the local executor). Without Ray
the cluster's tests skip."""

from __future__ import annotations

import importlib.util
import io
import json
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
                        ({"resource": ""}, "resource = ''"), ({"nodes": 3}, "nodes"), ("ray", "'ray'"),
                        ({"per_node": 0}, "per_node = 0"), ({"per_node": 2.5}, "per_node = 2.5"),
                        ({"per_node": True}, "per_node = True"), ({"per_node": 9}, "from 1 to 8")):
        with pytest.raises(ExecutorError, match=word):
            ExecutorSettings.resolve(None, None, table)


def test_evaluations_share_a_node_in_parts_ray_can_hold():
    assert ExecutorSettings.resolve(None, None, None).per_node == 2
    for n in range(1, 9):  # Ray keeps 4 decimals: n parts must still fit in the node's one unit
        share = ExecutorSettings(per_node=n).share
        assert share * n <= 1.0 and share > 1 / n - 1e-4 and round(share, 4) == share
    assert ExecutorSettings(per_node=1).share == 1.0 and ExecutorSettings(per_node=3).share == 0.3333


def test_the_board_relays_each_nodes_phase_and_its_pauses():
    from workbench.executor import _Board, running_line
    from workbench.gate import PAUSED

    board = _Board()
    board.report("r1-a", "aaaaaaaa11", "10.0.0.2", "start", "")
    board.report("r1-b", "aaaaaaaa11", "10.0.0.2", "start", "")
    board.report("r1-a", "aaaaaaaa11", "10.0.0.2", "step", json.dumps({"phase": "bench", "detail": "pass 1"}))
    board.report("r1-b", "aaaaaaaa11", "10.0.0.2", "step", json.dumps({"phase": "forcing", "detail": PAUSED}))
    board.report("r1-b", "bbbbbbbb22", "10.0.0.3", "step", json.dumps({"phase": "smoke"}))  # a lost node's late word
    running, lines, steps = board.take()
    assert lines == [("r1-a", "aaaaaaaa11", "start"), ("r1-b", "aaaaaaaa11", "start")]  # steps are not lines
    line = running_line(running, {b: json.loads(t) for b, t in steps.items()})
    assert line == "node aaaaaaaa (10.0.0.2): r1-a [bench]; node aaaaaaaa (10.0.0.2): r1-b [forcing, paused]"
    board.report("r1-a", "aaaaaaaa11", "10.0.0.2", "end", "")
    running, _lines, steps = board.take()
    assert set(running) == set(steps) == {"r1-b"}


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
    # The interactive app: the same settings and errors, before Textual starts.
    app = ["--workspace", str(ws.path)]
    r = _auto(*app)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "'k8s'" in r.stderr, r.stderr
    (ws.path / "specpilot.toml").write_text((ws.path / "specpilot.toml").read_text().replace('"k8s"', '"ray"')
                                            + "per_node = 0\n")
    r = _auto(*app)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "per_node = 0" in r.stderr, r.stderr
    r = _auto(*app, "--executor", "ray", pre="sys.modules['ray'] = None  # as if not installed")
    assert r.returncode == 2 and "per_node = 0" in r.stderr, r.stderr  # the table's error comes first
    (ws.path / "specpilot.toml").write_text((ws.path / "specpilot.toml").read_text().replace("per_node = 0\n", ""))
    r = _auto(*app, "--executor", "local", "--ray-address", "127.0.0.1:1")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "only with --executor ray" in r.stderr, r.stderr
    r = _auto(*app, "--executor", "ray", pre="sys.modules['ray'] = None  # as if not installed")
    assert r.returncode == 6 and r.stderr.splitlines()[-1].startswith("error: --executor ray: Ray is not installed")
    if HAVE_RAY:
        r = _auto(*app, "--executor", "ray", "--ray-address", "127.0.0.1:1")
        assert r.returncode == 6 and "cannot reach" in r.stderr.splitlines()[-1], r.stderr


# -- a local multi-node cluster ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    """A head (no evaluation slot: the store and git stay there) and two worker nodes with one `cpu_eval`
    each (the first one also `cpu_eval_solo`); small, for a shared 2-core machine."""
    if not HAVE_RAY:
        pytest.skip("ray is not installed (pip install -e .[ray])")
    import ray
    from ray.cluster_utils import Cluster

    small = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
    c = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
    # The first worker also offers `cpu_eval_solo`: evaluations asking for it share that one node.
    workers = [c.add_node(**small, resources={"cpu_eval": 1, **({"cpu_eval_solo": 1} if i == 0 else {})})
               for i in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, logging_level="ERROR")
    yield c, workers
    ray.shutdown()
    c.shutdown()


def _lines() -> tuple[list[str], callable]:
    out: list[str] = []
    return out, lambda m: (out.append(m), print(m, file=sys.stderr))


# Scripted edits whose verdicts do not follow timing noise: family -> (file, old, new, mechanism).
LEAN = ("system.toml", "lean_forward = false", "lean_forward = true", "lean-forward")  # ~1.3-1.4x: a clear keep
NO_DRAFTING = ("system.toml", 'method = "sd"', 'method = "ar"', "no-drafting")  # lossless, ~0.6x: a clear loss
NO_VERIFY = ("decoder/verify.py",  # every drafted token emitted as if accepted: forcing discards it
             "n = (draft == pred[:k]).to(torch.int64).cumprod(0).sum().view(1)\n    return torch.cat([n, pred])",
             "n = torch.tensor([k])\n    return torch.cat([n, draft, pred[k:]])", "trust-the-drafter")
SCRIPT = {"host-overhead": LEAN, "drafting": NO_DRAFTING, "acceptance": NO_VERIFY}


class _Scripted:
    """An agent (the loop's Agent interface) that commits one fixed edit per direction: `script[family]`,
    the lean forward for any other family."""

    name = "scripted"

    def __init__(self, script: dict | None = None) -> None:
        self.script = script or {}

    def run(self, ctx):
        from workbench.agents.base import AgentResult

        rel, old, new, mechanism = self.script.get(ctx.direction.family, LEAN)
        f = ctx.worktree / rel
        text = f.read_text()
        if old not in text:
            return AgentResult(False, f"{rel}: {old!r} not found")
        f.write_text(text.replace(old, new, 1))
        g = ctx.git()
        g.add(rel)
        g.commit("-q", "-m", mechanism)
        return AgentResult(True, f"{mechanism} ({rel})", mechanism=mechanism)


def _pinned(bd: dict, _exhausted: set, _base: str | None = None) -> list:
    """The round's directions fixed to SCRIPT's families (which gap measures largest follows timing noise too)."""
    from workbench.agents.base import Direction

    return [Direction(f, float(bd["families"].get(f, 0.0)), f"{f}: pinned by the test") for f in SCRIPT]


@pytest.mark.slow
@needs_demo
def test_a_round_on_the_cluster_keeps_what_the_local_executor_keeps(tmp_path, cluster):
    """One round, 3 scripted agents through the loop's agent interface, the same small demo: local, then
    through the ray executor. Each candidate sits far from the keep threshold (a clear win, a lossless
    clear loss, one forcing discards), so every stage's verdict and the merged mechanisms must agree."""
    from workbench.loop import Loop, LoopOptions

    opts = LoopOptions(rounds=1, agents=len(SCRIPT), budget_minutes=60, use_global_memory=False, auto_accept=False)
    kept, verdicts, merged, minutes = {}, {}, {}, {}
    for kind in ("local", "ray"):
        ws = init_demo(tmp_path / kind, **SMALL)
        lines, say = _lines()
        ev = RayEvaluator(ExecutorSettings("ray"), say) if kind == "ray" else None
        loop = Loop(ws, opts, progress=say, evaluator=ev)
        loop.make_agent = lambda: _Scripted(SCRIPT)
        loop.directions = _pinned
        t0 = time.monotonic()
        s = loop.run()
        minutes[kind] = (time.monotonic() - t0) / 60
        if ev is not None:
            ev.shutdown()
            assert any(ln.startswith("ray: running evaluations: node ") for ln in lines)
        r = s["rounds"][0]
        print(f"{kind}: " + "; ".join(f"{a['branch']} {a['status']} {a['speedup']}: {a['reason']}"
                                      for a in r["attempts"]), file=sys.stderr)
        # Every attempt's verdict, stage by stage as the store holds it (a node's record is written on the head).
        verdicts[kind] = {a["branch"]: (a["status"], [(e.stage, e.status) for e in
                                                      ws.memory.list_evaluations(ws.branch(a["branch"]).id)])
                          for a in r["attempts"]}
        merged[kind] = r["integration"]["merged"]
        kept[kind] = sorted((m.gap_family, m.name) for m in ws.memory.list_mechanisms())
        ws.close()
    print(f"round minutes: {minutes}; verdicts: {verdicts}; kept: {kept}", file=sys.stderr)
    local = verdicts["local"]
    assert {b: v[0] for b, v in local.items()} == {"r1-host-overhead-scripted": "keep",
                                                   "r1-drafting-scripted": "discard",
                                                   "r1-acceptance-scripted": "discard"}, local
    assert local["r1-drafting-scripted"][1][-1] == ("bench", "discard"), local  # timed: slower than the base
    assert local["r1-acceptance-scripted"][1][-1] == ("forcing", "discard"), local  # caught before timing
    assert verdicts["ray"] == local, verdicts
    assert merged["ray"] == merged["local"] == ["r1-host-overhead-scripted"], merged
    assert kept["ray"] == kept["local"] == [("host-overhead", "lean-forward")], kept


@pytest.mark.slow
@needs_demo
def test_two_evaluations_share_one_node_untimed_and_keep_their_verdicts(tmp_path, cluster):
    """per_node = 2 on one node (the `cpu_eval_solo` worker): a round's two candidates are evaluated there at
    once (both on the board together), their untimed stages side by side, their timed stages through the
    machine's timing gate; the verdicts are the clear ones (the lean forward kept, the verifier that trusts
    the drafter discarded by forcing), each attempt stored once."""
    from workbench.agents.base import Direction
    from workbench.loop import Loop, LoopOptions

    script = {"host-overhead": LEAN, "acceptance": NO_VERIFY}
    ws = init_demo(tmp_path / "demo", **SMALL)
    lines, say = _lines()
    ev = RayEvaluator(ExecutorSettings("ray", resource="cpu_eval_solo", per_node=2), say)
    loop = Loop(ws, LoopOptions(rounds=1, agents=2, budget_minutes=60, use_global_memory=False, auto_accept=False),
                progress=say, evaluator=ev)
    loop.make_agent = lambda: _Scripted(script)
    loop.directions = lambda bd, _ex, _base=None: [Direction(f, 1.0, "pinned by the test") for f in script]
    s = loop.run()
    ev.shutdown()
    (r,) = s["rounds"]
    got = {a["branch"]: a["status"] for a in r["attempts"]}
    assert got == {"r1-host-overhead-scripted": "keep", "r1-acceptance-scripted": "discard"}, r["attempts"]
    stages = {b: [(e.stage, e.status) for e in ws.memory.list_evaluations(ws.branch(b).id)] for b in got}
    assert stages["r1-acceptance-scripted"] == [("smoke", "keep"), ("forcing", "discard")], stages
    assert [x[0] for x in stages["r1-host-overhead-scripted"]] == ["smoke", "forcing", "bench"], stages
    together = [ln for ln in lines if ln.startswith("ray: running evaluations: ")
                and all(b in ln for b in got) and ln.count(f"node {cluster[1][0].node_id[:8]}") == 2]
    assert together, [ln for ln in lines if ln.startswith("ray: ")]  # both on the one node at once
    print(f"seen paused: {any('paused' in ln for ln in lines)}", file=sys.stderr)
    ws.close()


@pytest.mark.slow
@needs_demo
def test_the_tui_evaluates_on_the_cluster_and_shows_each_node(tmp_path, cluster):
    """The interactive app on a Ray executor: E re-evaluates a hand-made branch on a worker node, the
    Overview names the cluster and the node the evaluation runs on, the verdict arrives as a toast and the
    store holds its stages once (written by the head)."""
    import asyncio

    from tests.test_tui import machine_profiled_before, make_branch, opened, select_row, until
    from workbench.tui.app import make_app

    ws = init_demo(tmp_path / "demo", **SMALL)
    make_branch(ws, "lean", *LEAN[:3])
    machine_profiled_before()
    ev = RayEvaluator(ExecutorSettings("ray"))
    seen: list[str] = []

    def overview(app) -> str:
        from rich.console import Console

        con = Console(width=120, record=True, file=io.StringIO())
        con.print(app.query_one("#deployment").content)  # what the Overview shows, as text
        return con.export_text()

    async def go():
        app = make_app(ws.path, poll_s=0.3, blink=False, evaluator=ev)
        async with app.run_test(notifications=True, size=(120, 40)) as pilot:
            await opened(pilot)
            shown = overview(app)
            assert "evaluations" in shown and "Ray cluster at auto: 2 evaluation node(s) (cpu_eval)" in shown, shown
            await pilot.press("2")
            await until(pilot, lambda: "lean" in app.query_one("#branches-table").rows, 10, "its row")
            select_row(app, "#branches-table", "lean")
            await pilot.press("E")
            await until(pilot, lambda: "lean" in app.running_evaluations, 600, "the evaluation on a node")
            await pilot.press("1")
            await until(pilot, lambda: "running: node " in overview(app), 10, "the node on the Overview")
            seen.append(overview(app))
            await until(pilot, lambda: any(n.message.startswith("lean: ") for n in app._notifications), 1200,
                        "the verdict")
            seen.extend(n.message for n in app._notifications)
            assert not [n for n in app._notifications if n.severity == "error"], seen

    asyncio.run(go())
    ev.shutdown()
    print(seen, file=sys.stderr)
    assert any(m.startswith("lean: keep") for m in seen), seen
    stages = [e.stage for e in ws.memory.list_evaluations(ws.branch("lean").id)]
    assert stages == ["smoke", "forcing", "bench"], stages
    ws.close()


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
    loop.make_agent = lambda: _Scripted()  # the lean forward
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


@pytest.mark.slow
@needs_demo
@pytest.mark.parametrize("executor", ["ray", "local"])
def test_the_head_killed_mid_evaluation_resumes_and_submits_it_again(tmp_path, request, executor):
    """`specpilot-tui --auto` killed (-9) while its candidate is evaluated (ray: on a worker node; local: in its
    own cascade); the same command again finishes the round: the branch's commit is evaluated again (its
    agent is not re-run) and the attempt is in the round once. Ray: its stages are in the store once too
    (a node never writes it); local: the interrupted cascade's stages stay in the append-only ledger."""
    import os
    import signal
    import sqlite3
    from pathlib import Path

    ws = init_demo(tmp_path / "demo", **SMALL)
    ws.close()
    db = ws.path / ".specpilot" / "memory.db"
    pre = "import tests.test_ray as t\nfrom workbench.loop import Loop\nLoop.make_agent = lambda self: t._Scripted()"
    code = f"import sys\n{pre}\nfrom workbench.tui_entry import main\nsys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, "--auto", "--workspace", str(ws.path), "--rounds", "1", "--agents", "1",
           "--no-global-memory", "--json", "--executor", executor]
    if executor == "ray":
        c, _workers = request.getfixturevalue("cluster")
        cmd += ["--ray-address", c.address]

    def evaluating() -> bool:  # ray: the board shows it on a node; local: its cascade has stored a stage
        if executor == "ray":
            return "ray: running evaluations: node " in log.read_text()
        if not db.exists():
            return False
        with sqlite3.connect(db) as con:
            return con.execute("SELECT count(*) FROM evaluations e JOIN branches b ON e.branch_id = b.id "
                               "WHERE b.name LIKE 'r1-%' AND e.stage = 'smoke'").fetchone()[0] > 0

    root = Path(__file__).resolve().parent.parent
    log = tmp_path / "first.err"
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and proc.poll() is None and not evaluating():
            time.sleep(1)
        assert proc.poll() is None, f"the loop ended before its evaluation was under way:\n{log.read_text()[-3000:]}"
        time.sleep(5)  # into the evaluation: its systems are running
        assert proc.poll() is None, log.read_text()[-3000:]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    with sqlite3.connect(db) as con:
        rounds = [(st, json.loads(sm)) for st, sm in con.execute("SELECT status, summary FROM rounds")]
    ((status, summary),) = [x for x in rounds if "index" in x[1]]  # the loop's (not the hand-made branches')
    assert status == "running"
    assert summary["attempts"] == [] and len(summary["agents"]) == 1, summary  # killed between agent and verdict
    (branch,) = summary["agents"]
    head = summary["agents"][branch]["head"]

    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=1500)
    print(r.stderr[-4000:], file=sys.stderr)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming" in r.stderr and f"{branch}: its agent had finished at {head[:10]}" in r.stderr, r.stderr
    assert f"{branch}: agent: " not in r.stderr  # not run again
    if executor == "ray":
        assert "ray: running evaluations: node " in r.stderr  # submitted again, to the cluster
    s = json.loads(r.stdout)
    (att,) = s["rounds"][0]["attempts"]
    assert att["branch"] == branch and att["status"] == "keep", att
    con = sqlite3.connect(db)
    rounds = [st for st, sm in con.execute("SELECT status, summary FROM rounds") if "index" in json.loads(sm)]
    assert rounds == ["done"], rounds  # the interrupted round finished, no second one
    bid = con.execute("SELECT id FROM branches WHERE name = ?", (branch,)).fetchone()[0]
    stages = [x[0] for x in con.execute("SELECT stage FROM evaluations WHERE branch_id = ? ORDER BY id", (bid,))]
    if executor == "ray":
        assert stages == ["smoke", "forcing", "bench"], stages  # recorded once: a node never writes the store
    else:
        assert stages[-3:] == ["smoke", "forcing", "bench"] and "bench" not in stages[:-3], stages
    agents = con.execute("SELECT count(*) FROM events WHERE kind = 'loop.agent'").fetchone()[0]
    assert agents == 1  # the agent ran once, before the kill
    assert con.execute("SELECT head_commit FROM branches WHERE id = ?", (bid,)).fetchone()[0] == head
    con.close()
