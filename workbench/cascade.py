"""The evaluation cascade for one candidate branch, cheapest and strictest first.

    guard    uncommitted changes or a protected path touched   -> rejected (nothing runs)
    smoke    the system starts and answers one short request   -> crash
    forcing  every position of every forcing prompt vs stock   -> discard (unexplained mismatch) / crash
    bench    paired benchmark against the round's base         -> rejected (a timed output is not stock's:
                                                                  checked like forcing, every pass)
                                                                  / discard (no gain beyond the noise)
    ceiling  speedup over AR under the cost model's ceiling    -> rejected (a reward-hacking flag)
    keep     all of the above passed

Each stage is an evaluation in the store with a one-line reason; the first failing stage ends it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from workbench.forcing import force, run_system, stock_reference, timed_output_problem
from workbench.harness import SystemCrash
from workbench.measure import load_prompts, paired_bench
from workbench.workspace import Workspace

SMOKE_TOKENS = 16


@dataclass
class Attempt:
    status: str  # keep, discard, crash, rejected
    reason: str
    speedup: float | None = None  # over the round's base
    speedup_over_ar: float | None = None
    ci95: list[float] | None = None


def smoke_run(ws: Workspace, worktree: Path, label: str) -> tuple[bool, str]:
    """Start the worktree's system and generate a few tokens for one visible prompt."""
    prompts = load_prompts(ws)
    try:
        with run_system(ws, worktree, f"smoke-{label}") as sp:
            r = sp.generate(prompts[0].ids, SMOKE_TOKENS)
    except SystemCrash as e:
        return False, f"{e.kind}: {e.reason}"
    return True, f"ok: {len(r.tokens)} tokens in {r.seconds:.2f} s on {prompts[0].id}"


def timing_prompts(ws: Workspace) -> list:
    """What the paired benchmark times: the hidden split, which agents never see and tuned against
    (with the visible one too when the hidden split is small); the order is drawn per pass."""
    hidden = load_prompts(ws, "hidden")
    return hidden if len(hidden) >= 4 else hidden + load_prompts(ws)


def evaluate(ws: Workspace, branch: str, base: str, base_speedup_over_ar: float, ceiling: float, *,
             min_gain: float = 1.02, progress: Callable[[str], None] | None = None) -> Attempt:
    """Run the cascade on `branch` against the base commit; every stage is recorded in the store."""
    from costmodel.ceiling import plausible

    say = progress or (lambda _m: None)
    mem = ws.memory
    b = ws.branch(branch)

    def stage(name: str, status: str, reason: str, metrics: dict | None = None, **kw) -> Attempt:
        mem.add_evaluation(b.id, name, status, reason, metrics=metrics or {})
        mem.update_branch(b.id, status={"keep": "kept", "discard": "discarded", "crash": "crashed",
                                        "rejected": "rejected"}[status], head_commit=ws.head(branch))
        return Attempt(status, reason, **kw)

    why = ws.guard(branch)
    if why:
        return stage("guard", "rejected", why)

    ok, msg = smoke_run(ws, ws.worktree_path(branch), branch)
    if not ok:
        return stage("smoke", "crash", msg)
    mem.add_evaluation(b.id, "smoke", "keep", msg)

    say(f"  {branch}: forcing")
    rep = force(ws, branch, progress=False)
    if rep["status"] != "keep":
        return Attempt(rep["status"], f"forcing: {rep['reason']}")

    why = ws.guard(branch)  # nothing the forcing run left behind reaches the timed run
    if why:
        return stage("guard", "rejected", f"after forcing: {why}")
    say(f"  {branch}: paired benchmark against the base")
    prompts = timing_prompts(ws)
    try:
        with run_system(ws, ws.detached_worktree("_base", base), "base") as a, \
                run_system(ws, ws.worktree_path(branch), f"bench-{branch}") as c:
            res = paired_bench(a, c, prompts, ws.config.forcing_max_new_tokens)
    except SystemCrash as e:
        return stage("bench", "crash", f"{e.kind}: {e.reason}")
    metrics = res.as_dict()
    ref = stock_reference(ws, progress=False)
    wrong = [w for pid, outs in res.b_outputs.items() for o in outs
             if (w := timed_output_problem(ref, pid, o)) is not None]
    if wrong:
        return stage("bench", "rejected", f"timed output differs from stock ({len(wrong)}): {wrong[0]}", metrics)
    over_ar = base_speedup_over_ar * res.speedup
    fine, why = plausible(over_ar, ceiling)
    kw = {"speedup": res.speedup, "speedup_over_ar": over_ar, "ci95": [res.ci_low, res.ci_high]}
    if not fine:
        return stage("bench", "rejected", f"implausible: {why}", metrics, **kw)
    if res.speedup >= min_gain and res.ci_low > 1.0:
        return stage("bench", "keep", f"{res.line()} over the base, {over_ar:.2f}x over AR; forcing clean",
                     metrics, **kw)
    return stage("bench", "discard", f"no gain beyond the noise: {res.line()} (needs >= {min_gain:.2f}x and a CI "
                                     f"above 1)", metrics, **kw)
