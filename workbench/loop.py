"""The agentic loop: rounds of parallel agents, an evaluation cascade, integration, memory.

A round:
 1. profile the current base through the harness and break its time per token into gaps (cost model);
 2. directions: the largest gap families that agents can act on, each with the decoder's mechanisms
    for it and the mechanisms accepted on other deployments for it (those are tried first);
 3. K agents in parallel (an executor), each on its own branch and worktree from the base;
 4. the cascade per branch (`workbench.cascade`): guard rails, smoke run, token forcing, paired
    benchmark against the base, ceiling check; keep, discard, crash or rejected with a reason;
 5. integration: kept branches merged into a new base (one by one on conflict; `system.toml` merged
    key by key), the combination re-evaluated, the better of combination and best single kept;
 6. mechanisms recorded with their evidence (and, headless, accepted into the global memory).

Everything is in the workspace memory as it happens (rounds, branches, evaluations, events), and a
round's summary is saved after every agent and every attempt, so a killed loop resumes its interrupted
round: an attempt already evaluated is kept, a branch whose agent had finished (its evaluation was in
flight, here or on a Ray node) is evaluated again at the commit the agent left, and only an agent that
was still at work starts over.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from decoder.config import ConfigError, DecodeConfig, dump_table
from decoder.stats import MethodEntry
from store import Memory, global_memory_path
from workbench.agents.base import Agent, AgentContext, AgentResult, Direction, SmokeResult
from workbench.agents.kernel import applicable as applicable_kernels
from workbench.agents.llm import LLMAgent, LLMConfig, LLMConfigError
from workbench.agents.tuner import TunerAgent
from workbench.cascade import smoke_run, timing_prompts
from workbench.costing import ceiling_for, commit_gaps, hardware_profile, plausibility_ceiling, speedup_over_ar
from workbench.executor import LocalEvaluator
from workbench.forcing import stock_reference
from workbench.harness import cancel_branch
from workbench.integration import evaluate_attempt, integrate_kept, record_kept
from workbench.kernel_check import kernel_feedback
from workbench.memory_cli import publish_verdict
from workbench.planning import plan_directions
from workbench.progress import step, tracking
from workbench.workspace import STOCK_TAG, Workspace, WorkspaceError

BASE_BRANCH = "base"
MEASURE_PREFIX = "loop:"  # bench_runs method of the loop's paired measurements over AR ("loop:stock", "loop:final")
AR_BRANCH = "reference-ar"  # stock with method = "ar": the baseline every speedup over AR is measured against


class Executor(Protocol):
    """Runs agents; the local one uses threads (the heavy work is in harness subprocesses). A
    distributed executor (e.g. Ray) implements the same two methods."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    def __init__(self, workers: int) -> None:
        self.workers = max(1, workers)
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="agent")

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._pool.submit(fn, *args)

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)


@dataclass
class LoopOptions:
    rounds: int = 3
    agents: int = 2
    agent: str = "tuner"  # tuner or llm
    budget_minutes: float = 30.0
    auto_accept: bool = True  # headless: integrated mechanisms are accepted and carried to the global memory
    min_gain: float = 1.02
    llm: dict[str, Any] = field(default_factory=dict)
    use_global_memory: bool = True


class BudgetExhausted(Exception):
    pass


class RoundInterrupted(Exception):
    """Work of an interrupted round that ended after the interrupt (not saved: the resumed round redoes it)."""


def gap_label(gap: dict) -> str:
    """A ranked gap in a progress line: its part's name, with the family it belongs to when the name does not
    say it (two parts of one family then read apart: "compute", "prefill (compute)")."""
    name, family = str(gap.get("name") or ""), str(gap.get("family") or "")
    if not name or name == family:
        return family or name
    return name if family.split("-")[0] in name else f"{name} ({family})"


