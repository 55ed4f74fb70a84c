"""Mechanism lean_forward: the compact forward against the Hugging Face path it replaces."""

import copy

import pytest
import torch
from conftest import needs_demo, tiny_llama

from decoder.capabilities import onednn_bf16_refusal
from decoder.config import ConfigError, DecodeConfig
from decoder.drafters import DraftModelDrafter, NgramDrafter
from decoder.generate import HFRunner, ar_generate, crop_cache, speculative_generate
from decoder.lean import ONEDNN_BUCKETS, ONEDNN_WARM_MAX, LeanLM, LeanUnsupported, _onednn_linear, onednn_rows


@needs_demo
@pytest.mark.parametrize("pair", ["demo_fp32", "demo_bf16"])
def test_logits_match_hf(pair, request, demo_prompts):
    """Prefill, a verify block and a decode step: equal to HF's logits within bf16's spacing."""
    for model in request.getfixturevalue(pair):
        hf, lean = HFRunner(model), LeanLM(model)
        c_hf, c_lean = hf.new_cache(), lean.new_cache()
        p = torch.tensor(demo_prompts[0])
        for ids, last in ((p[:-5], False), (p[-5:], False), (torch.tensor([7]), True)):
            a, b = hf.forward(ids, c_hf, last), lean.forward(ids, c_lean, last)
            tol = 0.0 if model.dtype == torch.float32 else 0.125
            assert (a.float() - b.float()).abs().max().item() <= tol + 1e-4


@pytest.mark.parametrize("drafter", ["draft-model", "ngram"])
def test_lean_sd_token_identical_to_ar_fp32(tiny_fp32, tiny_prompts, drafter):
    _lean_sweep(tiny_fp32, tiny_prompts[:2], drafter)


@needs_demo
@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["draft-model", "ngram"])
def test_lean_sd_token_identical_to_ar_fp32_demo(demo_fp32, demo_prompts, drafter):
    _lean_sweep(demo_fp32, demo_prompts[:2], drafter)


def _lean_sweep(pair, prompts, drafter: str) -> None:
    target, draft_model = (LeanLM(m) for m in pair)
    cfg = DecodeConfig(max_new_tokens=40, dtype="float32", stop_at_eos=False)
    for prompt in prompts:
        ref = ar_generate(pair[0], prompt, DecodeConfig(**{**cfg.as_dict(), "method": "ar"})).tokens
        assert ar_generate(target, prompt, DecodeConfig(**{**cfg.as_dict(), "method": "ar"})).tokens == ref
        for k in range(1, 9):
            d = DraftModelDrafter(draft_model) if drafter == "draft-model" else NgramDrafter(4, 1)
            c = DecodeConfig(**{**cfg.as_dict(), "draft_len": k, "drafter": drafter})
            assert speculative_generate(target, d, prompt, c).tokens == ref, k


@needs_demo
@torch.inference_mode()
def test_lean_cache_rollback_is_exact(demo_fp32, demo_prompts):
    lean = LeanLM(demo_fp32[0])
    prompt = torch.tensor(demo_prompts[0][:64])
    nxt = torch.tensor([int(prompt[-1]), 42, 43])

    def run(junk):
        cache = lean.new_cache()
        lean.forward(prompt, cache)
        if junk is not None:
            lean.forward(junk, cache)
        crop_cache(cache, len(prompt) - 1)
        return lean.forward(nxt, cache)

    assert torch.equal(run(torch.tensor([11, 12, 13, 14, 15])), run(None))


@needs_demo
def test_generate_dispatches_lean(demo_fp32, demo_prompts):
    from decoder.generate import generate

    cfg = DecodeConfig(method="sd", lean_forward=True, max_new_tokens=16, dtype="float32", stop_at_eos=False)
    ref = ar_generate(demo_fp32[0], demo_prompts[1], DecodeConfig(method="ar", max_new_tokens=16,
                                                                  dtype="float32", stop_at_eos=False)).tokens
    assert generate(cfg, demo_fp32[0], demo_prompts[1], demo_fp32[1]).tokens == ref


def test_buffer_overflow_and_unsupported_model_are_clear():
    model = tiny_llama()
    lean = LeanLM(model, max_len=8)
    with pytest.raises(ValueError, match="exceeds the KV buffer"):
        lean.forward(torch.arange(9), lean.new_cache())
    model.config.model_type = "gpt2"
    with pytest.raises(LeanUnsupported, match="gpt2"):
        LeanLM(model)


