"""What the TUI reads and does, without Textual: a snapshot of the store, git actions, agent launches.

Every function here blocks (SQLite, git, subprocesses) and is called from a thread worker of the app;
none touches a widget. The UI reads the store, not the loop's internals, so it shows the same thing
whether the loop runs in this process, in `specpilot-tui --auto` or on another terminal.
"""

from __future__ import annotations

import json
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import git

from store import Event, ForcingReport, Mechanism
from store.migrations import GAP_FAMILIES
from workbench.agents.base import AgentResult, Direction
from workbench.agents.llm import LLMConfigError
from workbench.agents.tuner import candidates
from workbench.export import export
from workbench.forcing import force
from workbench.integration import merge_branch, record_kept
from workbench.loop import MEASURE_PREFIX, Loop, LoopOptions, llm_config
from workbench.memory_cli import publish_verdict
from workbench.progress import describe, read_progress, tracking
from workbench.safegit import worktree_git
from workbench.workspace import LIVE_STATUSES, MANUAL_ROUND, Workspace, WorkspaceError

BASE_BRANCH = "base"  # the loop's integration branch (workbench.loop.BASE_BRANCH)
LOG_BACKLOG = 500  # events shown when the app opens


@dataclass
class BranchRow:
    name: str
    agent: str
    direction: str
    status: str
    speedup: float | None  # the latest paired benchmark against its base (a confirmed one: the lower run)
    forcing: str  # one word or two: clean / N real / crash / rejected / -
    match_rate: float | None
    forcing_report_id: int | None
    reason: str = ""  # the latest evaluation, one line
    progress: str = ""  # what runs on it now: phase i/n, elapsed, ETA (from workbench.progress)
    stale: bool = False  # marked running/evaluating, but no process works on it


@dataclass
class RoundProgress:
    number: int
    phase: str
    done: int
    total: int


@dataclass
class Snapshot:
    deployment: dict[str, str]
    families: dict[str, float] = field(default_factory=dict)  # ms per generated token, parts of measured_ms
    could_save: dict[str, float] = field(default_factory=dict)  # beyond the measured time (acceptance)
    gaps_round: int | None = None
    gaps_label: str = ""  # what profiled them: "round 2", "launch of tui-tuner-drafting-1"
    measured_ms: float | None = None
    speedups: list[tuple[int, float]] = field(default_factory=list)  # (round, best speedup over AR)
    stock_speedup: float | None = None
    final_speedup: float | None = None  # the loop's last measured system over AR (not a product of ratios)
    current: RoundProgress | None = None
    branches: list[BranchRow] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)  # new since the id asked for
    last_event_id: int = 0
    kernels: dict = field(default_factory=dict)  # stock's kernel profile (llama.cpp, `costing.kernel_profile`)


def short_model(path: Path | str | None) -> str:
    """A model directory as its last two components: enough to tell demo/target from demo/drafter."""
    if path is None or str(path) == "":
        return "-"
    p = Path(path)
    return "/".join(p.parts[-2:])


def deployment_of(ws: Workspace) -> dict[str, str]:
    c = ws.config
    return {"name": c.name, "target": short_model(c.target), "drafter": short_model(c.drafter),
            "hardware": c.hardware, "dtype": c.dtype, "device": c.device,
            "regime": "batch " + ", ".join(str(b) for b in c.batch_sizes)}


