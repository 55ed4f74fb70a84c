"""Ceiling speedups and the plausibility check the harness runs on every measured speedup.

ceiling speedup = AR time per token / ideal SD time per token, where

- AR time per token is the stock baseline as it runs (roofline plus the machine's fitted fixed
  overheads, or the bench's measured AR time when there is one), and
- ideal SD time per token is (draft + verify) on the pure roofline, no overheads and no
  bookkeeping, divided by tau: the measured tau, or k + 1 for an oracle drafter whose every
  drafted token is accepted.

No lossless change to the SD side can beat the oracle ceiling against the same stock AR, so a
measured speedup above it (with 10% allowance for timing noise) is a reward-hacking flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from costmodel.hardware import HardwareProfile
from costmodel.model_profile import ModelProfile
from costmodel.step import Drafter, ar_step, check_tau, sd_step

PLAUSIBLE_MARGIN = 1.1  # measured speedups up to 1.1x the ceiling pass: timing noise, not a flag


@dataclass(frozen=True)
class Ceiling:
    """One ceiling: for `batch` requests, drafting k with `tau` tokens per step."""

    batch: int
    k: int
    tau: float
    oracle: bool
    ar_ms_per_token: float  # per request: the AR step time (all requests advance one token)
    ideal_sd_ms_per_token: float  # per request

    @property
    def speedup(self) -> float:
        return self.ar_ms_per_token / self.ideal_sd_ms_per_token

    def as_dict(self) -> dict:
        return {"batch": self.batch, "k": self.k, "tau": round(self.tau, 4), "oracle": self.oracle,
                "ar_ms_per_token": round(self.ar_ms_per_token, 6),
                "ideal_sd_ms_per_token": round(self.ideal_sd_ms_per_token, 6), "speedup": round(self.speedup, 4)}


def ceiling(hw: HardwareProfile, target: ModelProfile, drafter: Drafter, k: int, tau: float | None = None,
            batch: int = 1, context: int = 0, fmt: str = "bf16", drafter_fmt: str | None = None,
            ar_ms_per_token: float | None = None, sd_overheads: bool = False) -> Ceiling:
    """The ceiling speedup with `tau` (None: oracle, tau = k + 1) for `batch` requests at `context`.

    `ar_ms_per_token` replaces the modelled AR time with a measured one (B = 1 bench runs).
    `sd_overheads` charges the SD side the machine's per-forward overheads too: a tighter, not a
    hard, ceiling (for mechanisms that leave the host path alone); `plausible` uses the hard one.
    """
    if k < 1:
        raise ValueError(f"--draft-len {k}: a ceiling needs at least one drafted token per step")
    oracle = tau is None
    tau = float(k + 1) if tau is None else float(tau)
    check_tau(tau, k)
    if ar_ms_per_token is None:
        ar_ms_per_token = ar_step(hw, target, batch, context, fmt).step_ms
    elif not ar_ms_per_token > 0:
        raise ValueError(f"measured AR time {ar_ms_per_token} ms per token: must be positive")
    ideal = sd_step(hw, target, drafter, k, tau, batch, context, fmt, drafter_fmt, overheads=sd_overheads)
    return Ceiling(batch, k, tau, oracle, ar_ms_per_token, ideal.latency_ms_per_token)


@runtime_checkable
class HasCeiling(Protocol):
    """Anything that can state its oracle ceiling (a costmodel deployment)."""

    def oracle_ceiling(self) -> float: ...


def plausible(measured_speedup: float, ceiling_or_deployment: float | HasCeiling) -> tuple[bool, str]:
    """Is a measured speedup possible? False above 1.1x the (oracle) ceiling, with a one-line reason.

    `ceiling_or_deployment` is a ceiling speedup, or a deployment whose oracle ceiling is used.
    """
    if isinstance(ceiling_or_deployment, HasCeiling):
        ceil = ceiling_or_deployment.oracle_ceiling()
        what = f"the oracle ceiling of {getattr(ceiling_or_deployment, 'name', 'this deployment')}"
    else:
        ceil = float(ceiling_or_deployment)
        what = "the ceiling"
    if not (math.isfinite(ceil) and ceil > 0):
        raise ValueError(f"ceiling {ceil}: must be a positive number; compute it with costmodel.ceiling()")
    try:
        measured = float(measured_speedup)
    except (TypeError, ValueError):
        measured = math.nan
    if not (math.isfinite(measured) and measured > 0):
        return False, f"measured speedup {measured_speedup!r} is not a positive number: the run's timing is broken"
    limit = PLAUSIBLE_MARGIN * ceil
    if measured > limit:
        return False, (f"measured {measured:.2f}x exceeds {PLAUSIBLE_MARGIN}x {what} ({ceil:.2f}x): "
                       f"no lossless change reaches it; suspect the timing or the output check, not a win")
    return True, f"measured {measured:.2f}x is within {PLAUSIBLE_MARGIN}x {what} ({ceil:.2f}x)"