@needs_demo
def test_static_step_matches_lean_and_buckets(demo_fp32, demo_prompts):
    """The bucketed static step (CUDA-graph path, run eagerly here): logits as LeanLM's, any width."""
    from decoder.lean import StaticLeanLM, bucket_for

    assert [bucket_for(q) for q in (1, 2, 3, 5, 9, 17, 32)] == [1, 2, 4, 8, 16, 32, 32]
    with pytest.raises(ValueError, match="exceed the largest bucket"):
        bucket_for(33)
    lean = LeanLM(demo_fp32[0])
    static = StaticLeanLM(LeanLM(demo_fp32[0]), max_len=512, use_graphs=False)
    c1, c2 = lean.new_cache(), static.new_cache()
    p = demo_prompts[0]
    for ids, last in ((p, True), ([5, 6, 7], False), ([9], True), (list(range(10, 19)), False), ([4, 4], True)):
        a = lean.forward(torch.tensor(ids), c1, last)
        b = static.forward(torch.tensor(ids), c2, last)
        assert a.shape == b.shape
        assert (a - b).abs().max().item() < 1e-4  # fp32: only the attention's reduction length differs
        assert c1.length == c2.length
    crop_cache(c2, 10)
    with pytest.raises(ValueError, match="exceed the KV buffer"):
        static.forward(torch.arange(5), StaticLeanLM(LeanLM(demo_fp32[0]), max_len=4, use_graphs=False).new_cache())


@needs_demo
def test_static_sd_token_identical_fp32(demo_fp32, demo_prompts):
    from decoder.generate import generate

    base = dict(max_new_tokens=40, dtype="float32", stop_at_eos=False)
    ref = ar_generate(demo_fp32[0], demo_prompts[0], DecodeConfig(method="ar", **base)).tokens
    for k in (1, 3, 8):
        cfg = DecodeConfig(draft_len=k, lean_forward=True, cuda_graphs=True, **base)
        assert generate(cfg, demo_fp32[0], demo_prompts[0], demo_fp32[1]).tokens == ref, k
    with pytest.raises(ValueError, match="set lean_forward = true"):
        DecodeConfig(cuda_graphs=True)


@torch.inference_mode()
def test_transposed_matmul_matches_linear_and_keeps_tokens(tiny_fp32, tiny_prompts):
    """Mechanism transposed-matmul: calls of up to matmul_t_rows rows use x @ W^T (a transposed copy), wider ones
    F.linear; logits agree within f32 rounding at every width, and SD through `generate` stays token-identical
    to AR at widths on both sides of the cut."""
    from decoder.generate import generate

    model = tiny_fp32[0]
    plain, t = LeanLM(model), LeanLM(model)
    t.set_transposed_rows(3)
    assert len(t._wt) == 4 * len(t.layers) + 1 and not plain._wt
    p = torch.tensor(tiny_prompts[0])
    c1, c2 = plain.new_cache(), t.new_cache()
    for ids in (p[:-6], p[-6:-4], p[-4:-1], p[-1:]):  # widths >3, 2, 3, 1
        a, b = plain.forward(ids, c1), t.forward(ids, c2)
        assert (a - b).abs().max().item() <= 1e-4
    t.set_transposed_rows(0)
    assert not t._wt and torch.equal(t.forward(p, t.new_cache()), plain.forward(p, plain.new_cache()))
    base = DecodeConfig(lean_forward=True, max_new_tokens=24, dtype="float32", stop_at_eos=False)
    ref = generate(DecodeConfig(**{**base.as_dict(), "method": "ar"}), model, tiny_prompts[1], None).tokens
    for rows, k in ((1, 1), (3, 2), (3, 4)):
        cfg = DecodeConfig(**{**base.as_dict(), "drafter": "draft-model", "draft_len": k, "matmul_t_rows": rows})
        assert generate(cfg, model, tiny_prompts[1], tiny_fp32[1]).tokens == ref, (rows, k)
    with pytest.raises(ConfigError, match="matmul_t_rows = 3 is invalid: it changes the lean forward"):
        DecodeConfig(matmul_t_rows=3)
    with pytest.raises(ConfigError, match="use 0 \\(off\\) to 16 rows"):
        DecodeConfig(lean_forward=True, matmul_t_rows=17)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    onednn_bf16_refusal() is not None, reason="this CPU has no oneDNN bfloat16 path (refusal tested below)"))])
