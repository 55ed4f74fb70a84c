"""The evaluation harness: runs a branch's system in a sandboxed subprocess and times it from outside.

A candidate controls everything inside its own process: it may patch the clock, shadow modules or
run code at start-up. So the harness trusts only the tokens it returns, and takes every timing
itself, around the request/answer pair on the pipe. The process runs

- with its worktree first on the import path and as its working directory,
- with an allow-listed environment (`CANDIDATE_ENV_ALLOW`: locale, PATH, thread counts, device
  selection), so no secret reaches it whatever its name; protocol lines are capped in length,
- under a time limit per request and for start-up, and a memory limit on the resident set of its
  whole process tree (polled from outside, with an address-space rlimit as a backstop),
- in its own session: on a limit or at the end the whole process group is killed (and, sandboxed,
  its PID namespace with it),
- sandboxed where the machine allows (new user, mount, network and PID namespaces, an unused host
  uid when the workbench runs as root, no capabilities, a root holding only the worktree, the model
  files and the Python environment; see `_sandbox_init.py`).
  Where no sandbox is available the report says so in capitals, and `SPECPILOT_REQUIRE_SANDBOX=1`
  turns that into an error.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from workbench.gate import untimed
from workbench.progress import current_branch

NO_SANDBOX_WARNING = ("NO SANDBOX: the candidate ran with this user's full file-system and network access "
                      "(unshare with user namespaces is unavailable here); its isolation is NOT enforced")
_INIT = Path(__file__).with_name("_sandbox_init.py")
# Held-out data of the installed package: the demo's prompt sets, its hidden (timed) prompts among them. Where the
# package lies under a folder the sandbox mounts (a non-editable install under sys.prefix), an empty read-only
# folder covers it, so a candidate cannot read the prompts it is timed on.
HELD_OUT = (Path(__file__).resolve().parent.parent / "decoder" / "assets" / "demo" / "prompts",)
_PAGE = os.sysconf("SC_PAGE_SIZE")
# /etc files a Python process needs (no /etc/shadow, no keys).
_ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/passwd", "/etc/group", "/etc/hosts",
        "/etc/nsswitch.conf", "/etc/localtime", "/etc/os-release", "/etc/alternatives")


_LIVE: dict[str, dict[int, SystemProcess]] = {}  # branch -> id -> its running systems (here), for cancel_branch
_LIVE_LOCK = threading.Lock()


def cancel_branch(branch: str) -> int:
    """Kill every system this process runs for `branch`'s work now (their requests fail as `cancelled`);
    returns how many there were."""
    with _LIVE_LOCK:
        procs = list(_LIVE.get(branch, {}).values())
    for sp in procs:
        sp.kill("cancelled")
    return len(procs)


class SystemCrash(Exception):
    """The system under test failed: `kind` is timeout, memory, exit, protocol, start, cheat (it tried to
    get more of the machine than the other side) or cancelled (from the TUI); `reason` is one line."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason.replace("\n", " ")[:400]


@dataclass(frozen=True)
class Limits:
    start_s: float = 120.0  # model loading up to the ready line
    request_s: float = 120.0  # one generation request
    memory_mb: int = 6144  # resident set of the whole process tree
    threads: int | None = None  # OMP/MKL threads; None = all cores of this machine

    def as_dict(self) -> dict:
        return {"start_s": self.start_s, "request_s": self.request_s, "memory_mb": self.memory_mb,
                "threads": self.threads}


@cache
def sandbox_status() -> tuple[bool, str]:
    """Whether the sandbox can be built here (tried for real, on `true`), and why not when it cannot."""
    if os.environ.get("SPECPILOT_NO_SANDBOX") == "1":
        return False, "disabled by SPECPILOT_NO_SANDBOX=1"
    if sys.platform != "linux":
        return False, f"no user namespaces on {sys.platform}"
    true = next((p for p in ("/usr/bin/true", "/bin/true") if os.path.exists(p)), "/usr/bin/true")
    spec = sandbox_spec(Path("/usr"), [], [true], {"PATH": "/usr/bin:/bin"}, 256)
    try:
        r = subprocess.run(sandbox_command(spec), capture_output=True, text=True, timeout=20, env=_host_env())
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"the sandbox failed to start: {e}"
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit status {r.returncode}"
        return False, f"the sandbox was refused: {last}"
    who = "an unused host uid" if os.geteuid() == 0 else "this user's uid"
    return True, f"user, mount, network and PID namespaces; the candidate runs as {who}, without capabilities"


