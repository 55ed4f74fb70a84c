"""The lean forward on every architecture it supports, against the Hugging Face model it replaces.

Each architecture is a tiny random model built from its transformers Config (fp32, fixed seed, every
weight and bias random so each feature moves the logits); sliding-window models get a window of 8 and
prompts longer than it. Logits are compared full-sequence and through the cache (prefill, then steps
of 1 and 4 tokens), greedy tokens through ar_generate, draft trees and the batched engine against
single requests; unsupported configs must be refused in one line that names the feature.
"""

import copy

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MambaConfig,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from decoder.batch import BatchEngine, BatchLM, Request
from decoder.config import DecodeConfig
from decoder.generate import ar_generate, generate
from decoder.lean import LeanLM, LeanUnsupported, StaticLeanLM, lean_unsupported_reason
from decoder.presets import preset_config
from decoder.runners import HFRunner

WINDOW = 8
TOL = 1e-4  # fp32: only reduction order differs (the full-sequence forward is in fact bit-equal)
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0,
              tie_word_embeddings=False)  # tied, a random model just repeats its input token
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral-sw": (MistralConfig, MistralForCausalLM, dict(sliding_window=WINDOW)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    # Layer 0 full, layers 1-2 sliding (max_window_layers): both kinds of mask in one model.
    "qwen2-sw": (Qwen2Config, Qwen2ForCausalLM, dict(use_sliding_window=True, sliding_window=WINDOW,
                                                     max_window_layers=1)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16)),
    "gemma": (GemmaConfig, GemmaForCausalLM, dict(head_dim=16)),
    # Layers alternate sliding/full; soft-caps small enough to bite, a scale that is not 1/sqrt(head_dim).
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                                      attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "phi3": (Phi3Config, Phi3ForCausalLM, dict(partial_rotary_factor=0.5)),
}
SLIDING = ("mistral-sw", "qwen2-sw", "gemma2")
_MODELS: dict[tuple, torch.nn.Module] = {}