@torch.inference_mode()
def test_onednn_row_buckets_pad_without_changing_a_product(dtype):
    """The oneDNN backend runs a call at a bucketed row count (so a new prompt length meets a primitive built at
    packing): exact counts up to the verify widths, then coarser steps, never more than 12.5% padding past 512 rows;
    the zero rows are dropped and every real row's product is bit-identical to the unpadded call's."""
    limit0, _ = ONEDNN_BUCKETS[0]
    assert [onednn_rows(t) for t in range(1, limit0 + 1)] == list(range(1, limit0 + 1))
    seen = [onednn_rows(t) for t in range(1, 3 * ONEDNN_WARM_MAX)]
    assert all(a <= b for a, b in zip(seen, seen[1:], strict=False)) and all(r >= t for t, r in enumerate(seen, 1))
    assert all((onednn_rows(t) - t) / t <= 0.125 for t in range(513, 3 * ONEDNN_WARM_MAX))
    assert len({onednn_rows(t) for t in range(1, ONEDNN_WARM_MAX + 1)}) <= 100  # what packing builds stays small
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(48, 40, generator=g) * 0.1).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    for t in (1, 9, 64, 65, 300, 513, 4097):
        x = torch.randn(t, 40, generator=g).to(dtype)
        y = _onednn_linear(x, packed, None)
        assert y.shape == (t, 48)
        assert torch.equal(y, torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))


@torch.inference_mode()
def test_onednn_matmul_matches_linear_and_keeps_tokens(tiny_fp32, tiny_prompts):
    """Mechanism onednn-matmul: every lean matmul on a weight packed once for oneDNN; logits agree with F.linear's
    within f32 rounding at every width, "torch" drops the packed copies, SD through `generate` stays
    token-identical to AR (also beside transposed-matmul, which takes the calls of up to its rows), and bad
    values are one-line errors."""
    from decoder.generate import generate

    model = tiny_fp32[0]
    plain, dnn = LeanLM(model), LeanLM(model)
    dnn.set_matmul_backend("onednn")
    assert dnn.matmul_backend == "onednn" and len(dnn._packed) == 4 * len(dnn.layers) + 1 and not plain._packed
    p = torch.tensor(tiny_prompts[0])
    c1, c2 = plain.new_cache(), dnn.new_cache()
    for ids in (p[:-6], p[-6:-4], p[-4:-1], p[-1:]):  # widths >3, 2, 3, 1
        assert (plain.forward(ids, c1) - dnn.forward(ids, c2)).abs().max().item() <= 1e-4
    packed = dnn._packed
    dnn.set_matmul_backend("torch")
    assert not dnn._packed and torch.equal(dnn.forward(p, dnn.new_cache()), plain.forward(p, plain.new_cache()))
    dnn.set_matmul_backend("onednn")  # the batched engine switches per request: nothing is packed or built again
    assert dnn._packed is packed
    dnn.set_matmul_backend("torch")
    with pytest.raises(ValueError, match="matmul backend 'mkl': choose one of torch, onednn, bf16w"):
        dnn.set_matmul_backend("mkl")
    half = LeanLM(copy.deepcopy(tiny_fp32[1]).to(torch.float16))
    with pytest.raises(LeanUnsupported, match="packs float32 or bfloat16 weights, not torch.float16"):
        half.set_matmul_backend("onednn")
    base = DecodeConfig(lean_forward=True, max_new_tokens=24, dtype="float32", stop_at_eos=False)
    ref = generate(DecodeConfig(**{**base.as_dict(), "method": "ar"}), model, tiny_prompts[1], None).tokens
    for rows, k in ((0, 1), (0, 4), (1, 4)):
        cfg = DecodeConfig(**{**base.as_dict(), "drafter": "draft-model", "draft_len": k, "matmul_t_rows": rows,
                              "matmul_backend": "onednn"})
        assert generate(cfg, model, tiny_prompts[1], tiny_fp32[1]).tokens == ref, (rows, k)
    with pytest.raises(ConfigError, match="matmul_backend = 'onednn' is invalid: it changes the lean forward"):
        DecodeConfig(matmul_backend="onednn")
    with pytest.raises(ConfigError, match="matmul_backend = 'mkl' is invalid: choose one of torch, onednn, bf16w"):
        DecodeConfig(lean_forward=True, matmul_backend="mkl")
    with pytest.raises(ConfigError, match="oneDNN runs on the CPU; use \"torch\" on 'cuda'"):
        DecodeConfig(lean_forward=True, matmul_backend="onednn", device="cuda")


