"""The built-in tuner: composes and tunes the decoder's registered mechanisms, no LLM involved.

For its direction (a gap family) it reads the mechanism registry (config keys, ranges, requirements,
devices) and the memory (configs of mechanisms accepted elsewhere for the family, tried first: each
is paired against the current config, and the best of those that win is taken without a search),
builds candidate configs on top of the branch's current `system.toml`, and tunes them by
successive halving: every candidate runs on a few short visible prompts, the best third goes on
to more and longer prompts, and so on. Every run goes through the harness (timed outside the
system, under the measurement lock) and is checked against stock's tokens on the visible prompts,
so a config that changes the output is dropped at once. The winner, if it beats the current config
by more than the rung's noise margin, is written to `system.toml` and committed on the branch.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from decoder.config import ConfigError, DecodeConfig, choose_draft_len, dump_table, entry_starts, schedule_text
from decoder.contract import near_tie_threshold
from decoder.engines.llamacpp_config import LlamaCppConfig
from decoder.mechanisms import CONTRACTS, Contract
from workbench.agents.base import AgentContext, AgentResult, Direction
from workbench.agents.engine_patch import EnginePatch
from workbench.agents.engine_patch import applicable as applicable_patches
from workbench.agents.kernel import applicable as applicable_kernels
from workbench.agents.kernel import kernel_search
from workbench.engine_source import apply_patch
from workbench.forcing import run_system, stock_reference
from workbench.measure import LOAD_FLOOR, load_prompts, measurement_lock, warm_prompt
from workbench.progress import step
from workbench.workspace import Workspace, WorkspaceError

MAX_GRID = 12  # candidates per mechanism, sampled deterministically from larger grids
RUNGS = ((2, 32), (4, 64))  # (prompts, tokens) per rung; the finalist is then paired on every visible prompt
KEEP = 1 / 3
MIN_GAIN = 1.03  # the winner must beat the current config by this factor at the last rung
COMPOSE_TOP = 3  # a rung's best winners composed pairwise for the next rung
MAX_MEMORY = 6  # memory configs (composition first) paired against the current config before any search


@dataclass
class Candidate:
    changes: dict  # DecodeConfig keys changed against the branch's current config
    source: str  # "memory:<name>" or the registry mechanism's name
    cfg: DecodeConfig
    # A mechanism switched on with its own defaults (the engine's or the decoder's tuned values): carried to the
    # last rung whatever its rank at a short one, where a mechanism that pays only over longer outputs (an
    # n-gram drafter that needs a long match first) looks like noise.
    defaults: bool = False

    @property
    def key(self) -> str:
        return json.dumps(self.cfg.as_dict(), sort_keys=True)


TORCH = CONTRACTS["torch"]
SWITCH_OFF = (False, "chain", "bf16", "torch", "", "none")  # a key at one of these values: its mechanism is off


def _grid(name: str, rng: random.Random, contract: Contract = TORCH) -> list[dict]:
    m = contract.registry[name]
    keys = list(m.keys)
    combos = [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*(m.keys[k] for k in keys))]
    # With its switch off (verify = "chain", dcut = False, ...), a mechanism's other keys change nothing,
    # and switching it off is not exploring it (a base that has it on would be offered stock again).
    switches = {k for k, v in m.stock.items() if v in SWITCH_OFF}
    combos = [c for c in combos if not any(c[k] == m.stock[k] for k in switches)]
    if len(combos) > MAX_GRID:
        combos = [combos[0], combos[-1], *rng.sample(combos[1:-1], MAX_GRID - 2)]
    if switches:  # the switch alone first: the mechanism with the decoder's tuned defaults
        combos.insert(0, {k: next(v for v in m.keys[k] if v != m.stock[k]) for k in switches})
    return [{**m.requires, **c} for c in combos]


def with_requirements(changes: dict, contract: Contract = TORCH) -> dict:
    """A change recorded on another deployment's base plus what its mechanisms require: a memory config
    holds only the keys its agent changed (drafter = "mtp"), not those its base already had
    (lean_forward = true), which a different base may lack."""
    req: dict = {}
    for m in contract.registry.values():
        if any(k in changes and changes[k] != v and changes[k] in m.keys.get(k, ()) for k, v in m.stock.items()):
            req.update(m.requires)
    return {**req, **changes} if changes else {}


def tree_cap(points: list[int] | tuple[int, ...]) -> int:
    """The load-tree cap offered beside every tree the tuner tries under a load: the largest batch size below the
    top one (points 1, 8 -> 1: the tree at one request, the chain in the batch); 0 for a load of one point."""
    below = [b for b in points if b < max(points, default=1)]
    return max(below, default=0)


def candidates(base: DecodeConfig, family: str, memory: list[dict], seed: int = 0,
               refuse: Callable[[DecodeConfig], str | None] | None = None,
               contract: Contract = TORCH, points: list[int] | tuple[int, ...] = (1,)) -> list[Candidate]:
    """Memory's configs for the family first, then the registry's mechanisms of the family, on `base` (a config
    of `contract`'s class); `refuse` (Workspace.refusal) drops what the deployment's models cannot run. Under a
    load of several batch sizes (`points`), each candidate that switches a tree on comes again with the load-tree
    cap `tree_cap(points)`: a tree that pays at one request and costs in the batch is then one candidate, not a
    loss at one point that sinks the other."""
    cls = contract.config
    rng = random.Random(seed)
    out: list[Candidate] = []
    seen = {json.dumps(base.as_dict(), sort_keys=True)}
    proposals: list[tuple[str, dict]] = []
    confs = [(item.get("name", "?"), with_requirements(item.get("config") or {}, contract)) for item in memory]
    confs = [(n, c) for n, c in confs if c]
    if len(confs) > 1:  # all of them composed, best-measured first so later ones refine it
        composed: dict = {}
        for _, c in reversed(confs):
            composed.update(c)
        proposals.append(("memory:" + "+".join(n for n, _ in confs), composed))
    proposals += [(f"memory:{n}", c) for n, c in confs]
    defaults: list[dict] = []
    for name, m in contract.registry.items():
        if m.family == family and base.device.split(":")[0] in m.devices:
            grid = _grid(name, rng, contract)
            if any(v in SWITCH_OFF for v in m.stock.values()) and grid:
                defaults.append(grid[0])  # _grid puts the switch alone first
            proposals += [(name, c) for c in grid]
    for source, changes in proposals:
        changes = {k: v for k, v in changes.items() if k in cls.__dataclass_fields__
                   and k not in ("dtype", "device", "max_new_tokens", "seed")}
        try:
            cfg = cls(**{**base.as_dict(), **changes})
        except (ConfigError, TypeError):
            continue  # an incompatible combination (e.g. w12 with the lean forward)
        if refuse is not None and refuse(cfg):
            # A mechanism that asked for the lean forward may run without it (tree verification of a recurrent
            # target runs on the HF path); otherwise the models cannot run it.
            if not (changes.get("lean_forward") and not base.lean_forward):
                continue
            changes = {k: v for k, v in changes.items() if k != "lean_forward"}
            try:
                cfg = cls(**{**base.as_dict(), **changes})
            except (ConfigError, TypeError):
                continue
            if refuse(cfg):
                continue
        c = Candidate({k: v for k, v in changes.items() if base.as_dict().get(k) != v}, source, cfg,
                      defaults=not source.startswith("memory:") and changes in defaults)
        if c.key not in seen and c.changes:
            seen.add(c.key)
            out.append(c)
    cap = tree_cap(points)
    if cap and "tree_max_live" in cls.__dataclass_fields__:
        for c in list(out):
            turns_on = any(c.changes.get(k, 0) and not getattr(base, k) for k in ("corpus_tree_alts", "mtp_tree_alts"))
            if not turns_on or c.cfg.tree_max_live:
                continue
            try:
                cfg = cls(**{**c.cfg.as_dict(), "tree_max_live": cap})
            except (ConfigError, TypeError):
                continue
            v = Candidate({**c.changes, "tree_max_live": cap}, f"{c.source}+load-tree", cfg)
            if v.key not in seen and not (refuse is not None and refuse(cfg)):
                seen.add(v.key)
                out.append(v)
    return out


def compose(winners: list[Candidate], base: DecodeConfig, refuse: Callable[[DecodeConfig], str | None] | None = None,
            contract: Contract = TORCH) -> Candidate | None:
    """The rung's winners that each beat the base, composed best first: a later one joins when it sets only keys
    the composition has not set (two mechanisms, not two settings of one) and the composed config is valid and
    runnable (`refuse`). None unless at least two join: with one mechanism per candidate, two that pay only
    together (or each a little, and more side by side) are never tried as one."""
    changes: dict = {}
    parts: list[str] = []
    composed = base
    for c in winners:
        if set(c.changes) & set(changes):
            continue
        trial = {**changes, **c.changes}
        try:
            cfg = contract.config(**{**base.as_dict(), **trial})
        except (ConfigError, TypeError):
            continue
        if refuse is not None and refuse(cfg):
            continue
        changes, composed = trial, cfg
        parts.append(c.source)
    return Candidate(changes, "composed:" + "+".join(parts), composed) if len(parts) >= 2 else None


def compositions(winners: list[Candidate], base: DecodeConfig,
                 refuse: Callable[[DecodeConfig], str | None] | None = None, contract: Contract = TORCH,
                 top: int = COMPOSE_TOP) -> list[Candidate]:
    """Every pair of the best `top` winners of different mechanisms, then all winners composed (`compose`): a
    short rung's noise lets a mechanism that hurts (a load schedule beside ragged verify) beat the base, and the
    composition of everything carries it; a pair of the two that pay does not (session 22's batching tuner
    composed five and kept ragged verify alone)."""
    out: list[Candidate] = []
    for group in [*itertools.combinations(winners[:top], 2), winners]:
        c = compose(list(group), base, refuse, contract)
        if c is not None and c.key not in {x.key for x in out}:
            out.append(c)
    return out


def mechanism_name(changes: dict, contract: Contract = TORCH) -> str:
    """The registry mechanisms a change touches, with the values it set."""
    def touched(m) -> bool:  # one of its defining keys moved to a value of its own
        return any(k in changes and changes[k] != v and changes[k] in m.keys.get(k, (changes[k],))
                   for k, v in m.stock.items())

    names = [n for n, m in contract.registry.items() if touched(m)]
    vals = ",".join(f"{k}={v}" for k, v in sorted(changes.items()))
    return f"{'+'.join(names) or 'config'}({vals})"


SCHEDULE_LENS = (0, 1, 2, 3, 4)  # draft lengths the measured load schedule chooses from at each batch size


def _geomean(xs: list[float]) -> float:
    xs = [max(x, 1e-9) for x in xs]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else 0.0


def _off_stock(row: dict, tokens: list[int], n: int, threshold: float) -> str:
    """Why `tokens` are not stock's first `n` for this prompt ("" when they are, up to a near tie)."""
    stock, out = row["stock"][:n], tokens[:n]
    if out == stock:
        return ""
    j = next((i for i, (a, b) in enumerate(zip(out, stock, strict=False)) if a != b), min(len(out), len(stock)))
    margin = row["margins"][j] if j < len(row["margins"]) else math.inf
    return "" if margin < threshold else f"{row['id']}:{j} margin {margin:.3g}"


class TunerAgent:
    """Composes and tunes registered mechanisms for one direction; see the module docstring."""

    name = "tuner"

    def __init__(self, ws: Workspace, *, seed: int = 0, rungs: tuple = RUNGS, min_gain: float = MIN_GAIN) -> None:
        self.ws = ws
        self.seed = seed
        self.rungs = rungs
        self.min_gain = min_gain
        self.points = list(ws.config.batch_sizes)  # the load's batch sizes: every score covers all of them
        self.contract = ws.contract  # the config class of system.toml and the registry of what can be set

    def run(self, ctx: AgentContext) -> AgentResult:

        kernels = applicable_kernels(self.ws, self.ws.head(ctx.branch), ctx.direction.family)
        if kernels:  # a workspace carrying the engine's source: known kernel patches for this gap first
            def speculate() -> AgentResult | None:
                """On a base that verifies one token at a time the kernel has no wide forward to speed up:
                the drafting search runs next on the rebuilt engine."""
                if self.contract.verify_width(self.ws.config_at(self.ws.head(ctx.branch))) > 1:
                    return None
                d = Direction("drafting", ctx.direction.gap_ms, "drafting: what the kernel makes cheap to verify",
                              [], ctx.direction.memory)
                return self.run(replace(ctx, direction=d))

            return kernel_search(self.ws, ctx, kernels, then=speculate)
        before = self.ws.head(ctx.branch)
        applied = self._apply_engine_patches(ctx)
        result = self._search(ctx)
        return self._settle_engine_patches(ctx, before, applied, result) if applied else result

    def _apply_engine_patches(self, ctx: AgentContext) -> list[EnginePatch]:
        """Commit the engine patches of the direction's family that the base lacks (a workspace carrying the
        engine's source): the search then runs on the engine rebuilt from them, where their flags exist."""
        g = self.ws.worktree_git(ctx.branch)
        applied = []
        for p in applicable_patches(self.ws, self.ws.head(ctx.branch), ctx.direction.family):
            why = apply_patch(g, p.patch)
            if why is not None:  # a patch that does not apply to this base: searched without it
                ctx.log("tuner.engine", f"{p.name}: does not apply to the base ({why})", {"patch": p.name})
                continue
            g.add("-A")
            g.commit("-q", "-m", f"engine: {p.name}: {p.summary}")
            ctx.log("tuner.engine", f"applied {p.name} for the search", {"patch": p.name, "flag": p.flag})
            applied.append(p)
        return applied

    def _settle_engine_patches(self, ctx: AgentContext, before: str, applied: list[EnginePatch],
                               result: AgentResult) -> AgentResult:
        """Keep the applied patches only when the committed winner uses one of their flags; otherwise the branch
        goes back to `before`, with the winner's config (if any) committed on it alone."""
        g = self.ws.worktree_git(ctx.branch)
        head = self.ws.head(ctx.branch)
        used: list[EnginePatch] = []
        if result.committed:
            cfg = self.contract.config.from_table(self.ws.config_at(head), known_only=True)
            flags = set(cfg.patched_flags()) if isinstance(cfg, LlamaCppConfig) else set()
            used = [p for p in applied if p.flag in flags]
        if used:
            names = "+".join(p.name for p in used)
            return replace(result, mechanism=f"{names}+{result.mechanism}",
                           summary=f"{'; '.join(p.summary for p in used)}; {result.summary}",
                           message=f"engine {names} with {result.message}",
                           details={**result.details, "engine_patches": [p.name for p in used]})
        g.reset("-q", "--hard", before)
        if result.committed:  # the config alone, on the base without the unused patches
            g.checkout(head, "--", self.ws.config.config_file)
            g.add(self.ws.config.config_file)
            g.commit("-q", "-m", g.log("-1", "--format=%B", head).strip())
        ctx.log("tuner.engine", f"{'+'.join(p.name for p in applied)}: not used by the winner; reverted", {})
        return result

    def _search(self, ctx: AgentContext) -> AgentResult:
        """The config search on the branch as it is (successive halving, then the finalist paired)."""
        wt = ctx.worktree
        head = self.ws.head(ctx.branch)
        try:  # from the git object, not the worktree file: every key, the system's own knobs included
            table = self.ws.config_at(head)
            base = self.contract.config.from_table(table, known_only=True)
        except (WorkspaceError, ConfigError) as e:
            return AgentResult(False, f"the tuner cannot read the branch's config: {e}")

        def refuse(cfg) -> str | None:  # what the engine built from this branch can run
            return self.ws.refusal(cfg, head)

        cands = candidates(base, ctx.direction.family, ctx.direction.memory, self.seed, refuse, self.contract,
                           self.points)
        schedule_first = (ctx.direction.family == "batching" and any(b > 1 for b in self.points) and base.method == "sd"
                          and "load_schedule" in self.contract.config.__dataclass_fields__)
        if not cands and not schedule_first:
            return AgentResult(False, f"no registered mechanism for {ctx.direction.family} applies on "
                                      f"{base.device} beyond the current config")
        stock = stock_reference(self.ws, progress=False)  # tokenizes every prompt and reads the cache: once
        ref = {p["id"]: p for p in stock["prompts"] if p["split"] == "visible"}
        threshold = near_tie_threshold(stock["noise_floor"])
        prompts = [p for p in load_prompts(self.ws) if p.id in ref]
        limit = self.ws.config.forcing_max_new_tokens
        ctx.log("tuner.start", f"{len(cands)} candidate configs for {ctx.direction.family}",
                {"candidates": [c.changes for c in cands]})
        alive = list(cands)
        history: list[dict] = []
        base_c = Candidate({}, "current", base)
        with run_system(self.ws, wt, f"tuner-{ctx.branch}") as sp:
            ratio = 0.0
            if schedule_first:  # a schedule measured on this deployment's load, before the registry's fixed ones
                sched = self._measured_schedule(sp, base, prompts, min(self.rungs[0][1], limit), ref, threshold,
                                                history, ctx)
                if sched is not None:
                    alive.insert(0, sched)
            transferred = self._from_memory(sp, base, [c for c in cands if c.source.startswith("memory:")],
                                            prompts, limit, ref, threshold, history)
            if transferred is not None:  # accepted elsewhere and a win here too: no search needed
                alive, ratio = [transferred[0]], transferred[1]
            for rung, (np_, n) in enumerate(self.rungs if transferred is None else ()):
                if ctx.stop.is_set():
                    return AgentResult(False, "stopped by the engineer before a winner was found")
                n = min(n, limit)
                use = prompts[: np_ or len(prompts)]
                scores: dict[str, float] = {}
                per_point: dict[str, dict[int, float]] = {}
                with measurement_lock():
                    if sp.served:  # a fresh process each rung: nothing from an earlier rung's prompts remembered
                        sp.restart()
                    # Untimed, the base over the rung's prompts first: a fresh process pays once per shape (oneDNN
                    # builds a kernel per row count and prompt length), and whichever config ran first paid it
                    # (the loop's rungs scored 12 of 13 batching candidates above an unchanged base).
                    self._score_load(sp, base, use, n, ref, threshold)
                    group = [base_c, *alive]
                    for i, c in enumerate(group):
                        step(f"tuning r{rung + 1}/{len(self.rungs)}", i, len(group),
                             f"{len(use)} prompts x {n} tokens")
                        if ctx.stop.is_set():
                            return AgentResult(False, "stopped by the engineer before a winner was found")
                        tps, bad = self._score_load(sp, c.cfg, use, n, ref, threshold)
                        if bad:
                            ctx.log("tuner.drop", f"{c.changes} changes the output ({bad})", {"changes": c.changes})
                            scores[c.key] = -1.0
                        else:
                            per_point[c.key] = tps
                if base_c.key not in per_point:
                    return AgentResult(False, "the branch's current config gives output that is not stock's on the "
                                              "visible prompts; the tuner does not tune on top of it")
                for c in group:  # one point: tokens/s; several: the geometric mean of the speedups over the config
                    if c.key in per_point:
                        scores[c.key] = (per_point[c.key][self.points[0]] if len(self.points) == 1 else
                                         _geomean([per_point[c.key][b] / max(per_point[base_c.key][b], 1e-9)
                                                   for b in self.points]))
                base_tps = per_point[base_c.key][self.points[0]] if len(self.points) == 1 else {
                    str(b): v for b, v in per_point[base_c.key].items()}
                alive = sorted((c for c in alive if scores[c.key] > 0), key=lambda c: -scores[c.key])
                history.append({"rung": rung, "prompts": len(use), "tokens": n, "base_tps": base_tps,
                                "scores": [(c.changes, scores[c.key]) for c in alive]})
                if not alive:
                    break
                if rung < len(self.rungs) - 1:
                    top = max(1, math.ceil(len(alive) * KEEP))
                    winners = [c for c in alive if scores[c.key] > scores[base_c.key]]
                    alive = alive[:top] + [c for c in alive[top:] if c.defaults]
                    for both in compositions(winners, base, refuse, self.contract):
                        if both.key not in {c.key for c in alive}:
                            ctx.log("tuner.compose", f"composed {both.source}", {"changes": both.changes})
                            alive.insert(0, both)  # scored from the next rung on, beside the mechanisms it joins
            # The finalist against the current config, interleaved (A B, B A) on every visible prompt,
            # single sequential runs on a shared machine are too noisy to decide on.
            if transferred is None and alive and not ctx.stop.is_set():
                step("tuning final", detail=str(alive[0].changes))
                with measurement_lock():
                    ratio, at = self._paired_load(sp, base, alive[0].cfg, prompts, min(self.rungs[-1][1], limit))
                # Per point it is recorded, not judged: three short sweeps of one batch are too noisy
                # to hold a point to LOAD_FLOOR; the cascade's paired benchmark (CI, confirmation) does.
                history.append({"final": alive[0].changes, "paired_ratio": ratio,
                                **({"points": at, "below_floor": [b for b, r in at.items() if r < LOAD_FLOOR]}
                                   if len(at) > 1 else {})})
        ctx.log("tuner.done", f"{ctx.direction.family}: tuned", {"history": history})
        if not alive or ratio < self.min_gain:
            return AgentResult(False, f"no config beat the current one by {self.min_gain - 1:.0%} "
                                      f"(best {alive[0].changes if alive else '-'}: {ratio:.3f}x paired)",
                               details={"history": history})
        win = alive[0]
        # Key by key: the tuner's keys change, keys it does not know stay as the branch had them.
        (wt / self.ws.config.config_file).write_text(dump_table({**table, **win.cfg.as_dict()}, self.contract.config))
        name = mechanism_name(win.changes, self.contract)
        g = self.ws.worktree_git(ctx.branch)
        g.add(self.ws.config.config_file)
        g.commit("-q", "-m", f"tuner ({ctx.direction.family}): {name}\n\n{ratio:.3f}x the current config on the "
                          f"visible prompts (harness-timed, interleaved); source {win.source}")
        return AgentResult(True, f"{name}: {ratio:.2f}x on the visible prompts (paired)", mechanism=name,
                           summary=f"{ctx.direction.family}: set {win.changes} in system.toml (from {win.source})",
                           details={"config": win.changes, "history": history, "source": win.source})

    def _from_memory(self, sp, base: DecodeConfig, mem: list[Candidate], prompts, limit: int, ref: dict,
                     threshold: float, history: list) -> tuple[Candidate, float] | None:
        """Memory's configs first (the composition of all, then each): every one that keeps stock's tokens
        gets a paired run against the current config, and the best wins outright if it beats the current
        config by min_gain. All of them, not the first winner: what other deployments accepted for
        different gaps can differ a lot here, and the point of transfer is to start from the best."""
        n = min(self.rungs[-1][1], limit)
        best: tuple[Candidate, float] | None = None
        with measurement_lock():
            for c in mem[:MAX_MEMORY]:
                _, bad = self._score(sp, c.cfg, prompts[:2], n, ref, threshold)
                if bad:
                    history.append({"memory": c.changes, "dropped": bad})
                    continue
                r = self._paired(sp, base, c.cfg, prompts, n, passes=1)
                history.append({"memory": c.changes, "paired_ratio": r})
                if r >= self.min_gain and (best is None or r > best[1]):
                    best = (c, r)
        return best

    def _score_load(self, sp, cfg: DecodeConfig, prompts, n: int, ref: dict, threshold: float
                    ) -> tuple[dict[int, float], str]:
        """Tokens/s at every batch size of the load (a batch: the prompts cycled to that size, sent at once),
        every output checked against stock; ({}, why) at the first output that is not stock's."""
        out = {}
        for bs in self.points:
            if bs == 1:
                tps, bad = self._score(sp, cfg, prompts, n, ref, threshold)
            else:
                batch = [prompts[j % len(prompts)] for j in range(bs)]
                sp.generate_batch([warm_prompt(prompts).ids] * bs, 2, config=cfg.as_dict())  # untimed, as _score
                r = sp.generate_batch([p.ids for p in batch], n, config=cfg.as_dict())
                bad = next((why for p, toks in zip(batch, r.outputs, strict=True)
                            if (why := _off_stock(ref[p.id], toks, n, threshold))), "")
                tps = sum(len(o) for o in r.outputs) / r.seconds if r.seconds else 0.0
            if bad:
                return {}, bad if bs == 1 else f"{bad} at B = {bs}"
            out[bs] = tps
        return out, ""

    def _paired_load(self, sp, a: DecodeConfig, b: DecodeConfig, prompts, n: int, passes: int = 3
                     ) -> tuple[float, dict[int, float]]:
        """time(a) / time(b) at every batch size of the load (A B, then B A, a fresh process each pass; batches of
        the prompts cycled), and their geometric mean."""
        at = {}
        for bs in self.points:
            if bs == 1:
                at[bs] = self._paired(sp, a, b, prompts, n, passes)
                continue
            batch = [prompts[j % len(prompts)].ids for j in range(bs)]
            ta = tb = 0.0
            for i in range(passes):  # as _paired: a fresh process per pass, each batch once per config
                if sp.served:
                    sp.restart()
                for conf in (a, b):
                    sp.generate_batch([warm_prompt(prompts).ids] * bs, 2, config=conf.as_dict())
                for conf in ((a, b) if i % 2 == 0 else (b, a)):
                    r = sp.generate_batch(batch, n, config=conf.as_dict())
                    ta, tb = (ta + r.seconds, tb) if conf is a else (ta, tb + r.seconds)
            at[bs] = ta / tb if tb else 0.0
        return _geomean(list(at.values())), at

    def _measured_schedule(self, sp, base: DecodeConfig, prompts, n: int, ref: dict, threshold: float,
                           history: list, ctx: AgentContext) -> Candidate | None:
        """The load schedule this deployment's measurements pick: at every batch size of the load, the draft
        length (0 = AR steps) with the most tokens/s for the base config on the visible prompts (a speculative
        one only 3% ahead of AR, `choose_draft_len`), each keyed by the live requests that batch reaches
        (`entry_starts`: the engine looks the schedule up by live requests, and a request whose stock output
        ends at its first token is never live in a decode step)."""
        best: dict[int, int] = {}
        seen: dict[int, dict[int, float]] = {}
        reach: dict[int, int] = {}
        # The base's own length is a choice too: a corpus drafter's k = 8 beat every length up to 4 at one request,
        # and a schedule chosen from 0-4 alone cut it there (s23's loop scored those schedules 0.99-1.06x).
        lens = sorted({*SCHEDULE_LENS, base.draft_len}) if base.method == "sd" else list(SCHEDULE_LENS)
        with measurement_lock():
            for bs in self.points:
                # A batch of bs distinct visible prompts (cycled when fewer), as the timed load sends: two prompts
                # cycled to 8 had no request ending at its first token, and SD looked ahead of AR where the
                # load's batches (3 of 8 such requests) run faster on AR steps. One request: two prompts.
                use = prompts[:2] if bs == 1 else prompts[:bs]
                for i, k in enumerate(lens):
                    step("tuning schedule", i, len(lens), f"B = {bs}, draft {k}")
                    cfg = DecodeConfig(**{**base.as_dict(), "load_schedule": f"1:{k}"})
                    self.points, keep = [bs], self.points
                    try:
                        tps, bad = self._score_load(sp, cfg, use, n, ref, threshold)
                    finally:
                        self.points = keep
                    if not bad:
                        seen.setdefault(bs, {})[k] = tps[bs]
                if seen.get(bs):
                    best[bs] = choose_draft_len(seen[bs])
                    batch = [use[j % len(use)] for j in range(bs)] if bs > 1 else prompts[:1]
                    reach[bs] = max(1, sum(len(ref[p.id]["stock"][:n]) > 1 for p in batch))
        history.append({"schedule": {str(b): {str(k): round(v, 2) for k, v in d.items()} for b, d in seen.items()}})
        if len(best) != len(self.points):
            return None
        text = schedule_text({first: best[b] for b, first in entry_starts(reach).items()})
        ctx.log("tuner.schedule", f"measured schedule {text}", {"tokens_per_s": history[-1]["schedule"]})
        try:
            cfg = DecodeConfig(**{**base.as_dict(), "load_schedule": text})
        except ConfigError:
            return None
        return Candidate({"load_schedule": text}, "measured-schedule", cfg)

    @staticmethod
    def _paired(sp, a: DecodeConfig, b: DecodeConfig, prompts, n: int, passes: int = 3) -> float:
        """time(a) / time(b) over `passes` sweeps of the prompts, A B and B A alternating prompt by prompt and
        pass by pass. Every pass runs in a fresh process, both configs warmed on an untimed prompt, and sees
        each prompt once per config: a config that remembers answers across requests (llama.cpp's ngram-mod)
        is not credited for a prompt it already answered."""
        ta = tb = 0.0
        ca, cb = a.as_dict(), b.as_dict()
        warm = warm_prompt(prompts).ids
        for i in range(passes):
            if sp.served:
                sp.restart()
            for conf in (ca, cb):
                sp.generate(warm, 2, config=conf)
            for j, p in enumerate(prompts):
                for conf in ((ca, cb) if (i + j) % 2 == 0 else (cb, ca)):
                    r = sp.generate(p.ids, n, config=conf)
                    if conf is ca:
                        ta += r.seconds
                    else:
                        tb += r.seconds
        return ta / tb if tb else 0.0

    @staticmethod
    def _score(sp, cfg: DecodeConfig, prompts, n: int, ref: dict, threshold: float) -> tuple[float, str]:
        """Tokens/s of `cfg` over `prompts`, after an untimed request of it on a prompt never timed (a config's
        first request may start its server or build its drafter: not what a deployment pays per request)."""
        tokens, seconds = 0, 0.0
        conf = cfg.as_dict()
        sp.generate(warm_prompt(prompts).ids, 2, config=conf)
        for p in prompts:
            r = sp.generate(p.ids, n, config=conf)
            bad = _off_stock(ref[p.id], r.tokens, n, threshold)
            if bad:
                return 0.0, bad
            tokens += len(r.tokens)
            seconds += r.seconds
        return (tokens / seconds if seconds else 0.0), ""
