"""Mechanism bf16w-fused-layer: a Llama-style layer's work around attention as two calls of the bf16w kernel
library (kernels/cpu_bf16w.c: norm, QKV, RoPE; then O, residual, norm, gate/up, SiLU and product, down, residual)."""

from __future__ import annotations

import copy

import pytest
import torch

from decoder.batch import BatchEngine, BatchLM, Request
from decoder.capabilities import refusal
from decoder.config import ConfigError, DecodeConfig
from decoder.generate import generate
from decoder.lab.batch_bench import forward_of
from decoder.lean import LeanLM, LeanUnsupported
from decoder.presets import preset_config
from kernels import cpu_bf16w
from tests.test_lean_archs import _model

pytestmark = pytest.mark.skipif(cpu_bf16w.unavailable() is not None, reason=str(cpu_bf16w.unavailable()))


def _bf16_exact(model: torch.nn.Module) -> torch.nn.Module:
    """A bf16 checkpoint loaded as float32: every weight an exact bf16 value (what the kernel packs)."""
    return copy.deepcopy(model).to(torch.bfloat16).to(torch.float32)


@torch.inference_mode()
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral-sw"])
def test_fused_layer_matches_the_op_by_op_layer_at_every_width(arch):
    """Llama, Qwen2 (q/k/v biases) and a sliding-window Mistral: logits of the fused layer within float32 rounding
    of the op-by-op layer on the same kernel at widths 1 to MAX_ROWS (a prefill above runs op by op), and of
    torch's; a width-1 call of the fused layer gives the row it gives inside a wider call's first row when the
    attention is the same (the kernel calls are per row)."""
    model = _bf16_exact(_model(arch))
    ops, fused, plain = LeanLM(model), LeanLM(model), LeanLM(model)
    ops.set_matmul_backend("bf16w")
    fused.set_matmul_backend("bf16w")
    fused.set_fused_layer(True)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(1, 256, (cpu_bf16w.MAX_ROWS + 5,), generator=gen)
    caches = [lm.new_cache() for lm in (ops, fused, plain)]
    for ids in (prompt, *(torch.randint(1, 256, (q,), generator=gen) for q in (1, 3, 12, 13, cpu_bf16w.MAX_ROWS))):
        a, b, c = (lm.forward(ids, cache) for lm, cache in zip((ops, fused, plain), caches, strict=True))
        assert (a - b).abs().max().item() <= 1e-4, (arch, ids.shape[0])
        assert (c - b).abs().max().item() <= 1e-4, (arch, ids.shape[0])


@torch.inference_mode()
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bfloat16_fused_layer_rounds_where_the_op_by_op_layer_rounds(arch):
    """A bfloat16 model: the fused layer rounds each step to bfloat16 where the op-by-op bfloat16 layer does, so
    its logits equal the op-by-op layer's on the same kernel at widths 1 to 64 (measured bit-identical on these
    models and on the demo; a float32 summation order may move a value across a rounding boundary, so the test
    allows 2% of logits one bf16 step apart), and stay within bfloat16 rounding of torch's matmuls; a prefill
    above bf16w_rows runs op by op; the fused calls take and give bfloat16 rows. Weights in pairs of k where the
    CPU has AVX512-BF16 (then the op-by-op layer multiplies with the same dot products)."""
    model = _model(arch).to(torch.bfloat16)
    ops, fused, plain = LeanLM(model), LeanLM(model), LeanLM(model)
    ops.set_matmul_backend("bf16w")
    fused.set_matmul_backend("bf16w")
    fused.set_fused_layer(True)
    layout = torch.int32 if cpu_bf16w.pairs_available() else torch.int16
    assert all(p.dtype == layout for p, _ in fused._bf16w.values())
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(1, 256, (cpu_bf16w.MAX_ROWS + 5,), generator=gen)
    caches = [lm.new_cache() for lm in (ops, fused, plain)]
    for ids in (prompt, *(torch.randint(1, 256, (q,), generator=gen) for q in (1, 3, 12, 13, 1, cpu_bf16w.MAX_ROWS))):
        a, b, c = (lm.forward(ids, cache) for lm, cache in zip((ops, fused, plain), caches, strict=True))
        assert b.dtype == torch.bfloat16
        step = a.float().abs().clamp_min(2 ** -60) * 2 ** -7
        assert ((a.float() - b.float()).abs() <= step).all() and (a != b).float().mean().item() <= 0.02, ids.shape
        assert (c.float() - b.float()).abs().max().item() <= 0.1, (arch, ids.shape[0])
    counts = {"pre": 0}
    pre = cpu_bf16w.pre_attn

    def counted(x, *rest):
        counts["pre"] += 1
        assert x.dtype == torch.bfloat16
        return pre(x, *rest)

    cpu_bf16w.pre_attn = counted
    try:
        fused.forward(prompt[:3], fused.new_cache())
        assert counts["pre"] == len(fused.layers)
        fused.forward(prompt, fused.new_cache())  # 69 rows > bf16w_rows: op by op, no fused call
        assert counts["pre"] == len(fused.layers)
    finally:
        cpu_bf16w.pre_attn = pre