def _model(name: str, **overrides):
    """A tiny random model of architecture `name` (cached): weights, biases and norms all random."""
    key = (name, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        config_cls, model_cls, kw = ARCHS[name]
        torch.manual_seed(0)
        model = model_cls(config_cls(**{**COMMON, **kw, **overrides})).eval()
        gen = torch.Generator().manual_seed(1)
        embed_std = 0.5 / model.config.hidden_size ** 0.5 if "gemma" in name else 0.5  # Gemma scales by sqrt(D)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.add_(0.1 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_((embed_std if "embed" in n else 0.1) * torch.randn(p.shape, generator=gen))
        _MODELS[key] = model
    return _MODELS[key]


def _drafter(name: str):
    """The target with its weights perturbed: agrees often, not always (drafts get accepted and rejected)."""
    key = (name, "drafter")
    if key not in _MODELS:
        d = copy.deepcopy(_model(name))
        gen = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for p in d.parameters():
                p.add_(0.2 * p.std() * torch.randn(p.shape, generator=gen))
        _MODELS[key] = d
    return _MODELS[key]


def _prompt(n: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", ARCHS)
@torch.inference_mode()
def test_logits_match_hf(name):
    """Full sequence, then through the cache (prefill past the window, steps of 1 and 4): LeanLM, the
    static step (CUDA-graph path, eager here) and LeanLM on oneDNN's packed weights (mechanism onednn-matmul,
    biases fused) equal HF's logits in fp32."""
    model = _model(name)
    assert lean_unsupported_reason(model.config) is None
    lean = LeanLM(model, max_len=64)
    dnn = LeanLM(model, max_len=64)
    dnn.set_matmul_backend("onednn")
    assert len(dnn._packed) == 4 * len(dnn.layers) + 1
    ids = _prompt(30)
    assert _diff(lean.forward(ids, lean.new_cache()), model(ids[None]).logits[0]) <= TOL
    hf = HFRunner(model)
    static = StaticLeanLM(LeanLM(model, max_len=64), max_len=64, use_graphs=False)
    c_hf, c_lean, c_static, c_dnn = hf.new_cache(), lean.new_cache(), static.new_cache(), dnn.new_cache()
    for a, b in ((0, 20), (20, 21), (21, 25), (25, 26), (26, 30)):
        ref = hf.forward(ids[a:b], c_hf)
        assert _diff(lean.forward(ids[a:b], c_lean), ref) <= TOL, (a, b)
        assert _diff(static.forward(ids[a:b], c_static), ref) <= TOL, (a, b)
        assert _diff(dnn.forward(ids[a:b], c_dnn), ref) <= TOL, (a, b)


@pytest.mark.parametrize("name", SLIDING)
@torch.inference_mode()
def test_window_matters_on_these_prompts(name):
    """The same weights without the window give different logits: the tests above would see a lean
    forward that ignored it."""
    ids = _prompt(30)
    off = {"use_sliding_window": False} if name == "qwen2-sw" else {"sliding_window": 4096}
    assert _diff(_model(name)(ids[None]).logits[0], _model(name, **off)(ids[None]).logits[0]) > 100 * TOL


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_tokens_equal_hf(name):
    """Greedy AR on the lean forward, and lean SD with a draft model, give HF's greedy tokens."""
    model = _model(name)
    base = dict(max_new_tokens=24, dtype="float32", stop_at_eos=False)
    prompt = _prompt(12, seed=5).tolist()
    ref = ar_generate(model, prompt, DecodeConfig(method="ar", **base)).tokens
    assert ar_generate(LeanLM(model), prompt, DecodeConfig(method="ar", **base)).tokens == ref
    sd = generate(DecodeConfig(draft_len=4, lean_forward=True, **base), model, prompt, _drafter(name))
    assert sd.tokens == ref
    assert 0 < sd.stats.accepted < sd.stats.drafted  # both accepted and rejected drafts were rolled through


@pytest.mark.parametrize("name", ["mistral-sw", "gemma2"])
@torch.inference_mode()
def test_tree_masks_apply_the_window(name):
    """A draft tree verified in one forward (LeanLM and BatchLM): each node's logits equal feeding its
    path after the prefix, the window counted in positions (depths), not cache slots."""
    model = _model(name)
    lean, batch = LeanLM(model, max_len=64), BatchLM(model)
    prefix, root = _prompt(20).tolist(), 7
    # Nodes a, b (depth 0) and c (child of a), fed in that order after the root.
    toks, depth = [11, 12, 13], torch.tensor([0, 0, 1])
    anc = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)
    n, start = 3, len(prefix)
    mask = torch.zeros(1 + n, start + 1 + n, dtype=torch.bool)
    mask[:, : start + 1] = True
    mask[1:, start + 1 :] = anc
    positions = torch.tensor([start, *(start + 1 + depth).tolist()])

    def path_logits(path: list[int]) -> torch.Tensor:
        c = lean.new_cache()
        lean.forward(torch.tensor(prefix), c)
        return lean.forward(torch.tensor([root, *path]), c)[-1]

    want = torch.stack([path_logits([]), path_logits([11]), path_logits([12]), path_logits([11, 13])])
    cache = lean.new_cache()
    lean.forward(torch.tensor(prefix), cache)
    got = lean.forward(torch.tensor([root, *toks]), cache, positions=positions, attn_mask=mask)
    assert _diff(got, want) <= TOL
    bcache = batch.new_cache(2, 64)
    other = _prompt(9, seed=6).tolist()
    batch.forward(torch.tensor(prefix + other), [0, 1], [start, len(other)], bcache)
    got = batch.forward(torch.tensor([root, *toks, 3, 4]), [0, 1], [1 + n, 2], bcache, trees=[(depth, anc), None])
    assert _diff(got[: 1 + n], want) <= TOL


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "mistral-sw", "gemma2"])
def test_batched_engine_equals_single_request(name):
    """The batched engine (AR, draft-model SD ragged or padded, tree SD) on prompts shorter and longer than
    the window gives each request HF's single-request greedy tokens."""
    model, drafter = _model(name), _drafter(name)
    base = DecodeConfig(max_new_tokens=16, dtype="float32", stop_at_eos=False)
    prompts = [_prompt(n, seed=10 + n).tolist() for n in (5, 23, 12, 17)]
    refs = [ar_generate(model, p, preset_config("ar", base)).tokens for p in prompts]
    for cfg in (preset_config("ar-lean", base, ragged_verify=True),
                preset_config("sd-draft-model-lean", base),
                preset_config("sd-draft-model-lean", base, ragged_verify=True, continuous_batching=True),
                preset_config("sd-tree", base, ragged_verify=True)):
        run = BatchEngine(model, cfg, 3, drafter).run([Request(p, 0.0, i) for i, p in enumerate(prompts)])
        assert [r.tokens for r in run.results] == refs, cfg


def _tiny(cfg_cls, **kw):
    return cfg_cls(**{**COMMON, **kw})


UNSUPPORTED = [
    (lambda: GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256), "'gpt2' (GPT-2 blocks"),
    (lambda: GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4), "'gpt_neox'"),
    (lambda: _tiny(MixtralConfig, num_local_experts=4), "mixture-of-experts"),
    (lambda: _tiny(Qwen2MoeConfig), "mixture-of-experts"),
    (lambda: MambaConfig(hidden_size=64, num_hidden_layers=2), "recurrent"),
    (lambda: _tiny(Gemma3TextConfig, head_dim=16), "'gemma3_text'"),
    (lambda: _tiny(LlamaConfig, hidden_act="gelu_new"), "activation 'gelu_new'"),
    (lambda: _tiny(LlamaConfig, hidden_act="relu2"), "activation 'relu2'"),
    (lambda: _tiny(LlamaConfig, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "RoPE scaling 'dynamic'"),
    (lambda: _tiny(Phi3Config, rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
                                             "original_max_position_embeddings": 64}), "RoPE scaling 'longrope'"),
]


@pytest.mark.parametrize("make, needle", UNSUPPORTED)
def test_unsupported_configs_are_refused_in_one_line(make, needle):
    reason = lean_unsupported_reason(make())
    assert reason is not None and needle in reason, reason
    assert "\n" not in reason and reason.startswith("lean forward: ") and reason.endswith("use the HF path")


def test_unsupported_models_raise_at_construction():
    torch.manual_seed(0)
    for model in (GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=256)),
                  LlamaForCausalLM(_tiny(LlamaConfig, hidden_act="gelu_new", num_hidden_layers=1))):
        with pytest.raises(LeanUnsupported, match="^lean forward: .*use the HF path$"):
            LeanLM(model)
