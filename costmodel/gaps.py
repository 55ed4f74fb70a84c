"""Gap breakdown: where each generated token's time goes, ranked, each part tagged with its family.

From a bench run (`measured_gaps`): the measured ms per generated token is split into parts that
add up to it exactly:

    prefill                   phase "prefill"                                  family compute
    drafting                  phase "draft"                                    family drafting
    weight reads, KV reads,   the roofline of the verify forwards actually     weights, kv, kv,
    recurrent state, compute  run (compute counts only beyond memory time)     compute
    host/launch overhead      phase "verify" minus that roofline (residual)    host-overhead
    bookkeeping               phase "accept" (acceptance, cache rollback)      host-overhead
    other host time           phase "other" plus wall time outside phases      host-overhead

The acceptance gap is reported beside them, not inside: the ms per token an oracle drafter (every
drafted token accepted, tau = k + 1) would save at the same per-step cost.

For a projection (`modelled_gaps`) the same parts come from the step model instead of a bench.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from costmodel.entry import GapError, MethodEntry, read_entry
from costmodel.hardware import HardwareProfile
from costmodel.model_profile import ModelProfile
from costmodel.step import Drafter, forward_time, sd_step
from decoder.contract import GAP_FAMILIES

FAMILIES = GAP_FAMILIES
__all__ = ["FAMILIES", "GapError", "Gap", "GapBreakdown", "MethodEntry", "measured_gaps", "modelled_gaps",
           "check_accounting"]


@dataclass(frozen=True)
class Gap:
    name: str
    family: str
    ms_per_token: float
    could_save: bool = False  # True for the acceptance gap: not part of the measured total

    def as_dict(self) -> dict:
        return {"name": self.name, "family": self.family, "ms_per_token": round(self.ms_per_token, 6),
                "could_save": self.could_save}


@dataclass(frozen=True)
class GapBreakdown:
    """Parts of one method's time per generated token; `components` sum to `measured_ms_per_token`."""

    method: str
    measured_ms_per_token: float
    components: tuple[Gap, ...]
    acceptance_gap: Gap
    tau: float
    oracle_tau: float
    modelled: bool = False  # True when the "measured" total is itself the step model's projection
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def components_sum(self) -> float:
        return sum(g.ms_per_token for g in self.components)

    def ranked(self) -> list[Gap]:
        """Components and the acceptance gap, largest first."""
        return sorted([*self.components, self.acceptance_gap], key=lambda g: -g.ms_per_token)

    def by_family(self) -> dict[str, float]:
        totals = dict.fromkeys(FAMILIES, 0.0)
        for g in (*self.components, self.acceptance_gap):
            totals[g.family] += g.ms_per_token
        return totals

    def as_dict(self) -> dict:
        return {
            "method": self.method, "modelled": self.modelled,
            "measured_ms_per_token": round(self.measured_ms_per_token, 6),
            "components_sum_ms_per_token": round(self.components_sum, 6),
            "tau": round(self.tau, 4), "oracle_tau": self.oracle_tau,
            "gaps": [g.as_dict() for g in self.ranked()],
            "families": {k: round(v, 6) for k, v in self.by_family().items()},
            "notes": list(self.notes),
        }


def _verify_parts(step_parts, steps_per_token: float, measured_verify: float | None) -> tuple[list[Gap], list[str]]:
    """Roofline parts of the verify forwards per token, and the host/launch residual."""
    compute_beyond_memory = step_parts.compute_beyond_memory_ms
    parts = [
        Gap("weight reads", "weights", step_parts.weights_ms * steps_per_token),
        Gap("KV reads", "kv", step_parts.kv_ms * steps_per_token),
        Gap("recurrent state", "kv", step_parts.state_ms * steps_per_token),
        Gap("compute", "compute", compute_beyond_memory * steps_per_token),
    ]
    notes: list[str] = []
    modelled = sum(g.ms_per_token for g in parts)
    if measured_verify is None:
        return parts, notes
    if modelled > measured_verify:
        # The machine beat its own roofline: the profile underrates it. Scale the parts to the
        # measurement so the accounting stays exact, and say so.
        scale = max(measured_verify, 0.0) / modelled
        notes.append(f"verify measured {measured_verify:.4f} ms/token but the roofline predicts {modelled:.4f}: "
                     f"the hardware profile underrates this machine (re-run `specpilot profile hardware`)")
        parts = [Gap(g.name, g.family, g.ms_per_token * scale) for g in parts]
        residual = 0.0
    else:
        residual = measured_verify - modelled
    parts.append(Gap("host/launch overhead", "host-overhead", residual))
    return parts, notes


