"""Mechanism bf16w-matmul: the CPU kernel multiplying float32 rows by bfloat16-held weights (kernels/cpu_bf16w.c),
and the lean forward on it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from decoder.capabilities import refusal
from decoder.config import ConfigError, DecodeConfig
from decoder.generate import generate
from decoder.lean import LeanLM, LeanUnsupported
from kernels import cpu_bf16w

pytestmark = pytest.mark.skipif(cpu_bf16w.unavailable() is not None, reason=str(cpu_bf16w.unavailable()))


def _bf16_exact(shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.1).to(torch.bfloat16).float()


@pytest.mark.parametrize("n,k", [(32, 16), (40, 72), (96, 8), (7, 33)])
def test_kernel_matches_float64_and_each_row_is_the_one_row_call(n, k):
    """Each output within float32 rounding of the exact product (bias added), for row counts across the kernel's
    12-row blocks and N not a multiple of its 32-output panels; and row m of an M-row call is bit-identical to
    the same row alone (one FMA chain per output in k order at any M): a verify scores a row as a step does."""
    w = _bf16_exact((n, k), 1)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    panels = cpu_bf16w.pack(w)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(3))
    ref = (x.double() @ w.double().T + bias.double())
    scale = (x.double().abs() @ w.double().abs().T).max().item() + bias.abs().max().item()
    for m in (1, 5, 12, 13, 30, 64):
        y = cpu_bf16w.linear(x[:m], panels, n, bias)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert (y.double() - ref[:m]).abs().max().item() <= 4 * k * 2 ** -24 * scale, m
        for row in (0, m - 1):
            assert torch.equal(y[row], cpu_bf16w.linear(x[row : row + 1], panels, n, bias)[0]), (m, row)
    nobias = cpu_bf16w.linear(x[:3], panels, n)
    assert (nobias.double() - (ref[:3] - bias.double())).abs().max().item() <= 4 * k * 2 ** -24 * scale


def test_pack_refuses_what_bfloat16_cannot_hold_and_bad_inputs_in_one_line():
    w = _bf16_exact((8, 16), 4)
    w[3, 5] += 1e-4  # no longer a bf16 value
    with pytest.raises(ValueError, match=r"holds 1 values bfloat16 cannot represent exactly") as e:
        cpu_bf16w.pack(w)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="packs a 2-D float32 or bfloat16 CPU weight, not torch.float16"):
        cpu_bf16w.pack(w.half())
    panels = cpu_bf16w.pack(_bf16_exact((8, 16), 5))
    with pytest.raises(ValueError, match="does not fit x"):
        cpu_bf16w.linear(torch.randn(2, 17), panels, 8)
    with pytest.raises(ValueError, match="multiplies float32 or bfloat16 rows, not torch.float64"):
        cpu_bf16w.linear(torch.randn(2, 16, dtype=torch.float64), panels, 8)


@torch.inference_mode()
def test_lean_forward_on_bf16w_matches_torch_and_keeps_tokens(tiny_fp32, tiny_prompts):
    """A float32 model with bf16-exact weights (a bf16 checkpoint loaded as float32): logits within float32
    rounding of F.linear's at every width (prefill above MAX_ROWS included), SD through `generate` token-identical
    to AR on the kernel; switching back keeps the panels; a model whose weights bf16 cannot hold is refused in
    one line and stays on "torch"."""
    model = copy.deepcopy(tiny_fp32[0]).to(torch.bfloat16).to(torch.float32)
    drafter = copy.deepcopy(tiny_fp32[1]).to(torch.bfloat16).to(torch.float32)
    plain, kern = LeanLM(model), LeanLM(model)
    kern.set_matmul_backend("bf16w")
    assert kern.matmul_backend == "bf16w" and len(kern._bf16w) == 4 * len(kern.layers) + 1
    long = torch.tensor((tiny_prompts[1] * 3)[: cpu_bf16w.MAX_ROWS + 8])
    c1, c2 = plain.new_cache(), kern.new_cache()
    for ids in (long, long[-6:-4], long[-4:-1], long[-1:]):  # F.linear above MAX_ROWS, then widths 2, 3, 1
        assert (plain.forward(ids, c1) - kern.forward(ids, c2)).abs().max().item() <= 1e-4
    panels = kern._bf16w
    kern.set_matmul_backend("torch")
    assert not kern._bf16w
    kern.set_matmul_backend("bf16w")
    assert kern._bf16w is panels  # the batched engine switches per request: nothing is packed again
    base = DecodeConfig(lean_forward=True, max_new_tokens=24, dtype="float32", stop_at_eos=False,
                        matmul_backend="bf16w")
    ref = generate(DecodeConfig(**{**base.as_dict(), "method": "ar", "matmul_backend": "torch"}), model,
                   tiny_prompts[1], None).tokens
    assert generate(DecodeConfig(**{**base.as_dict(), "method": "ar"}), model, tiny_prompts[1], None).tokens == ref
    for k in (1, 4):
        cfg = DecodeConfig(**{**base.as_dict(), "drafter": "draft-model", "draft_len": k})
        assert generate(cfg, model, tiny_prompts[1], drafter).tokens == ref, k
    raw = LeanLM(tiny_fp32[0])  # random float32 weights: not a bf16 checkpoint
    with pytest.raises(LeanUnsupported, match=r'matmul_backend = "bf16w": a \(\d+, \d+\) weight holds \d+ values') as e:
        raw.set_matmul_backend("bf16w")
    assert "\n" not in str(e.value) and raw.matmul_backend == "torch" and not raw._bf16w


def test_bf16w_config_and_capabilities_refuse_what_it_cannot_run(tiny_fp32):
    with pytest.raises(ConfigError, match="matmul_backend = 'bf16w' is invalid: it changes the lean forward"):
        DecodeConfig(matmul_backend="bf16w")
    with pytest.raises(ConfigError, match="the bf16w kernel runs on the CPU; use \"torch\" on 'cuda'"):
        DecodeConfig(lean_forward=True, matmul_backend="bf16w", device="cuda")
    cfg = DecodeConfig(lean_forward=True, matmul_backend="bf16w")
    why = refusal(cfg, tiny_fp32[0].config, None, "float16")
    assert why is not None and "loaded as float16" in why and "\n" not in why
    assert refusal(cfg, tiny_fp32[0].config, None, "float32") is None
    assert refusal(cfg, tiny_fp32[0].config, None, "bfloat16") is None
    lean = LeanLM(copy.deepcopy(tiny_fp32[0]).to(torch.float16))
    with pytest.raises(LeanUnsupported, match="multiplies float32 or bfloat16 activations on the CPU, not "
                                              "torch.float16"):
        lean.set_matmul_backend("bf16w")
    with pytest.raises(ConfigError, match="bf16w_rows = 8 is invalid: it limits the bf16w kernel"):
        DecodeConfig(lean_forward=True, bf16w_rows=8)
    with pytest.raises(ConfigError, match="bf16w_rows = 65 is invalid: use 1 to 64"):
        DecodeConfig(lean_forward=True, matmul_backend="bf16w", bf16w_rows=65)


PAIRS = [False, pytest.param(True, marks=pytest.mark.skipif(
    cpu_bf16w.unavailable() is not None or not cpu_bf16w.pairs_available(), reason="no AVX512-BF16 on this CPU"))]


@pytest.mark.parametrize("pairs", PAIRS)
@pytest.mark.parametrize("n,k", [(32, 16), (40, 72), (7, 34), (640, 384)])
def test_bfloat16_rows_round_once_as_torch_bfloat16_matmul(n, k, pairs):
    """A bfloat16 deployment: bfloat16 rows in, bfloat16 out, each output the float32 sum (bias added) rounded once
    to nearest-even: equal to the float64 product rounded to bfloat16 except where the float32 sum lands on the
    other side of a rounding boundary (at most one bf16 ulp, rarely), and so to torch's bfloat16 F.linear; row m
    of an M-row call is bit-identical to the row alone. Weights packed by k (FMA chains) and in pairs of k
    (AVX512-BF16 dot products, where the CPU has them)."""
    w = _bf16_exact((n, k), 6).to(torch.bfloat16)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    panels = cpu_bf16w.pack(w, pairs)
    assert panels.dtype == (torch.int32 if pairs else torch.int16)
    x = torch.randn(24, k, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    exact = (x.double() @ w.double().T + bias.double()).to(torch.bfloat16)
    for m in (1, 5, 12, 13, 24):
        y = cpu_bf16w.linear(x[:m], panels, n, bias)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        ulp = exact[:m].float().abs().clamp_min(2 ** -100) * 2 ** -7
        off = (y.float() - exact[:m].float()).abs()
        assert (off <= ulp).all() and (y != exact[:m]).float().mean().item() <= 0.01, m
        assert ((y.float() - F.linear(x[:m], w, bias).float()).abs() <= ulp).all(), m
        for row in (0, m - 1):
            assert torch.equal(y[row], cpu_bf16w.linear(x[row : row + 1], panels, n, bias)[0]), (m, row)
    nan = x[:2].clone()
    nan[1, 0] = float("nan")
    y = cpu_bf16w.linear(nan, panels, n)
    assert torch.isnan(y[1]).all() and not torch.isnan(y[0]).any()
    if pairs:
        with pytest.raises(ValueError, match="weights packed in pairs multiply bfloat16 rows, not torch.float32"):
            cpu_bf16w.linear(x.float(), panels, n)
        with pytest.raises(ValueError, match=r"in pairs of k only for an even K .*; use pairs=False"):
            cpu_bf16w.pack(w[:, :-1].contiguous(), True)


@torch.inference_mode()
def test_lean_bfloat16_forward_on_bf16w_keeps_tokens_and_bf16w_rows_routes_calls(tiny_fp32, tiny_prompts):
    """A bfloat16 model: logits of the lean forward on the kernel within bfloat16 rounding of torch's at every
    width; AR and SD through `generate` on the kernel give the same tokens as on torch's matmuls; bf16w_rows
    sends wider calls to F.linear (then bit-identical to the torch backend's forward)."""
    model = copy.deepcopy(tiny_fp32[0]).to(torch.bfloat16)
    drafter = copy.deepcopy(tiny_fp32[1]).to(torch.bfloat16)
    plain, kern = LeanLM(model), LeanLM(model)
    kern.set_matmul_backend("bf16w")
    ids = torch.tensor(tiny_prompts[1])
    c1, c2 = plain.new_cache(), kern.new_cache()
    for part in (ids[:30], ids[30:35], ids[35:36]):
        a, b = plain.forward(part, c1), kern.forward(part, c2)
        assert b.dtype == torch.bfloat16 and (a.float() - b.float()).abs().max().item() <= 0.05
    kern.set_bf16w_rows(4)
    c1, c2 = plain.new_cache(), kern.new_cache()
    assert torch.equal(plain.forward(ids[:9], c1), kern.forward(ids[:9], c2))  # 9 rows > 4: F.linear throughout
    with pytest.raises(LeanUnsupported, match="bf16w_rows = 0: use 1 to 64"):
        kern.set_bf16w_rows(0)
    base = DecodeConfig(lean_forward=True, max_new_tokens=24, dtype="bfloat16", stop_at_eos=False)
    ref = generate(DecodeConfig(**{**base.as_dict(), "method": "ar"}), model, tiny_prompts[1], None).tokens
    on = {**base.as_dict(), "matmul_backend": "bf16w"}
    assert generate(DecodeConfig(**{**on, "method": "ar"}), model, tiny_prompts[1], None).tokens == ref
    for rows in (64, 2):
        cfg = DecodeConfig(**{**on, "drafter": "draft-model", "draft_len": 4, "bf16w_rows": rows})
        assert generate(cfg, model, tiny_prompts[1], drafter).tokens == ref, rows


def test_kernel_agrees_with_f_linear_on_the_demo_shapes():
    """The demo target's shapes (fused QKV 640x384, gate/up 2048x384, down 384x1024, head 6144x384) at decode and
    verify widths: within float32 rounding of F.linear."""
    for n, k in ((640, 384), (2048, 384), (384, 1024), (6144, 384)):
        w = _bf16_exact((n, k), n + k)
        panels = cpu_bf16w.pack(w)
        for m in (1, 9, 24):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            assert (cpu_bf16w.linear(x, panels, n) - F.linear(x, w)).abs().max().item() <= 1e-4, (n, k, m)