def test_onednn_bf16_on_a_cpu_without_its_path_is_refused_in_one_line(tiny_fp32, monkeypatch):
    """On a CPU without AVX512-BW/VL/DQ or AVX-NE-CONVERT oneDNN cannot pack bfloat16 weights: the config is refused
    from the capabilities (the bench skips the method, the tuner never proposes it) and the lean forward raises
    one line, instead of a RuntimeError from inside torch mid-run. float32 and the torch backend are unaffected."""
    from decoder.capabilities import refusal

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)  # such a CPU's answer
    cfg = DecodeConfig(lean_forward=True, matmul_backend="onednn")
    why = refusal(cfg, tiny_fp32[0].config, None, "bfloat16")
    assert why is not None and "AVX512-BW/VL/DQ" in why and "\n" not in why and 'dtype = "float32"' in why
    assert refusal(cfg, tiny_fp32[0].config, None, "float32") is None
    assert refusal(DecodeConfig(lean_forward=True), tiny_fp32[0].config, None, "bfloat16") is None
    lm = LeanLM(copy.deepcopy(tiny_fp32[0]).to(torch.bfloat16))
    with pytest.raises(LeanUnsupported, match="needs a CPU with AVX512-BW/VL/DQ or AVX-NE-CONVERT"):
        lm.set_matmul_backend("onednn")
    assert lm.matmul_backend == "torch" and not lm._packed


@torch.inference_mode()
def test_fused_mlp_matches_the_plain_mlp_and_keeps_tokens(tiny_fp32, tiny_prompts):
    """Mechanism fused-mlp: calls of at least fused_mlp_rows rows compute the SiLU MLP with the activation and the
    product fused into oneDNN's matmuls; logits agree with the unfused oneDNN forward within f32 rounding above
    and at the threshold, are bit-identical below it, SD stays token-identical to AR, and bad values are one-line
    errors (no oneDNN, a GELU model, a bad row count)."""
    from decoder.generate import generate

    model = tiny_fp32[0]
    dnn, fused = LeanLM(model), LeanLM(model)
    dnn.set_matmul_backend("onednn")
    fused.set_matmul_backend("onednn")
    fused.set_fused_mlp_rows(8)
    assert fused.fused_rows == 8 and len(fused._fused) == len(fused.layers)
    p = torch.tensor(tiny_prompts[0])
    c1, c2 = dnn.new_cache(), fused.new_cache()
    assert (dnn.forward(p[:-4], c1) - fused.forward(p[:-4], c2)).abs().max().item() <= 1e-4  # a prefill, fused
    assert (dnn.forward(p[-4:], c1) - fused.forward(p[-4:], c2)).abs().max().item() <= 1e-4  # on that cache
    assert torch.equal(dnn.forward(p[:4], dnn.new_cache()), fused.forward(p[:4], fused.new_cache()))  # 4 rows: plain
    fused.set_matmul_backend("torch")  # without oneDNN's weights there is nothing to fuse into
    assert fused.fused_rows == 0 and not fused._fused
    with pytest.raises(LeanUnsupported, match="fused_mlp_rows fuses into oneDNN's matmuls; set matmul_backend"):
        fused.set_fused_mlp_rows(8)
    base = DecodeConfig(lean_forward=True, matmul_backend="onednn", max_new_tokens=24, dtype="float32",
                        stop_at_eos=False, fused_mlp_rows=4)
    ref = generate(DecodeConfig(**{**base.as_dict(), "method": "ar"}), model, tiny_prompts[1], None).tokens
    assert generate(base, model, tiny_prompts[1], tiny_fp32[1]).tokens == ref
    with pytest.raises(ConfigError, match="fused_mlp_rows = 128 is invalid: it fuses into oneDNN's matmuls"):
        DecodeConfig(lean_forward=True, fused_mlp_rows=128)
    with pytest.raises(ConfigError, match="fused_mlp_rows = -1 is invalid: use 0"):
        DecodeConfig(lean_forward=True, matmul_backend="onednn", fused_mlp_rows=-1)
    gelu = copy.deepcopy(model)
    gelu.config.hidden_act = "gelu"
    for layer in gelu.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    from decoder.capabilities import refusal

    why = refusal(base, gelu.config)
    assert why == "target: fused_mlp_rows fuses a SiLU MLP; this model's activation is 'gelu': use 0"
    assert refusal(base, model.config) is None
    lm = LeanLM(gelu)
    lm.set_matmul_backend("onednn")
    with pytest.raises(LeanUnsupported, match="fuses a SiLU MLP; this model's activation is 'gelu': use 0"):
        lm.set_fused_mlp_rows(8)


