"""The loop's parts on a real (small) demo workspace: the cascade against hostile candidates, key-wise
config merging, the headless entry point. The full multi-round loop is a slow test."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import git
import pytest

from tests.conftest import needs_demo
from tests.test_forcing import make_branch, patch_generate
from workbench.cascade import evaluate, noise_floor
from workbench.forcing import stock_reference
from workbench.integration import merge_branch
from workbench.loop import BASE_BRANCH, Loop, LoopOptions
from workbench.workspace import Workspace, init_demo

pytestmark = needs_demo


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    w = init_demo(tmp_path_factory.mktemp("loop") / "demo", forcing_max_new_tokens=16, prompt_limit=4, hidden=1,
                  limits={"request_s": 30, "start_s": 90}, bench={"noise_pairs": 1})
    stock_reference(w, progress=False)
    yield w
    w.close()


@pytest.fixture(scope="module")
def ceiling(ws) -> float:
    return Loop(ws, LoopOptions()).ceiling()


def test_a_branch_that_skips_verification_is_discarded_by_forcing(ws, ceiling):
    # Emit every drafted token as if the target had accepted it.
    make_branch(ws, "no-verify", {"decoder/verify.py": (
        "n = (draft == pred[:k]).to(torch.int64).cumprod(0).sum().view(1)\n    return torch.cat([n, pred])",
        "n = torch.tensor([k])\n    return torch.cat([n, draft, pred[k:]])")}, "trust the drafter")
    att = evaluate(ws, "no-verify", ws.stock_commit, 1.3, ceiling)
    assert att.status == "discard" and att.reason.startswith("forcing:"), att.reason


@pytest.mark.slow  # the harness-level twin, test_forcing's test_patching_the_clock_gains_no_measured_speed, is fast
def test_a_branch_that_patches_the_timer_gains_nothing(ws, ceiling):
    make_branch(ws, "timer", {"decoder/generate.py": patch_generate(
        "import time\ntime.perf_counter = time.monotonic = time.time = lambda: 0.0")}, "instant clock")
    att = evaluate(ws, "timer", ws.stock_commit, 1.3, ceiling, min_gain=1.25)
    # timed from outside, a patched clock is no faster than stock: no gain beyond the noise
    assert att.status == "discard" and att.reason.startswith("no gain"), att.reason
    assert att.speedup is not None and att.speedup < 1.25


@pytest.mark.slow  # the rule itself is unit-tested with costmodel.ceiling.plausible; this is the cascade end to end
def test_a_speedup_above_the_ceiling_is_rejected(ws, ceiling):
    # Lossless on every forcing prompt (it computes the hidden ones honestly) but it answers the
    # benchmark's visible prompts from a memo: far faster than any lossless change can be.
    ref = stock_reference(ws, False)
    memo = {",".join(map(str, p["prompt_ids"])): p["stock"] for p in ref["prompts"]}
    make_branch(ws, "too-fast", {
        "decoder/memo.json": json.dumps(memo),
        "decoder/generate.py": patch_generate(
            "import json, pathlib\n"
            "memo = json.loads((pathlib.Path(__file__).parent / 'memo.json').read_text())\n"
            "hit = memo.get(','.join(map(str, prompt)))\n"
            "if hit is not None and len(hit) >= cfg.max_new_tokens:\n"
            "    return Generation(hit[:cfg.max_new_tokens])")}, "answer known prompts at once")
    # The rule under test, independent of this machine's measured profile: the memo measures 3-5x over
    # AR here, so the ceiling is pinned at 2.0 (the deployment's real ceiling comes from the cost model).
    att = evaluate(ws, "too-fast", ws.stock_commit, 1.3, min(ceiling, 2.0))
    assert att.status == "rejected" and att.reason.startswith("implausible"), att.reason
    evals = ws.memory.list_evaluations(ws.branch("too-fast").id)
    assert [e.stage for e in evals][-3:] == ["smoke", "forcing", "bench"]


def test_a_branch_lossless_when_forced_but_wrong_when_timed_is_rejected(ws, ceiling):
    """A candidate that can tell it is being timed: the paired benchmark freezes the idle side (SIGSTOP)
    while the other is timed, and this one notices the SIGCONT that resumes it; from then on it answers with
    one token. Forcing never freezes it (clean there); the check of every timed output catches it. (It used to
    tell by a repeated prompt; every pass now runs in fresh processes, so none repeats.)"""
    make_branch(ws, "two-faced", {"decoder/generate.py": patch_generate(
        "import builtins, dataclasses, signal\n"
        "st = builtins.__dict__.setdefault('_bench_seen', [])\n"
        "if not st:\n"
        "    st.append(0)\n"
        "    signal.signal(signal.SIGCONT, lambda *a: st.append(1))\n"
        "if len(st) > 1:\n"
        "    cfg = dataclasses.replace(cfg, max_new_tokens=1)")}, "short answers when timed")
    att = evaluate(ws, "two-faced", ws.stock_commit, 1.3, ceiling)
    assert att.status == "rejected" and att.reason.startswith("timed output differs from stock"), att.reason
    assert "1 tokens where stock gives 16" in att.reason


@pytest.mark.slow  # a real paired benchmark of the base against itself; the rule is exercised by make demo
def test_the_keep_threshold_comes_from_the_base_against_itself_and_is_cached(ws):

    first = noise_floor(ws, ws.stock_commit)
    assert first["pairs"] == 1 and len(first["runs"]) == 1 and first["margin"] == 2.0
    assert first["noise"] == pytest.approx(abs(first["runs"][0]["speedup"] - 1.0))
    assert first["keep_threshold"] == pytest.approx(1.0 + 2.0 * first["noise"])
    t0 = time.perf_counter()
    assert noise_floor(ws, ws.stock_commit) == first  # read back, not measured again
    assert time.perf_counter() - t0 < 5.0


def test_a_protected_edit_is_rejected_before_anything_runs(ws, ceiling):
    make_branch(ws, "edit-serve", {"decoder/serve.py": ("import argparse", "import argparse  # mine")}, "tweak")
    att = evaluate(ws, "edit-serve", ws.stock_commit, 1.3, ceiling)
    assert att.status == "rejected" and "decoder/serve.py" in att.reason
    assert [e.stage for e in ws.memory.list_evaluations(ws.branch("edit-serve").id)] == ["guard"]


def test_config_conflicts_merge_key_by_key(ws):
    make_branch(ws, "cfg-a", {"system.toml": ("lean_forward = false", "lean_forward = true")}, "lean")
    make_branch(ws, "cfg-b", {"system.toml": ("stop_at_eos = true", "stop_at_eos = false")}, "no eos")
    make_branch(ws, "cfg-c", {"system.toml": ("lean_forward = false", "lean_forward = false\n")}, "noop-ish")
    ws.create_branch("merge-into")
    wt = ws.worktree_git("merge-into")
    assert merge_branch(wt, "cfg-a", "system.toml")[0]
    ok, why = merge_branch(wt, "cfg-b", "system.toml")
    assert ok, why
    text = (ws.worktree_path("merge-into") / "system.toml").read_text()
    assert "lean_forward = true" in text and "stop_at_eos = false" in text
    make_branch(ws, "cfg-d", {"system.toml": ("lean_forward = false", "lean_forward = false\ncuda_graphs = true")},
                "graphs without lean: invalid once merged? no: lean is on in ours")
    make_branch(ws, "cfg-e", {"system.toml": ('drafter = "draft-model"', 'drafter = "ngram"')}, "ngram")
    make_branch(ws, "cfg-f", {"system.toml": ('drafter = "draft-model"', 'drafter = "draft-model"\n\n')}, "x")
    ok, why = merge_branch(wt, "cfg-e", "system.toml")
    assert ok, why
    ws.create_branch("merge-clash")
    wt2 = ws.worktree_git("merge-clash")
    make_branch(ws, "cfg-g", {"system.toml": ("draft_len = 3", "draft_len = 5")}, "k=5")
    make_branch(ws, "cfg-h", {"system.toml": ("draft_len = 3", "draft_len = 6")}, "k=6")
    assert merge_branch(wt2, "cfg-g", "system.toml")[0]
    ok, why = merge_branch(wt2, "cfg-h", "system.toml")
    assert not ok and "draft_len" in why
    assert not wt2.status("--porcelain", "--untracked-files=no").strip()  # the failed merge was aborted cleanly


NEW_KNOB = {
    "decoder/config.py": ('    dtype: str = "bfloat16"\n',
                          '    dtype: str = "bfloat16"\n    fast_path: bool = False  # lean forward, renamed\n'),
    "decoder/generate.py": ('    if cfg.weight_format == "w12" and not',
                            '    if cfg.fast_path:\n        cfg = dataclasses.replace(cfg, lean_forward=True)\n'
                            '    if cfg.weight_format == "w12" and not'),
    "system.toml": ('method = "sd"', 'method = "sd"\nfast_path = true'),
}


def test_a_base_with_a_key_the_installed_schema_does_not_know_is_read_planned_and_merged(ws):
    """What an LLM agent writes: a new DecodeConfig key, code behind it, the key set in system.toml. Every
    workbench reader of a config takes the keys it needs and passes the others through."""
    from decoder.config import DecodeConfig, verify_width
    from workbench.agents.tuner import candidates

    make_branch(ws, "knob-base", NEW_KNOB, "fast_path: a new knob and the mechanism behind it")
    head = ws.head("knob-base")
    table = ws.config_at(head)
    assert table["fast_path"] is True and verify_width(table) == 1 + table["draft_len"]
    with pytest.raises(Exception, match="unknown key"):
        DecodeConfig.from_table(table)  # the installed schema alone would refuse it
    base = DecodeConfig.from_table(table, known_only=True)
    assert candidates(base, "drafting", [])  # the tuner plans on it
    bd = {"families": {"drafting": 1.0}, "gaps": []}
    assert Loop(ws, LoopOptions(agents=1, use_global_memory=False)).directions(bd, set(), head)
    make_branch(ws, "knob-and-k", {"system.toml": ("draft_len = 3", "draft_len = 4")}, "k=4")
    ws.create_branch("knob-merge", base=head)
    ok, why = merge_branch(ws.worktree_git("knob-merge"), "knob-and-k", "system.toml")
    assert ok, why
    text = (ws.worktree_path("knob-merge") / "system.toml").read_text()
    assert "fast_path = true" in text and "draft_len = 4" in text


@pytest.mark.slow  # the fast twin above covers every reader; this runs the candidate through the cascade
def test_a_branch_that_adds_a_config_key_and_a_mechanism_behind_it_is_evaluated(ws, ceiling):
    make_branch(ws, "new-knob", NEW_KNOB, "fast_path: a new knob and the mechanism behind it")
    att = evaluate(ws, "new-knob", ws.stock_commit, 1.3, ceiling)
    stages = [e.stage for e in ws.memory.list_evaluations(ws.branch("new-knob").id)]
    assert att.status in ("keep", "discard") and "forcing" in stages and "bench" in stages, (att.reason, stages)
    assert not att.reason.startswith("forcing:"), att.reason  # lossless: the candidate's code ran with its key


def test_a_candidate_gets_the_ceiling_of_its_own_verify_width(ws):
    """The plausibility ceiling is the oracle at the width a system's config verifies: stock's for the round,
    a candidate's own when it drafts wider (never below the round's)."""
    from workbench.costing import ceiling_for

    loop = Loop(ws, LoopOptions())
    hw, base = loop.hardware(), loop.ceiling()  # one profile for all three figures
    make_branch(ws, "k8", {"system.toml": ("draft_len = 3", "draft_len = 8")}, "k=8")
    # floor 0: on a machine whose measured profile puts stock's oracle below 1x AR, a floor of 1 would hide it
    assert ceiling_for(ws, hw, ws.stock_commit, 0.0) == pytest.approx(base)
    wide = ceiling_for(ws, hw, ws.head("k8"), 0.0)
    assert wide != pytest.approx(base) and ceiling_for(ws, hw, ws.head("k8"), base) == max(wide, base)


def test_headless_never_imports_textual():
    code = ("import sys, workbench.tui_entry as t, workbench.loop, workbench.agents.tuner\n"
            "rc = t.main(['--auto', '--workspace', '/nonexistent/ws'])\n"
            "assert 'textual' not in sys.modules, 'textual imported'\n"
            "sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1


def test_auto_with_no_budget_left_reports_and_exits_3(ws):
    r = subprocess.run([sys.executable, "-m", "workbench.tui_entry", "--auto", "--workspace", str(ws.path),
                        "--budget-minutes", "0.001", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stderr
    s = json.loads(r.stdout)
    assert s["status"] == "budget" and s["rounds"] == []
    assert {"stock_speedup", "final_speedup", "rounds", "accepted_mechanisms"} <= set(s)


@pytest.mark.slow
def test_one_round_of_the_tuner_keeps_a_lossless_speedup(ws):
    summary = Loop(ws, LoopOptions(rounds=1, agents=2, budget_minutes=20, use_global_memory=False)).run()
    assert summary["rounds"] and summary["rounds"][0]["attempts"]
    kept = [a for a in summary["rounds"][0]["attempts"] if a["status"] == "keep"]
    assert kept, summary
    assert ws.repo.commit(BASE_BRANCH).hexsha != ws.stock_commit
    assert summary["final_speedup"] > summary["stock_speedup"]


@pytest.mark.slow
def test_a_round_with_the_llm_agent_against_a_local_openai_server(tmp_path):
    """The LLM agent in the loop, end to end: a scripted server (the test double for a hosted LLM) sends a
    malformed call, an edit whose SEARCH text does not match, a 500, then the right edit and finish; the
    branch gets the intended commit, the failures went back to the model, and the cascade keeps it."""
    from tests.openai_stub import OpenAIStub, call, calls, http_error

    w = init_demo(tmp_path / "demo", forcing_max_new_tokens=16, prompt_limit=4, hidden=1)
    fix = "<<<<<<< SEARCH\nlean_forward = false\n=======\nlean_forward = true\n>>>>>>> REPLACE\n"
    wrong = "<<<<<<< SEARCH\nlean_forward = no\n=======\nlean_forward = true\n>>>>>>> REPLACE\n"
    script = [call("read_file", raw_arguments="{not json"), call("edit", path="system.toml", blocks=wrong),
              http_error(500), calls([("edit", json.dumps({"path": "system.toml", "blocks": fix})),
                                      ("finish", json.dumps({"summary": "fused lean forward",
                                                             "mechanism_name": "lean-forward"}))])]
    with OpenAIStub(script) as stub:
        opts = LoopOptions(rounds=1, agents=1, agent="llm", budget_minutes=20, use_global_memory=False,
                           llm={"base_url": stub.base_url, "model": "stub", "api_key": "sk-test", "backoff_s": 0.1})
        summary = Loop(w, opts).run()
        sent = json.dumps([r["body"] for r in stub.requests])
    att = summary["rounds"][0]["attempts"][0]
    assert att["agent"] == "llm" and "lean_forward = true" in w.repo.git.show(f"{att['branch']}:system.toml")
    assert "SEARCH" in sent and "nearest" in sent.lower()  # the failed block went back with the nearest lines
    assert att["status"] == "keep", att
    assert summary["final_speedup"] > summary["stock_speedup"]


@pytest.mark.slow
def test_auto_resumes_the_round_it_was_killed_in(tmp_path):
    """kill -9 in the middle of round 1, run the same command again: round 1 is finished, not restarted."""
    import os
    import signal
    import sqlite3
    import time

    w = init_demo(tmp_path / "demo", forcing_max_new_tokens=16, prompt_limit=4, hidden=1)
    cmd = [sys.executable, "-m", "workbench.tui_entry", "--auto", "--workspace", str(w.path), "--rounds", "1",
           "--agents", "1", "--no-global-memory", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    db = w.path / ".specpilot" / "memory.db"
    deadline = time.time() + 600
    while time.time() < deadline:  # wait until an agent of round 1 is at work
        time.sleep(1)
        if db.exists() and sqlite3.connect(db).execute(
                "SELECT count(*) FROM branches WHERE name LIKE 'r1-%' AND status = 'running'").fetchone()[0]:
            break
    assert proc.poll() is None, "the loop ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # The loop's state is the store: the round it was killed in is the running one.
    running = sqlite3.connect(db).execute("SELECT summary FROM rounds WHERE status = 'running'").fetchall()
    assert [json.loads(r[0])["index"] for r in running] == [1]
    assert not (w.path / ".specpilot" / "loop.json").exists()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stderr
    s = json.loads(r.stdout)
    assert [x["index"] for x in s["rounds"]] == [1] and s["rounds"][0]["attempts"]
    rounds = sqlite3.connect(db).execute("SELECT count(*) FROM rounds WHERE status = 'done'").fetchone()[0]
    assert rounds == 1  # the interrupted round was finished, not a second one started


def test_best_round_is_the_round_that_produced_the_final_base():
    from workbench.loop import best_round

    rounds = [{"index": 1, "base_commit": "s"}, {"index": 2, "base_commit": "a"}, {"index": 3, "base_commit": "a"}]
    assert best_round(rounds, "a", "s") == 1  # round 1 ended on a, nothing later changed it
    assert best_round(rounds, "b", "s") == 3  # round 3 moved the base to b
    assert best_round(rounds, "s", "s") == 0  # stock stayed best
    assert best_round(list(reversed(rounds)), "a", "s") == 1


def test_memory_configs_carry_what_their_mechanisms_require():
    """A config accepted on a lean base (drafter = mtp) transfers to a stock base with lean_forward on."""
    from decoder.config import DecodeConfig
    from workbench.agents.tuner import candidates, with_requirements

    assert with_requirements({"drafter": "mtp", "draft_len": 6})["lean_forward"] is True
    assert with_requirements({"draft_len": 5}) == {"draft_len": 5}
    mem = [{"name": "mtp", "config": {"drafter": "mtp", "draft_len": 6, "verify": "chain"}}]
    cands = candidates(DecodeConfig(), "drafting", mem)
    assert cands[0].source == "memory:mtp"
    assert cands[0].cfg.drafter == "mtp" and cands[0].cfg.lean_forward and cands[0].cfg.draft_len == 6


def test_under_a_load_every_tree_is_also_offered_capped_to_the_batch_sizes_below_the_top():
    """Mechanism load-tree in the tuner: at points 1, 8 each candidate that turns a tree on comes again with
    tree_max_live = 1; at one point none does; on a base with a tree the registry's caps are the candidates, and
    on a base without one a cap alone is no candidate (the config refuses it)."""
    from decoder.config import DecodeConfig
    from workbench.agents.tuner import candidates, tree_cap

    assert (tree_cap([1, 8]), tree_cap([1, 4, 8, 16]), tree_cap([1]), tree_cap([8])) == (1, 8, 0, 0)
    stock = DecodeConfig()
    single = candidates(stock, "acceptance", [])
    loaded = candidates(stock, "acceptance", [], points=[1, 8])
    trees = [c for c in single if c.cfg.corpus_tree_alts or c.cfg.mtp_tree_alts]
    assert trees and not any(c.cfg.tree_max_live for c in single)
    capped = [c for c in loaded if c.cfg.tree_max_live]
    assert len(capped) == len(trees) and all(c.cfg.tree_max_live == 1 and c.source.endswith("+load-tree")
                                             for c in capped)
    assert {json.dumps({**c.changes, "tree_max_live": 1}, sort_keys=True) for c in trees} == {
        json.dumps(c.changes, sort_keys=True) for c in capped}
    on_tree = DecodeConfig(drafter="corpus", lean_forward=True, corpus_tree_alts=4)
    caps = sorted(c.cfg.tree_max_live for c in candidates(on_tree, "acceptance", []) if c.changes.keys() ==
                  {"tree_max_live"})
    assert caps == [1, 2, 4, 8]


def test_no_agent_slot_for_a_family_whose_mechanisms_are_all_on(ws):
    """With the lean forward, transposed and oneDNN matmuls and the fused MLP on in the base (the host-overhead
    mechanisms on a CPU),
    host-overhead gets no tuner agent, however large its gap; without a base it still does (the TUI's launch)."""
    from decoder.config import DecodeConfig

    repo = git.Repo(ws.path)
    cfg = DecodeConfig.load(ws.path / ws.config.config_file)
    wt = ws.path.parent / "lean-base"
    repo.git.worktree("add", "-b", "lean-base", str(wt), "stock")
    try:
        cfg.lean_forward, cfg.matmul_t_rows, cfg.matmul_backend, cfg.fused_mlp_rows = True, 3, "onednn", 128
        cfg.dtype = "float32"  # oneDNN packs float32 on every x86 CPU (bfloat16 needs AVX512: a base refused there)
        cfg.save(wt / ws.config.config_file)
        lrepo = git.Repo(wt)
        lrepo.git.add(ws.config.config_file)
        lrepo.index.commit("lean forward, transposed and oneDNN matmuls on")
        base = lrepo.head.commit.hexsha
        bd = {"families": {"host-overhead": 3.0, "drafting": 1.0}, "gaps": []}
        loop = Loop(ws, LoopOptions(agents=2, use_global_memory=False))
        assert [d.family for d in loop.directions(bd, set(), base)] == ["drafting"]
        assert [d.family for d in loop.directions(bd, set(), ws.stock_commit)] == ["host-overhead", "drafting"]
        assert [d.family for d in loop.directions(bd, set())] == ["host-overhead", "drafting"]
    finally:
        repo.git.worktree("remove", "--force", str(wt))


def test_the_demo_times_candidates_on_prompts_agents_never_see(tmp_path):
    """A candidate replaying stock's outputs for the visible prompts gains nothing where it is timed."""
    from workbench.cascade import timing_prompts
    from workbench.measure import load_prompts

    w = init_demo(tmp_path / "demo")
    timed = {p.id for p in timing_prompts(w)}
    assert len(timed) >= 4 and not timed & {p.id for p in load_prompts(w)}
    assert timed == {p.id for p in load_prompts(w, "hidden")}


def test_the_round_line_names_each_gap_part_apart():
    from workbench.loop import gap_label

    parts = [("compute", "compute"), ("prefill", "compute"), ("weight reads", "weights"),
             ("host/launch overhead", "host-overhead"), ("bookkeeping", "host-overhead")]
    labels = [gap_label({"name": n, "family": f}) for n, f in parts]
    assert labels == ["compute", "prefill (compute)", "weight reads (weights)", "host/launch overhead",
                      "bookkeeping (host-overhead)"]
    assert len(set(labels)) == len(labels)


@pytest.mark.slow
@needs_demo
def test_ctrl_c_while_agents_tune_ends_the_run_and_the_round_reruns_them(tmp_path):
    """SIGINT to `specpilot-tui --auto` while its tuner agents are at work: exit 4 with the resume line, the
    agents stopped and their systems killed rather than waited for, and nothing they returned after the
    interrupt saved as finished (the round holds no finished agent, so the same command runs them again)."""
    import json
    import signal
    import sqlite3
    import subprocess
    import sys
    import time
    from pathlib import Path

    from workbench.workspace import init_demo

    ws = init_demo(tmp_path / "demo", forcing_max_new_tokens=16, prompt_limit=4, hidden=1, bench={"noise_pairs": 1})
    ws.close()
    cmd = [sys.executable, "-m", "workbench.tui_entry", "--auto", "--workspace", str(ws.path), "--rounds", "1",
           "--agents", "2", "--no-global-memory", "--json"]
    err = tmp_path / "err"
    with err.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.DEVNULL, stderr=f)
    progress = ws.path / ".specpilot" / "progress"
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and proc.poll() is None:
            phases = [json.loads(p.read_text()).get("phase", "") for p in progress.glob("r1-*.json")
                      if p.stat().st_size]
            if any(ph.startswith("tuning") for ph in phases):
                break
            time.sleep(0.5)
        assert proc.poll() is None, err.read_text()[-3000:]
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert rc == 4 and "interrupted (SIGINT); run the same command again to resume the round" in text, text[-3000:]
    with sqlite3.connect(ws.path / ".specpilot" / "memory.db") as con:
        rounds = [(st, json.loads(sm)) for st, sm in con.execute("SELECT status, summary FROM rounds")]
    ((status, summary),) = [r for r in rounds if "index" in r[1]]
    assert status == "running" and summary.get("agents", {}) == {} and summary["attempts"] == [], summary
