"""Where a candidate's evaluation (the cascade: guard, smoke, forcing, paired timing) runs.

    local  here, in the loop's own process: today's behaviour, the default, no Ray needed
    ray    a Ray task per evaluation on a cluster (`pip install -e .[ray]`)

A Ray evaluation receives everything it needs in one payload: the candidate as a git bundle (stock and
the branch, the base among its ancestors), made on the head from git objects with hardened git (never
a candidate's configuration), the workspace's `specpilot.toml` and hidden prompts, stock's cached
forcing tokens, and the base's noise floor when the head has it. Models travel by path: every node
mounts them where the deployment says. On the node the task builds a throwaway workspace from the
bundle (a repository it initialises itself), runs the same `cascade.evaluate` with the same harness
and sandbox, and returns the evaluation record: the attempt and every stage it recorded in its scratch
store. The head checks the record and writes it into the real store: nodes never write the store, the
memory or the head's git. A record the head cannot read is a crash of that candidate, not of the loop.

Placement: a node offers one unit of the deployment's resource (`cpu_eval` here, e.g. `h200` on a GPU
cluster; nodes are started with `--resources '{"cpu_eval": 1}'`) and a task takes 1 / `per_node` of it
(default 2), so a node runs up to `per_node` evaluations at once. Their untimed stages (start-up, smoke,
forcing) run side by side; their paired benchmarks take the machine's timing gate (`workbench.gate`) one
at a time, and untimed work on that machine pauses at its next request while one is timed: one timed
pair per machine, nothing beside it. A node that dies mid-evaluation costs a retry on another node (Ray's
task retries, bounded by `max_retries`); the attempt is recorded once, by the head, when a task returns.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from store import EVALUATION_STATUSES
from workbench.cascade import Attempt, evaluate
from workbench.forcing import stock_reference
from workbench.gate import PAUSED
from workbench.progress import step, tracking
from workbench.safegit import hardened
from workbench.workspace import STOCK_TAG, Workspace, WorkspaceError

EXECUTORS = ("local", "ray")
DEFAULT_RESOURCE = "cpu_eval"
DEFAULT_RETRIES = 2
DEFAULT_PER_NODE = 2
MAX_PER_NODE = 8
SETTING_KEYS = ("kind", "address", "resource", "num_gpus", "max_retries", "per_node")
RECORD_VERSION = 1
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # Ray sets these in its workers; the candidate gets the head's
BRANCH_STATUS = {"keep": "kept", "discard": "discarded", "crash": "crashed", "rejected": "rejected"}
Say = Callable[..., None]


class ExecutorError(Exception):
    """The executor cannot start (Ray missing, a cluster unreachable, a bad setting); one line."""


@dataclass(frozen=True)
class ExecutorSettings:
    kind: str = "local"
    address: str | None = None  # host:port of a running cluster, "auto" (RAY_ADDRESS or this machine's), "local"
    resource: str = DEFAULT_RESOURCE  # a node offers 1 unit; an evaluation takes 1 / per_node of it
    num_gpus: float = 0.0
    max_retries: int = DEFAULT_RETRIES
    per_node: int = DEFAULT_PER_NODE  # evaluations sharing a node: untimed stages together, timed ones in turn

    @classmethod
    def resolve(cls, kind: str | None, address: str | None, table: dict | None, where: str = "[executor]"
                ) -> ExecutorSettings:
        """The flags over the workspace's `[executor]` table over the defaults; ExecutorError names a bad value."""
        if table is not None and not isinstance(table, dict):
            raise ExecutorError(f"{where} = {table!r}: write a table, e.g. [executor] kind = \"ray\"")
        t = dict(table or {})
        unknown = sorted(set(t) - set(SETTING_KEYS))
        if unknown:
            raise ExecutorError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(SETTING_KEYS)}")
        kind = kind or t.get("kind", "local")
        if kind not in EXECUTORS:
            raise ExecutorError(f"executor {kind!r}: use one of {', '.join(EXECUTORS)}")
        address = address or t.get("address")
        resource, gpus, retries = t.get("resource", DEFAULT_RESOURCE), t.get("num_gpus", 0), t.get("max_retries",
                                                                                                   DEFAULT_RETRIES)
        if not isinstance(resource, str) or not resource:
            raise ExecutorError(f"{where}: resource = {resource!r}; name the custom resource every evaluation "
                                f"node offers, e.g. resource = \"cpu_eval\"")
        if isinstance(gpus, bool) or not isinstance(gpus, (int, float)) or gpus < 0:
            raise ExecutorError(f"{where}: num_gpus = {gpus!r}; use a number >= 0")
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 10:
            raise ExecutorError(f"{where}: max_retries = {retries!r}; use an integer from 0 to 10")
        if address is not None and (not isinstance(address, str) or not address.strip()):
            raise ExecutorError(f"{where}: address = {address!r}; use host:port, auto or local")
        per_node = t.get("per_node", DEFAULT_PER_NODE)
        if isinstance(per_node, bool) or not isinstance(per_node, int) or not 1 <= per_node <= MAX_PER_NODE:
            raise ExecutorError(f"{where}: per_node = {per_node!r}; use an integer from 1 to {MAX_PER_NODE} (the "
                                f"evaluations one node runs at once; 1 = one evaluation per node)")
        return cls(kind, address, resource, float(gpus), retries, per_node)

    @property
    def share(self) -> float:
        """The part of a node's resource one evaluation takes (Ray keeps 4 decimals: 1/3 -> 0.3333)."""
        return _ray_quantity(1 / self.per_node)


