#!/usr/bin/env python
"""GPU check of the cost model: predicted against measured verify-step times of an 8B Llama.

Builds a random-init Llama with the Llama-3.1-8B shape (costmodel/data/llama-3.1-8b.json) in bf16
on cuda, fills a KV cache of L = 1024 tokens for B requests, and times one forward of q new tokens
per request (the verify step) with CUDA events, for q in {1, 2, 4, 8, 16, 32, 64} and B in
{1, 4, 16}. It prints, per cell, the datasheet roofline's prediction (no overheads), the
prediction of a profile fitted on the B = 1 cells only (overhead, achieved bandwidth and peak),
and the measurement, with median absolute relative errors: all cells, and the held-out B > 1
cells. Writes gpu_check_costmodel.json and the fitted profile (<name>-fitted.json) to $OUT when set.

Runs in well under 5 minutes on one H200 (model init ~30 s, 21 cells x 13 forwards).
Usage: python scripts/gpu_check_costmodel.py [--context 1024] [--reps 10] [--out DIR]
       python scripts/gpu_check_costmodel.py --smoke   # a tiny model on the CPU: exercises the code path only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a bare checkout, no install needed

from costmodel.fit import Sample, fit_profile, median_abs_rel_error, predict_ms  # noqa: E402
from costmodel.hardware import DATASHEETS, HardwareProfile, save_profile  # noqa: E402
from costmodel.model_profile import DATA_DIR, ModelProfile, from_config, load_model_profile  # noqa: E402

QS = (1, 2, 4, 8, 16, 32, 64)
BATCHES = (1, 4, 16)
WARMUP = 3
CONFIG = DATA_DIR / "llama-3.1-8b.json"


def datasheet_for(device_name: str) -> HardwareProfile:
    """The datasheet profile matching a CUDA device name (H200 when unsure, with a warning)."""
    name = device_name.lower()
    for key, needle in (("h200", "h200"), ("h100-sxm", "h100"), ("b200", "b200"), ("a100-80gb", "a100"),
                        ("l40s", "l40s"), ("rtx-4090", "4090")):
        if needle in name:
            return DATASHEETS[key]
    print(f"warning: no datasheet profile for {device_name!r}; predicting with h200", file=sys.stderr)
    return DATASHEETS["h200"]


# --smoke: the same code path on a tiny Llama on the CPU (no GPU, seconds), to catch breakage early.
SMOKE_CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
                "max_position_embeddings": 2048, "tie_word_embeddings": False}


def build_model(raw: dict, device: str):
    """Random-init Llama of config `raw`, bf16, on `device`, in eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "transformers_version",
                                                                   "torch_dtype", "model_type")})
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # allocate bf16 directly: no 32 GB fp32 detour
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def _timed_ms(fn, device: str) -> float:
    """Milliseconds of fn(): CUDA events on a GPU (device time, launch gaps included), else wall time."""
    import torch

    if device == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - t0)


def measure_batch(model, batch: int, context: int, reps: int, device: str = "cuda") -> dict[int, float]:
    """Median ms of one forward of q new tokens per request onto `context` cached tokens, for each q."""
    import warnings

    import torch
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    gen = torch.Generator(device=device).manual_seed(batch)
    out: dict[int, float] = {}
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # `past_key_values` renamed in newer transformers
        prompt = torch.randint(0, vocab, (batch, context), device=device, generator=gen)  # [B, L]
        cache = DynamicCache(config=model.config)
        model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        for q in QS:
            new = torch.randint(0, vocab, (batch, q), device=device, generator=gen)  # [B, q]
            times = []
            for i in range(WARMUP + reps):
                # Full logits [B, q, V], as verification needs them.
                ms = _timed_ms(lambda new=new: model(input_ids=new, past_key_values=cache, use_cache=True), device)
                cache.crop(-q)  # back to L: every repeat verifies onto the same context
                if i >= WARMUP:
                    times.append(ms)
            out[q] = statistics.median(times)
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def summarize(hw: HardwareProfile, model: ModelProfile, samples: list[Sample]) -> dict:
    """Datasheet and fitted predictions against measurements (pure arithmetic: testable on CPU)."""
    measured = [m for *_, m in samples]
    bare = HardwareProfile(**{**hw.to_dict(), "fixed_overhead_ms": 0.0, "per_layer_overhead_ms": 0.0})
    datasheet = predict_ms(bare, model, samples, "bf16")
    b1 = [s for s in samples if s[1] == 1]
    fit = fit_profile(bare, model, b1, "bf16", bandwidth_range=(0.25, 1.2), peak_range=(0.25, 1.2))
    fitted = predict_ms(fit.profile, model, samples, "bf16")
    held = [i for i, s in enumerate(samples) if s[1] != 1]
    cells = [{"batch": b, "q": q, "context": ctx, "measured_ms": round(m, 4), "datasheet_ms": round(d, 4),
              "fitted_ms": round(f, 4)} for (q, b, ctx, m), d, f in zip(samples, datasheet, fitted, strict=True)]
    return {
        "hardware": hw.name, "model": model.name, "cells": cells,
        "median_abs_rel_error": {
            "datasheet_all": round(median_abs_rel_error(datasheet, measured), 4),
            "fitted_all": round(median_abs_rel_error(fitted, measured), 4),
            "fitted_held_out_batch_gt_1": round(median_abs_rel_error([fitted[i] for i in held],
                                                                     [measured[i] for i in held]), 4) if held else None,
        },
        "fit": {"overhead_ms": round(fit.overhead_ms, 4), "bandwidth_scale": round(fit.bandwidth_scale, 4),
                "peak_scale": round(fit.peak_scale, 4),
                "achieved_bandwidth_GBps": fit.profile.achieved_bandwidth_GBps,
                "achieved_bf16_tflops": fit.profile.achieved_bf16_tflops},
        "fitted_profile": fit.profile.to_dict(),
    }


