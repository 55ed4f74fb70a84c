#!/usr/bin/env python
"""GPU check of the w12 kernel: time against torch's bf16 matmul at decode shapes, and bandwidth reached.

For weights of Llama-3-8B's projection shapes, K x N (in x out) = 4096x4096, 4096x14336 and
14336x4096, and M = 1, 4, 16 and 64 activation rows, it times out[M, N] = x[M, K] @ W^T with
torch's bf16 F.linear (cuBLAS) and with the fused w12 kernel, and prints per cell: both times, the
speedup, and the fraction of the H200's 4.8 TB/s each reaches (bytes = weights + x + out).

Weights: Gaussian (std 0.02) bf16 with 1e-4 of them replaced by outliers (+-4.0) so that escapes
are exercised at about the rate of trained checkpoints. Each timed call reads a different copy of
the weights (enough copies to span 4x the 50 MB L2), captured in one CUDA graph and replayed, so
the time is HBM streaming, not launch overhead or L2 hits. Every cell is also checked: the kernel's
output against the reference path (unpack + F.linear) within the fp32-accumulation tolerance.

A small tile sweep (--sweep, on by default) times a few other kernel configs at M = 1 and 16 and
reports the best next to the default (`kernels.w12_triton.default_config`).

Runs in about 2-3 minutes on one H200 (packing on the CPU, ~60 Triton compiles, timing).
Writes gpu_check_w12.json to $OUT (or --out) when set.
Usage: python scripts/gpu_check_w12.py [--reps 20] [--no-sweep] [--out DIR]
       python scripts/gpu_check_w12.py --smoke   # tiny shapes on the CPU, reference backend: the code path only
       python scripts/gpu_check_w12.py --smoke --interpret   # ... with the Triton kernel, interpreted
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a bare checkout, no install needed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.w12 import W12Weight, pack, unpack, w12_linear_reference  # noqa: E402

SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))  # (K, N): in x out
ROWS = (1, 4, 16, 64)
SMOKE_SHAPES = ((96, 64), (64, 160))
SMOKE_ROWS = (1, 4, 16)
H200_BANDWIDTH = 4.8e12  # bytes/s, datasheet
L2_BYTES = 50 * 2**20
OUTLIER_RATE = 1e-4


def make_weight(k: int, n: int, device: str, seed: int = 0) -> torch.Tensor:
    """bf16 [N, K]: Gaussian std 0.02 with OUTLIER_RATE of entries set to +-4 (escapes)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    flat = w.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(flat.numel() * OUTLIER_RATE))]
    flat[idx] = torch.where(torch.rand(idx.numel(), generator=g) < 0.5, -4.0, 4.0)
    return w.to(torch.bfloat16).to(device)


