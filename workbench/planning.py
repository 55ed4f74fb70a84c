"""Planning a round: which gap families get an agent, with what the registry and the memory offer them.

Pure functions of the measured gaps, the families already explored, the base's config and what the
memory returns: the loop (`workbench/loop.py`) and the TUI's launch call them; nothing here runs a system.
"""

from __future__ import annotations

from collections.abc import Callable

from decoder.config import DecodeConfig
from decoder.mechanisms import Contract
from workbench.agents.base import Direction
from workbench.agents.tuner import TORCH, candidates


def registry_mechanisms(family: str, device: str, contract: Contract = TORCH) -> list[dict]:
    """The registered mechanisms of a gap family that run on `device` (cpu, cuda), as an agent sees them."""
    return [{"name": m.name, "keys": {k: list(v) for k, v in m.keys.items()}, "applies": m.applies,
             "summary": m.summary} for m in contract.registry.values() if m.family == family and device in m.devices]


def plan_directions(breakdown: dict, exhausted: set[str], *, agents: int, agent: str, device: str,
                    base_cfg: DecodeConfig | None, memory_for: Callable[[str], list[dict]],
                    transfer_tried: bool, refuse: Callable[[DecodeConfig], str | None] | None = None,
                    contract: Contract = TORCH,
                    kernels_for: Callable[[str], list] | None = None,
                    fruitless: set[str] | None = None) -> tuple[list[Direction], bool]:
    """Up to `agents` directions from the gap breakdown, largest gap first (families where other deployments
    accepted mechanisms first among equals), skipping families explored without a gain (`exhausted`), with
    nothing to gain, or, for the tuner, with nothing left to turn on `base_cfg`. The first time memory has
    something (`transfer_tried` false), the first agent also composes every mechanism accepted elsewhere.
    A family with a known kernel patch the base does not carry (`kernels_for`, a workspace carrying the engine's
    source) has something for the tuner even with nothing left to turn in the config.
    Families whose last direction kept nothing (`fruitless`: explored on an earlier base, so not `exhausted`)
    rank after those not tried yet, largest gap first within each: with gaps of near-equal size, a family that
    just came up empty (acceptance, with MTP trees that lose on a lookup drafter) does not take the slot of one
    never tried (batching, whose knobs are tuned on the drafter the base has now).
    Returns (directions, whether that transfer was tried now)."""
    fams = sorted(breakdown["families"].items(), key=lambda kv: -kv[1])
    out = []
    offered: set[str] = set()  # a kernel addresses several families: one direction per round tries it
    for fam, ms in fams:
        if fam in exhausted or ms <= 0:
            continue  # explored without a gain on this base, or nothing to gain (e.g. batching at B = 1)
        mechs = registry_mechanisms(fam, device, contract)
        memory = memory_for(fam)
        kernels = [k for k in (kernels_for(fam) if kernels_for is not None and agent == "tuner" else [])
                   if k.name not in offered and not set(k.families) & exhausted]  # tried on this base already
        if agent == "tuner" and not mechs and not memory and not kernels:
            continue  # the tuner has nothing to turn for this family
        if (base_cfg is not None and not kernels
                and not candidates(base_cfg, fam, memory, refuse=refuse, contract=contract)):
            continue  # every mechanism of the family is already on in the base: no agent slot for it
        if kernels:
            offered |= {k.name for k in kernels}
            mechs = mechs + [{"name": k.name, "kernel": k.patch.name, "summary": k.summary} for k in kernels]
        gap_names = [g["name"] for g in breakdown["gaps"] if g["family"] == fam]
        out.append(Direction(fam, ms, f"{fam}: {ms:.3f} ms/token ({', '.join(gap_names)})", mechs, memory))
    fruitless = fruitless or set()
    out.sort(key=lambda d: (not d.memory, d.family in fruitless, -d.gap_ms))
    if agent == "tuner" and base_cfg is not None and len(out) < agents:
        out += _unpriced(breakdown, fams, exhausted, {d.family for d in out}, device=device, base_cfg=base_cfg,
                         memory_for=memory_for, refuse=refuse, contract=contract)
    out = out[:agents]
    if not (out and out[0].memory and not transfer_tried):
        return out, False
    # First contact with what other deployments learned: the first agent also tries every accepted
    # mechanism of the gap families together (the tuner composes them), not one family per round.
    extra = [m for d in out[1:] for m in d.memory]
    extra += [m for fam, ms in fams if ms > 0 and fam not in {d.family for d in out} for m in memory_for(fam)]
    if extra:
        first = out[0]
        out[0] = Direction(first.family, first.gap_ms, first.summary + "; transfer: composes the mechanisms "
                           "accepted elsewhere", first.mechanisms, first.memory + extra)
    return out, True


def _unpriced(breakdown: dict, fams: list, exhausted: set[str], taken: set[str], *, device: str,
              base_cfg: DecodeConfig, memory_for: Callable[[str], list[dict]],
              refuse: Callable[[DecodeConfig], str | None] | None, contract: Contract) -> list[Direction]:
    """Directions for agent slots the measured gaps leave free: families the cost model measured at no gain
    (a residual at or below zero, e.g. host overhead on an engine whose step is its forward) whose registry
    still has knobs to turn on the base. Their gap does not price what those knobs do (llama.cpp's threads
    change the forward's own cost), so an idle agent tries them, after every family with a positive gap.
    A family with no measured part at all (batching at B = 1) has nothing to try."""
    out = []
    for fam, ms in fams:
        if ms > 0 or fam in exhausted or fam in taken:
            continue
        parts = [g["name"] for g in breakdown["gaps"] if g["family"] == fam]
        if not parts or not candidates(base_cfg, fam, memory_for(fam), refuse=refuse, contract=contract):
            continue
        out.append(Direction(fam, ms, f"{fam}: {ms:.3f} ms/token ({', '.join(parts)}; no measured gain, but knobs "
                                      "the cost model does not price are left to try)",
                             registry_mechanisms(fam, device, contract), memory_for(fam)))
    return out