@torch.inference_mode()
def test_draft_model_pruned_head_keeps_tokens(tiny_fp32, tiny_prompts, tmp_path):
    """Mechanism draft-vocab on the draft model: its lean head scores only the ranked tokens (those logits equal
    the full head's, the rest are -inf), and SD through `generate` (chain, oneDNN or not, and tree) stays
    token-identical to AR; without the ranking, or off the lean forward, it is a one-line error."""
    import json

    from decoder.featdraft import VOCAB_RANK_FILE, FeatureHeads
    from decoder.generate import generate

    model, drafter = tiny_fp32
    vocab = drafter.config.vocab_size
    rank = torch.randperm(vocab, generator=torch.Generator().manual_seed(0)).tolist()
    (tmp_path / VOCAB_RANK_FILE).write_text(json.dumps({"ids": rank}))
    heads = FeatureHeads(tmp_path, model.config, torch.float32, torch.device("cpu"))
    ids = heads.vocab_ids(64)
    full, pruned = LeanLM(drafter), LeanLM(drafter)
    pruned.set_head_vocab(ids)
    p = torch.tensor(tiny_prompts[0])
    a, b = full.forward(p, full.new_cache()), pruned.forward(p, pruned.new_cache())
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[ids] = True
    assert torch.allclose(a[:, keep], b[:, keep], atol=1e-5) and torch.isneginf(b[:, ~keep]).all()
    base = DecodeConfig(lean_forward=True, max_new_tokens=24, dtype="float32", stop_at_eos=False)
    ref = generate(DecodeConfig(**{**base.as_dict(), "method": "ar"}), model, tiny_prompts[1], None).tokens
    for extra in ({}, {"matmul_backend": "onednn"}, {"verify": "tree"}):
        cfg = DecodeConfig(**{**base.as_dict(), "draft_vocab": 64, **extra})
        assert generate(cfg, model, tiny_prompts[1], drafter, heads=heads).tokens == ref, extra
    with pytest.raises(ValueError, match="draft_vocab with the draft model needs the target's token ranking"):
        generate(DecodeConfig(**{**base.as_dict(), "draft_vocab": 64}), model, tiny_prompts[1], drafter)
    with pytest.raises(ConfigError, match="the draft model's pruned head is on its lean forward"):
        DecodeConfig(draft_vocab=64)


