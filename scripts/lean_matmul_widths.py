"""What the lean forward's matmuls cost per verify width on this CPU, for a target's real weight shapes.

The lean forward (decoder/lean.py) runs four matmuls a layer (fused QKV, O, fused gate/up, down) as
`F.linear(x, W)`. On a CPU, PyTorch's sgemm picks its kernel by the row count, and a speculative verify of
k drafted tokens is a k + 1 row matmul: this measures, over a model's worth of distinct weights (so they stream
from memory as in a real forward, not from cache), each width 1..N as

  linear   F.linear(x, W)                         (what the lean forward does)
  xWt      x @ W^T with W^T stored contiguous     (the other memory layout)
  pad4     F.linear on x padded with zero rows up to a multiple of 4
  mkldnn   oneDNN's linear with the weight prepacked (torch.utils.mkldnn), x converted in and out each call
  onednn   what mechanism onednn-matmul runs (LeanLM.set_matmul_backend): the weight packed once for
           ONEDNN_PACK_ROWS rows (torch.ops.mkldnn._reorder_linear_weight), dense x in and out
  bf16w    what mechanism bf16w-matmul runs (float32 only, on a CPU the kernel runs on): the weight held as
           bfloat16 panels (kernels/cpu_bf16w.py), widened in registers

(the LM head over every row included, as a verify scores every drafted position)
and prints ms per forward's matmuls (the fastest of --repeats passes) and JSON with --out.

    python scripts/lean_matmul_widths.py --target DIR [--dtype float32] [--widths 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.utils.mkldnn

from decoder.lean import ONEDNN_PACK_ROWS
from decoder.models import ModelLoadError, model_config, smollm2_deployment
from kernels import cpu_bf16w

MODES = ("linear", "xWt", "pad4", "mkldnn", "onednn", "bf16w")


def layer_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(out, in) of the lean forward's four matmuls of one layer: fused QKV, O, fused gate/up, down."""
    d, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    hd = int(cfg.get("head_dim") or d // heads)
    kv = int(cfg.get("num_key_value_heads") or heads)
    return [((heads + 2 * kv) * hd, d), (d, heads * hd), (2 * inter, d), (d, inter)]


def _mkldnn_linear(w: torch.Tensor) -> torch.nn.Module:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    lin.weight.data = w
    return torch.utils.mkldnn.to_mkldnn(lin)


def measure(cfg: dict, dtype: torch.dtype, widths: int, repeats: int) -> dict:
    layers = int(cfg["num_hidden_layers"])
    shapes = layer_shapes(cfg)
    ws = [[torch.randn(o, i, dtype=dtype) for (o, i) in shapes] for _ in range(layers)]
    ws.append([torch.randn(int(cfg["vocab_size"]), int(cfg["hidden_size"]), dtype=dtype)])  # the LM head
    wts = [[w.t().contiguous() for w in lw] for lw in ws]
    dnn = torch.backends.mkldnn.is_available()
    packed = [[_mkldnn_linear(w) for w in lw] for lw in ws] if dnn else None
    reorder = torch.ops.mkldnn._reorder_linear_weight
    reordered = [[reorder(w, ONEDNN_PACK_ROWS) for w in lw] for lw in ws] if dnn else None
    kern = dtype == torch.float32 and cpu_bf16w.unavailable() is None
    panels = [[cpu_bf16w.pack(w.to(torch.bfloat16)) for w in lw] for lw in ws] if kern else None

    def one(m: int, mode: str) -> float:
        xs = {i: torch.randn(m, i, dtype=dtype) for (_, i) in shapes + [(0, int(cfg["hidden_size"]))]}
        pad = {i: torch.cat([x, x.new_zeros(-m % 4, i)]) for i, x in xs.items()}
        t = time.perf_counter()
        for li, (lw, lwt) in enumerate(zip(ws, wts, strict=True)):
            for j, (w, wt) in enumerate(zip(lw, lwt, strict=True)):
                if mode == "linear":
                    torch.nn.functional.linear(xs[w.shape[1]], w)
                elif mode == "xWt":
                    xs[w.shape[1]] @ wt
                elif mode == "pad4":
                    torch.nn.functional.linear(pad[w.shape[1]], w)
                elif mode == "mkldnn":
                    packed[li][j](xs[w.shape[1]].to_mkldnn()).to_dense()
                elif mode == "bf16w":
                    cpu_bf16w.linear(xs[w.shape[1]], panels[li][j], w.shape[0])
                else:
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], reordered[li][j], None, "none", [], "")
        return time.perf_counter() - t

    modes = [m for m in MODES if (m not in ("mkldnn", "onednn") or dnn) and (m != "bf16w" or kern)]
    out: dict = {mode: {} for mode in modes}
    with torch.inference_mode():
        for m in range(1, widths + 1):
            for mode in modes:
                one(m, mode)  # warm
            best = {mode: min(one(m, mode) for _ in range(repeats)) for mode in modes}
            for mode in modes:
                out[mode][str(m)] = round(1e3 * best[mode], 2)
            print(f"w{m}: " + "  ".join(f"{mode} {out[mode][str(m)]:6.1f} ms" for mode in modes), file=sys.stderr,
                  flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="a Hugging Face model directory (default: the smollm2 deployment's)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--widths", type=int, default=8, help="widths 1..N (default 8)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    if not 1 <= args.widths <= 64 or args.repeats < 1 or args.threads < 1:
        print("error: --widths 1-64, --repeats and --threads at least 1", file=sys.stderr)
        return 2
    try:
        target = Path(args.target) if args.target else smollm2_deployment().target
        cfg = model_config(target, "target")
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    report = {"target": str(target), "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats,
              "shapes_per_layer": layer_shapes(cfg), "layers": int(cfg["num_hidden_layers"]),
              "ms_per_forward_matmuls": measure(cfg, getattr(torch, args.dtype), args.widths, args.repeats)}
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