@torch.inference_mode()
def test_fused_layer_kernel_calls_are_per_row():
    """pre_attn and post_attn: row m of an M-row call bit-identical to the same row alone (norm, RoPE, SiLU and
    the matmuls are per row), so a verify scores a row as a one-row step does apart from attention."""
    lean = LeanLM(_bf16_exact(_model("llama")))
    lean.set_matmul_backend("bf16w")
    ly, w = lean.layers[0], lean._bf16w
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(13, lean.config.hidden_size, generator=gen)
    att = torch.randn(13, lean.q_size, generator=gen)
    cos, sin = lean.cos[5:18, None, :].contiguous(), lean.sin[5:18, None, :].contiguous()

    def pre(lo, hi):
        return cpu_bf16w.pre_attn(x[lo:hi], ly.ln1, lean.eps, w[id(ly.wqkv)], ly.bqkv, cos[lo:hi], sin[lo:hi],
                                  lean.n_heads, lean.n_kv, lean.head_dim)

    def post(lo, hi):
        return cpu_bf16w.post_attn(x[lo:hi], att[lo:hi], w[id(ly.wo)], ly.bo, ly.ln2, lean.eps, w[id(ly.wgu)],
                                   ly.bgu, w[id(ly.wdown)], ly.bdown)

    full_pre, full_post = pre(0, 13), post(0, 13)
    for m in (0, 7, 12):
        assert torch.equal(full_pre[m], pre(m, m + 1)[0]) and torch.equal(full_post[m], post(m, m + 1)[0]), m
    with pytest.raises(ValueError, match=r"bf16w post_attn: x \(13, 64\) .*att \(12, 64\)"):
        cpu_bf16w.post_attn(x, att[:12], w[id(ly.wo)], ly.bo, ly.ln2, lean.eps, w[id(ly.wgu)], ly.bgu,
                            w[id(ly.wdown)], ly.bdown)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sd_and_batches_on_the_fused_layer_keep_ar_tokens(tiny_fp32, tiny_prompts, dtype):
    """SD through `generate` and through the batched engine (ragged, scheduled) on the fused layer give AR's tokens
    on the fused layer: the mechanism changes no token its own AR would not (a float32 and a bfloat16 model)."""
    model, drafter = (_bf16_exact(m).to(getattr(torch, dtype)) for m in tiny_fp32)
    base = DecodeConfig(lean_forward=True, max_new_tokens=24, dtype=dtype, stop_at_eos=False,
                        matmul_backend="bf16w", fused_layer=True)
    ref = {i: generate(DecodeConfig(**{**base.as_dict(), "method": "ar"}), model, p, None).tokens
           for i, p in enumerate(tiny_prompts)}
    for k in (1, 4):
        cfg = DecodeConfig(**{**base.as_dict(), "drafter": "draft-model", "draft_len": k})
        assert generate(cfg, model, tiny_prompts[1], drafter).tokens == ref[1], k
    cfg = DecodeConfig(**{**base.as_dict(), "drafter": "draft-model", "draft_len": 4, "ragged_verify": True,
                          "load_schedule": "1:4,2:2"})
    run = BatchEngine(BatchLM(model), cfg, 3, BatchLM(drafter)).run(
        [Request(p, 0.0, i) for i, p in enumerate(tiny_prompts)])
    assert {i: r.tokens for i, r in enumerate(run.results)} == ref