class Loop:
    def __init__(self, ws: Workspace, opts: LoopOptions, progress: Callable[[str], None] | None = None,
                 executor: Executor | None = None, evaluator: Any = None) -> None:
        self.ws = ws
        self.opts = opts
        self.progress = progress or (lambda msg: None)
        self.executor = executor
        # Where the cascade runs (`workbench.executor`): here, or on a Ray cluster (each agent's evaluation
        # then starts as soon as its agent ends, beside the others).
        self.evaluator = evaluator or LocalEvaluator()
        self.t0 = time.monotonic()
        self.dep_id = ws.deployment_id()
        self._ceiling: float | None = None  # this session's plausibility ceiling, once announced
        self._transfer_tried = False  # this session tried the mechanisms other deployments accepted
        self.steering: dict[str, Any] = {}  # branch -> queue, for the TUI
        self.stops: dict[str, Any] = {}
        self._hardware = None  # this session's hardware profile, once known

    # -- helpers ---------------------------------------------------------------------------------------

    def say(self, msg: str, kind: str = "loop", payload: dict | None = None) -> None:
        self.progress(msg)
        self.ws.memory.record_event(kind, msg, payload or {})

    # -- state: everything is derived from the store (rounds and their summaries, measurements) -----------

    def rounds(self) -> list:
        """This deployment's loop rounds (not the manual round of hand-made branches), oldest first."""
        return [r for r in self.ws.memory.list_rounds(self.dep_id) if "index" in r.summary]

    def measured(self, label: str, commit: str) -> dict | None:
        """The latest paired measurement over AR of `commit` under `label` ("stock", "final"), if any."""
        for r in reversed(self.ws.memory.list_bench_runs(self.dep_id, f"{MEASURE_PREFIX}{label}")):
            if r.config.get("commit") == commit:
                return r.report
        return None

    def base_speedup_over_ar(self) -> float:
        """The current base's speedup over AR: the last finished round's, else stock's, else 1."""
        done = [r for r in self.rounds() if r.status == "done" and r.summary.get("best_speedup_over_ar")]
        if done:
            return float(done[-1].summary["best_speedup_over_ar"])
        stock = self.measured("stock", self.ws.stock_commit)
        return first_point(stock) if stock else 1.0

    def exhausted(self) -> set[str]:
        """Families explored without a gain since the base last moved."""
        out: set[str] = set()
        for r in self.rounds():
            if r.status != "done":
                continue
            integ = r.summary.get("integration") or {}
            if integ.get("commit") and integ["commit"] != r.summary.get("base_commit"):
                out = set()
            else:
                out |= {d["family"] for d in r.summary.get("directions", [])}
        return out

    def fruitless(self) -> set[str]:
        """Families whose last direction this session kept nothing, on whatever base: after a base move they may
        be explored again (`exhausted` resets), but after the families not yet tried (planning's order)."""
        out: set[str] = set()
        for r in self.rounds():
            if r.status != "done":
                continue
            for d in r.summary.get("directions", []):
                kept = any(a.get("direction") == d["family"] and a.get("status") == "keep"
                           for a in r.summary.get("attempts", []))
                (out.discard if kept else out.add)(d["family"])
        return out

    def transfer_tried(self) -> bool:
        return self._transfer_tried or any(r.summary.get("transfer_tried") for r in self.rounds())

    def session_ceiling(self) -> float:
        if self._ceiling is None:
            self._ceiling = self.ceiling()
        return self._ceiling

    def minutes(self) -> float:
        return (time.monotonic() - self.t0) / 60

    def _check_budget(self, what: str) -> None:
        if self.minutes() > self.opts.budget_minutes:
            raise BudgetExhausted(f"budget of {self.opts.budget_minutes:g} min spent before {what}")

    def _ensure_refs(self) -> None:
        repo = self.ws.repo
        if BASE_BRANCH not in repo.heads:
            repo.create_head(BASE_BRANCH, self.ws.stock_commit)
        if AR_BRANCH not in repo.heads:
            wt = self.ws.detached_worktree("_ar", self.ws.stock_commit)
            # Stock's config with one key changed, every other key (the system's own included) kept.
            ar = {**self.ws.config_at(self.ws.stock_commit), **self.ws.contract.ar}
            (wt / self.ws.config.config_file).write_text(dump_table(ar, self.ws.contract.config))
            g = self.ws.worktree_git("_ar")
            g.add(self.ws.config.config_file)
            g.commit("-q", "--allow-empty", "-m", "reference: the AR baseline (stock with "
                     + ", ".join(f"{k} = {v}" for k, v in self.ws.contract.ar.items()) + ")")
            repo.create_head(AR_BRANCH, g.rev_parse("HEAD").strip())

    def base_commit(self) -> str:
        return self.ws.rev(BASE_BRANCH)

    def speedup_over_ar(self, commit: str, label: str) -> dict:
        """A paired benchmark of `commit` against the AR reference, recorded in the store (`measured`)."""
        out = speedup_over_ar(self.ws, self.ws.rev(AR_BRANCH), commit, label, self.say)
        self.ws.memory.add_bench_run(self.dep_id, f"{MEASURE_PREFIX}{label}", config={"commit": commit},
                                     tokens_per_s=out["b_tokens_per_s"], speedup=out["speedup"], report=out)
        return out

    def hardware(self):
        """The deployment's hardware profile, measured at most once a session (`hardware_profile`)."""
        if self._hardware is None:
            self._hardware = hardware_profile(self.ws, self.say)
        return self._hardware

    def ceiling(self) -> float:
        """The plausibility ceiling on this session's profile, announced (`plausibility_ceiling`)."""
        return plausibility_ceiling(self.ws, self.hardware(), self.say)

    # -- directions ------------------------------------------------------------------------------------

    def gaps(self, commit: str, label: str = "") -> dict:
        """The ranked gaps of `commit`, profiled once per commit (`commit_gaps`)."""
        return commit_gaps(self.ws, self.dep_id, commit, label, self.hardware, self.say)

    def directions(self, breakdown: dict, exhausted: set[str], base: str | None = None) -> list[Direction]:
        """The round's directions (`plan_directions`) on `base`'s config as the tuner reads it."""
        table = self.ws.config_at(base or self.ws.stock_commit)
        device = str(table.get("device", DecodeConfig().device)).split(":")[0]
        base_cfg = None
        if base is not None and self.opts.agent == "tuner":
            try:  # the tuner turns the keys it knows; a base with keys it does not know keeps them
                base_cfg = self.ws.contract.config.from_table(table, known_only=True)
            except ConfigError as e:
                self.say(f"the built-in tuner cannot read the base config ({e}); it skips this round")
                return []
        out, tried = plan_directions(breakdown, exhausted, fruitless=self.fruitless(), agents=self.opts.agents,
                                     agent=self.opts.agent,
                                     device=device, base_cfg=base_cfg, memory_for=self._memory_for,
                                     transfer_tried=self.transfer_tried(), refuse=self.ws.refusal,
                                     contract=self.ws.contract,
                                     kernels_for=lambda fam: applicable_kernels(self.ws, base, fam) if base else [])
        self._transfer_tried = self._transfer_tried or tried
        return out

    def _memory_for(self, family: str) -> list[dict]:
        if not self.opts.use_global_memory:
            return []

        path = global_memory_path()
        if not path.exists():
            return []
        with Memory(path) as g:
            ms = g.mechanisms_for_family(family, exclude_deployment=self.ws.config.name)
        items = []
        for m in ms:
            conf = next((e.get("config") for e in m.evidence if e.get("config")), None)
            items.append({"name": m.name, "summary": m.summary, "config": conf or {}, "uid": m.uid,
                          "evidence": m.evidence, "patch": m.patch[:4000]})
        return items

    # -- agents ----------------------------------------------------------------------------------------

    def make_agent(self) -> Agent:
        if self.opts.agent == "tuner":

            return TunerAgent(self.ws)
        if self.opts.agent == "llm":

            return LLMAgent(llm_config(self.ws, self.opts.llm))
        raise WorkspaceError(f"--agent {self.opts.agent}: unknown; use tuner or llm")

    def _smoke(self, branch: str) -> Callable[[], SmokeResult]:
        def smoke() -> SmokeResult:

            ok, msg = smoke_run(self.ws, self.ws.worktree_path(branch), branch)
            if ok and self.ws.config.engine_source:  # an edited kernel: its test and micro-benchmark too
                kok, kmsg = kernel_feedback(self.ws, self.ws.head(branch))
                if kmsg:  # the kernel's verdict first: a failed kernel test fails the smoke run
                    ok, msg = kok, (f"{msg}; {kmsg}" if kok else f"{kmsg} (the system itself ran: "
                                                                  f"{msg.removeprefix('ok: ')})")
            return SmokeResult(ok, msg)

        return smoke

    def _run_agent(self, agent: Agent, branch: str, d: Direction, gaps: dict, visible: list[dict]) -> AgentResult:

        q: queue.Queue[str] = self.steering.setdefault(branch, queue.Queue())
        stop = self.stops.setdefault(branch, threading.Event())
        b = self.ws.branch(branch)

        def log(kind: str, message: str, payload: dict) -> None:
            self.ws.memory.record_event(kind, f"{branch}: {message}", {"branch_id": b.id, **payload})

        ctx = AgentContext(branch, self.ws.worktree_path(branch), d, gaps["breakdown"]["gaps"], visible,
                           self._smoke(branch), log, q, stop, git_common_dir=Path(self.ws.repo.git_dir),
                           deadline=self.t0 + self.opts.budget_minutes * 60)  # the agent ends inside the budget
        self.ws.begin_evaluation(b, "running")
        with tracking(self.ws.state, branch, keep=True):  # the evaluation goes on where the agent stops
            step(f"{agent.name} agent", detail=d.family)
            try:
                return agent.run(ctx)
            except Exception as e:  # noqa: BLE001 - an agent's failure is an attempt's result, not the loop's
                return AgentResult(False, f"agent failed: {type(e).__name__}: {e}".splitlines()[0][:300])
            finally:
                step("waiting to evaluate")

    # -- a round ---------------------------------------------------------------------------------------

    def run_round(self, index: int, resume: dict | None = None) -> dict:
        self._check_budget(f"round {index}")
        base = self.base_commit()
        if resume is None:
            rnd = self.ws.memory.add_round(self.dep_id, status="running", base_commit=base,
                                           summary={"index": index, "attempts": []})
            summary: dict[str, Any] = {"index": index, "base_commit": base, "attempts": []}
        else:
            rnd = self.ws.memory.get_round(resume["round_id"])
            summary = dict(rnd.summary)
            base = rnd.base_commit or base
            self.say(f"round {index}: resuming ({len(summary.get('attempts', []))} attempts already done)")
        summary["round_id"] = rnd.id

        if "gaps" not in summary:
            self.say(f"round {index}: profiling base {base[:10]}")
            summary["gaps"] = self.gaps(base, f"round {index}")
            self.ws.memory.update_round(rnd.id, summary=summary)
        gaps = summary["gaps"]
        bd = gaps["breakdown"]
        top = ", ".join(f"{gap_label(g)} {g['ms_per_token']:.2f}" for g in bd["gaps"][:4])
        base_rate = MethodEntry.from_dict(gaps.get("entry")).tokens_per_s
        self.say(f"round {index}: base {base_rate:.1f} tok/s; largest gaps (ms/token): {top}")
        if "directions" not in summary:
            dirs = self.directions(bd, self.exhausted(), base)
            summary["directions"] = [d.as_dict() for d in dirs]
            summary["transfer_tried"] = self._transfer_tried
            self.ws.memory.update_round(rnd.id, summary=summary)
        dirs = [Direction(**d) for d in summary["directions"]]
        if not dirs:
            self.say(f"round {index}: no direction left to explore")
        done = {a["branch"] for a in summary["attempts"]}
        visible = self.visible_prompts()
        agent = self.make_agent()
        base_ar = summary.setdefault("base_speedup_over_ar", self.base_speedup_over_ar())
        ceiling = summary.setdefault("ceiling", self.session_ceiling())  # one ceiling for the whole round
        self.ws.memory.update_round(rnd.id, summary=summary)

        # An agent's result is saved with the branch's head when the agent returns: a resumed round evaluates
        # that commit again (its evaluation was in flight when the loop died) instead of re-running the agent.
        finished = summary.setdefault("agents", {})
        todo: list[tuple[str, Direction, AgentResult | None]] = []
        for d in dirs:
            name = f"r{index}-{d.family}-{agent.name}"
            if name in done:
                continue
            prior = finished.get(name)
            if prior is not None and self.ws.find_branch(name) is not None and self.ws.head(name) == prior["head"]:
                self.say(f"round {index}: {name}: its agent had finished at {prior['head'][:10]}; evaluating that "
                         f"commit again", "loop.resubmit", {"branch": name, "head": prior["head"]})
                todo.append((name, d, AgentResult(prior["committed"], prior["message"], prior.get("mechanism", ""),
                                                  prior.get("summary", ""), prior.get("details") or {})))
                continue
            if self.ws.find_branch(name) is not None:
                self.ws.reset_branch(name, base)  # an interrupted agent: start it over
            else:
                self.ws.create_branch(name, base=base, agent=agent.name, direction=d.family, round_id=rnd.id)
            todo.append((name, d, None))
        order = {f"r{index}-{d.family}-{agent.name}": i for i, d in enumerate(dirs)}
        lock = threading.Lock()  # agents and (with a concurrent evaluator) evaluations end in worker threads
        interrupted = threading.Event()  # Ctrl-C / SIGTERM: what ends after it is not saved as finished

        def agent_result(name: str, d: Direction, prior: AgentResult | None) -> AgentResult:
            if prior is not None:
                return prior
            res = self._run_agent(agent, name, d, gaps, visible)
            if interrupted.is_set():  # cut short: not finished, so the resumed round runs this agent again
                raise RoundInterrupted(name)
            self.say(f"round {index}: {name}: agent: {res.message}", "loop.agent",
                     {"branch": name, "committed": res.committed})
            with lock:
                finished[name] = {"committed": res.committed, "message": res.message, "mechanism": res.mechanism,
                                  "summary": res.summary, "details": res.details, "head": self.ws.head(name)}
                self.ws.memory.update_round(rnd.id, summary=summary)
            return res

        def record(att: dict) -> None:
            if interrupted.is_set():  # an evaluation whose systems the interrupt killed is no verdict
                raise RoundInterrupted(att.get("branch", ""))
            with lock:  # saved as soon as it ends, in the directions' order: a resumed round never evaluates it again
                summary["attempts"].append(att)
                summary["attempts"].sort(key=lambda a: order.get(a["branch"], -1))
                self.ws.memory.update_round(rnd.id, summary=summary)

        def agent_then_evaluation(name: str, d: Direction, prior: AgentResult | None) -> None:
            res = agent_result(name, d, prior)
            record(self._attempt(name, d, agent.name, res, base, base_ar, ceiling))

        pending = [(name, d, prior) for name, d, prior in todo if prior is None]
        jobs = todo if self.evaluator.concurrent else pending
        executor = self.executor or LocalExecutor(min(len(jobs) or 1, self.opts.agents, os.cpu_count() or 1))
        try:
            if self.evaluator.concurrent:  # each evaluation starts as soon as its agent ends
                futures = [executor.submit(agent_then_evaluation, name, d, prior) for name, d, prior in todo]
                for f in futures:
                    f.result()
            else:  # agents in parallel, evaluations one after the other here
                results = {name: executor.submit(agent_result, name, d, prior) for name, d, prior in pending}
                for name, d, prior in todo:
                    res = prior if prior is not None else results[name].result()
                    record(self._attempt(name, d, agent.name, res, base, base_ar, ceiling))
        except BaseException:
            # Interrupted: the agents stop at their next step and their systems die now, so the run ends in
            # seconds; nothing that ends after this is saved, and the same command resumes the round.
            interrupted.set()
            for name, _d, _prior in todo:
                self.stops.setdefault(name, threading.Event()).set()
                cancel_branch(name)
            raise
        finally:
            if self.executor is None:
                executor.shutdown(wait=not interrupted.is_set())

        kept = [a for a in summary["attempts"] if a["status"] == "keep"]
        if "integration" not in summary:
            summary["integration"] = self.integrate(index, rnd.id, base, kept, base_ar, ceiling)
            self.ws.memory.update_round(rnd.id, summary=summary)
        integ = summary["integration"]
        summary["best_speedup_over_ar"] = base_ar
        if integ["commit"] != base:
            self.ws.repo.git.branch("-f", BASE_BRANCH, integ["commit"])
            for name in integ.get("merged", []):  # now part of base: no longer a candidate of its own
                self.ws.memory.update_branch(self.ws.branch(name).id, status="merged")
            summary["best_speedup_over_ar"] = base_ar * first_point(integ)
        self.ws.memory.update_round(rnd.id, status="done", summary=summary)
        return summary

    def visible_prompts(self) -> list[dict]:
        """The prompts agents may see ({"id", "text"}), as committed in stock; never the hidden split."""
        text = self.ws.repo.git.show(f"{STOCK_TAG}:prompts/visible.jsonl")
        return [{"id": str(r["id"]), "text": r["text"]} for r in map(json.loads, filter(str.strip, text.splitlines()))]

    def run_agent(self, family: str, branch: str, gaps: dict | None = None) -> dict:
        """One agent on one direction from the current base, then the cascade: a one-agent round outside
        the round structure (the TUI's launch). Steering and stop reach it through `steering[branch]` and
        `stops[branch]`, which may be set up before the call. Returns the attempt."""
        agent = self.make_agent()  # first: a missing LLM endpoint is reported before anything runs
        self._ensure_refs()
        base = self.base_commit()
        # The branch exists from the start, so its row (and progress) shows while the base is profiled.
        b = self.ws.create_branch(branch, base=base, agent=agent.name, direction=family)
        self.say(f"{branch}: {agent.name} agent launched on {family}", "tui.launch",
                 {"branch": branch, "agent": agent.name, "direction": family})
        if gaps is None:
            self.ws.begin_evaluation(b, "running")
            try:
                with tracking(self.ws.state, branch, keep=True):
                    step("profiling base", detail=base[:10])
                    gaps = self.gaps(base, f"launch of {branch}")
            except BaseException as e:
                self.ws.memory.add_evaluation(b.id, "agent", "crash", f"profiling the base failed: {e}"[:300])
                self.ws.end_evaluation(b, "crashed")
                (self.ws.state / "progress" / f"{branch}.json").unlink(missing_ok=True)
                raise
        bd = gaps["breakdown"]
        agents, self.opts.agents = self.opts.agents, len(bd.get("families", {})) or 7
        try:
            d = next((x for x in self.directions(bd, set()) if x.family == family), None)
        finally:
            self.opts.agents = agents
        if d is None:
            ms = float(bd.get("families", {}).get(family, 0.0))
            d = Direction(family, ms, f"{family}: {ms:.3f} ms/token (chosen by the engineer)")
        res = self._run_agent(agent, branch, d, gaps, self.visible_prompts())
        self.say(f"{branch}: agent: {res.message}", "loop.agent", {"branch": branch, "committed": res.committed})
        ceiling = self.session_ceiling() if res.committed else 0.0
        att = self._attempt(branch, d, agent.name, res, base, self.base_speedup_over_ar(),
                            ceiling)
        att["base_commit"] = base
        return att

    def _attempt(self, name: str, d: Direction, agent: str, res: AgentResult, base: str, base_ar: float,
                 ceiling: float) -> dict:
        if res.committed:  # its own verify width may raise its ceiling (a tree, a longer draft)
            ceiling = ceiling_for(self.ws, self.hardware(), self.ws.head(name), ceiling)
        with tracking(self.ws.state, name):
            return evaluate_attempt(self.ws, name, d.family, agent, res, base, base_ar, ceiling, self.opts.min_gain,
                                    self.say, run=self.evaluator.evaluate)

    # -- integration -----------------------------------------------------------------------------------

    def integrate(self, index: int, round_id: int, base: str, kept: list[dict], base_ar: float,
                  ceiling: float) -> dict:
        """The round's kept branches into one new base (`integrate_kept`), the merged ones recorded."""
        for a in kept:  # the combination may verify as wide as its widest part
            ceiling = ceiling_for(self.ws, self.hardware(), self.ws.head(a["branch"]), ceiling)
        chosen = integrate_kept(self.ws, index, round_id, base, kept, base_ar, ceiling, self.opts.min_gain, self.say,
                                run=self.evaluator.evaluate)
        for a in kept:
            if a["branch"] in chosen["merged"]:
                self._record(a, base, index)
        if kept:
            self.say(f"round {index}: base -> {chosen['commit'][:10]} ({chosen['speedup']:.3f}x over the old base; "
                     f"merged {', '.join(chosen['merged'])})", "loop.integrate", chosen)
        return chosen

    def _record(self, a: dict, base: str, index: int) -> None:
        m = record_kept(self.ws, a, base, a["direction"], index)
        if self.opts.auto_accept:
            note = f"auto: kept and integrated in round {index} ({a['speedup']:.3f}x over its base, forcing clean)"
            m = self.ws.memory.set_mechanism_status(m.id, "accepted", note)
            publish_verdict(m, self.ws.state / "memory.db")

    # -- the whole loop --------------------------------------------------------------------------------

    def run(self) -> dict:
        need, have = max(self.ws.config.batch_sizes), len({p.id for p in timing_prompts(self.ws)})
        if need > have:  # a timed batch never repeats a prompt (workbench.measure): say so before any work
            raise WorkspaceError(f"{self.ws.path / 'specpilot.toml'}: load batch size {need} needs at least {need} "
                                 f"distinct prompts and the workspace has {have}; lower load batch_sizes")
        self._ensure_refs()
        self.say(f"loop on {self.ws.config.name}: {self.opts.rounds} rounds x {self.opts.agents} {self.opts.agent} "
                 f"agents, budget {self.opts.budget_minutes:g} min")
        stock_reference(self.ws, progress=False)
        status = "done"
        rounds: list[dict] = []
        try:
            if self.measured("stock", self.ws.stock_commit) is None:
                self._check_budget("measuring stock")
                self.speedup_over_ar(self.ws.stock_commit, "stock")
            prior = [r for r in self.rounds() if r.status in ("done", "running")]
            for r in prior:
                if r.status == "done":
                    rounds.append(r.summary)
            start = max((r.summary["index"] for r in prior), default=0)
            for r in prior:  # a round the loop was killed in: finished, not restarted
                if r.status == "running":
                    rounds.append(self.run_round(r.summary["index"], resume={"round_id": r.id}))
                    start = max(start, r.summary["index"])
            for index in range(start + 1, self.opts.rounds + 1):
                rounds.append(self.run_round(index))
        except BudgetExhausted as e:
            status = "budget"
            self.say(str(e))
        final = self.base_commit()
        stock = self.measured("stock", self.ws.stock_commit)
        if stock is None:  # the budget ended before anything was measured
            stock = final_m = {"speedup": None, "ci95": None}
        elif final == self.ws.stock_commit:
            final_m = stock
        else:
            final_m = self.measured("final", final) or self.speedup_over_ar(final, "final")
        accepted = [{"id": m.id, "name": m.name, "family": m.gap_family, "uid": m.uid,
                     "speedup": next((e.get("speedup") for e in m.evidence), None)}
                    for m in self.ws.memory.list_mechanisms(status="accepted")]
        return {
            "workspace": str(self.ws.path), "deployment": self.ws.config.name, "status": status,
            "stock_speedup": stock["speedup"], "final_speedup": final_m["speedup"],
            "improvement": final_m["speedup"] / stock["speedup"] if stock["speedup"] else None,
            "stock_ci95": stock["ci95"], "final_ci95": final_m["ci95"],
            "stock_commit": self.ws.stock_commit, "final_commit": final,
            "rounds": [{"index": r["index"], "base_commit": r.get("base_commit"),
                        "best_speedup_over_ar": r.get("best_speedup_over_ar"),
                        "directions": [d["family"] for d in r.get("directions", [])],
                        "integration": {k: v for k, v in (r.get("integration") or {}).items()},
                        "attempts": [{k: a.get(k) for k in ("branch", "agent", "direction", "status", "reason",
                                                            "speedup", "speedup_over_ar", "mechanism")}
                                     for a in r.get("attempts", [])]} for r in rounds],
            "accepted_mechanisms": accepted,
            "load": {"batch_sizes": self.ws.config.batch_sizes},
            "points": load_points_summary(self.ws.config.batch_sizes, stock, final_m),
            "ceiling": self._ceiling or next((r.summary.get("ceiling") for r in reversed(self.rounds())
                                              if r.summary.get("ceiling")), None),
            "minutes": round(self.minutes(), 2),
            "best_round": best_round(rounds, final, self.ws.stock_commit),
        }