def _ray_quantity(x: float) -> float:
    """A fractional resource amount as Ray keeps it (4 decimals), rounded down so `per_node` of them fit."""
    return math.floor(x * 10_000 + 1e-9) / 10_000


# -- the payload (head) ---------------------------------------------------------------------------------


def make_bundle(ws: Workspace, branch: str) -> bytes:
    """Stock and `branch` (its history: the base it started from) as a git bundle, read from the main
    repository's objects with hardened git and a git dir of ours."""
    git_dir = Path(ws.repo.git_dir)
    g = hardened(git_dir, ws.path)
    fd, tmp = tempfile.mkstemp(prefix="specpilot-", suffix=".bundle")
    os.close(fd)
    try:
        g.bundle("create", tmp, f"refs/tags/{STOCK_TAG}", f"refs/heads/{branch}")
        return Path(tmp).read_bytes()
    finally:
        os.unlink(tmp)


def evaluation_payload(ws: Workspace, branch: str, base: str, base_ar: float, ceiling: float,
                       min_gain: float) -> dict:
    """Everything a node needs to evaluate `branch` against `base` (models by path)."""
    stock_reference(ws, progress=False)  # cached on the head once; shipped, never recomputed on a node
    noise = ws.state / "noise" / f"{base}.json"
    return {
        "version": RECORD_VERSION, "branch": branch, "base": base, "head": ws.head(branch),
        "base_ar": base_ar, "ceiling": ceiling, "min_gain": min_gain,
        "bundle": make_bundle(ws, branch),
        "specpilot_toml": (ws.path / "specpilot.toml").read_text(),
        "hidden": ws.hidden_prompts_path().read_text(),
        "stock": {p.name: p.read_text() for p in sorted((ws.state / "stock").glob("*.json"))},
        "noise": noise.read_text() if noise.exists() else None,
        "thread_env": {k: os.environ.get(k) for k in THREAD_ENV},
    }


# -- the evaluation (node) ------------------------------------------------------------------------------


