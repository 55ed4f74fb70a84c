"""The evaluation cascade for one candidate branch, cheapest and strictest first.

    guard    uncommitted changes or a protected path touched   -> rejected (nothing runs)
    smoke    the system starts and answers one short request   -> crash
    kernel   a commit that changes the engine's kernels (ggml/): -> discard (outputs off stock's beyond the
             its kernels on the deployment's real weights at      tolerance) / crash (does not build or run)
             the verify widths against stock's, in the sandbox
             (workbench/kernel_check.py)
    forcing  every position of every forcing prompt vs stock   -> discard (unexplained mismatch) / crash
    bench    paired benchmark against the round's base at every  -> rejected (a timed output is not stock's:
             point of the load (batch sizes; a batch is timed      checked like forcing, every pass)
             as one batched request)                             / discard (slower than LOAD_FLOOR of the
                                                                  base at any point of the load)
                                                                  / discard (no gain beyond the noise: a CI
                                                                  above 1 and a speedup past min_gain and
                                                                  the keep threshold of `noise_floor`, twice:
                                                                  in a second pair of fresh processes too)
    ceiling  speedup over AR under the cost model's ceiling    -> rejected (a reward-hacking flag)
    keep     all of the above passed

Each stage is an evaluation in the store with a one-line reason; the first failing stage ends it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from costmodel.ceiling import plausible
from workbench.forcing import force, run_system, stock_reference, timed_output_problem
from workbench.harness import SystemCrash
from workbench.kernel_check import kernel_check
from workbench.measure import LOAD_FLOOR, LoadResult, TimedOutputWrong, load_prompts, paired_bench
from workbench.progress import step
from workbench.workspace import NOISE_MARGIN, NOISE_PAIRS, Workspace

SMOKE_TOKENS = 16


@dataclass
class Attempt:
    status: str  # keep, discard, crash, rejected
    reason: str
    speedup: float | None = None  # over the round's base
    speedup_over_ar: float | None = None
    ci95: list[float] | None = None
    points: dict[str, float] | None = None  # speedup over the base per batch size of the load (several points)


def smoke_run(ws: Workspace, worktree: Path, label: str) -> tuple[bool, str]:
    """Start the worktree's system and generate a few tokens for one visible prompt."""
    prompts = load_prompts(ws)
    try:
        with run_system(ws, worktree, f"smoke-{label}") as sp:
            r = sp.generate(prompts[0].ids, SMOKE_TOKENS)
    except SystemCrash as e:
        return False, f"{e.kind}: {e.reason}"
    return True, f"ok: {len(r.tokens)} tokens in {r.seconds:.2f} s on {prompts[0].id}"


MIN_TIMING_PROMPTS = 4


def timing_prompts(ws: Workspace) -> list:
    """What the paired benchmark times: the hidden split, which agents never see and tuned against, with the
    visible one too when the hidden split is small (under MIN_TIMING_PROMPTS, or under the load's largest batch:
    a timed batch holds distinct prompts); the order is drawn per pass."""
    hidden = load_prompts(ws, "hidden")
    enough = max(MIN_TIMING_PROMPTS, *ws.config.batch_sizes)
    return hidden if len(hidden) >= enough else hidden + load_prompts(ws)


def bench_cpus(ws: Workspace) -> set[int] | None:
    """The CPUs paired benchmarks run on: `[bench] cpus = [..]` in specpilot.toml, else all this process may use."""
    cpus = ws.config.bench.get("cpus")
    return {int(c) for c in cpus} if cpus else None


def paired_load(ws: Workspace, a_wt: Path, a_log: str, b_wt: Path, b_log: str, *, label: str = "bench",
                check_b: Callable[[str, list[int]], str | None] | None = None) -> LoadResult:
    """B's system against A's, each started once, paired at every batch size of the deployment's load."""
    points = ws.config.batch_sizes
    out = {}
    with run_system(ws, a_wt, a_log) as a, run_system(ws, b_wt, b_log) as b:
        for bs in points:
            out[bs] = paired_bench(a, b, timing_prompts(ws), ws.config.forcing_max_new_tokens, cpus=bench_cpus(ws),
                                   label=label if len(points) == 1 else f"{label} B={bs}", check_b=check_b,
                                   batch=bs)
    return LoadResult(out)