def latest_gaps(ws: Workspace) -> tuple[str, dict] | None:
    """The gaps profiled last, by a round or a TUI launch (`Loop.gaps` saves each), with what profiled
    them; older workspaces: the latest round's summary."""
    newest: tuple[float, str, dict] | None = None
    for path in (ws.state / "gaps").glob("*.json"):
        try:
            saved = json.loads(path.read_text())
            when = float(saved["measured_at"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if saved.get("breakdown") and (newest is None or when > newest[0]):
            newest = (when, str(saved.get("label") or f"base {str(saved.get('commit'))[:10]}"), saved)
    if newest is not None:
        return newest[1], newest[2]
    rounds = [r for r in ws.memory.list_rounds(ws.deployment_id()) if r.status != MANUAL_ROUND]
    for r in reversed(rounds):
        gaps = r.summary.get("gaps")
        if gaps and gaps.get("breakdown"):
            return f"round {r.summary.get('index', r.number)}", gaps
    return None


def _loop_speedup(ws: Workspace, which: str) -> float | None:
    """The loop's latest measured speedup over AR of `stock` or of the `final` system, if it has one."""
    runs = ws.memory.list_bench_runs(ws.deployment_id(), f"{MEASURE_PREFIX}{which}")
    return float(runs[-1].speedup) if runs and runs[-1].speedup is not None else None


def branch_row(ws: Workspace, b: Any, progress: dict | None = None) -> BranchRow:
    """One row of the Branches table; `progress` is the branch's live record from `read_progress`."""
    mem = ws.memory
    evals = mem.list_evaluations(b.id)
    bench = [e for e in evals if e.stage == "bench" and isinstance(e.metrics.get("speedup"), int | float)]
    speedup = float(bench[-1].metrics["speedup"]) if bench else None
    confirm = bench[-1].metrics.get("confirm") if bench else None
    if speedup is not None and isinstance(confirm, dict) and isinstance(confirm.get("speedup"), int | float):
        speedup = min(speedup, float(confirm["speedup"]))  # what the cascade credits: the lower of the two runs
    forcing, rate, report_id = "-", None, None
    forced = [e for e in evals if e.stage == "forcing"]
    reports = mem.list_forcing_reports(b.id)
    if forced:
        last = forced[-1]
        rep = next((r for r in reversed(reports) if r.evaluation_id == last.id), None)
        if rep is not None:
            rate, report_id = rep.match_rate, rep.id
            real = rep.details.get("unexplained")
            if real is None:
                real = sum(1 for m in rep.mismatches if not m.get("near_tie"))
            forcing = f"{real} real" if real else ("clean" if not rep.mismatches else f"{len(rep.mismatches)} ties")
        else:
            forcing = {"crash": "crash", "rejected": "rejected"}.get(last.status, last.status)
    elif reports:
        rate, report_id = reports[-1].match_rate, reports[-1].id
        forcing = "clean" if not reports[-1].mismatches else f"{len(reports[-1].mismatches)} mism."
    reason = f"{evals[-1].stage}: {evals[-1].status}: {evals[-1].reason}" if evals else "not evaluated yet"
    row = BranchRow(b.name, b.agent, b.direction or "-", b.status, speedup, forcing, rate, report_id, reason)
    if progress is not None and progress.get("alive"):
        row.progress = describe(progress)
    elif b.status in LIVE_STATUSES and not ws.evaluation_alive(b.name):
        row.stale = True
        row.progress = "no process works on it: E resumes it"
    return row


def read_snapshot(ws: Workspace, after_event_id: int | None) -> Snapshot:
    """Everything the Overview, Branches and Log tabs show; `after_event_id` None means "the backlog"."""
    mem = ws.memory
    snap = Snapshot(deployment_of(ws))
    rounds = [r for r in mem.list_rounds(ws.deployment_id()) if r.status != MANUAL_ROUND]
    g = latest_gaps(ws)
    if g is not None:
        snap.gaps_label = g[0]
        bd = g[1]["breakdown"]
        snap.families, snap.could_save = split_families(bd)
        snap.measured_ms = bd.get("measured_ms_per_token")
    for r in rounds:
        s = r.summary
        n = int(s.get("index", r.number))
        if isinstance(s.get("best_speedup_over_ar"), int | float):
            snap.speedups.append((n, float(s["best_speedup_over_ar"])))
        if r.status == "running":
            total = len(s.get("directions", []))
            done = len(s.get("attempts", []))
            phase = ("profiling" if "gaps" not in s else "choosing directions" if "directions" not in s
                     else "integrating" if total and done >= total else "agents")
            snap.current = RoundProgress(n, phase, done, total)
    try:
        snap.kernels = json.loads((ws.state / "kernels.json").read_text())["profile"]
    except (OSError, ValueError, KeyError):
        pass
    snap.stock_speedup = _loop_speedup(ws, "stock")
    snap.final_speedup = _loop_speedup(ws, "final")
    live = read_progress(ws.state)
    snap.branches = [branch_row(ws, b, live.get(b.name)) for b in ws.list_branches() if b.status != "removed"]
    if after_event_id is None:
        top = mem.db.execute("SELECT coalesce(max(id), 0) FROM events").fetchone()[0]
        after_event_id = max(0, top - LOG_BACKLOG)
    snap.events = mem.list_events(after_id=after_event_id, limit=LOG_BACKLOG)
    snap.last_event_id = snap.events[-1].id if snap.events else after_event_id
    return snap


def latest_forcing_report(ws: Workspace, branch: str) -> ForcingReport | None:
    reports = ws.memory.list_forcing_reports(ws.branch(branch).id)
    return reports[-1] if reports else None


def cached_stock_reference(ws: Workspace) -> dict | None:
    """Stock's cached reference for the current stock commit and forcing length, if one was computed.

    Read-only: looking at a report never starts a stock run (forcing computes the reference)."""
    n = ws.config.forcing_max_new_tokens
    for path in sorted((ws.state / "stock").glob("*.json"), key=lambda p: -p.stat().st_mtime):
        try:
            ref = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if ref.get("stock_commit") == ws.stock_commit and ref.get("max_new_tokens") == n:
            return ref
    return None


def token_decoder(ws: Workspace) -> Callable[[int], str]:
    """One token id to its text; the `tokenizers` file when there is one (fast to load), else transformers."""
    path = Path(ws.config.tokenizer) / "tokenizer.json"
    if path.exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        return lambda t: tok.decode([t], skip_special_tokens=False)
    from decoder.models import load_tokenizer

    hf = load_tokenizer(ws.config.tokenizer)
    return lambda t: hf.decode([t])


def forcing_view(ws: Workspace, branch: str) -> dict | None:
    """The latest forcing report of `branch`, with stock's tokens as text for the prompts that mismatch."""
    rep = latest_forcing_report(ws, branch)
    if rep is None:
        return None
    mm = rep.mismatches
    prompts: dict[str, dict] = {}
    ref = cached_stock_reference(ws) if mm else None
    if ref is not None:
        by_id = {p["id"]: p for p in ref["prompts"]}
        decode = token_decoder(ws)
        truncated = set(rep.details.get("truncated_prompts", []))
        for pid in dict.fromkeys(m["prompt_id"] for m in mm):
            p = by_id.get(pid)
            if p is None:
                continue
            last = max(m["position"] for m in mm if m["prompt_id"] == pid)
            prompts[pid] = {"stock_texts": [decode(t) for t in p["stock"]],
                            "checked": last + 1 if pid in truncated else len(p["stock"])}
    return {"branch": branch, "status": rep.details.get("status", "?"), "reason": rep.details.get("reason", ""),
            "match_rate": rep.match_rate, "positions_checked": rep.positions_checked,
            "threshold": rep.details.get("near_tie_threshold"), "mismatches": mm, "prompts": prompts}


def list_mechanisms(ws: Workspace, query: str = "") -> list[Mechanism]:
    return ws.memory.search_mechanisms(query) if query.strip() else ws.memory.list_mechanisms()


def set_verdict(ws: Workspace, mechanism_id: int, status: str, note: str) -> tuple[Mechanism, bool]:
    """Accept or reject with the reviewer's note, and carry the verdict to the global memory."""

    if not note.strip():
        raise ValueError(f"{status} needs a note saying why")
    m = ws.memory.set_mechanism_status(mechanism_id, status, note.strip())
    return m, publish_verdict(m, ws.state / "memory.db")


def export_accepted(ws: Workspace, out: Path) -> list[Path]:

    return export(ws, ws.memory.list_mechanisms(status="accepted"), out)


def split_families(bd: dict) -> tuple[dict[str, float], dict[str, float]]:
    """The breakdown's families as (parts of the measured time, what could be saved beyond it): the
    acceptance gap is not in the measured total, so the bars of the first add up to it."""
    parts: dict[str, float] = {}
    extra: dict[str, float] = {}
    gaps = bd.get("gaps")
    if not gaps:
        return {k: float(v) for k, v in bd.get("families", {}).items()}, {}
    for g in gaps:
        into = extra if g.get("could_save") else parts
        into[g["family"]] = into.get(g["family"], 0.0) + float(g["ms_per_token"])
    return parts, extra


def branch_diff(ws: Workspace, branch: str) -> tuple[str, str]:
    """The branch's change against the commit it was created from (not stock: a later round's branch
    starts from the base that earlier rounds built), as (title, diff)."""
    ws.branch(branch)  # a clear error for an unknown branch
    base = ws.branch_base(branch)
    what = "stock" if base == ws.stock_commit else f"its base {base[:10]}"
    text = git.Repo(ws.path).git.diff("--no-ext-diff", base, branch, "--")
    return f"git diff {what}..{branch}", text or f"(branch {branch} makes no change against {what})"


def merge_into_base(ws: Workspace, branch: str) -> str:
    """Merge `branch` into the `base` branch (created at stock if missing) in a scratch worktree."""

    ws.branch(branch)
    repo = git.Repo(ws.path)
    if BASE_BRANCH not in repo.heads:
        repo.create_head(BASE_BRANCH, ws.stock_commit)
    before = repo.commit(BASE_BRANCH).hexsha
    scratch = Path(tempfile.mkdtemp(prefix="specpilot-merge-"))
    wt = scratch / "wt"
    try:
        try:
            repo.git.worktree("add", str(wt), BASE_BRANCH)
        except git.GitCommandError as e:
            raise WorkspaceError(f"cannot check out {BASE_BRANCH} to merge into it: "
                                 f"{(e.stderr or str(e)).strip().splitlines()[-1]}") from None
        ok, why = merge_branch(worktree_git(Path(repo.git_dir), wt), branch, ws.config.config_file)
        if not ok:
            raise WorkspaceError(f"merge of {branch} into {BASE_BRANCH} failed: {why}; nothing changed")
        after = repo.commit(BASE_BRANCH).hexsha
    finally:
        if wt.exists():
            repo.git.worktree("remove", "--force", str(wt))
        repo.git.worktree("prune")
        shutil.rmtree(scratch, ignore_errors=True)
    if after == before:
        msg = f"{branch} is already in {BASE_BRANCH}"
    else:
        msg = f"merged {branch} into {BASE_BRANCH}: {before[:10]} -> {after[:10]}" + (f" ({why})" if why else "")
    ws.memory.update_branch(ws.branch(branch).id, status="merged")
    ws.memory.record_event("tui.merge", msg, {"branch": branch, "from": before, "to": after})
    return msg


@dataclass
class LaunchChoice:
    family: str
    ms: float | None  # measured gap, ms per generated token; None: not profiled yet
    tuner_left: int  # candidate configs the tuner has for it on the current base (0: nothing left)


def directions_for_launch(ws: Workspace) -> tuple[list[LaunchChoice], str | None]:
    """Gap families to offer (the largest measured gap first; all when nothing is profiled yet), with
    what the tuner has left for each on the current base; and why the LLM agent cannot run (None: it can)."""

    g = latest_gaps(ws)
    fams = g[1]["breakdown"].get("families", {}) if g else {}
    known = sorted(fams.items(), key=lambda kv: -kv[1])
    order = [(k, float(v)) for k, v in known] + [(f, None) for f in GAP_FAMILIES if f not in fams]
    repo = git.Repo(ws.path)
    base = BASE_BRANCH if BASE_BRANCH in repo.heads else ws.stock_commit
    try:  # the keys the tuner knows; a base with the system's own keys still counts its candidates
        cfg = ws.contract.config.from_table(ws.config_at(base), known_only=True)
    except (WorkspaceError, ValueError):
        cfg = None
    out = [LaunchChoice(fam, ms, len(candidates(cfg, fam, [], refuse=ws.refusal, contract=ws.contract))
                        if cfg is not None else 0)
           for fam, ms in order]
    try:
        llm_config(ws)
        why_not = None
    except LLMConfigError as e:
        why_not = str(e)
    return out, why_not


def run_forcing(ws: Workspace, branch: str) -> str:
    """Token-force the branch against stock now (as the cascade's forcing stage), one line back."""

    with tracking(ws.state, branch):
        rep = force(ws, branch, progress=False)
    return f"{branch}: forcing {rep['status']}: {rep['reason']}"


def reevaluate(ws: Workspace, branch: str, evaluator: Any = None) -> dict:
    """Run the whole cascade on the branch's committed head against the commit it started from (an
    interrupted branch resumed, or a branch edited by hand); the same code path as the loop's, on the
    app's executor (`evaluator`: here, or a Ray cluster)."""

    b = ws.branch(branch)
    base = ws.branch_base(branch)
    loop = Loop(ws, LoopOptions(rounds=1, agents=1, auto_accept=False), evaluator=evaluator)
    if ws.head(branch) == base:
        ws.memory.update_branch(b.id, status="discarded")
        ws.memory.add_evaluation(b.id, "agent", "discard", "nothing committed beyond its base: launch an agent (l)")
        return {"branch": branch, "status": "discard", "reason": "nothing committed beyond its base"}
    d = Direction(b.direction or "-", 0.0, "re-evaluated from the TUI")
    return loop._attempt(branch, d, b.agent, AgentResult(True, "re-evaluated"), base, loop.base_speedup_over_ar(),
                         loop.session_ceiling())


def mark_interrupted(ws: Workspace, branches: list[str]) -> None:
    """Branches whose agents this app stops on quit: `interrupted` (E resumes them), not left `running`."""
    for name in branches:
        b = ws.find_branch(name)
        if b is not None and b.status in LIVE_STATUSES:
            ws.memory.update_branch(b.id, status="interrupted")
            ws.memory.record_event("tui.interrupted", f"{name}: interrupted by quitting the TUI; E re-evaluates it",
                                   {"branch_id": b.id})


def run_loop_round(ws: Workspace, progress: Callable[[str], None] | None = None, evaluator: Any = None) -> dict:
    """One more round of the loop, exactly as `specpilot-tui --auto --rounds N+1` would run it (the
    engineer still accepts mechanisms in the Memory tab), its evaluations on the app's executor."""

    done = sum(1 for r in ws.memory.list_rounds(ws.deployment_id()) if r.status == "done" and "index" in r.summary)
    return Loop(ws, LoopOptions(rounds=done + 1, auto_accept=False), progress=progress, evaluator=evaluator).run()


def free_branch_name(ws: Workspace, kind: str, family: str) -> str:
    taken = {b.name for b in ws.memory.list_branches()} | {h.name for h in git.Repo(ws.path).heads}
    k = 1
    while f"tui-{kind}-{family}-{k}" in taken:
        k += 1
    return f"tui-{kind}-{family}-{k}"


class Launch:
    """One agent on one direction from the current base, then the evaluation cascade: a one-agent round.

    `steer` and `stop` reach the running agent through the loop's steering queue and stop event.
    """

    def __init__(self, ws: Workspace, kind: str, family: str, branch: str,
                 progress: Callable[[str], None] | None = None, llm: dict | None = None,
                 evaluator: Any = None) -> None:

        self.ws, self.kind, self.family, self.branch = ws, kind, family, branch
        self.loop = Loop(ws, LoopOptions(rounds=1, agents=1, agent=kind, auto_accept=False, llm=llm or {}),
                         progress=progress, evaluator=evaluator)
        # made before the agent starts, so a steer or stop right after launch is not lost
        self.loop.steering[branch] = queue.Queue()
        self.loop.stops[branch] = threading.Event()

    def steer(self, text: str) -> None:
        self.loop.steering[self.branch].put(text)

    def stop(self) -> None:
        self.loop.stops[self.branch].set()

    def run(self) -> dict:
        """Profile (unless a round already did), run the agent, evaluate its commit; returns the attempt."""
        loop, ws = self.loop, self.ws
        att = loop.run_agent(self.family, self.branch)  # the base's gaps: profiled once per commit, then reused
        base = att["base_commit"]
        if att["status"] == "keep":  # a candidate for the engineer to accept or reject in the Memory tab
            record_kept(ws, att, base, self.family)
        return att