def llm_config(ws: Workspace, override: dict | None = None):
    """The LLM agent's endpoint: `override`, else the workspace's [llm] table, the environment filling
    gaps; an error names the file to edit."""

    try:
        return LLMConfig.load(override or ws.config.llm or None)
    except LLMConfigError as e:
        where = f"the [llm] table of {ws.path / 'specpilot.toml'}"
        raise LLMConfigError(str(e).replace("the [llm] config section", where).replace("in [llm]", f"in {where}")) \
            from None


def first_point(measured: dict) -> float:
    """A measurement's speedup at the load's first batch size (its aggregate has "points" beside it)."""
    points = measured.get("points") or {}
    if not points:
        return float(measured["speedup"])
    v = points[min(points, key=int)]  # a paired result's dict, or (an attempt's) the speedup itself
    return float(v["speedup"] if isinstance(v, dict) else v)


def load_points_summary(batch_sizes: list[int], stock: dict, final: dict) -> dict:
    """Per batch size of the load: stock's and the final system's speedup over the same engine's AR."""
    def at(m: dict, bs: int) -> dict:
        return (m.get("points") or {}).get(str(bs)) or (m if len(batch_sizes) == 1 else {})

    out = {}
    for bs in batch_sizes:
        st, fi = at(stock, bs), at(final, bs)
        s_sp, f_sp = st.get("speedup"), fi.get("speedup")
        out[str(bs)] = {"stock_speedup": s_sp, "final_speedup": f_sp,
                        "improvement": f_sp / s_sp if s_sp and f_sp else None,
                        "stock_ci95": st.get("ci95"), "final_ci95": fi.get("ci95"),
                        "ar_tokens_per_s": fi.get("a_tokens_per_s") or st.get("a_tokens_per_s"),
                        "final_tokens_per_s": fi.get("b_tokens_per_s"), "ar": fi.get("ar") or st.get("ar")}
    return out


def best_round(rounds: list[dict], final: str, stock: str) -> int | None:
    """The round after which the base was already the final system (0: stock stayed best; None: unknown).

    A round's summary holds the base it started from, so round i ended on the next round's base (the
    last round on the final commit)."""
    if final == stock:
        return 0
    ordered = sorted(rounds, key=lambda r: r["index"])
    for i, r in enumerate(ordered):
        after = ordered[i + 1].get("base_commit") if i + 1 < len(ordered) else final
        if after == final:
            return r["index"]
    return None
