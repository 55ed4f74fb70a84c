"""Fitting a hardware profile's overheads and achieved throughput to measured forward times.

Model: measured(q, B, L) ~= a + max(memory_ms(q, B, L) / s_bw, compute_ms(q, B, L) / s_peak), where
memory_ms and compute_ms come from the profile as it stands, `a` is the per-forward overhead of
the measured model, and s_bw, s_peak scale the profile's bandwidth and matmul peak to what real
forwards achieve. The scales are grid-searched; for each pair, `a` has a closed form (least
squares on relative error), so the fit is exact arithmetic with no optimiser to tune.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from costmodel.hardware import HardwareProfile
from costmodel.model_profile import COMPUTE_DTYPE, ModelProfile
from costmodel.step import forward_time

Sample = tuple[int, int, int, float]  # (q, batch, context, measured ms)


@dataclass
class FitResult:
    profile: HardwareProfile
    predicted_ms: list[float]
    measured_ms: list[float]
    median_abs_rel_error: float
    overhead_ms: float  # the fitted per-forward overhead of the measured model
    bandwidth_scale: float
    peak_scale: float


def median_abs_rel_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Median over samples of |predicted - measured| / measured."""
    if len(predicted) != len(measured) or not measured:
        raise ValueError(f"need as many predictions as measurements (got {len(predicted)} and {len(measured)})")
    return statistics.median(abs(p - m) / m for p, m in zip(predicted, measured, strict=True))


def predict_ms(hw: HardwareProfile, model: ModelProfile, samples: Sequence[Sample], fmt: str = "bf16") -> list[float]:
    """Predicted forward ms (with the profile's overheads) for each (q, batch, context, _) sample."""
    return [forward_time(hw, model, q, b, ctx, fmt).total_ms for q, b, ctx, _ in samples]


def _geomspace(lo: float, hi: float, n: int) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)] if n > 1 else [1.0]


def _overhead_for(roof: list[float], measured: list[float]) -> float:
    """The a >= 0 minimising sum(((a + r - m) / m)^2)."""
    w = [1 / m**2 for m in measured]
    a = sum(wi * (m - r) for wi, m, r in zip(w, measured, roof, strict=True)) / sum(w)
    return max(0.0, a)


def fit_profile(hw: HardwareProfile, model: ModelProfile, samples: Sequence[Sample], fmt: str = "bf16",
                fit_bandwidth: bool = True, fit_peak: bool = True,
                bandwidth_range: tuple[float, float] = (0.125, 2.0),
                peak_range: tuple[float, float] = (0.125, 1.5)) -> FitResult:
    """Fit the overhead (and optionally bandwidth and peak scales) of `hw` to measured forwards of `model`.

    The returned profile keeps its datasheet fields; fitted values go to per_layer_overhead_ms (the
    overhead beyond the profile's fixed one, per layer), achieved_bandwidth_GBps and
    achieved_<dtype>_tflops.
    """
    if not samples:
        raise ValueError("no measured samples to fit; measure at least one (q, batch, context) forward")
    if any(m <= 0 for *_, m in samples):
        raise ValueError("measured times must be positive milliseconds")
    measured = [m for *_, m in samples]
    bare = replace(hw, fixed_overhead_ms=0.0, per_layer_overhead_ms=0.0, measured=dict(hw.measured))
    parts = [forward_time(bare, model, q, b, ctx, fmt) for q, b, ctx, _ in samples]
    mem = [p.memory_ms for p in parts]
    comp = [p.compute_ms for p in parts]
    compute_dtype = COMPUTE_DTYPE[fmt]
    can_fit_peak = fit_peak and compute_dtype in ("bf16", "fp32")
    best = None
    for s_bw in _geomspace(*bandwidth_range, 97) if fit_bandwidth else [1.0]:
        for s_pk in _geomspace(*peak_range, 49) if can_fit_peak else [1.0]:
            roof = [max(m / s_bw, c / s_pk) for m, c in zip(mem, comp, strict=True)]
            a = _overhead_for(roof, measured)
            loss = sum(((a + r - m) / m) ** 2 for r, m in zip(roof, measured, strict=True))
            if best is None or loss < best[0]:
                best = (loss, s_bw, s_pk, a)
    assert best is not None
    _, s_bw, s_pk, a = best

    # Keep the profile's fixed overhead (measured on a model too small to cost anything else, it is
    # what every forward pays) and charge the rest of the fitted overhead per layer: launches and module
    # calls scale with depth, so a one-layer drafter is priced at one layer's share, not the target's.
    fixed = min(hw.fixed_overhead_ms, a)
    fitted = replace(bare, fixed_overhead_ms=round(fixed, 6),
                     per_layer_overhead_ms=round((a - fixed) / model.num_layers, 6))
    if fit_bandwidth:
        fitted.achieved_bandwidth_GBps = round(hw.bandwidth_GBps() * s_bw, 3)
    if can_fit_peak:
        peak = round(hw.peak_tflops(compute_dtype) * s_pk, 6)
        if compute_dtype == "bf16":
            fitted.achieved_bf16_tflops = peak
        else:
            fitted.achieved_fp32_tflops = peak
    predicted = predict_ms(fitted, model, samples, fmt)
    return FitResult(fitted, predicted, measured, median_abs_rel_error(predicted, measured), a, s_bw, s_pk)
