"""w12 in the decoder: swap a target's linear layers for `W12Linear`, and checkpoint statistics.

`apply_w12` replaces the attention and MLP projections (q/k/v/o, gate/up/down) of a loaded bf16
model in place. The embedding stays bf16, and so does a tied lm_head (it *is* the embedding; packing
it would keep two copies). On the reference backend the swapped model computes exactly what the bf16
model computes (unpack, then the same F.linear); the Triton backend reads 12 bits per weight and may
differ by fp32 accumulation order (near-ties only).

`w12_stats` reads a checkpoint's safetensors files tensor by tensor (no model is built) and reports,
per matrix and in total, the escape rate, bits per weight and bytes saved that packing would give.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from decoder.models import ModelLoadError
from kernels.w12 import BACKENDS, W12Linear, window_stats

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_bytes(model: nn.Module) -> int:
    """Bytes held by a model's parameters and buffers, each storage counted once (tied weights once)."""
    seen: set[int] = set()
    total = 0
    for t in (*model.parameters(), *model.buffers()):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def _is_tied(model: nn.Module, linear: nn.Linear) -> bool:
    get_inputs = getattr(model, "get_input_embeddings", None)
    emb = get_inputs() if callable(get_inputs) else None
    return emb is not None and emb.weight.untyped_storage().data_ptr() == linear.weight.untyped_storage().data_ptr()


def apply_w12(model: nn.Module, group_size: int | None = None, backend: str = "auto",
              targets: tuple[str, ...] = DEFAULT_TARGETS) -> dict:
    """Swap every bf16 nn.Linear whose name ends in one of `targets` for a W12Linear, in place.

    group_size: None for one exponent base per tensor, else weights per group along a row.
    backend: "auto" (Triton on CUDA inputs, reference on CPU), "reference" or "triton".
    Returns the memory footprint before and after and the packed layers' escape rate and bits per weight.
    `targets` may name "lm_head" when it is untied; a tied one raises ValueError.
    """
    if backend not in BACKENDS:
        raise ValueError(f"apply_w12: backend {backend!r} is unknown; use one of {', '.join(BACKENDS)}")
    before = model_bytes(model)
    chosen: list[tuple[str, nn.Linear]] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            if module.weight.dtype != torch.bfloat16:
                raise ValueError(f"apply_w12: {name}.weight is {module.weight.dtype}; w12 packs bf16 weights "
                                 f"(load the model with dtype='bfloat16')")
            if name.rsplit(".", 1)[-1] == "lm_head" and _is_tied(model, module):
                raise ValueError("apply_w12: lm_head is tied to the input embedding; leave it out of targets "
                                 "(packing it would keep a second copy)")
            chosen.append((name, module))
    if not chosen:
        raise ValueError(f"apply_w12: no nn.Linear named {', '.join(targets)} in {type(model).__name__}")

    numel = escapes = bytes_bf16 = bytes_w12 = 0
    for name, linear in chosen:
        packed = W12Linear.from_linear(linear, group_size, backend)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, packed)
        n = linear.weight.numel()
        numel += n
        escapes += packed.esc_col.numel()
        bytes_bf16 += 2 * n
        bytes_w12 += packed.packed.nbytes
    after = model_bytes(model)
    return {
        "layers": len(chosen), "group_size": group_size, "backend": backend,
        "bytes_before": before, "bytes_after": after, "bytes_saved": before - after,
        "saved_fraction": (before - after) / before,
        "linear_bytes_bf16": bytes_bf16, "linear_bytes_w12": bytes_w12,
        "escapes": escapes, "escape_rate": escapes / numel, "bits_per_weight": 8 * bytes_w12 / numel,
    }


def _totals(rows: list[dict]) -> dict:
    numel = sum(r["numel"] for r in rows)
    if not numel:
        return {"tensors": 0, "numel": 0, "escapes": 0, "escape_rate": 0.0, "bits_per_weight": 0.0,
                "bytes_bf16": 0, "bytes_w12": 0, "bytes_saved": 0}
    escapes = sum(r["escapes"] for r in rows)
    b16, b12 = sum(r["bytes_bf16"] for r in rows), sum(r["bytes_w12"] for r in rows)
    return {"tensors": len(rows), "numel": numel, "escapes": escapes, "escape_rate": escapes / numel,
            "bits_per_weight": 8 * b12 / numel, "bytes_bf16": b16, "bytes_w12": b12, "bytes_saved": b16 - b12}


def w12_stats(model_dir: Path | str, group_size: int | None = None,
              targets: tuple[str, ...] = DEFAULT_TARGETS) -> dict:
    """Per-matrix and total escape rate, bits per weight and bytes saved of a local safetensors checkpoint.

    Every 2-D floating tensor is counted (non-bf16 ones as cast to bf16, which is what a bf16 load
    runs); `swapped` marks those `apply_w12` would pack. `total` covers all matrices, `swapped` the
    packed ones only (the embedding and a tied lm_head stay bf16).
    """
    from safetensors import safe_open

    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist; pass a local checkpoint directory")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files; w12 stats reads safetensors checkpoints")
    if group_size is not None and group_size < 1:
        raise ValueError(f"group size {group_size} must be at least 1 (or omitted: one base per tensor)")
    rows: list[dict] = []
    skipped = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if t.dim() != 2 or not t.is_floating_point():
                    skipped += 1
                    continue
                stats = window_stats(t.to(torch.bfloat16), group_size)
                stats.pop("base")
                module = name.removesuffix(".weight").rsplit(".", 1)[-1]
                rows.append({"name": name, "source_dtype": str(t.dtype).removeprefix("torch."),
                             "swapped": name.endswith(".weight") and module in targets, **stats})
    if not rows:
        raise ModelLoadError(f"{path}: no 2-D floating tensors in {len(files)} safetensors file(s)")
    return {"model": str(path), "group_size": group_size, "tensors": rows, "skipped_non_matrices": skipped,
            "total": _totals(rows), "swapped": _totals([r for r in rows if r["swapped"]])}