def sandbox_command(spec: dict) -> list[str]:
    """The command that builds the sandbox `spec` describes and execs its argv inside."""
    return [sys.executable, "-I", str(_INIT), json.dumps(spec)]


# The only variables of the workbench's environment a candidate sees (an allow-list: a secret under a
# name nobody thought of, e.g. AZURE_OPENAI_KEY or DATABASE_URL, never reaches it).
CANDIDATE_ENV_ALLOW = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "LD_LIBRARY_PATH",
                       "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "TRITON_INTERPRET", "OPENBLAS_CORETYPE",
                       "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
MAX_PROTOCOL_LINE = 4 * 2**20  # bytes: a longer line from the system is a protocol violation, not buffered
# A system's log (its stderr) keeps its first LOG_HEAD_BYTES and its last LOG_TAIL_BYTES; what lies
# between is dropped and counted (a candidate cannot fill the host's disk by printing).
LOG_HEAD_BYTES, LOG_TAIL_BYTES = 2**20, 64 * 2**10
SANDBOX_TMPFS = ("/tmp", "/dev/shm")  # RAM-backed inside the sandbox: counted in its memory


def clean_env(worktree: Path, threads: int | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The candidate's environment: an allow-list of this one, the worktree first on the import path."""
    env = {k: v for k, v in os.environ.items() if k in CANDIDATE_ENV_ALLOW}
    env.update({"PYTHONPATH": str(worktree), "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "HOME": "/tmp", "TMPDIR": "/tmp"})
    if threads:
        env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
    env.update(extra or {})
    return env


def sandbox_spec(worktree: Path, read_only: list[Path], argv: list[str], env: dict[str, str],
                 memory_mb: int) -> dict:
    """What the sandbox shows: system libraries, the Python environment, the models, the worktree."""
    py_dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(Path(sys.executable).resolve().parent.parent)}
    ro = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/sys/devices/system/cpu", *_ETC,
          *sorted(py_dirs), *(str(Path(p).resolve()) for p in read_only)]
    # The worktree is read-only too: a run writes nothing the next stage could find (caches go to /tmp).
    return {"read_only": [*ro, str(worktree)], "read_write": [], "cwd": str(worktree), "argv": argv, "env": env,
            "hide": hidden_under([*ro, str(worktree)]),
            "rlimit_as": (memory_mb + 4096) * 1024 * 1024,
            "dev_extra": sorted(p.name for p in Path("/dev").glob("nvidia*") if not p.is_dir())}  # GPUs, if any


def hidden_under(mounted: list[str], held_out: tuple[Path, ...] = HELD_OUT) -> list[str]:
    """The held-out folders that lie under one of the `mounted` paths (the sandbox covers each with an empty
    read-only folder); none for an editable install, whose package lies outside every mounted folder."""
    out = []
    for h in held_out:
        if not h.is_dir():
            continue
        h = h.resolve()
        if any(h == Path(m).resolve() or Path(m).resolve() in h.parents for m in mounted if os.path.exists(m)):
            out.append(str(h))
    return out


def unreadable_for_sandbox(paths: list[Path]) -> Path | None:
    """The first of `paths` (or of their direct entries) that the sandbox's uid could not read, when the
    workbench runs as root (the candidate then runs as an unrelated uid); None when all can be read."""
    if os.geteuid() != 0:
        return None  # the candidate keeps this user's uid
    for top in paths:
        for p in [top, *(sorted(top.iterdir()) if top.is_dir() and not top.is_symlink() else [])]:
            try:
                mode = p.stat().st_mode
            except OSError:
                continue
            need = 0o005 if p.is_dir() else 0o004
            if mode & need != need:
                return p
    return None


def _tree(root_pid: int) -> list[int]:
    """`root_pid` and all its descendants, walked from /proc outside the candidate (a child that left
    the process group or session is still found by its parent link)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def _tree_rss(pids: list[int]) -> int:
    """Resident bytes of these processes."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1]) * _PAGE
        except OSError:
            pass
    return total


def _sandbox_tmpfs_bytes(pids: list[int]) -> int:
    """Bytes stored in the sandbox's RAM-backed file systems, seen from outside through the root of
    the first process of `pids` that has pivoted into it (0 before that)."""
    host_root = os.stat("/").st_dev
    for pid in pids:
        try:
            if os.stat(f"/proc/{pid}/root").st_dev == host_root:
                continue
            total = 0
            for mount_point in SANDBOX_TMPFS:
                st = os.statvfs(f"/proc/{pid}/root{mount_point}")
                total += (st.f_blocks - st.f_bfree) * st.f_frsize
            return total
        except OSError:
            continue
    return 0


def _capped_copy(src, log_path: Path) -> None:
    """Copy the system's stderr into its log: the head, a count of what was dropped, then the tail."""
    head_left, tail, dropped = LOG_HEAD_BYTES, bytearray(), 0
    with open(log_path, "ab") as log:
        while chunk := src.read1(65536):
            if head_left > 0:
                log.write(chunk[:head_left])
                log.flush()
                chunk, head_left = chunk[head_left:], max(0, head_left - len(chunk))
            tail += chunk
            if len(tail) > LOG_TAIL_BYTES:
                dropped += len(tail) - LOG_TAIL_BYTES
                del tail[:len(tail) - LOG_TAIL_BYTES]
        if dropped:
            log.write(f"\n[specpilot: {dropped} bytes of this log dropped; its last {len(tail)} follow]\n".encode())
        log.write(tail)


@dataclass
class Timed:
    tokens: list[int]
    seconds: float  # measured by the harness around the pipe round trip
    stats: dict | None = None  # the system's own account of its phases (profile=True): for direction only


@dataclass
class TimedBatch:
    outputs: list[list[int]]  # new tokens per request of the batch, in order
    seconds: float  # measured by the harness around the whole batch
    stats: dict | None = None


def _int_list(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


@dataclass
class SystemProcess:
    """One running system: start it, send generation requests, close it; raises SystemCrash on failure."""

    worktree: Path
    argv: list[str]  # e.g. [python, -m, decoder.serve, --target, ...]
    limits: Limits = field(default_factory=Limits)
    read_only: list[Path] = field(default_factory=list)  # model directories the system may read
    log_path: Path | None = None
    sandbox: bool | None = None  # None: use it where available
    env_extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self._lines: queue.Queue = queue.Queue()
        self._killed: str | None = None
        self._next_id = 0
        self.sandboxed = False
        self.sandbox_note = ""
        self.peak_rss = 0
        self.served = 0  # requests sent to the current process (a restart starts again at 0)
        self._log_thread: threading.Thread | None = None
        self.branch = current_branch()  # whose work this is: cancel_branch reaches it

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> dict:
        """Start the system and wait for its ready line: untimed work, so never beside a timed run
        (`workbench.gate`)."""
        with untimed():
            return self._start()

    def _start(self) -> dict:
        ok, why = sandbox_status()
        use = ok if self.sandbox is None else self.sandbox
        if use and not ok:
            raise SystemCrash("start", f"a sandbox was required but is unavailable: {why}")
        if not use and os.environ.get("SPECPILOT_REQUIRE_SANDBOX") == "1":
            raise SystemCrash("start", f"SPECPILOT_REQUIRE_SANDBOX=1 but no sandbox: {why}")
        self.sandboxed, self.sandbox_note = use, (why if use else NO_SANDBOX_WARNING + f" ({why})")
        env = clean_env(self.worktree, self.limits.threads, self.env_extra)
        if use:
            spec = sandbox_spec(self.worktree, self.read_only, self.argv, env, self.limits.memory_mb)
            closed = unreadable_for_sandbox([Path(p) for p in spec["read_only"]])
            if closed:
                raise SystemCrash("start", f"{closed} is not readable by the sandbox's unprivileged uid (mode "
                                           f"{closed.stat().st_mode & 0o777:o}); run `chmod -R o+rX {closed}` or "
                                           f"run SpecPilot as an unprivileged user")
            cmd = sandbox_command(spec)
            preexec = _die_with_parent
        else:
            cmd, preexec = self.argv, self._rlimit
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE if self.log_path else subprocess.DEVNULL,
                                         cwd=self.worktree, env=env if not use else _host_env(),
                                         start_new_session=True, preexec_fn=preexec)
        except OSError as e:
            raise SystemCrash("start", f"could not start {self.argv[0]}: {e}") from None
        if self.log_path:
            self._log_thread = threading.Thread(target=_capped_copy, args=(self.proc.stderr, self.log_path),
                                                daemon=True)
            self._log_thread.start()
        if self.branch is not None:
            with _LIVE_LOCK:
                _LIVE.setdefault(self.branch, {})[id(self)] = self
        threading.Thread(target=self._read, args=(self.proc, self._lines), daemon=True).start()
        threading.Thread(target=self._watch, args=(self.proc,), daemon=True).start()
        ready = self._get(self.limits.start_s, "start-up (model loading)")
        if not ready.get("ready"):
            self.kill("protocol")
            raise SystemCrash("protocol", f"the system's first line was not {{\"ready\": true}}: {str(ready)[:120]}")
        return ready

    def _rlimit(self) -> None:

        _die_with_parent()
        cap = (self.limits.memory_mb + 4096) * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    def kill(self, why: str) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self._killed = self._killed or why
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """The whole process tree stopped (SIGSTOP) for the block: the idle side of a paired benchmark
        can neither compute ahead nor burn the CPU the other side is being timed on."""
        pids = _tree(self.proc.pid) if self.proc is not None and self.proc.poll() is None else []
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in reversed(pids):
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def _threads(self) -> list[int]:
        tids = []
        for pid in _tree(self.proc.pid) if self.proc is not None else []:
            with suppress(OSError):
                tids += [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        return tids

    def pin(self, cpus: set[int]) -> None:
        """Every thread of the system's process tree onto `cpus` (new ones inherit it)."""
        for tid in self._threads():
            with suppress(OSError):
                os.sched_setaffinity(tid, cpus)

    def check_pinned(self, cpus: set[int]) -> None:
        """Raise when a thread of the system runs outside `cpus`: it widened its own affinity to get more
        of the machine than the side it is compared with."""
        for tid in self._threads():
            try:
                mine = os.sched_getaffinity(tid)
            except OSError:
                continue  # gone
            if not mine <= cpus:
                self.kill("cheat")
                raise SystemCrash("cheat", f"thread {tid} moved itself to CPUs {sorted(mine)} outside the "
                                           f"benchmark's {sorted(cpus)} while being timed")

    def restart(self) -> dict:
        """The system again in a fresh process (and, sandboxed, a fresh /tmp): nothing an earlier request
        left in its memory carries over, so a prompt timed again is new to it (untimed, like `start`)."""
        self.close()
        self.proc = None
        self._lines = queue.Queue()
        self._killed = None
        self.served = 0
        return self.start()

    def close(self) -> None:
        """Ask the system to quit, then kill what is left of its process group."""
        if self.branch is not None:
            with _LIVE_LOCK:
                _LIVE.get(self.branch, {}).pop(id(self), None)
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers that left the leader behind
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait()

    def __enter__(self) -> SystemProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests --------------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[int], max_new_tokens: int, *, config: dict | None = None,
                 profile: bool = False) -> Timed:
        """One request, timed by the harness from writing it to reading the whole answer.

        `config` overrides DecodeConfig keys for this request; `profile` asks for the system's phase stats.
        """
        ans, rid, seconds = self._request({"prompt_ids": prompt_ids, "max_new_tokens": max_new_tokens},
                                          config, profile)
        toks = ans.get("tokens")
        if not _int_list(toks):
            self.kill("protocol")
            raise SystemCrash("protocol", f"answer {rid} has no list of integer tokens")
        stats = ans.get("stats") if isinstance(ans.get("stats"), dict) else None
        return Timed(toks, seconds, stats)

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int, *, config: dict | None = None,
                       profile: bool = False) -> TimedBatch:
        """`prompts` arriving at once, decoded together by the system's batched engine; timed like
        `generate` around the whole batch (its throughput is what a server under this load delivers)."""
        ans, rid, seconds = self._request({"batch": prompts, "max_new_tokens": max_new_tokens}, config, profile)
        outs = ans.get("outputs")
        if not isinstance(outs, list) or len(outs) != len(prompts) or not all(_int_list(o) for o in outs):
            self.kill("protocol")
            raise SystemCrash("protocol", f"answer {rid} has no list of {len(prompts)} integer token lists")
        stats = ans.get("stats") if isinstance(ans.get("stats"), dict) else None
        return TimedBatch(outs, seconds, stats)

    def _request(self, body: dict, config: dict | None, profile: bool) -> tuple[dict, int, float]:
        """Send one request, wait for its answer; (answer, id, seconds from writing to the whole answer).
        Outside a timed run the request is untimed work: it waits while another is timed (`workbench.gate`),
        and its clock starts when it is sent."""
        assert self.proc is not None, "start() first"
        with untimed():
            return self._send(body, config, profile)

    def _send(self, body: dict, config: dict | None, profile: bool) -> tuple[dict, int, float]:
        self.served += 1
        self._next_id += 1
        rid = self._next_id
        req: dict = {"id": rid, **body}
        if config:
            req["config"] = config
        if profile:
            req["profile"] = True
        line = json.dumps(req).encode() + b"\n"
        t0 = time.perf_counter()
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except OSError:
            raise self._dead("while sending a request") from None
        ans = self._get(self.limits.request_s, f"request {rid}")
        seconds = time.perf_counter() - t0
        if self._over_memory():  # the watcher samples; an answer is only taken with the tree under the limit
            self.kill("memory")
            raise self._dead(f"at the answer to request {rid}")
        if ans.get("id") != rid:
            self.kill("protocol")
            raise SystemCrash("protocol", f"answer for id {ans.get('id')!r} when {rid} was expected")
        if "error" in ans:
            raise SystemCrash("exit", f"the system reported an error: {ans['error']}")
        return ans, rid, seconds

    def _get(self, timeout: float, what: str) -> dict:
        try:
            item = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.kill("timeout")
            raise SystemCrash("timeout", f"no answer to {what} within {timeout:g} s; process group killed") from None
        if item is None:
            raise self._dead(f"during {what}")
        return item

    def _dead(self, when: str) -> SystemCrash:
        self.kill("exit")
        if self._killed == "memory":
            return SystemCrash("memory", f"resident memory {self.peak_rss / 2**20:.0f} MiB passed the "
                                         f"{self.limits.memory_mb} MiB limit {when}; process group killed")
        if self._killed == "cancelled":
            return SystemCrash("cancelled", f"cancelled by the engineer {when}; process group killed")
        if self._killed == "protocol":
            return SystemCrash("protocol", f"the system sent a line over {MAX_PROTOCOL_LINE // 2**20} MiB {when}; "
                                           f"process group killed")
        rc = self.proc.returncode if self.proc else None
        tail = self._log_tail()
        if rc is not None and rc < 0:
            what = f"killed by signal {-rc}"
        else:
            what = f"exited with status {rc}"
        if "MemoryError" in tail or "std::bad_alloc" in tail or "Cannot allocate memory" in tail:
            return SystemCrash("memory", f"out of memory under the {self.limits.memory_mb} MiB limit {when} "
                                         f"({what}): {tail}")
        return SystemCrash("exit", f"the system {what} {when}" + (f": {tail}" if tail else ""))

    def _log_tail(self) -> str:
        if self._log_thread is not None:
            self._log_thread.join(timeout=2)  # the copy ends when the last writer of the pipe is gone
        if not self.log_path or not self.log_path.exists():
            return ""
        lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return lines[-1].strip()[:200] if lines else ""

    def _read(self, proc: subprocess.Popen, lines: queue.Queue) -> None:
        """`proc`'s protocol lines into `lines` (bound at start: a restart's new process has its own)."""
        assert proc.stdout is not None
        while True:
            raw = proc.stdout.readline(MAX_PROTOCOL_LINE + 1)
            if not raw:
                break
            if len(raw) > MAX_PROTOCOL_LINE:
                if self.proc is proc:
                    self.kill("protocol")
                break
            try:
                obj = json.loads(raw)
            except ValueError:
                continue  # not protocol: ignore (the server sends prints to stderr anyway)
            if isinstance(obj, dict):
                lines.put(obj)
        lines.put(None)

    def _over_memory(self) -> bool:
        """Measure the process tree now (resident memory plus, sandboxed, its RAM-backed files) and
        say whether it, or any earlier sample, passed the limit."""
        if self.proc is None or self.proc.poll() is not None:
            return self.peak_rss > self.limits.memory_mb * 2**20
        pids = _tree(self.proc.pid)
        rss = _tree_rss(pids) + (_sandbox_tmpfs_bytes(pids) if self.sandboxed else 0)
        self.peak_rss = max(self.peak_rss, rss)
        return self.peak_rss > self.limits.memory_mb * 2**20

    def _watch(self, proc: subprocess.Popen) -> None:
        while self.proc is proc and proc.poll() is None:
            if self._over_memory():
                self.kill("memory")
                return
            time.sleep(0.05)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the harness dies (kill -9 included), so no candidate
    outlives the evaluation that started it; sandboxed, the init's own death signal then ends its namespace."""

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _host_env() -> dict[str, str]:
    """The environment the sandbox's init runs with (the candidate's comes from the sandbox spec)."""
    return {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL")}
