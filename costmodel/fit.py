"""Fitting a hardware profile's overheads and achieved throughput to measured forward times.

Model: measured(q, B, L) ~= a + max(memory_ms(q, B, L) / s_bw, compute_ms(q, B, L) / s_peak), where
memory_ms and compute_ms come from the profile as it stands, `a` is the per-forward overhead of
the measured model, and s_bw, s_peak scale the profile's bandwidth and matmul peak to what real
forwards achieve. The scales are grid-searched; for each pair, `a` has a closed form (least
squares on relative error), so the fit is exact arithmetic with no optimiser to tune.

With batched samples (`kv_samples`, B > 1: where the KV traffic of many requests shows), the KV and
state bytes leave the max and get a rate of their own, kv_bandwidth = the profile's peak x s_kv:
measured ~= a + max(weights_ms / s_bw, compute_ms / s_peak) + kv_state_ms / s_kv, grid-searched
jointly over all samples.
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
    kv_bandwidth_scale: float | None = None  # None: no batched samples, the KV shares the memory term


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
                peak_range: tuple[float, float] = (0.125, 1.5),
                kv_samples: Sequence[Sample] = (), kv_range: tuple[float, float] = (1 / 64, 4.0)) -> FitResult:
    """Fit the overhead (and optionally bandwidth and peak scales) of `hw` to measured forwards of `model`.

    The returned profile keeps its datasheet fields; fitted values go to per_layer_overhead_ms (the
    overhead beyond the profile's fixed one, per layer), achieved_bandwidth_GBps and
    achieved_<dtype>_tflops, and, with `kv_samples` (batched forwards fitted together with `samples`),
    kv_bandwidth_GBps. `predicted_ms` and the error cover `samples` then `kv_samples`.
    """
    if not samples:
        raise ValueError("no measured samples to fit; measure at least one (q, batch, context) forward")
    every = [*samples, *kv_samples]
    if any(m <= 0 for *_, m in every):
        raise ValueError("measured times must be positive milliseconds")
    measured = [m for *_, m in every]
    bare = replace(hw, fixed_overhead_ms=0.0, per_layer_overhead_ms=0.0, kv_bandwidth_GBps=None,
                   measured=dict(hw.measured))
    parts = [forward_time(bare, model, q, b, ctx, fmt) for q, b, ctx, _ in every]
    kv_alone = bool(kv_samples)
    mem = [p.weights_ms if kv_alone else p.memory_ms for p in parts]
    kv = [p.kv_ms + p.state_ms if kv_alone else 0.0 for p in parts]
    comp = [p.compute_ms for p in parts]
    compute_dtype = COMPUTE_DTYPE[fmt]
    can_fit_peak = fit_peak and compute_dtype in ("bf16", "fp32")
    # kv above is priced at the bare profile's bandwidth; at a rate of peak x s_kv it scales by bw / (peak x s_kv).
    kv_unit = bare.bandwidth_GBps() / hw.mem_bandwidth_GBps
    best = None
    for s_kv in _geomspace(*kv_range, 25) if kv_alone else [None]:
        kv_ms = [k * kv_unit / s_kv for k in kv] if s_kv else kv
        for s_bw in _geomspace(*bandwidth_range, 97) if fit_bandwidth else [1.0]:
            for s_pk in _geomspace(*peak_range, 49) if can_fit_peak else [1.0]:
                roof = [max(m / s_bw, c / s_pk) + k for m, c, k in zip(mem, comp, kv_ms, strict=True)]
                a = _overhead_for(roof, measured)
                loss = sum(((a + r - m) / m) ** 2 for r, m in zip(roof, measured, strict=True))
                if best is None or loss < best[0]:
                    best = (loss, s_bw, s_pk, a, s_kv)
    assert best is not None
    _, s_bw, s_pk, a, s_kv = best

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
    if s_kv is not None:
        fitted.kv_bandwidth_GBps = round(hw.mem_bandwidth_GBps * s_kv, 4)
    predicted = predict_ms(fitted, model, every, fmt)
    return FitResult(fitted, predicted, measured, median_abs_rel_error(predicted, measured), a, s_bw, s_pk, s_kv)
