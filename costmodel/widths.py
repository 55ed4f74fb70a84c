"""The cost model of an engine measured by width: what one forward over w tokens costs, for w = 1..16.

For an engine whose kernels we do not model op by op (llama.cpp), the roofline's question (what would a
step cost if the drafts were free and always right) is answered from measurements instead: the forward
cost at each verify width (`llama-bench -p W -n 0 -d CONTEXT`, decoder/engines/llamacpp.py:bench_widths).

- The oracle at width w: every step yields w tokens at the cost of one w-wide forward, so the speedup
  over AR is w * c(1) / c(w), the best of it over widths 2..w. The plausibility ceiling multiplies it by
  c(1) / roofline(1) (the weights' bytes over the machine's memory bandwidth): engine changes that are not
  speculation (threads, kernels) may make one forward that much cheaper, and no more.
- The gaps of a measured run (`width_gaps`): its time per generated token split into parts that add up
  to it exactly: prefill (family compute), one-token forwards (weights: the floor every step pays), the
  extra cost of the verify width (compute: what cheaper small-batch kernels would save), the engine's
  decode-loop time beyond its forwards (host-overhead: sampling, drafting, graph building), time outside
  the engine's own phases (host-overhead: server, HTTP, the adapter), and beside them, not inside, the
  drafting gap: what the best width's oracle would save against the measured decode loop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from costmodel.entry import read_entry
from costmodel.gaps import Gap, GapBreakdown


@dataclass(frozen=True)
class WidthProfile:
    """Forward cost (ms) of one engine configuration at measured widths, and how it was measured."""

    name: str  # e.g. "llama.cpp smollm2 Q4_1, 1 thread"
    ms: dict[int, float]  # width -> ms per forward (at the context depth in `measured`)
    source: str = "llama-bench"
    measured: dict = field(default_factory=dict)  # measured_at, load_avg, depth, threads, stddev_ms
    roofline_ms: float | None = None  # one forward's weight bytes over the machine's memory bandwidth

    def __post_init__(self) -> None:
        if 1 not in self.ms or any(w < 1 or v <= 0 for w, v in self.ms.items()):
            raise ValueError(f"width profile {self.name}: needs a positive cost at width 1 and at every width "
                             f"measured; got {self.ms}")

    def cost(self, width: float) -> float:
        """ms of one forward over `width` tokens: linear between measured widths, and beyond the widest at its
        last measured slope (never below the widest's cost)."""
        ws = sorted(self.ms)
        if width <= 1:
            return self.ms[1]
        for lo, hi in zip(ws, ws[1:], strict=False):
            if width <= hi:
                return self.ms[lo] + (self.ms[hi] - self.ms[lo]) * (width - lo) / (hi - lo)
        if len(ws) < 2:
            return self.ms[1] * width
        lo, hi = ws[-2], ws[-1]
        return self.ms[hi] + max(0.0, (self.ms[hi] - self.ms[lo]) / (hi - lo)) * (width - hi)

    def oracle(self, max_width: int) -> tuple[float, int]:
        """(the best speedup over AR with every draft accepted, its width) over widths 1..max_width."""
        best = (1.0, 1)
        for w in range(2, max(1, max_width) + 1):
            r = w * self.ms[1] / self.cost(w)
            if r > best[0]:
                best = (r, w)
        return best

    def ceiling(self, max_width: int) -> float:
        """The plausibility ceiling over AR: the oracle at widths up to `max_width` on the measured costs, times
        how far one forward may still fall to its roofline (threads, kernels: engine changes that are not
        speculation); the measured oracle alone when no roofline is known."""
        headroom = max(1.0, self.ms[1] / self.roofline_ms) if self.roofline_ms else 1.0
        return self.oracle(max_width)[0] * headroom

    def physical_ceiling(self, max_width: int) -> float:
        """The ceiling when the engine itself changes (its kernels may make wide forwards cheap, #24): a forward
        over up to `max_width` tokens still reads every weight once, so no step beats `max_width` tokens per
        roofline-cost forward: max_width * c(1) / roofline (never below `ceiling`)."""
        if not self.roofline_ms:
            return self.ceiling(max_width)
        return max(self.ceiling(max_width), max(1, max_width) * self.ms[1] / self.roofline_ms)

    def as_dict(self) -> dict:
        return {"name": self.name, "ms": {str(w): round(v, 4) for w, v in sorted(self.ms.items())},
                "source": self.source, "measured": self.measured, "roofline_ms": self.roofline_ms}

    @classmethod
    def from_dict(cls, d: Mapping) -> WidthProfile:
        return cls(str(d["name"]), {int(w): float(v) for w, v in dict(d["ms"]).items()}, str(d.get("source", "")),
                   dict(d.get("measured") or {}), float(d["roofline_ms"]) if d.get("roofline_ms") else None)


def measured_profile(name: str, ms: dict[int, float], roofline_ms: float | None = None,
                     **measured: object) -> WidthProfile:
    """A profile measured now (the time and the load average recorded beside the figures)."""
    return WidthProfile(name, ms, "llama-bench", {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                                  "load_avg": round(os.getloadavg()[0], 2), **measured}, roofline_ms)


def width_gaps(entry: Mapping, profile: WidthProfile, num_prompts: int) -> GapBreakdown:
    """Split a method entry's measured ms per generated token (B = 1) into the parts above, from the engine's
    own phases (prefill and decode-loop ms per token), its forward and draft counts, and the width profile."""
    e = read_entry(entry)
    ph = dict(e.phase_ms_per_token)
    measured = e.ms_per_token
    tokens = max(e.new_tokens or 0, 1)
    steps = max((e.target_forwards or 0) - num_prompts, 0) / tokens  # decode forwards per generated token
    width = 1.0  # the mean verify width: 1 + drafted per step = 1 + (accepted per step, tau - 1) / acceptance rate
    if e.acceptance_rate:
        width = 1.0 + max(e.tau - 1.0, 0.0) / e.acceptance_rate
    elif e.draft_len:
        width = 1.0 + e.draft_len
    c1, cw = profile.cost(1), profile.cost(width)
    decode = ph.get("verify", 0.0)
    prefill = ph.get("prefill", 0.0)
    notes = [f"forward costs from {profile.source} ({profile.name}); mean verify width {width:.2f} from the "
             f"engine's drafted and accepted counts (priced at the mean width: a lower bound when widths vary)"]
    loop_rest = decode - steps * cw
    if loop_rest < 0:
        notes.append(f"the decode loop ({decode:.3f} ms/token) is faster than its forwards priced at the profile "
                     f"({steps * cw:.3f}): the profile was measured on a busier machine; the part is shown as 0")
    outside = measured - prefill - decode
    components = (
        Gap("prefill", "compute", prefill),
        Gap("one-token forwards (weight reads)", "weights", steps * c1),
        Gap("verify width beyond one token", "compute", steps * (cw - c1)),
        Gap("engine decode loop beyond forwards", "host-overhead", max(loop_rest, 0.0)),
        Gap("server, HTTP and adapter", "host-overhead", outside + min(loop_rest, 0.0)),
    )
    best, best_w = profile.oracle(16)
    oracle_ms = c1 / best  # ms per token with every draft at the best width accepted
    drafting = max(0.0, decode - oracle_ms) if decode else 0.0
    notes.append(f"oracle: width {best_w} with every draft accepted, {best:.2f}x over one-token forwards")
    return GapBreakdown(e.name, measured, components, Gap("drafting gap (oracle at the best width)", "drafting",
                                                          drafting, True), e.tau, float(best_w), notes=tuple(notes))