def tolerance(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Allowed |out - ref| [M, N]: one bf16 ulp of the larger of the two plus twice the fp32 accumulation
    bound K * 2^-24 * sum |x||w| (kernel and reference are fp32 sums of the same exact products, in
    different orders, each rounded to bf16 once). The same rule as tests/test_w12.py."""
    k = x.shape[-1]
    mag = torch.maximum(out.double().abs(), ref.double().abs()).clamp_min(2.0**-126)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - 7)
    bound = x.double().abs() @ w.double().abs().T  # [M, N]
    return ulp + 2 * k * 2.0**-24 * bound


def _time_ms(fn: Callable[[], object], device: str, reps: int) -> tuple[float, bool]:
    """Median ms of fn() (one call covers all weight copies); CUDA graph replay on a GPU when it captures."""
    if device != "cuda":
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
        return statistics.median(times), False
    for _ in range(3):
        fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # noqa: BLE001 (fall back to plain launches, and say so)
        print(f"warning: CUDA graph capture failed ({type(e).__name__}: {e}); timing plain launches",
              file=sys.stderr)
        graph = None
    run = graph.replay if graph is not None else fn
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), graph is not None


def run_cell(x: torch.Tensor, ws: list[torch.Tensor], ps: list[W12Weight], device: str, reps: int,
             w12_fn: Callable[[torch.Tensor, W12Weight], torch.Tensor]) -> dict:
    """Times bf16 and w12 for one (shape, M) cell over all copies; checks the w12 output."""
    m, k = x.shape
    n = ws[0].shape[0]
    copies = len(ws)
    bf16_ms, graphed = _time_ms(lambda: [F.linear(x, w) for w in ws], device, reps)
    w12_ms, _ = _time_ms(lambda: [w12_fn(x, p) for p in ps], device, reps)
    bf16_ms, w12_ms = bf16_ms / copies, w12_ms / copies
    io_bytes = 2 * m * k + 2 * m * n
    bf16_bytes, w12_bytes = 2 * n * k + io_bytes, ps[0].nbytes + io_bytes

    # Checked against the exact fp64 sum (cuBLAS may reduce split-K partials in bf16, so it is no yardstick).
    out, ref = w12_fn(x, ps[0]), w12_linear_reference(x, ps[0])
    exact = x.double() @ unpack(ps[0]).double().T  # [M, N]
    err = (out.double() - exact).abs()
    tol = tolerance(x, ws[0], out, exact)
    return {
        "M": m, "K": k, "N": n, "copies": copies, "cuda_graph": graphed,
        "bf16_us": round(1000 * bf16_ms, 3), "w12_us": round(1000 * w12_ms, 3),
        "speedup": round(bf16_ms / w12_ms, 4),
        "bf16_bandwidth_fraction": round(bf16_bytes / (bf16_ms / 1000) / H200_BANDWIDTH, 4),
        "w12_bandwidth_fraction": round(w12_bytes / (w12_ms / 1000) / H200_BANDWIDTH, 4),
        "w12_bits_per_weight": round(ps[0].bits_per_weight, 4), "escapes": ps[0].num_escapes,
        "max_abs_err_vs_exact": float(err.max()),
        "max_abs_diff_vs_reference": float((out.float() - ref.float()).abs().max()),
        "within_tolerance": bool((err <= tol).all()),
    }


SWEEP = ((8, 256, 4), (4, 256, 4), (16, 256, 4), (8, 512, 4), (16, 128, 8), (32, 128, 4))  # block_n, block_k, warps


def sweep_cell(x: torch.Tensor, ps: list[W12Weight], reps: int, device: str) -> list[dict]:
    """Times a few kernel tile configs for one cell."""
    import dataclasses

    import triton

    from kernels.w12_triton import KernelConfig, default_config, w12_matmul

    m = x.shape[0]
    base = default_config(m, *ps[0].shape)
    rows = []
    for block_n, block_k, warps in SWEEP:
        if base.block_m > 1 and block_n < 16:
            continue  # tl.dot needs 16 columns
        cfg = KernelConfig(base.block_m, block_n, min(block_k, triton.next_power_of_2(ps[0].shape[1])),
                           num_warps=warps)
        try:
            ms, _ = _time_ms(lambda cfg=cfg: [w12_matmul(x, p, cfg) for p in ps], device, reps)
        except Exception as e:  # noqa: BLE001 (a config that does not compile is a data point, not a crash)
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            rows.append({"config": dataclasses.asdict(cfg), "error": error})
            continue
        rows.append({"config": dataclasses.asdict(cfg), "w12_us": round(1000 * ms / len(ps), 3)})
    return rows


def format_table(cells: list[dict]) -> str:
    lines = [f"{'K x N':>12} {'M':>3} {'bf16 us':>9} {'w12 us':>9} {'speedup':>8} {'bf16 BW':>8} {'w12 BW':>7} "
             f"{'bits/w':>7} {'ok':>3}"]
    for c in cells:
        lines.append(f"{c['K']:>5} x {c['N']:<5} {c['M']:>3} {c['bf16_us']:>9.2f} {c['w12_us']:>9.2f} "
                     f"{c['speedup']:>7.2f}x {c['bf16_bandwidth_fraction']:>8.0%} {c['w12_bandwidth_fraction']:>7.0%} "
                     f"{c['w12_bits_per_weight']:>7.3f} {'yes' if c['within_tolerance'] else 'NO':>3}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-sweep", action="store_true", help="skip the kernel tile sweep")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for the JSON (default: $OUT)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU with the reference backend")
    ap.add_argument("--interpret", action="store_true",
                    help="with --smoke: the Triton kernel under TRITON_INTERPRET=1 instead of the reference backend")
    args = ap.parse_args(argv)
    if args.interpret and not args.smoke:
        ap.error("--interpret goes with --smoke (on a GPU the kernel is compiled)")

    t0 = time.perf_counter()
    if args.smoke:
        device, device_name, shapes, rows = "cpu", "cpu (smoke)", SMOKE_SHAPES, SMOKE_ROWS
        args.reps = min(args.reps, 3)
        w12_fn = w12_linear_reference
        if args.interpret:
            os.environ["TRITON_INTERPRET"] = "1"  # read when triton decorates the kernel, at import
            from kernels.w12_triton import w12_matmul

            device_name, w12_fn = "cpu (smoke, triton interpreter)", w12_matmul
    elif not torch.cuda.is_available():
        print("error: no CUDA device; run on a GPU machine, or pass --smoke to exercise the code on the CPU",
              file=sys.stderr)
        return 2
    else:
        from kernels.w12_triton import w12_matmul

        device, device_name, shapes, rows = "cuda", torch.cuda.get_device_name(0), SHAPES, ROWS
        w12_fn = w12_matmul
    print(f"{device_name}: torch {torch.__version__}", flush=True)

    cells: list[dict] = []
    sweeps: list[dict] = []
    failures = 0
    for k, n in shapes:
        w = make_weight(k, n, "cpu")
        p = pack(w)
        if not torch.equal(unpack(p).view(torch.int16), w.view(torch.int16)):
            print(f"error: {k}x{n}: w12 round trip is not bit-exact", file=sys.stderr)
            return 1
        copies = max(2, math.ceil(4 * L2_BYTES / (2 * n * k))) if device == "cuda" else 2
        ws = [w.to(device)] + [w.to(device).clone() for _ in range(copies - 1)]
        ps = [p.to(device) for _ in range(copies)]
        print(f"{k}x{n}: packed {p.bits_per_weight:.3f} bits/weight, {p.num_escapes} escapes, {copies} copies "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
        gen = torch.Generator().manual_seed(k + n)
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device)  # [M, K]
            cell = run_cell(x, ws, ps, device, args.reps, w12_fn)
            failures += not cell["within_tolerance"]
            cells.append(cell)
            sweep = (device == "cuda" or args.interpret) and not args.no_sweep and m in (1, 16)
            if sweep:
                sweeps.append({"M": m, "K": k, "N": n, "default": cell["w12_us"],
                               "configs": sweep_cell(x, ps, min(args.reps, 5), device)})
        del ws, ps
        if device == "cuda":
            torch.cuda.empty_cache()

    print(format_table(cells))
    for s in sweeps:
        ok = [r for r in s["configs"] if "w12_us" in r]
        if ok:
            best = min(ok, key=lambda r: r["w12_us"])
            print(f"sweep {s['K']}x{s['N']} M={s['M']}: default {s['default']:.2f} us, best {best['w12_us']:.2f} us "
                  f"with {best['config']}")
    one_row = [c["speedup"] for c in cells if c["M"] == 1]
    summary = {"device": device_name, "torch": torch.__version__, "cells": cells, "sweeps": sweeps,
               "min_speedup_one_row": min(one_row), "goal_one_row": 1.25, "limit_one_row": 4 / 3,
               "all_within_tolerance": failures == 0, "seconds": round(time.perf_counter() - t0, 1)}
    try:
        import triton

        summary["triton"] = triton.__version__
    except ImportError:
        summary["triton"] = None
    print(f"one-row speedup (min over shapes): {summary['min_speedup_one_row']:.2f}x (goal 1.25x, limit 1.33x); "
          f"{'all cells within tolerance' if failures == 0 else f'{failures} cells OUT OF TOLERANCE'}; "
          f"{summary['seconds']} s")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check_w12.json").write_text(json.dumps(summary, indent=2))
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