def test_fused_layer_config_and_capabilities_refuse_what_it_cannot_run(tiny_fp32):
    """One line each: without the bf16w backend (config and LeanLM), on a Qwen3 / Gemma / Gemma 2 / partial-rotary
    target (capabilities, and LeanLM on the loaded model)."""
    with pytest.raises(ConfigError, match="fused_layer = True is invalid: it runs on the bf16w kernel; set "
                                          "matmul_backend"):
        DecodeConfig(lean_forward=True, fused_layer=True)
    cfg = DecodeConfig(lean_forward=True, matmul_backend="bf16w", fused_layer=True)
    assert refusal(cfg, tiny_fp32[0].config, None, "float32") is None
    for arch, kind in (("qwen3", "a qwen3 model"), ("gemma", "a gemma model"), ("gemma2", "a gemma2 model"),
                       ("phi3", "a partial rotary")):
        why = refusal(cfg, _model(arch).config, None, "float32")
        assert why is not None and why.startswith("target: fused_layer runs Llama-style layers") and kind in why
        assert "\n" not in why
    assert refusal(cfg, tiny_fp32[0].config, None, "bfloat16") is None
    why = refusal(cfg, tiny_fp32[0].config, None, "float16")
    assert why is not None and "\n" not in why and ("loaded as float16" in why)
    lean = LeanLM(_bf16_exact(tiny_fp32[0]))
    with pytest.raises(LeanUnsupported, match='fused_layer runs on the bf16w kernel.s panels; set matmul_backend'):
        lean.set_fused_layer(True)
    q3 = LeanLM(_bf16_exact(_model("qwen3")))
    q3.set_matmul_backend("bf16w")
    with pytest.raises(LeanUnsupported, match="normalises q/k or the sublayer outputs; use fused_layer = false"):
        q3.set_fused_layer(True)
    assert not q3.fused_layer


def test_silu_of_the_fused_layer_is_within_two_ulp_of_float64():
    """Its exp is a degree-7 polynomial after range reduction: silu(g) * u within a few float32 ulps of the
    float64 value over the range activations take, the vector lanes and the scalar tail (I = 37) alike; saturates
    cleanly far out (no inf or NaN)."""
    g = torch.cat([torch.linspace(-30, 30, 4001), torch.tensor([-200.0, -89.0, 89.0, 200.0, 0.0])])
    n = g.numel() - g.numel() % 37
    g = g[:n].view(-1, 37)
    u = torch.full_like(g, 1.5)
    got = cpu_bf16w.silu_mul(torch.cat([g, u], dim=1)).double()
    ref = torch.nn.functional.silu(g.double()) * 1.5
    assert torch.isfinite(got).all()
    rel = ((got - ref).abs() / ref.abs().clamp_min(1e-30))[ref.abs() > 1e-30]
    assert rel.max().item() <= 4 * 2 ** -24


def test_the_batched_bench_divides_a_layer_method_by_ar_on_the_fused_layer():
    """A `*-layer` method's "same forward" batched AR runs the fused layer too (session 34 first measured it
    against AR without it: 3.12x at B = 1 and 1.66x at B = 8 where AR on the fused layer gives 2.19x and 1.46x)."""
    f = forward_of(preset_config("sd-corpus-lean-layer", DecodeConfig(dtype="float32")))
    assert f["fused_layer"] is True and f["matmul_backend"] == "bf16w"