def format_summary(summary: dict) -> str:
    lines = [f"{'B':>3} {'q':>3} {'datasheet ms':>13} {'fitted ms':>10} {'measured ms':>12} {'fit err':>8}"]
    for c in summary["cells"]:
        err = abs(c["fitted_ms"] - c["measured_ms"]) / c["measured_ms"]
        lines.append(f"{c['batch']:>3} {c['q']:>3} {c['datasheet_ms']:>13.3f} {c['fitted_ms']:>10.3f} "
                     f"{c['measured_ms']:>12.3f} {err:>8.1%}")
    e, f = summary["median_abs_rel_error"], summary["fit"]
    lines.append(f"median abs rel error: datasheet {e['datasheet_all']:.1%}, fitted on B=1 {e['fitted_all']:.1%} "
                 f"(held-out B>1: {e['fitted_held_out_batch_gt_1']:.1%})")
    lines.append(f"fit: overhead {f['overhead_ms']:.3f} ms/forward, bandwidth x{f['bandwidth_scale']:.2f} "
                 f"({f['achieved_bandwidth_GBps']} GB/s), bf16 peak x{f['peak_scale']:.2f} "
                 f"({f['achieved_bf16_tflops']} TFLOPS)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for the JSON (default: $OUT)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the code path, not the GPU")
    args = ap.parse_args(argv)

    import torch

    t0 = time.perf_counter()
    if args.smoke:
        device, device_name, raw = "cpu", "cpu (smoke)", SMOKE_CONFIG
        args.context, args.reps = min(args.context, 64), min(args.reps, 2)
        target = from_config(raw, "smoke-llama")
        hw = DATASHEETS["h200"]
    elif not torch.cuda.is_available():
        print("error: no CUDA device; run on a GPU machine, or pass --smoke to exercise the code on the CPU",
              file=sys.stderr)
        return 2
    else:
        device, device_name, raw = "cuda", torch.cuda.get_device_name(0), json.loads(CONFIG.read_text())
        target = load_model_profile(CONFIG)
        hw = datasheet_for(device_name)
    model = build_model(raw, device)
    print(f"{device_name}: built {target.name} ({target.total_params / 1e9:.2f}B params) in "
          f"{time.perf_counter() - t0:.1f} s; predicting with {hw.name} ({hw.source})", flush=True)
    samples: list[Sample] = []
    for b in BATCHES:
        for q, ms in measure_batch(model, b, args.context, args.reps, device).items():
            samples.append((q, b, args.context, ms))
        print(f"B={b} measured ({time.perf_counter() - t0:.1f} s)", flush=True)
    summary = summarize(hw, target, samples)
    summary.update(device=device_name, torch=torch.__version__, seconds=round(time.perf_counter() - t0, 1))
    print(format_summary(summary))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check_costmodel.json").write_text(json.dumps(summary, indent=2) + "\n")
        fitted = HardwareProfile.from_dict({**summary["fitted_profile"], "name": f"{hw.name}-fitted"})
        save_profile(fitted, out / f"{hw.name}-fitted.json")
        print(f"wrote {out / 'gpu_check_costmodel.json'} and {out / (hw.name + '-fitted.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