def measured_gaps(entry: MethodEntry | Mapping, hw: HardwareProfile, target: ModelProfile, context: int,
                  fmt: str = "bf16", num_prompts: int | None = None) -> GapBreakdown:
    """Split a bench method entry's measured ms per generated token (B = 1) into ranked parts.

    `entry` is one item of `specpilot bench --json`'s "methods" (fields phase_ms_per_token, tau,
    tokens_per_s, draft_len; target_forwards and new_tokens when present); `num_prompts` (the
    report's) lets the prefill forwards be told from the verify forwards exactly.
    """
    e = read_entry(entry)
    name, ph, tau, k = e.name, dict(e.phase_ms_per_token), e.tau, e.draft_len or 0
    phase_sum = sum(ph.values())
    measured = e.ms_per_token
    notes: list[str] = []

    # Verify forwards per generated token: exact from the counts, else 1 / tau (prefill ignored).
    forwards, new_tokens = e.target_forwards, e.new_tokens
    if forwards and new_tokens and num_prompts:
        steps_per_token = (forwards - num_prompts) / new_tokens
    else:
        steps_per_token = 1.0 / tau
    q = k + 1 if k else 1
    step_parts = forward_time(hw, target, q, 1, context, fmt, overheads=False)
    verify_parts, verify_notes = _verify_parts(step_parts, steps_per_token, ph["verify"])
    notes += verify_notes

    outside_phases = measured - phase_sum  # harness time around the generate call
    if outside_phases < -1e-3:
        notes.append(f"phases add up to {phase_sum:.4f} ms/token, more than the wall time {measured:.4f}")
    components = (
        Gap("prefill", "compute", ph["prefill"]),
        Gap("drafting", "drafting", ph["draft"]),
        *verify_parts,
        Gap("bookkeeping", "host-overhead", ph["accept"]),
        Gap("other host time", "host-overhead", ph["other"] + outside_phases),
    )
    # Acceptance gap: the same per-step cost spread over k + 1 tokens instead of the measured ones.
    oracle_tau = float(k + 1) if k else 1.0
    per_token_sd = ph["draft"] + ph["verify"] + ph["accept"]
    if k and steps_per_token > 0:
        per_step = per_token_sd / steps_per_token
        acceptance = max(0.0, per_token_sd - per_step / oracle_tau)
    else:
        acceptance = 0.0
    return GapBreakdown(name, measured, tuple(components), Gap("acceptance gap", "acceptance", acceptance, True),
                        tau, oracle_tau, notes=tuple(notes))


def modelled_gaps(hw: HardwareProfile, target: ModelProfile, drafter: Drafter, k: int, tau: float, batch: int = 1,
                  context: int = 0, fmt: str = "bf16") -> GapBreakdown:
    """The same breakdown for a projected SD step: machine time per generated token (all B requests)."""
    step = sd_step(hw, target, drafter, k, tau, batch, context, fmt)
    tokens = tau * batch  # generated per step
    v = step.verify
    compute_beyond_memory = v.compute_beyond_memory_ms
    components = (
        Gap("weight reads", "weights", v.weights_ms / tokens),
        Gap("KV reads", "kv", v.kv_ms / tokens),
        Gap("recurrent state", "kv", v.state_ms / tokens),
        Gap("compute", "compute", compute_beyond_memory / tokens),
        Gap("drafting", "drafting", step.draft_ms / tokens),  # the whole draft call, as the bench's phase
        Gap("host/launch overhead", "host-overhead", v.overhead_ms / tokens),
    )
    acceptance = step.step_ms / tokens - step.step_ms / ((k + 1) * batch)
    notes = () if batch == 1 else (f"per token over all {batch} requests: weight reads are shared by the batch",)
    return GapBreakdown("projection", step.ms_per_token, components,
                        Gap("acceptance gap", "acceptance", max(0.0, acceptance), True), tau, float(k + 1),
                        modelled=True, notes=notes)


def check_accounting(breakdown: GapBreakdown, tolerance_ms: float = 1e-6) -> None:
    """Raise if the components do not add up to the measured total (the contract of this module)."""
    diff = breakdown.components_sum - breakdown.measured_ms_per_token
    if abs(diff) > tolerance_ms:
        raise AssertionError(f"gap components sum to {breakdown.components_sum:.6f} ms/token, measured "
                             f"{breakdown.measured_ms_per_token:.6f} (off by {diff:.6f})")