def noise_of(runs: list[dict]) -> float:
    """The largest deviation from 1 of the base against itself: over the runs' aggregates and, under a load
    profile, every point of each run (an aggregate may hide one point's noise)."""
    return max(abs(v - 1.0) for r in runs for v in [r["speedup"], *(r.get("points") or {}).values()])


def noise_floor(ws: Workspace, base: str, *, progress: Callable[[str], None] | None = None) -> dict:
    """What a change that does nothing measures: the base against itself in `noise_pairs` fresh
    process pairs (the paired benchmark's own interval misses what differs between processes and over
    time). The keep threshold is 1 + `noise_margin` x the largest deviation. Cached per base commit."""
    path = ws.state / "noise" / f"{base}.json"
    if path.exists():
        try:
            return json.loads(path.read_text())
        except ValueError:
            pass  # a torn write: measure again
    pairs = max(1, int(ws.config.bench.get("noise_pairs", NOISE_PAIRS)))
    margin = float(ws.config.bench.get("noise_margin", NOISE_MARGIN))
    wt = ws.detached_worktree("_base", base)
    runs = []
    for i in range(pairs):
        if progress:
            progress(f"  noise floor: the base against itself, pair {i + 1}/{pairs}")
        res = paired_load(ws, wt, f"noise-{i}a", wt, f"noise-{i}b", label=f"noise {i + 1}/{pairs}")
        runs.append({"speedup": res.speedup, "ci95": [res.ci_low, res.ci_high], "passes": res.first.passes,
                     **({"points": _points(res)} if len(res.points) > 1 else {})})
    # Every point's deviation counts: the aggregate of a change that does nothing may hide one point's noise.
    noise = noise_of(runs)
    out = {"base": base, "pairs": pairs, "margin": margin, "noise": noise, "keep_threshold": 1.0 + margin * noise,
           "runs": runs, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "load_avg": os.getloadavg()[0]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out) + "\n")
    os.replace(tmp, path)
    return out


