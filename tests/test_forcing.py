"""Workspaces, the harness and token forcing against hostile candidates: real git, SQLite and subprocesses.

One small demo workspace (6 prompts: 4 visible, 2 hidden; 24 forced tokens) is shared by the module;
each test makes its own branch. The sandbox tests skip, saying why, where `unshare` is unavailable.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import git
import pytest

from tests.cli_runs import run_many
from tests.conftest import needs_demo
from workbench.cli import main as cli_main
from workbench.export import export, record_mechanism
from workbench.forcing import force, run_system, stock_reference
from workbench.harness import sandbox_status
from workbench.workspace import Workspace, WorkspaceError, init_demo

pytestmark = needs_demo
SANDBOX, SANDBOX_WHY = sandbox_status()
needs_sandbox = pytest.mark.skipif(not SANDBOX, reason=f"no sandbox on this machine: {SANDBOX_WHY}")
N_TOKENS = 24


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    path = tmp_path_factory.mktemp("ws") / "demo"
    w = init_demo(path, forcing_max_new_tokens=N_TOKENS, prompt_limit=6, hidden=2,
                  limits={"request_s": 20, "start_s": 90, "memory_mb": 1536, "threads": 1})
    stock_reference(w, progress=False)
    yield w
    w.close()


def make_branch(ws: Workspace, name: str, edits: dict[str, tuple[str, str] | str], message: str) -> Path:
    """A branch from stock with `edits` committed: path -> (old, new) replacement, or the whole new text."""
    ws.create_branch(name)
    wt = ws.worktree_path(name)
    for rel, change in edits.items():
        f = wt / rel
        if isinstance(change, tuple):
            text = f.read_text()
            assert change[0] in text, f"{rel}: {change[0]!r} not found"
            f.write_text(text.replace(change[0], change[1], 1))
        else:
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(change)
    repo = git.Repo(wt)
    repo.git.add("-A")
    repo.index.commit(message)
    return wt


GENERATE_DEF = ("def generate(cfg: DecodeConfig, target, prompt: list[int], drafter_model=None, "
                "profile_sync: bool = False,\n             heads=None) -> Generation:\n")


def patch_generate(body: str) -> tuple[str, str]:
    """An edit to decoder/generate.py that runs `body` at the top of `generate` (indented 4)."""
    lines = "".join("    " + ln + "\n" for ln in body.strip().splitlines())
    return (GENERATE_DEF, GENERATE_DEF + lines)


def test_init_makes_a_stock_commit_and_refuses_a_used_folder(ws, tmp_path):
    repo = ws.repo
    assert repo.commit("stock").hexsha == repo.head.commit.hexsha
    files = set(repo.git.ls_files().splitlines())
    assert {"specpilot.toml", "system.toml", "prompts/visible.jsonl", "decoder/serve.py", "kernels/w12.py"} <= files
    assert not any(f.startswith(".specpilot") for f in files)
    hidden = {json.loads(ln)["id"] for ln in ws.hidden_prompts_path().read_text().splitlines()}
    visible = {json.loads(ln)["id"] for ln in (ws.path / "prompts/visible.jsonl").read_text().splitlines()}
    assert len(hidden) == 2 and len(visible) == 4 and not hidden & visible
    (tmp_path / "x").write_text("taken")
    with pytest.raises(WorkspaceError, match="not empty"):
        init_demo(tmp_path)


def test_stock_forces_clean_through_the_cli(ws, capfd):
    """`specpilot force --json` through the CLI's own main, in this process: the command's parsing, its report
    and the store are what is checked (the child processes are the harness's, as from a shell)."""
    ws.create_branch("same-as-stock")
    capfd.readouterr()
    rc = cli_main(["force", "--workspace", str(ws.path), "--branch", "same-as-stock", "--json", "--quiet"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["match_rate"] == 1.0 and rep["mismatches"] == [] and rep["status"] == "keep"
    assert rep["positions_checked"] == sum(len(p["stock"]) for p in stock_reference(ws, False)["prompts"])
    assert set(rep["splits"]) == {"visible", "hidden"}
    b = ws.branch("same-as-stock")
    assert b.status == "forced"
    ev = ws.memory.list_evaluations(b.id)[-1]
    assert ev.status == "keep" and ws.memory.list_forcing_reports(b.id)[-1].match_rate == 1.0


def test_wrong_acceptance_rule_is_caught_at_the_exact_positions(ws):
    # Accept one draft token more than the matching prefix: the next token is then conditioned on a
    # rejected draft token. The rule passes a glance, and the forcing must pin every place it bites.
    make_branch(ws, "off-by-one", {"decoder/verify.py": (
        "n = (draft == pred[:k]).to(torch.int64).cumprod(0).sum().view(1)",
        "n = ((draft == pred[:k]).to(torch.int64).cumprod(0).sum() + 1).clamp(max=k).view(1)")},
        "verify: accept one more draft token")
    rep = force(ws, "off-by-one", progress=False)
    assert rep["status"] == "discard" and rep["unexplained"] > 0
    ref = {p["id"]: p for p in stock_reference(ws, False)["prompts"]}
    # Independent check: run the branch's system without forcing and find its first divergence.
    first = {}
    for m in rep["mismatches"]:
        first.setdefault(m["prompt_id"], m["position"])
        assert m["stock_token"] == ref[m["prompt_id"]]["stock"][m["position"]]
        assert m["candidate_token"] != m["stock_token"]
    with run_system(ws, ws.worktree_path("off-by-one"), "check") as sp:
        for pid, pos in first.items():
            out = sp.generate(ref[pid]["prompt_ids"], N_TOKENS).tokens
            stock = ref[pid]["stock"]
            assert next(i for i, (a, b) in enumerate(zip(out, stock, strict=False)) if a != b) == pos
            # and after stock's token is forced at each mismatch, the next one is where the branch diverges again
            later = [m["position"] for m in rep["mismatches"] if m["prompt_id"] == pid]
            if len(later) > 1:
                out2 = sp.generate(ref[pid]["prompt_ids"] + stock[: later[0] + 1], N_TOKENS - later[0] - 1).tokens
                d = next(i for i, (a, b) in enumerate(zip(out2, stock[later[0] + 1:], strict=False)) if a != b)
                assert later[0] + 1 + d == later[1]


def test_cached_outputs_pass_visible_and_fail_hidden(ws):
    # The candidate memorises stock's outputs for the prompts it can see, keyed by prompt text, and
    # emits junk elsewhere: the hidden split catches it.
    ref = stock_reference(ws, False)
    table = {",".join(map(str, p["prompt_ids"])): p["stock"] for p in ref["prompts"] if p["split"] == "visible"}
    make_branch(ws, "memoriser", {
        "decoder/memo.json": json.dumps(table),
        "decoder/generate.py": patch_generate(
            "import json, pathlib\n"
            "memo = json.loads((pathlib.Path(__file__).parent / 'memo.json').read_text())\n"
            "for key, toks in memo.items():\n"
            "    k = [int(x) for x in key.split(',')]\n"
            "    if prompt[:len(k)] == k and len(prompt) >= len(k):\n"
            "        done = len(prompt) - len(k)\n"
            "        return Generation(toks[done:done + cfg.max_new_tokens])\n"
            "return Generation([7] * cfg.max_new_tokens)")}, "fast path: memoised outputs")
    rep = force(ws, "memoriser", progress=False)
    assert rep["splits"]["visible"]["match_rate"] == 1.0
    assert rep["splits"]["hidden"]["match_rate"] < 0.5
    assert rep["status"] == "discard"
    assert {m["split"] for m in rep["mismatches"]} == {"hidden"}


def test_a_branch_that_never_returns_is_killed_and_recorded_as_a_crash(ws, monkeypatch):
    monkeypatch.setitem(ws.config.limits, "request_s", 5)  # stock answers a request in well under 1 s
    make_branch(ws, "spinner", {"decoder/generate.py": patch_generate("while True:\n    pass")}, "spin")
    t0 = time.perf_counter()
    rep = force(ws, "spinner", progress=False)
    assert rep["status"] == "crash" and rep["reason"].startswith("timeout:")
    assert "\n" not in rep["reason"]
    assert time.perf_counter() - t0 < 200  # the limit is 5 s per request: it was not waited out forever
    b = ws.branch("spinner")
    assert b.status == "crashed"
    assert ws.memory.list_evaluations(b.id)[-1].status == "crash"


def test_a_protocol_line_without_end_is_capped_and_the_branch_crashes(ws):
    make_branch(ws, "flood", {"decoder/generate.py": patch_generate(
        "import gc, io\n"  # serve's protocol stream (stdout itself is redirected to the log)
        "for f in [o for o in gc.get_objects() if isinstance(o, io.TextIOWrapper) and 'w' in o.mode]:\n"
        "    if f.fileno() > 2:\n"
        "        f.write('7' * (6 << 20)); f.flush()")}, "a 6 MiB line on the protocol pipe")
    rep = force(ws, "flood", progress=False)
    assert rep["status"] == "crash" and rep["reason"].startswith("protocol:"), rep["reason"]
    assert "MiB" in rep["reason"]


ESCAPES = """import os
def _ok(f):
    try:
        f()
        return True
    except OSError:
        return False
esc = []
if _ok(lambda: open('/proc/sys/kernel/core_pattern', 'w').close()):
    esc.append('core_pattern')
if _ok(lambda: open('/proc/sys/vm/swappiness', 'w').write('60')):
    esc.append('proc-sys')
if os.path.exists('/dev/shm/specpilot-host-marker'):
    esc.append('host-dev-shm')
if _ok(lambda: open('/dev/shm/big', 'wb').write(bytes(100 << 20))):
    esc.append('dev-shm-size')
if _ok(lambda: open('decoder/written-at-run-time.txt', 'w').write('x')):
    esc.append('worktree-write')
if set(os.listdir('/dev')) - {'null', 'zero', 'full', 'random', 'urandom', 'shm', 'fd', 'stdin', 'stdout', 'stderr'}:
    esc.append('dev:' + ','.join(sorted(os.listdir('/dev'))))
if esc:
    raise SystemExit('ESCAPED ' + ' '.join(esc))
"""


def test_the_sandbox_contains_proc_sys_dev_and_the_worktree(ws):
    """The candidate tries, on every request: kernel tunables, the host's /dev/shm, an unbounded
    /dev/shm, writing its own worktree, host devices. Any success ends the system ('ESCAPED ...');
    contained, it decodes as stock does."""
    from workbench.harness import sandbox_status

    if not sandbox_status()[0]:
        pytest.skip(f"no sandbox here: {sandbox_status()[1]}")
    marker = Path("/dev/shm/specpilot-host-marker")
    marker.write_text("host")
    try:
        make_branch(ws, "escapes", {"decoder/generate.py": patch_generate(ESCAPES)}, "try to get out")
        rep = force(ws, "escapes", progress=False)
    finally:
        marker.unlink(missing_ok=True)
    assert rep["status"] == "keep", rep["reason"]
    assert not (ws.worktree_path("escapes") / "decoder" / "written-at-run-time.txt").exists()


def test_a_branch_that_allocates_without_bound_is_stopped_by_the_memory_limit(ws):
    make_branch(ws, "hog", {"decoder/generate.py": patch_generate(
        "hoard = []\nwhile True:\n    hoard.append(b'x' * (64 * 2**20))")}, "cache everything")
    rep = force(ws, "hog", progress=False)
    assert rep["status"] == "crash" and rep["reason"].startswith("memory:"), rep["reason"]
    assert ws.memory.list_evaluations(ws.branch("hog").id)[-1].reason == rep["reason"]


def test_a_branch_that_edits_a_protected_file_is_rejected_without_running(ws):
    make_branch(ws, "tamper", {"prompts/visible.jsonl": ""}, "fewer prompts")
    logs_before = set((ws.state / "logs").glob("tamper-*.log"))
    rep = force(ws, "tamper", progress=False)
    assert rep["status"] == "rejected" and "prompts/visible.jsonl" in rep["reason"]
    assert set((ws.state / "logs").glob("tamper-*.log")) == logs_before  # no system was started
    # uncommitted edits are not evaluated either
    ws.create_branch("dirty")
    (ws.worktree_path("dirty") / "decoder" / "extra.py").write_text("x = 1\n")
    assert force(ws, "dirty", progress=False)["status"] == "rejected"


@needs_sandbox
def test_a_branch_cannot_read_the_store_or_stock_outputs(ws):
    # It looks for stock's cached reference and the memory next to its own worktree, and would copy
    # stock's tokens from them; in the sandbox it finds nothing and the hidden split catches it.
    make_branch(ws, "snoop", {"decoder/generate.py": patch_generate(
        "import json, pathlib, sys\n"
        "state = pathlib.Path(__file__).resolve().parents[3]\n"
        "found = sorted(str(p) for p in state.glob('**/*') if p.is_file() and 'worktrees' not in p.parts)\n"
        "print('SNOOP', json.dumps(found), file=sys.stderr)\n"
        "for f in state.glob('stock/*.json'):\n"
        "    for p in json.loads(f.read_text())['prompts']:\n"
        "        k = p['prompt_ids']\n"
        "        if prompt[:len(k)] == k:\n"
        "            done = len(prompt) - len(k)\n"
        "            return Generation(p['stock'][done:done + cfg.max_new_tokens])\n"
        "return Generation([7] * cfg.max_new_tokens)")}, "peek")
    rep = force(ws, "snoop", progress=False)
    assert rep["sandbox"]["enabled"]
    assert rep["status"] == "discard" and rep["splits"]["hidden"]["match_rate"] < 0.5
    log = max((ws.state / "logs").glob("snoop-*.log"), key=lambda p: p.stat().st_mtime).read_text()
    seen = [json.loads(ln.split("SNOOP ", 1)[1]) for ln in log.splitlines() if ln.startswith("SNOOP ")]
    assert seen and all(s == [] for s in seen)
    assert (ws.state / "memory.db").exists()  # it is there; the candidate just cannot see it


def test_patching_the_clock_gains_no_measured_speed(ws):
    # The candidate stops its own clocks and sleeps 0.3 s per request: the harness, timing from outside,
    # still sees every one of those sleeps.
    make_branch(ws, "clock", {"decoder/generate.py": patch_generate(
        "import time\n"
        "time.sleep(0.3)\n"
        "time.perf_counter = time.monotonic = time.time = lambda: 0.0")}, "faster clock")
    rep = force(ws, "clock", progress=False)
    assert rep["status"] == "keep"
    assert rep["timing"]["first_pass_seconds"] >= 0.3 * rep["prompts"]
    assert rep["timing"]["measured_by"].startswith("harness")


def test_kill_9_during_an_evaluation_leaves_store_consistent_and_workspace_recoverable(ws):
    make_branch(ws, "slow", {"decoder/generate.py": patch_generate("import time\ntime.sleep(1.0)")}, "slow")
    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "force", "--workspace", str(ws.path),
                             "--branch", "slow", "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    log = None
    while time.time() < deadline and log is None:  # wait until the system is up and answering
        time.sleep(0.5)
        logs = list((ws.state / "logs").glob("slow-*.log"))
        if logs and "Loading weights" in logs[0].read_text(errors="replace") and \
                ws.memory.db.execute("SELECT status FROM branches WHERE name='slow'").fetchone()[0] == "evaluating":
            log = logs[0]
    assert log is not None, "the evaluation never started"
    time.sleep(2.0)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(1.0)
    # the candidate died with its harness (no orphan keeps running the branch's code)
    for _ in range(40):
        if not _processes_using(ws.worktree_path("slow")):
            break
        time.sleep(0.25)
    assert _processes_using(ws.worktree_path("slow")) == []
    con = sqlite3.connect(ws.state / "memory.db")
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()
    done = Workspace(ws.path).recover()
    assert any("slow" in line and "interrupted" in line for line in done)
    b = ws.branch("slow")
    assert b.status == "interrupted"
    assert ws.memory.list_evaluations(b.id)[-1].status == "crash"
    assert ws.worktree_path("slow").exists()


def _processes_using(path: Path) -> list[int]:
    """Pids whose command line names `path` (the sandbox launcher) or whose working directory is it."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] == "Z" or int(fields[1]) == os.getpid():
                continue  # already dead and waiting to be reaped, or our own git helper
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(f"/proc/{d}/cwd")
        except OSError:
            continue
        if str(path) in cmd or cwd == str(path):
            found.append(int(d))
    return found


def test_recover_rebuilds_a_lost_worktree_and_prunes_stale_ones(ws):
    ws.create_branch("fragile")
    import shutil

    shutil.rmtree(ws.worktree_path("fragile"))
    (ws.state / "worktrees" / "orphan").mkdir()
    done = ws.recover()
    assert any("fragile" in d and "re-created" in d for d in done)
    assert any("orphan" in d for d in done)
    assert (ws.worktree_path("fragile") / "decoder" / "generate.py").exists()
    assert not (ws.state / "worktrees" / "orphan").exists()


@pytest.mark.slow  # fast twins: test_tui's accept-then-export, test_demo_cli's end-to-end run (slow)
def test_export_then_git_am_on_a_fresh_clone_reproduces_the_mechanism(ws, tmp_path):
    make_branch(ws, "ngram", {"system.toml": ('drafter = "draft-model"', 'drafter = "ngram"')},
                "config: n-gram drafter")
    rep = force(ws, "ngram", progress=False)
    assert rep["status"] == "keep"
    m = record_mechanism(ws, "ngram", "ngram-drafter", "drafting", "prompt-lookup drafting")
    ws.memory.set_mechanism_status(m.id, "accepted", "lossless, fewer drafter forwards")
    files = export(ws, ws.memory.list_mechanisms(status="accepted"), tmp_path / "patches")
    assert files and all(f.suffix == ".patch" for f in files)
    fresh = tmp_path / "fresh"
    git.Repo.clone_from(ws.path, fresh)
    repo = git.Repo(fresh)
    repo.git.checkout("-B", "main", "stock")
    repo.git.am(*map(str, files))
    assert (fresh / "system.toml").read_text() == (ws.worktree_path("ngram") / "system.toml").read_text()
    ref = stock_reference(ws, False)["prompts"][0]
    with run_system(ws, fresh, "fresh") as a, run_system(ws, ws.worktree_path("ngram"), "orig") as b:
        assert a.generate(ref["prompt_ids"], N_TOKENS).tokens == b.generate(ref["prompt_ids"], N_TOKENS).tokens
    export(ws, [m], None, branch="with-ngram")
    assert ws.repo.git.diff("with-ngram", "ngram", "--", "system.toml") == ""


def test_the_candidate_environment_has_no_secrets(monkeypatch, tmp_path):
    from workbench.harness import clean_env

    for k in ("OPENAI_API_KEY", "GITHUB_TOKEN", "MY_SERVICE_TOKEN", "DB_PASSWORD", "AWS_ACCESS_KEY_ID",
              "AZURE_OPENAI_KEY", "MISTRAL_KEY", "GH_PAT", "DATABASE_URL", "SPECPILOT_LLM_API_KEY"):
        monkeypatch.setenv(k, "secret")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = clean_env(tmp_path, threads=1)
    assert not [k for k, v in env.items() if v == "secret"]
    assert env["PYTHONPATH"] == str(tmp_path) and env["OMP_NUM_THREADS"] == "1"


def test_cli_init_and_branch_errors_are_one_line(tmp_path):
    w = str(tmp_path / "w")
    r = run_many("workbench.cli", {  # one after another, each captured as a process of its own
        "init": ["init", "demo", w, "--json"],
        "bad-name": ["branch", "create", "bad name", "--workspace", w],
        "no-branch": ["force", "--workspace", w, "--branch", "nope"],
        "create": ["branch", "create", "b", "--workspace", w],
        "list": ["branch", "list", "--workspace", w, "--json"],
    }, timeout=300)
    assert r["init"].returncode == 0 and json.loads(r["init"].stdout)["workspace"] == str((tmp_path / "w").resolve())
    assert r["bad-name"].returncode == 2 and r["bad-name"].stderr.count("\n") == 1
    assert "not allowed" in r["bad-name"].stderr
    assert r["no-branch"].returncode == 2 and "no branch named 'nope'" in r["no-branch"].stderr
    assert r["create"].returncode == 0
    assert [b["name"] for b in json.loads(r["list"].stdout)] == ["b"]


def test_accepting_in_a_workspace_carries_the_mechanism_to_the_global_memory(ws):
    from store import Memory, global_memory_path

    m = ws.memory.add_mechanism("carry-me", "drafting", "a verdict other deployments should see")
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "memory", "accept", str(m.id), "--note", "good",
                        "--workspace", str(ws.path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "global memory" in r.stdout, r.stderr
    with Memory(global_memory_path()) as g:
        assert [x.status for x in g.list_mechanisms() if x.uid == m.uid] == ["accepted"]
