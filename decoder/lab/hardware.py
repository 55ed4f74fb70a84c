"""Measuring this machine for the cost model: memory bandwidth, matmul throughput and the fixed cost of a
forward, fitted into a `cpu-local` hardware profile (costmodel/hardware.py holds the profile and the
arithmetic; this is the part that runs torch)."""

from __future__ import annotations

import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

from costmodel.accuracy import KV_FIT_BATCH_SIZES, STEP_POINTS, StepPoint, StepSweep
from costmodel.fit import fit_profile, median_abs_rel_error
from costmodel.hardware import LOCAL, PROFILE_REPEATS, HardwareError, HardwareProfile
from costmodel.model_profile import load_model_profile


def _median_time(fn: Callable[[], object], budget_s: float, min_reps: int = 3, max_reps: int = 200) -> float:
    """Median wall seconds of `fn()` over as many repeats as `budget_s` allows (after one warm-up)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_bandwidth_GBps(budget_s: float, megabytes: int = 128) -> float:
    """Large-tensor copy: bytes read plus bytes written per second (well beyond any cache)."""

    n = megabytes * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), budget_s)
    return 2 * n * 4 / t / 1e9


def _matmul_curve(dtype_name: str, hidden: int, qs: tuple[int, ...], budget_s: float) -> dict[str, float]:
    """TFLOPS of x[q, h] @ W[h, 4h] (an MLP up-projection at decode shapes) for each q."""

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    w = torch.randn(hidden, 4 * hidden, dtype=dtype)  # [h, 4h]
    curve = {}
    for q in qs:
        x = torch.randn(q, hidden, dtype=dtype)  # [q, h]
        t = _median_time(lambda x=x: torch.mm(x, w), budget_s / len(qs))
        curve[str(q)] = 2 * q * hidden * 4 * hidden / t / 1e12
    return curve


def _tiny_llama(layers: int):

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def _forward_ms(model, q: int, context: int, budget_s: float, batch: int = 1, dtype=None) -> float:
    """Median ms of one forward of q new tokens per request onto a KV cache of `context` tokens."""
    if dtype is not None:
        model = model.to(dtype)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (batch, context), generator=gen)  # [B, L]
    new = torch.randint(0, vocab, (batch, q), generator=gen)  # [B, q]
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return 1000 * _median_time(_verify_step(model, prompt, new), budget_s)


def _verify_step(model, prompt: torch.Tensor, new: torch.Tensor) -> Callable[[], None]:
    """Prefill `prompt` [B, L] into a fresh cache; return a call that runs one forward of `new` [B, q] onto it
    and rolls the cache back, so every repeat verifies onto the same context. Call under inference_mode."""
    # transformers 5.2x renames `past_key_values` to `cache` with a FutureWarning; the GPU machine's 5.17
    # knows only the old name, so keep it (the callers silence the warning).
    cache = DynamicCache(config=model.config)
    model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    q = new.shape[1]

    def step() -> None:
        model(input_ids=new, past_key_values=cache, use_cache=True)  # full logits [B, q, V], as verify needs
        cache.crop(-q)

    return step


def measure_steps(target: Path | str, drafter: Path | str | None = None, context: int = 256,
                  dtype: str = "bfloat16", seconds_budget: float = 4.0, threads: int | None = None,
                  models: tuple | None = None, extra_verify_qs: tuple[int, ...] = (),
                  min_rounds: int = 3, probes: dict | None = None) -> StepSweep:
    """Time the step model's points (costmodel/accuracy.py: STEP_POINTS) on the Hugging Face forward of
    `target` (and `drafter` for the draft points; without it they are skipped) at `context` cached tokens,
    on `threads` torch threads (None: as set). `models` passes the (target, drafter) modules already loaded.

    Every point has its own prefilled cache; after a warm-up round, rounds time each point once in turn
    until the budget is spent (at least `min_rounds`), and a point's time is the median of its rounds: a
    burst of load on a shared machine then lands on all points alike instead of on whichever was being
    timed. ar and verify q = 1 are the same shape timed apart: their gap shows the noise. `probes` (name ->
    model) are timed in the same rounds at q = 1 onto 32 cached tokens, into extra["probe_ms"]: the tiny
    models whose times split the overhead into a fixed and a per-layer part, measured beside the rest."""
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    fmt = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
    points = [p for p in STEP_POINTS if drafter is not None or p.role == "target"]
    points += [StepPoint("verify", q) for q in extra_verify_qs if StepPoint("verify", q) not in points]
    if models is None:
        models = tuple(None if d is None else AutoModelForCausalLM.from_pretrained(
            str(d), dtype=torch_dtype, local_files_only=True).eval() for d in (target, drafter))
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    times: dict[StepPoint | str, list[float]] = {p: [] for p in points}
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            steps = {}
            for p in points:
                model = models[0] if p.role == "target" else models[1]
                gen = torch.Generator().manual_seed(p.batch)
                vocab = model.config.vocab_size
                prompt = torch.randint(0, vocab, (p.batch, context), generator=gen)  # [B, L]
                steps[p] = _verify_step(model, prompt, torch.randint(0, vocab, (p.batch, p.q), generator=gen))
            for name, model in (probes or {}).items():
                vocab = model.config.vocab_size
                steps[name] = _verify_step(model, torch.randint(0, vocab, (1, 32)), torch.randint(0, vocab, (1, 1)))
            times.update({name: [] for name in probes or {}})
            for step in steps.values():
                step()  # warm-up
            start = time.perf_counter()
            rounds = 0
            while rounds < min_rounds or time.perf_counter() - start < seconds_budget:
                for p, step in steps.items():
                    t = time.perf_counter()
                    step()
                    times[p].append(time.perf_counter() - t)
                rounds += 1
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    target_profile = load_model_profile(target)
    drafter_profile = load_model_profile(drafter) if drafter is not None else None
    return StepSweep(
        target=str(target), target_fingerprint=target_profile.fingerprint, context=context, fmt=fmt,
        measured_ms={p: 1000 * statistics.median(times[p]) for p in points},
        drafter=str(drafter) if drafter is not None else None,
        drafter_fingerprint=drafter_profile.fingerprint if drafter_profile else None, threads=used,
        extra={**({"probe_ms": {n: round(1000 * statistics.median(times[n]), 4) for n in probes}} if probes else {}),
               "rounds": rounds, "seconds": round(time.perf_counter() - t0, 2),
               "load_avg": round(os.getloadavg()[0], 2), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")})


def measure_cpu_local(model_dir: Path | str | None = None, seconds_budget: float = 10.0, context: int = 256,
                      dtype: str = "bfloat16", qs: tuple[int, ...] = (1, 2, 4, 8, 16),
                      name: str = LOCAL, steps: bool = False, drafter_dir: Path | str | None = None
                      ) -> HardwareProfile:
    """Measure this machine: copy bandwidth, bf16/fp32 matmul throughput at decode shapes, per-forward
    and per-layer overhead (tiny random models), and, with `model_dir`, the verify time of the real
    model for each q, to which the per-layer overhead, achieved bandwidth and matmul rate are fitted.
    With `steps` too, the step model's points (`measure_steps`: AR, verify, batched, and the draft
    model's forward when `drafter_dir` is given) are timed in the same run, into measured["steps"], so
    `specpilot costmodel` can state its prediction error against forwards timed beside the fit.

    Runs on the threads torch is set to use; measure with the thread count the bench will use.
    """
    if seconds_budget <= 0:
        raise HardwareError(f"seconds budget {seconds_budget}: must be positive (about 10 s is enough)")
    if steps and model_dir is None:
        raise HardwareError("a step sweep needs the model to time; pass model_dir")
    if steps:  # the step sweep holds the verify sweep and the tiny models: its points are the fit's samples
        share = {"copy": 0.1, "matmul": 0.25, "layers": 0.15, "model": 0.5}
    elif model_dir:
        share = {"copy": 0.15, "matmul": 0.35, "layers": 0.2, "model": 0.3}
    else:
        share = {"copy": 0.2, "matmul": 0.5, "layers": 0.3}
    t_start = time.perf_counter()
    bandwidth = _copy_bandwidth_GBps(seconds_budget * share["copy"])
    curve_qs = (1, 2, 4, 8, 16, 64)
    hidden = 1024
    bf16 = _matmul_curve("bf16", hidden, curve_qs, seconds_budget * share["matmul"] * 0.5)
    fp32 = _matmul_curve("fp32", hidden, curve_qs, seconds_budget * share["matmul"] * 0.5)
    # The peak a verify step can reach is the best at decode shapes (q <= 16); q = 64 is kept for the record.
    decode_bf16 = max(v for q, v in bf16.items() if int(q) <= 16)
    decode_fp32 = max(v for q, v in fp32.items() if int(q) <= 16)

    # Overheads: a 1-layer and a 4-layer tiny model cost almost nothing but module and kernel-launch
    # overhead, so their times give a fixed and a per-layer part. With a model dir, the per-layer part
    # is refitted on the real model (fit_profile), whose layers are wider than the tiny ones.
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    sweep = None
    if steps:  # the tiny models are timed inside the step sweep, under the same load as the forwards they split
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype, local_files_only=True).eval()
        drafter = None if drafter_dir is None else AutoModelForCausalLM.from_pretrained(
            str(drafter_dir), dtype=torch_dtype, local_files_only=True).eval()
        tiny = {"1_layer": _tiny_llama(1).to(torch_dtype), "4_layers": _tiny_llama(4).to(torch_dtype)}
        budget = seconds_budget * (share["model"] + share["layers"])
        sweep = measure_steps(model_dir, drafter_dir, context, dtype, budget, models=(model, drafter),
                              extra_verify_qs=qs, probes=tiny)
        t1, t4 = sweep.extra["probe_ms"]["1_layer"], sweep.extra["probe_ms"]["4_layers"]
    else:
        layer_budget = seconds_budget * share["layers"] / 2
        t1 = _forward_ms(_tiny_llama(1), 1, 32, layer_budget, dtype=torch_dtype)
        t4 = _forward_ms(_tiny_llama(4), 1, 32, layer_budget, dtype=torch_dtype)
    per_layer = max(0.0, (t4 - t1) / 3)
    fixed = max(0.0, t1 - per_layer)

    profile = HardwareProfile(
        name=name, mem_bandwidth_GBps=round(bandwidth, 3), bf16_tflops=round(decode_bf16, 6),
        fp8_tflops=None, l2_MB=0.0, fp32_tflops=round(decode_fp32, 6),
        source=f"measured on {platform.node() or 'this machine'} ({platform.processor() or platform.machine()})",
        fixed_overhead_ms=round(fixed, 4), per_layer_overhead_ms=round(per_layer, 4),
        achieved_bf16_tflops=round(decode_bf16, 6), achieved_fp32_tflops=round(decode_fp32, 6),
        measured={
            "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": dtype,
            "matmul_hidden": hidden, "matmul_tflops": {"bf16": bf16, "fp32": fp32},
            "tiny_forward_ms": {"1_layer": round(t1, 4), "4_layers": round(t4, 4)},
        },
    )
    if model_dir is not None:
        model_dir = Path(model_dir)

        target = load_model_profile(model_dir)
        kv_samples: list[tuple[int, int, int, float]] = []
        if sweep is not None:
            measured_ms = [round(sweep.measured_ms[StepPoint("verify", q)], 4) for q in qs]
            kv_samples = [(p.q, p.batch, context, round(ms, 4)) for p, ms in sweep.measured_ms.items()
                          if p.kind == "batched" and p.batch in KV_FIT_BATCH_SIZES]
        else:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype,
                                                         local_files_only=True).eval()
            q_budget = seconds_budget * share["model"] / len(qs)
            measured_ms = [round(_forward_ms(model, q, context, q_budget), 4) for q in qs]
        fmt = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
        samples = [(q, 1, context, m) for q, m in zip(qs, measured_ms, strict=True)]
        # Fit the per-forward overhead, and the bandwidth and matmul rate a real forward achieves
        # (weights that fit in the CPU's last-level cache stream faster than a copy; small HF matmuls
        # run slower or faster than the [q, 1024] x [1024, 4096] probe), near the probed values. With
        # batched samples, the KV rate too; the weights then stream no slower than a copy (below it the
        # fit trades weight time for overhead, which these samples cannot tell apart).
        fit = fit_profile(profile, target, samples, fmt, bandwidth_range=(1.0 if kv_samples else 0.25, 16.0),
                          peak_range=(0.25, 2.0), kv_samples=kv_samples)
        profile = fit.profile
        verify_predicted = fit.predicted_ms[: len(samples)]
        profile.measured["validation"] = {
            "model": str(model_dir), "fingerprint": target.fingerprint, "format": fmt, "context": context,
            "batch": 1, "q": list(qs), "measured_ms": measured_ms,
            "predicted_ms": [round(p, 4) for p in verify_predicted],
            "median_abs_rel_error": round(median_abs_rel_error(verify_predicted, measured_ms), 4),
        }
        if kv_samples:  # fitted together with the verify sweep: in-sample for prediction_error
            profile.measured["validation"]["kv_fit"] = {
                "kind": "batched", "samples": [{"q": q, "batch": b, "measured_ms": m} for q, b, _, m in kv_samples],
                "predicted_ms": [round(p, 4) for p in fit.predicted_ms[len(samples):]],
                "kv_bandwidth_GBps": profile.kv_bandwidth_GBps,
            }
        if sweep is not None:
            profile.measured["steps"] = sweep.as_dict()
    profile.measured["seconds"] = round(time.perf_counter() - t_start, 2)
    return profile


def measure_cpu_local_repeated(model_dir: Path | str | None = None, seconds_budget: float = 10.0,
                               repeats: int = PROFILE_REPEATS, threads: int | None = None, **kw) -> HardwareProfile:
    """`measure_cpu_local` `repeats` times (the budget is split between them) on `threads` torch threads
    (None: as set). The run with the fastest forward (the quietest machine) is kept; every run's
    figures, the spread of the forward time and the load average stay in `measured` as the evidence
    the profile came from."""

    if repeats < 1:
        raise HardwareError(f"repeats {repeats}: must be at least 1")
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        runs = [measure_cpu_local(model_dir, seconds_budget / repeats, **kw) for _ in range(repeats)]
    finally:
        torch.set_num_threads(before)

    def forward_ms(p: HardwareProfile) -> float:
        val = p.measured.get("validation")
        return float(val["measured_ms"][0]) if val else float(p.measured["tiny_forward_ms"]["4_layers"])

    times = [forward_ms(p) for p in runs]
    best = runs[times.index(min(times))]
    best.measured["repeats"] = [{"forward_ms": round(t, 4), "copy_GBps": p.mem_bandwidth_GBps,
                                 "fixed_overhead_ms": p.fixed_overhead_ms,
                                 "per_layer_overhead_ms": p.per_layer_overhead_ms} for t, p in zip(times, runs,
                                                                                                    strict=True)]
    best.measured["spread"] = round((max(times) - min(times)) / min(times), 4) if min(times) > 0 else None
    best.measured["load_avg"] = round(os.getloadavg()[0], 2)
    best.measured["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return best
