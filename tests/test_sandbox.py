"""The sandbox itself, attacked from inside by small probe programs (real namespaces, no model).

Each probe runs under the same spec and init the harness uses for candidates and reports, as JSON,
what it managed; the host side checks the sandboxed processes' host uids from /proc. Skips, saying
why, where the machine cannot build the sandbox.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import fake_system
from workbench._sandbox_init import CANDIDATE_ID, SANDBOX_UID_BASE
from workbench.harness import (
    LOG_HEAD_BYTES,
    LOG_TAIL_BYTES,
    Limits,
    SystemCrash,
    SystemProcess,
    _host_env,
    _tree,
    clean_env,
    sandbox_command,
    sandbox_spec,
    sandbox_status,
)

SANDBOX, SANDBOX_WHY = sandbox_status()
pytestmark = pytest.mark.skipif(not SANDBOX, reason=f"no sandbox on this machine: {SANDBOX_WHY}")

PROBE = r'''
import ctypes, errno, json, os, socket, sys, time
libc = ctypes.CDLL(None, use_errno=True)
got = {}
def tried(name, f):
    try:
        f()
        got[name] = True
    except OSError as e:
        got[name] = e.strerror or str(e)
got["uid"], got["gid"], got["euid"] = os.getuid(), os.getgid(), os.geteuid()
got["cap_eff"] = [ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("CapEff")][0]
tried("core_pattern", lambda: open("/proc/sys/kernel/core_pattern", "w").close())
tried("proc_sys", lambda: open("/proc/sys/vm/swappiness", "w").write("60"))
tried("sysrq", lambda: open("/proc/sysrq-trigger", "w").write("h"))
tried("host_root_home", lambda: os.listdir("/root/.ssh"))
tried("etc_shadow", lambda: open("/etc/shadow").read())
tried("write_root", lambda: open("/evil", "w").close())
tried("write_worktree", lambda: open("written.txt", "w").close())
def call(rc):
    if rc != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
tried("mount_tmpfs", lambda: call(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, None)))
tried("umount_proc_sys", lambda: call(libc.umount2(b"/proc/sys", 2)))
def own_userns():  # in a child: a user namespace of its own would allow an unaccounted tmpfs
    pid = os.fork()
    if pid == 0:
        os._exit(0 if libc.unshare(0x10000000) == 0 else 1)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        raise OSError(1, "refused")
tried("new_userns", own_userns)
tried("network", lambda: socket.create_connection(("10.255.255.1", 80), timeout=1))
tried("loopback_listen", lambda: socket.socket().bind(("127.0.0.1", 0)))
def big(path, mib):
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(bytes(1 << 20))
tried("tmp_600m", lambda: big("/tmp/big", 600))
os.unlink("/tmp/big") if os.path.exists("/tmp/big") else None
tried("shm_100m", lambda: big("/dev/shm/big", 100))
# Fork until refused: the process limit must stop it well short of starving the host.
kids = []
try:
    for _ in range(3000):
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        kids.append(pid)
    got["forks"] = len(kids)
except OSError as e:
    got["forks"] = len(kids)
    got["fork_error"] = e.strerror
for pid in kids:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print(json.dumps(got), flush=True)
sys.stdin.readline()  # hold still while the host looks at us
'''


def _sandboxed(tmp_path: Path, script: str, **spec_extra: object) -> subprocess.Popen:
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / "probe.py").write_text(script)
    argv = [sys.executable, "-I", str(wt / "probe.py")]
    spec = sandbox_spec(wt, [], argv, clean_env(wt, 1), 1024) | spec_extra
    return subprocess.Popen(sandbox_command(spec), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_host_env(), cwd=wt, start_new_session=True)


def test_the_candidate_is_unprivileged_inside_and_outside_and_contained(tmp_path):
    proc = _sandboxed(tmp_path, PROBE, max_processes=200)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read().decode()[-2000:]
        got = json.loads(line)
        host_uids = set()
        for pid in _tree(proc.pid):
            with open(f"/proc/{pid}/status") as f:
                host_uids |= {int(ln.split()[1]) for ln in f if ln.startswith("Uid:")}
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    # Inside: not root, no capability.
    assert (got["uid"], got["gid"], got["euid"]) == (CANDIDATE_ID, CANDIDATE_ID, CANDIDATE_ID)
    assert int(got["cap_eff"], 16) == 0
    # Outside: an unused uid when the workbench is root (never 0), else the workbench's own.
    if os.geteuid() == 0:
        assert host_uids and all(u >= SANDBOX_UID_BASE for u in host_uids), host_uids
    else:
        assert host_uids == {os.geteuid()}
    for attack in ("core_pattern", "proc_sys", "sysrq", "host_root_home", "etc_shadow", "write_root",
                   "write_worktree", "mount_tmpfs", "umount_proc_sys", "network", "tmp_600m", "shm_100m",
                   "new_userns"):
        assert got[attack] is not True, f"{attack} succeeded inside the sandbox"
    assert got["loopback_listen"] is True  # only the namespace's own loopback
    assert got["forks"] < 200 and got.get("fork_error"), got
    assert not (tmp_path / "wt" / "written.txt").exists()


SERVER = fake_system(r'''
for name in ("a", "b"):  # two files: one file may not pass 256 MiB
    with open("/tmp/hoard-" + name, "ab") as f:
        for _ in range(200):
            f.write(bytes(1 << 20))
print(json.dumps({"id": req["id"], "tokens": [1]}), flush=True)
''', setup=r'''
sys.stderr.write("x" * (3 << 20) + "\nthe last line\n"); sys.stderr.flush()
''')


def test_sandbox_tmpfs_counts_as_memory_and_the_log_is_capped(tmp_path):
    """400 MiB written to the sandbox's RAM-backed /tmp passes a 300 MiB limit (the process itself
    stays small); 3 MiB of stderr leave a log of head + tail with the drop counted."""
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / "server.py").write_text(SERVER)
    log = tmp_path / "server.log"
    sp = SystemProcess(wt, [sys.executable, "-I", str(wt / "server.py")], limits=Limits(memory_mb=300, request_s=30),
                       log_path=log, sandbox=True)
    with sp:
        with pytest.raises(SystemCrash) as err:
            sp.generate([1, 2], 4)
    assert err.value.kind == "memory", err.value.reason
    deadline = time.time() + 5
    while "bytes of this log dropped" not in log.read_text(errors="replace") and time.time() < deadline:
        time.sleep(0.1)
    text = log.read_text(errors="replace")
    assert log.stat().st_size <= LOG_HEAD_BYTES + LOG_TAIL_BYTES + 200
    assert "bytes of this log dropped" in text and text.rstrip().endswith("the last line")


ECHO = fake_system(r'''
if greedy:  # more of the machine than the side it is compared with
    os.sched_setaffinity(0, range(os.cpu_count()))
print(json.dumps({"id": req["id"], "tokens": [1, 2, 3]}), flush=True)
''', setup=r'''
greedy = len(sys.argv) > 1
''')


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin one side to one of them")
def test_a_side_that_widens_its_cpu_affinity_while_timed_is_caught(tmp_path):
    from workbench.measure import Prompt, paired_bench

    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / "echo.py").write_text(ECHO)
    one = {min(os.sched_getaffinity(0))}
    prompts = [Prompt(f"p{i}", [1, 2]) for i in range(4)]
    argv = [sys.executable, "-I", str(wt / "echo.py")]
    with SystemProcess(wt, argv) as a, SystemProcess(wt, argv) as b:
        res = paired_bench(a, b, prompts, 3, cpus=one, min_passes=2, max_passes=2)  # the honest pair passes
    assert res.passes == 2
    with SystemProcess(wt, argv) as a, SystemProcess(wt, [*argv, "greedy"]) as b:
        with pytest.raises(SystemCrash) as err:
            paired_bench(a, b, prompts, 3, cpus=one)
    assert err.value.kind == "cheat" and "outside the benchmark's" in err.value.reason


def test_a_worktree_the_sandbox_uid_cannot_read_is_a_one_line_start_error(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only root hands the candidate another uid")
    wt = tmp_path / "wt"
    wt.mkdir(mode=0o700)
    (wt / "echo.py").write_text(ECHO)
    with pytest.raises(SystemCrash) as err:
        SystemProcess(wt, [sys.executable, "-I", str(wt / "echo.py")], sandbox=True).start()
    assert err.value.kind == "start" and str(wt) in err.value.reason and "chmod" in err.value.reason


BURNER = r'''
import json, os, sys, threading
def burn():
    while True:
        pass
if os.fork() == 0:  # a child process burns too: freezing must reach the whole tree
    burn()
threading.Thread(target=burn, daemon=True).start()
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()
'''


def _cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def test_the_idle_side_is_frozen_whole_while_the_other_is_timed(tmp_path):
    """A side that computes ahead or burns CPU during the other's turn: its process tree gets no CPU
    while frozen (checked from /proc), and runs again after."""
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / "burner.py").write_text(BURNER)
    with SystemProcess(wt, [sys.executable, "-I", str(wt / "burner.py")]) as sp:
        time.sleep(0.3)
        pids = _tree(sp.proc.pid)
        with sp.frozen():
            time.sleep(0.2)  # signals delivered, stops settled
            before = _cpu_seconds(pids)
            time.sleep(1.0)
            frozen = _cpu_seconds(pids) - before
        before = _cpu_seconds(pids)
        time.sleep(1.0)
        running = _cpu_seconds(pids) - before
    assert frozen <= 0.02, frozen
    assert running >= 0.3, running


RECORDER = fake_system(r'''
print(json.dumps({"id": req["id"], "tokens": req["prompt_ids"][:1]}), flush=True)
''')


def test_the_benchmark_order_is_new_every_pass(tmp_path):
    """A candidate that predicts the next prompt from the order cannot: every pass draws a new one."""
    from workbench.measure import Prompt, paired_bench

    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / "rec.py").write_text(RECORDER)
    prompts = [Prompt(f"p{i}", [i]) for i in range(6)]
    argv = [sys.executable, "-I", str(wt / "rec.py")]
    seen: list[int] = []
    with SystemProcess(wt, argv) as a, SystemProcess(wt, argv) as b:
        gen = b.generate

        def recording(ids, n, **kw):
            seen.append(ids[0])
            return gen(ids, n, **kw)

        b.generate = recording
        paired_bench(a, b, prompts, 1, min_passes=4, max_passes=4, rel_ci=0.0)
    passes = [tuple(seen[1 + 7 * i:7 * (i + 1)]) for i in range(4)]  # each after its pass's warm-up request
    assert all(sorted(p) == list(range(6)) for p in passes), passes
    assert len(set(passes)) > 1, passes  # 4 equal draws of 720 orders: about 1 in 4e8


MEMO = fake_system(r'''
key = tuple(req["prompt_ids"])
print(json.dumps({"id": req["id"], "tokens": [1 if key in seen else 0]}), flush=True)
seen.add(key)
''', setup=r'''
seen = set()
''')


@pytest.mark.parametrize("fresh", [True, False])
def test_no_timed_prompt_is_one_the_process_has_answered_before(tmp_path, fresh):
    """A system that remembers answers across requests (llama.cpp's ngram-mod does, a candidate could on
    purpose) would be timed on repeats from the second pass on; every pass runs in fresh processes, warmed on a
    prompt that is never timed, so each timed prompt is new to the process that answers it. The recorder
    answers 1 for a prompt it has seen: with `fresh=False` (the old protocol) repeats are timed."""
    from workbench.measure import Prompt, paired_bench

    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / "memo.py").write_text(MEMO)
    prompts = [Prompt(f"p{i}", [i, i + 1]) for i in range(4)]
    argv = [sys.executable, "-I", str(wt / "memo.py")]
    timed: list[list[int]] = []

    def check(pid, toks):
        timed.append(toks)
        return None

    with SystemProcess(wt, argv) as a, SystemProcess(wt, argv) as b:
        paired_bench(a, b, prompts, 1, min_passes=3, max_passes=3, rel_ci=0.0, check_b=check, fresh=fresh)
    assert len(timed) == 12
    if fresh:
        assert all(t == [0] for t in timed), timed
    else:
        assert timed.count([1]) == 8, timed  # passes 2 and 3 were repeats


HELD_OUT_PROBE = r'''
import json, os
got = {"public": open(os.environ["PKG"] + "/public.txt").read(),
       "listing": sorted(os.listdir(os.environ["PKG"] + "/prompts"))}
try:
    got["secret"] = open(os.environ["PKG"] + "/prompts/hidden.jsonl").read()
except OSError as e:
    got["secret"] = e.strerror
print(json.dumps(got), flush=True)
'''


def test_held_out_prompts_under_a_mounted_folder_are_covered_and_an_editable_install_has_none(tmp_path):
    """A non-editable install puts the package (the demo's held-out prompts with it) under sys.prefix, which
    the sandbox mounts: the held-out folder is covered by an empty read-only one, the rest of the mount stays
    readable. An editable install lies outside every mounted folder: nothing to cover."""
    from workbench.harness import HELD_OUT, hidden_under

    pkg = tmp_path / "site" / "decoder"
    (pkg / "prompts").mkdir(parents=True)
    (pkg / "prompts" / "hidden.jsonl").write_text('{"id": "timed", "text": "the answer"}\n')
    (pkg / "public.txt").write_text("weights and code")
    held = (pkg / "prompts",)
    assert hidden_under([str(tmp_path / "site")], held) == [str((pkg / "prompts").resolve())]
    assert hidden_under([str(tmp_path / "elsewhere"), "/usr"], held) == []
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / "probe.py").write_text(HELD_OUT_PROBE)
    argv = [sys.executable, "-I", str(wt / "probe.py")]
    spec = sandbox_spec(wt, [tmp_path / "site"], argv, clean_env(wt, 1, {"PKG": str(pkg.resolve())}), 1024)
    spec["hide"] = hidden_under(spec["read_only"], held)
    out = subprocess.run(sandbox_command(spec), capture_output=True, text=True, env=_host_env(), timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["public"] == "weights and code" and got["listing"] == []
    assert "answer" not in got["secret"]
    # This checkout's package: covered exactly when a mounted folder holds it.
    assert HELD_OUT[0].is_dir()
    assert sandbox_spec(wt, [], argv, {}, 1024)["hide"] == []
    assert sandbox_spec(wt, [HELD_OUT[0].parent.parent], argv, {}, 1024)["hide"] == [str(HELD_OUT[0])]