def _git(cwd: Path, *argv: str) -> None:
    """Git in a repository this process created (ours: no candidate configuration anywhere in it)."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL")}
    env.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL="/dev/null", GIT_TERMINAL_PROMPT="0", HOME=str(cwd))
    subprocess.run(["git", "-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false", *argv], cwd=cwd, env=env,
                   check=True, capture_output=True, timeout=300)


def evaluate_payload(payload: dict, report: Callable[[str, str], None] | None = None) -> dict:
    """Run the cascade on the payload's candidate in a throwaway workspace; the evaluation record.

    `report(kind, message)` sees each step (kind "stage" or "say") as it happens."""
    t0 = time.monotonic()
    say_lines: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="specpilot-eval-"))
    saved = {k: os.environ.get(k) for k in THREAD_ENV}
    for k, v in (payload.get("thread_env") or {}).items():  # the candidate's environment is the head's
        if k in THREAD_ENV:
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    try:
        path = root / "ws"
        path.mkdir()
        (root / "c.bundle").write_bytes(payload["bundle"])
        _git(path, "init", "-q")
        _git(path, "fetch", "-q", str(root / "c.bundle"), f"+refs/tags/{STOCK_TAG}:refs/tags/{STOCK_TAG}",
             "+refs/heads/*:refs/bundle/*")
        _git(path, "checkout", "-q", "--detach", STOCK_TAG)
        (path / "specpilot.toml").write_text(payload["specpilot_toml"])  # the head's, as it runs there
        state = path / ".specpilot"
        for sub in ("stock", "noise"):
            (state / sub).mkdir(parents=True, exist_ok=True)
        (state / "hidden.jsonl").write_text(payload["hidden"])
        for name, text in payload["stock"].items():
            (state / "stock" / Path(name).name).write_text(text)
        noise = state / "noise" / f"{payload['base']}.json"
        if payload.get("noise"):
            noise.write_text(payload["noise"])
        ws = Workspace(path)
        try:
            branch = payload["branch"]
            b = ws.create_branch(branch, base=payload["head"], agent="remote")
            if ws.head(branch) != payload["head"]:
                raise WorkspaceError(f"the bundle's {branch} is not {payload['head'][:10]}")

            def say(msg: str, *_a: Any) -> None:
                say_lines.append(msg)
                if report:
                    report("say", msg)

            relay = (lambda rec: report("step", json.dumps(rec))) if report else None
            with tracking(state, branch, forward=relay):  # the cascade's steps, relayed to the head's board
                att = evaluate(ws, branch, payload["base"], float(payload["base_ar"]), float(payload["ceiling"]),
                               min_gain=float(payload["min_gain"]), progress=say)
            forcing = {f.evaluation_id: {**f.details, "match_rate": f.match_rate,
                                         "positions_checked": f.positions_checked, "mismatches": f.mismatches}
                       for f in ws.memory.list_forcing_reports(b.id)}
            evals = [{"stage": e.stage, "status": e.status, "reason": e.reason, "metrics": e.metrics,
                      "forcing": forcing.get(e.id)} for e in ws.memory.list_evaluations(b.id)]
        finally:
            ws.close()
        return {"version": RECORD_VERSION, "branch": branch, "head": payload["head"],
                "attempt": {"status": att.status, "reason": att.reason, "speedup": att.speedup,
                            "speedup_over_ar": att.speedup_over_ar, "ci95": att.ci95, "points": att.points},
                "evaluations": evals, "say": say_lines,
                "noise": noise.read_text() if noise.exists() and not payload.get("noise") else None,
                "seconds": time.monotonic() - t0}
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        shutil.rmtree(root, ignore_errors=True)


# -- the record (head) ----------------------------------------------------------------------------------


class MalformedRecord(Exception):
    pass


def _num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_record(record: object, branch: str, head: str) -> dict:
    """The record if it is one the head can store, else MalformedRecord saying what is wrong."""
    if not isinstance(record, dict):
        raise MalformedRecord(f"a {type(record).__name__}, not a dict")
    if record.get("version") != RECORD_VERSION:
        raise MalformedRecord(f"version {record.get('version')!r}, expected {RECORD_VERSION}")
    if record.get("branch") != branch or record.get("head") != head:
        raise MalformedRecord(f"for {record.get('branch')!r} at {str(record.get('head'))[:10]}, "
                              f"not {branch} at {head[:10]}")
    a = record.get("attempt")
    if not isinstance(a, dict) or a.get("status") not in EVALUATION_STATUSES or not isinstance(a.get("reason"), str):
        raise MalformedRecord("no attempt with a known status and a reason")
    for k in ("speedup", "speedup_over_ar"):
        if a.get(k) is not None and not _num(a[k]):
            raise MalformedRecord(f"attempt {k} = {a[k]!r}")
    if a.get("ci95") is not None and not (isinstance(a["ci95"], list) and len(a["ci95"]) == 2
                                          and all(map(_num, a["ci95"]))):
        raise MalformedRecord(f"attempt ci95 = {a['ci95']!r}")
    if a.get("points") is not None and not (isinstance(a["points"], dict) and all(map(_num, a["points"].values()))):
        raise MalformedRecord(f"attempt points = {a['points']!r}")
    evals = record.get("evaluations")
    if not isinstance(evals, list) or not evals:
        raise MalformedRecord("no evaluations")
    for e in evals:
        if (not isinstance(e, dict) or not isinstance(e.get("stage"), str) or e.get("status") not in
                EVALUATION_STATUSES or not isinstance(e.get("reason"), str) or not isinstance(e.get("metrics"), dict)
                or not (e.get("forcing") is None or isinstance(e["forcing"], dict))):
            raise MalformedRecord(f"an evaluation is not stage/status/reason/metrics: {str(e)[:80]}")
    if evals[-1]["status"] != a["status"]:
        raise MalformedRecord(f"the last stage says {evals[-1]['status']}, the attempt {a['status']}")
    if not isinstance(record.get("say", []), list):
        raise MalformedRecord("say is not a list")
    return record


def apply_record(ws: Workspace, branch: str, base: str, record: dict) -> Attempt:
    """Write a checked record's stages into the store (once, all or none: one transaction) and return
    its attempt."""
    b = ws.branch(branch)
    with ws.memory.transaction():
        for e in record["evaluations"]:
            ws.memory.add_evaluation(b.id, e["stage"], e["status"], e["reason"], metrics=e["metrics"],
                                     forcing=e.get("forcing"))
    a = record["attempt"]
    noise = record.get("noise")
    if isinstance(noise, str):  # the base's noise floor, measured there: cached here like a local one
        try:
            if json.loads(noise).get("base") == base:
                path = ws.state / "noise" / f"{base}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                if not path.exists():
                    path.write_text(noise)
        except (ValueError, AttributeError):
            pass
    return Attempt(a["status"], a["reason"], a.get("speedup"), a.get("speedup_over_ar"), a.get("ci95"),
                   a.get("points"))


# -- the executors ----------------------------------------------------------------------------------------


class LocalEvaluator:
    """The cascade here, in this process (today's behaviour)."""

    kind = "local"
    concurrent = False  # the loop evaluates attempts one after the other, as it always has

    def evaluate(self, ws: Workspace, branch: str, base: str, base_ar: float, ceiling: float, *,
                 min_gain: float = 1.02, progress: Say | None = None) -> Attempt:
        return evaluate(ws, branch, base, base_ar, ceiling, min_gain=min_gain, progress=progress)

    def shutdown(self) -> None:
        pass


def _remote_evaluate(payload: dict, board: Any) -> dict:
    """The Ray task: the cascade on this node, steps reported to the head's board (best effort)."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    ip = ray.util.get_node_ip_address()
    branch = payload.get("branch", "?")

    def report(kind: str, msg: str) -> None:
        try:
            board.report.remote(branch, node, ip, kind, msg)
        except Exception:  # noqa: BLE001 - progress is a view: a lost board never fails the evaluation
            pass

    report("start", "")
    try:
        return evaluate_payload(payload, report)
    except Exception as e:  # noqa: BLE001 - the head records it as this candidate's crash, in one line
        return {"version": RECORD_VERSION, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300],
                "trace": traceback.format_exc()[-2000:]}
    finally:
        report("end", "")


class _Board:
    """A Ray actor on the head's node: which node runs which evaluation, and their progress lines."""

    def __init__(self) -> None:
        self.running: dict[str, tuple[str, str]] = {}  # branch -> (node, ip)
        self.lines: list[tuple[str, str, str]] = []  # (branch, node, message)
        self.steps: dict[str, str] = {}  # branch -> its cascade's latest progress report (JSON), while running

    def report(self, branch: str, node: str, ip: str, kind: str, msg: str) -> None:
        if kind == "step":
            if self.running.get(branch, ("",))[0] == node:
                self.steps[branch] = msg
            return
        if kind == "start":
            self.running[branch] = (node, ip)
            self.steps.pop(branch, None)
        elif kind == "end":
            if self.running.get(branch, ("",))[0] == node:
                self.running.pop(branch, None)
                self.steps.pop(branch, None)
        self.lines.append((branch, node, msg if kind == "say" else kind))

    def take(self) -> tuple[dict, list, dict]:
        lines, self.lines = self.lines, []
        return dict(self.running), lines, dict(self.steps)


def node_label(node: str, ip: str = "") -> str:
    return f"node {node[:8]}" + (f" ({ip})" if ip else "")


def running_line(running: dict[str, tuple[str, str]], steps: dict[str, dict]) -> str:
    """The running evaluations per node, each with its cascade's phase (and whether it waits for another
    evaluation's timed run on that machine): "node 1a2b3c4d (10.0.0.2): r1-x [forcing, paused]; ..."."""
    def phase(branch: str) -> str:
        rec = steps.get(branch) or {}
        what = str(rec.get("phase") or "")
        if rec.get("detail") == PAUSED:
            what = f"{what}, paused" if what else "paused"
        return f" [{what}]" if what else ""

    return "; ".join(f"{node_label(n, ip)}: {b}{phase(b)}"
                     for b, (n, ip) in sorted(running.items(), key=lambda x: (x[1], x[0])))


def _reachable(address: str) -> str | None:
    """Why host:port cannot be reached (None: a TCP connection opens within 5 s)."""
    host, _, port = address.rpartition(":")
    if address.startswith("ray://") or not host or not port.isdigit():
        return None  # Ray's own client address or a name Ray resolves: Ray says
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            return None
    except OSError as e:
        return e.strerror or str(e)


class RayEvaluator:
    """Evaluations as Ray tasks on a cluster; the records land in this process's store."""

    kind = "ray"
    concurrent = True  # each agent's evaluation starts when its agent ends, on whichever node is free

    def __init__(self, settings: ExecutorSettings, progress: Callable[[str], None] | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise ExecutorError("--executor ray: Ray is not installed; run `pip install -e .[ray]` (or "
                                "`pip install 'specpilot[ray]'`), or use --executor local") from None
        self.ray = ray
        self.settings = settings
        self.progress = progress or (lambda _m: None)
        address = settings.address or "auto"
        self._owned = False
        if not ray.is_initialized():
            if address != "local":
                why = _reachable(address)
                if why:
                    raise ExecutorError(f"--ray-address {address}: cannot reach it ({why}); start the head with "
                                        f"`ray start --head` there or pass the address `ray status` prints")
            try:
                if address == "local":  # a one-node cluster in this process, for trying it out
                    ray.init(resources={settings.resource: 1}, include_dashboard=False, log_to_driver=False,
                             logging_level="ERROR")
                else:
                    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise ExecutorError(f"--ray-address {address}: cannot connect to a Ray cluster "
                                    f"({str(e).splitlines()[0][:200]}); start one with `ray start --head "
                                    f"--resources '{{\"{settings.resource}\": 1}}'` or pass its address") from None
            self._owned = True
        have = ray.cluster_resources().get(settings.resource, 0)
        if have < 1:
            self.shutdown()
            raise ExecutorError(f"the Ray cluster at {address} offers no {settings.resource!r} resource; start "
                                f"each evaluation node with `ray start --address ... --resources "
                                f"'{{\"{settings.resource}\": 1}}'` (or set [executor] resource)")
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        # On this process's node (soft affinity placed it on a worker, which a node's death then took along).
        self.board = ray.remote(num_cpus=0, max_restarts=0)(_Board).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()
        self.task = ray.remote(_remote_evaluate).options(
            num_cpus=0, num_gpus=_ray_quantity(settings.num_gpus / settings.per_node),
            resources={settings.resource: settings.share}, max_retries=settings.max_retries, retry_exceptions=False)
        self.nodes = int(have)
        self.progress(f"ray: {self.nodes} evaluation node(s) ({settings.resource}), {settings.per_node} evaluation(s) "
                      f"at once on each (untimed stages together, timed ones in turn) on "
                      f"{sum(1 for n in ray.nodes() if n.get('Alive'))} node(s); at most "
                      f"{settings.max_retries} retries when a node dies")
        self._lock = threading.Lock()
        self._shown = ""
        self.steps: dict[str, dict] = {}  # branch -> its node's latest progress report
        self._says: dict[str, Say] = {}
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="ray-board")
        self._watcher.start()

    # -- progress ---------------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(2.0):
            self.poll()

    def poll(self) -> dict:
        """Print the board's new lines and, when it changed, the running evaluations per node."""
        try:
            running, lines, steps = self.ray.get(self.board.take.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - a view only
            return {}
        with self._lock:
            for branch, node, msg in lines:  # the cascade's lines, through the loop's say when it gave one
                if msg not in ("start", "end"):
                    self._says.get(branch, self.progress)(f"  [{node[:8]}] {msg.strip()}")
            self.steps = {}
            for branch, text in steps.items():
                try:
                    rec = json.loads(text)
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    self.steps[branch] = rec
            shown = running_line(running, self.steps)
            if shown != self._shown:
                self._shown = shown
                self.progress(f"ray: running evaluations: {shown or 'none'}")
        return running

    # -- evaluation -------------------------------------------------------------------------------------

    def evaluate(self, ws: Workspace, branch: str, base: str, base_ar: float, ceiling: float, *,
                 min_gain: float = 1.02, progress: Say | None = None) -> Attempt:
        """The cascade on a node; the record checked and stored here, once. A lost or malformed
        evaluation is the candidate's crash."""
        if progress is not None:
            self._says[branch] = progress
        b = ws.branch(branch)
        head = ws.head(branch)
        ws.begin_evaluation(b)
        step("queued on the Ray cluster", detail=self.settings.resource)
        try:
            payload = evaluation_payload(ws, branch, base, base_ar, ceiling, min_gain)
            ref = self.task.remote(payload, self.board)
            while True:
                ready, _ = self.ray.wait([ref], timeout=2.0)
                if ready:
                    break
                running = self.poll()
                if branch in running:  # the node's own progress report, under its node's name
                    rec = self.steps.get(branch) or {}
                    where = node_label(*running[branch])
                    step(str(rec.get("phase") or "evaluating on the Ray cluster"),
                         rec.get("done") if isinstance(rec.get("done"), int) else None,
                         rec.get("total") if isinstance(rec.get("total"), int) else None,
                         f"{where}: {rec['detail']}" if rec.get("detail") else where)
            try:
                record = self.ray.get(ref)
            except Exception as e:  # noqa: BLE001 - a node lost more often than the retries allow, or Ray's own error
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                return self._crash(ws, b, "remote", f"evaluation lost on the Ray cluster after "
                                                    f"{self.settings.max_retries} retries: {why}")
            self.poll()
            if isinstance(record, dict) and "error" in record and record.get("version") == RECORD_VERSION:
                return self._crash(ws, b, "remote", f"the evaluation failed on its node: {record['error']}")
            try:
                check_record(record, branch, head)
            except MalformedRecord as e:
                return self._crash(ws, b, "remote", f"malformed evaluation record from the Ray cluster: {e}")
            att = apply_record(ws, branch, base, record)
            ws.end_evaluation(b, BRANCH_STATUS[att.status])
            return att
        except BaseException:
            if ws.branch(branch).status == "evaluating":
                ws.end_evaluation(b, "error")
            raise
        finally:
            self._says.pop(branch, None)

    def _crash(self, ws: Workspace, b: Any, stage: str, reason: str) -> Attempt:
        ws.memory.add_evaluation(b.id, stage, "crash", reason)
        ws.end_evaluation(b, "crashed")
        return Attempt("crash", reason)

    def shutdown(self) -> None:
        if getattr(self, "_stop", None) is not None:
            self._stop.set()
        if self._owned and self.ray.is_initialized():
            self.ray.shutdown()
            self._owned = False


def make_evaluator(settings: ExecutorSettings, progress: Callable[[str], None] | None = None):
    """The evaluator `settings` name; ExecutorError (one line) when it cannot start."""
    if settings.kind == "local":
        return LocalEvaluator()
    return RayEvaluator(settings, progress)