def _gqa_model(name: str, dtype: torch.dtype):
    """A tiny random GQA model (6 query heads over 2 KV heads), Llama or Mistral with a window of 8 keys."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    kw = dict(vocab_size=64, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=256)
    if name == "mistral-sw":
        return MistralForCausalLM(MistralConfig(**kw, sliding_window=8)).eval().to(dtype)
    return LlamaForCausalLM(LlamaConfig(**kw)).eval().to(dtype)


def _agree(a: torch.Tensor, b: torch.Tensor, where: object) -> None:
    """Bit-identical where MKL's sgemm sums a row the same whatever the row count (seen on AVX-512 CPUs; bfloat16
    everywhere); MKL's AVX2 kernels block the folded call's extra rows differently, leaving float32 rounding."""
    if a.dtype == torch.float32 and not torch.equal(a, b):
        gap = (a - b).abs().max().item()
        assert gap <= 1e-5 * max(1.0, a.abs().max().item()), (where, gap)
        assert torch.equal(a.argmax(-1), b.argmax(-1)), where
    else:
        assert torch.equal(a, b), where


@torch.inference_mode()
def test_one_bfloat16_query_runs_folded_and_bit_identical_to_enable_gqa():
    """A single bfloat16 query row without a mask (a decode step) runs each KV head's query heads as rows of one
    SDPA head (5x faster on an EPYC's CPU path): the same output bits as SDPA with enable_gqa, at short and long
    caches; float32 keeps the plain call."""
    lean = LeanLM(_gqa_model("llama", torch.bfloat16))
    gen = torch.Generator().manual_seed(9)
    h, kv, hd = lean.n_heads, lean.n_kv, lean.head_dim
    for n_keys in (3, 70, 700):
        q = torch.randn(1, h, 1, hd, generator=gen).to(torch.bfloat16)
        k, v = (torch.randn(1, kv, n_keys, hd, generator=gen).to(torch.bfloat16) for _ in range(2))
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=lean.scale)
        assert torch.equal(lean.attention(q, k, v, None), ref), n_keys
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, *rest, **kw):
        calls.append((q.shape[1], kw.get("enable_gqa", False)))
        return sdpa(q, k, *rest, **kw)

    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        lean.attention(q, k, v, None)
        LeanLM(_gqa_model("llama", torch.float32)).attention(q.float(), k.float(), v.float(), None)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    assert calls == [(kv, False), (h, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama", "mistral-sw"])
@torch.inference_mode()
def test_folded_gqa_attention_matches_the_boolean_mask_path(name, dtype):
    """Grouped queries under a FoldedMask give every logit the boolean-mask SDPA path gives: verify blocks of 2-9
    rows, a tree verify, a batched ragged step and the static step, with and without a sliding window."""
    from decoder.batch import BatchLM
    from decoder.lean import FoldedMask, StaticLeanLM

    model = _gqa_model(name, dtype)
    folded, plain = LeanLM(model), LeanLM(model)
    plain.fold_mask = lambda mask, q: mask  # the reference: SDPA with enable_gqa and the boolean mask
    assert isinstance(folded.fold_mask(torch.ones(3, 5, dtype=torch.bool), 3), FoldedMask)
    one = torch.ones(1, 5, dtype=torch.bool)
    assert folded.fold_mask(one, 1) is one  # a single query row keeps the plain path
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(1, 64, (20,), generator=gen)
    caches = [lm.new_cache() for lm in (folded, plain)]
    for lm, c in zip((folded, plain), caches, strict=True):
        lm.forward(prompt, c)
    for q in range(2, 10):  # verify blocks, each rolled back like a rejected draft
        ids = torch.randint(1, 64, (q,), generator=gen)
        a, b = (lm.forward(ids, c) for lm, c in zip((folded, plain), caches, strict=True))
        _agree(a, b, q)
        for c in caches:
            c.crop(20 + q // 2)
    depth = torch.tensor([0, 1, 1, 2])  # a tree: root's children 1 and 2, node 3 under node 1
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    ids = torch.randint(1, 64, (4,), generator=gen)
    outs = []
    for lm, c in zip((folded, plain), caches, strict=True):
        start = c.length
        mask = torch.cat([torch.ones(4, start, dtype=torch.bool), anc], dim=1)
        outs.append(lm.forward(ids, c, positions=depth + start, attn_mask=mask))
    _agree(*outs, 'tree')
    blm = [BatchLM(lm) for lm in (folded, plain)]
    bcaches = [b.new_cache(3, 64) for b in blm]
    prompts = [torch.randint(1, 64, (n,), generator=gen) for n in (12, 17, 9)]
    step = torch.randint(1, 64, (4 + 1 + 6,), generator=gen)
    for b, c in zip(blm, bcaches, strict=True):
        b.forward(torch.cat(prompts), [0, 1, 2], [12, 17, 9], c)
    a, b = (lm.forward(step, [0, 1, 2], [4, 1, 6], c) for lm, c in zip(blm, bcaches, strict=True))
    _agree(a, b, 'batched/static')
    static = [StaticLeanLM(lm, max_len=64) for lm in (folded, plain)]
    scaches = [s.new_cache() for s in static]
    for s, c in zip(static, scaches, strict=True):
        s.forward(prompt[:5], c)
    a, b = (s.forward(prompt[5:12], c) for s, c in zip(static, scaches, strict=True))
    _agree(a, b, 'batched/static')