def evaluate(ws: Workspace, branch: str, base: str, base_speedup_over_ar: float, ceiling: float, *,
             min_gain: float = 1.02, progress: Callable[[str], None] | None = None) -> Attempt:
    """Run the cascade on `branch` against the base commit; every stage is recorded in the store."""

    say = progress or (lambda _m: None)
    mem = ws.memory
    b = ws.branch(branch)

    def stage(name: str, status: str, reason: str, metrics: dict | None = None, **kw) -> Attempt:
        mem.add_evaluation(b.id, name, status, reason, metrics=metrics or {})
        mem.update_branch(b.id, status={"keep": "kept", "discard": "discarded", "crash": "crashed",
                                        "rejected": "rejected"}[status], head_commit=ws.head(branch))
        return Attempt(status, reason, **kw)

    step("guard")
    why = ws.guard(branch)
    if why:
        return stage("guard", "rejected", why)

    step("smoke")
    ok, msg = smoke_run(ws, ws.worktree_path(branch), branch)
    if not ok:
        return stage("smoke", "crash", msg)
    mem.add_evaluation(b.id, "smoke", "keep", msg)

    if ws.config.engine_source:
        try:
            kc = kernel_check(ws, ws.head(branch))
        except SystemCrash as e:
            return stage("kernel", "crash", f"{e.kind}: {e.reason}")
        if kc:
            say(f"  {branch}: {kc['reason']}")
            if not kc["ok"]:
                return stage("kernel", "discard", kc["reason"], kc)
            mem.add_evaluation(b.id, "kernel", "keep", kc["reason"], metrics=kc)

    say(f"  {branch}: forcing")
    rep = force(ws, branch, progress=False)
    if rep["status"] != "keep":
        return Attempt(rep["status"], f"forcing: {rep['reason']}")

    why = ws.guard(branch)  # nothing the forcing run left behind reaches the timed run
    if why:
        return stage("guard", "rejected", f"after forcing: {why}")
    say(f"  {branch}: paired benchmark against the base")
    ref = stock_reference(ws, progress=False)

    def bench(label: str) -> tuple[LoadResult | None, Attempt | None]:
        """One paired benchmark in fresh processes at every point of the load, its timed outputs checked
        against stock."""
        step(label, detail="starting both systems")
        try:
            res = paired_load(ws, ws.detached_worktree("_base", base), "base", ws.worktree_path(branch),
                              f"bench-{branch}", label=label,
                              check_b=lambda pid, toks: timed_output_problem(ref, pid, toks))
        except SystemCrash as e:
            return None, stage("bench", "rejected" if e.kind == "cheat" else "crash", f"{e.kind}: {e.reason}")
        except TimedOutputWrong as e:  # stopped at the first wrong answer: no speed is measured for it
            return None, stage("bench", "rejected", f"timed output differs from stock: {e}")
        return res, None

    res, ended = bench("bench")
    if ended is not None:
        return ended
    metrics = res.as_dict()
    over_ar = base_speedup_over_ar * res.first.speedup  # the ceiling and the base's ratio are the first point's
    fine, why = plausible(over_ar, ceiling)
    kw = {"speedup": res.speedup, "speedup_over_ar": over_ar, "ci95": [res.ci_low, res.ci_high],
          "points": _points(res)}
    if not fine:
        return stage("bench", "rejected", f"implausible: {why}", metrics, **kw)
    if len(res.points) > 1 and res.worst[1] < LOAD_FLOOR:
        return stage("bench", "discard", f"slower at B = {res.worst[0]}: {res.line()} (a kept change is >= "
                                         f"{LOAD_FLOOR}x of the base at every batch size of the load)", metrics, **kw)
    if res.speedup < min_gain or res.ci_low <= 1.0:
        return stage("bench", "discard", f"no gain beyond the noise: {res.line()} (needs >= {min_gain:.2f}x and a "
                                         f"CI above 1)", metrics, **kw)
    # A gain: is it more than a change that does nothing shows? (measured once per base, when needed)
    noise = noise_floor(ws, base, progress=say)
    keep_at = max(min_gain, noise["keep_threshold"])
    metrics.update(keep_threshold=keep_at, noise=noise["noise"])
    if res.speedup < keep_at:
        return stage("bench", "discard", f"no gain beyond the noise: {res.line()} (needs >= {keep_at:.3f}x: the base "
                                         f"against itself deviates up to {noise['noise']:.3f})", metrics, **kw)
    # Passed once: it must pass again in a second pair of fresh processes (a lucky pair, or a burst of
    # load on one side, does not repeat), and the lower of the two is what it is credited with.
    say(f"  {branch}: {res.line()}; confirming in fresh processes")
    again, ended = bench("confirm")
    if ended is not None:
        return ended
    metrics["confirm"] = again.as_dict()
    if again.speedup < keep_at or again.ci_low <= 1.0 or (len(again.points) > 1 and again.worst[1] < LOAD_FLOOR):
        return stage("bench", "discard", f"not reproduced: {res.line()}, then {again.line()} in fresh processes "
                                         f"(needs >= {keep_at:.3f}x and a CI above 1 both times"
                                         f"{f', >= {LOAD_FLOOR}x at every batch size' if len(res.points) > 1 else ''})",
                     metrics, **kw)
    low = min((res, again), key=lambda r: r.speedup)
    over_ar = base_speedup_over_ar * low.first.speedup
    kw = {"speedup": low.speedup, "speedup_over_ar": over_ar, "ci95": [low.ci_low, low.ci_high],
          "points": _points(low)}
    return stage("bench", "keep", f"{low.line()} over the base, reproduced ({res.speedup:.3f}x and "
                                  f"{again.speedup:.3f}x; keep threshold {keep_at:.3f}x), {over_ar:.2f}x over AR; "
                                  f"forcing clean", metrics, **kw)


def _points(res: LoadResult) -> dict[str, float] | None:
    return {str(b): r.speedup for b, r in sorted(res.points.items())} if len(res.points) > 1 else None
