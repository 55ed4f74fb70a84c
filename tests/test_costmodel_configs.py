"""Cost-model profiles of each config family against the model transformers builds from the same config.

Each family's config is built from its transformers Config class with small sizes and saved with
`save_pretrained` (the config.json `load_model_profile` reads, in the installed transformers' naming);
the profile's total and active parameters must equal `sum(p.numel())` of a tiny random model built
from it with `AutoModelForCausalLM.from_config` (exactly: the profile counts tensor by tensor), and its
KV and recurrent-state bytes are checked by hand. Active parameters are measured as the total less the
routed experts a token does not pick: (experts - top_k) / experts of every `*.experts` module.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BambaConfig,
    DeepseekV2Config,
    DeepseekV3Config,
    FalconH1Config,
    Gemma2Config,
    JambaConfig,
    Lfm2Config,
    LlamaConfig,
    Mamba2Config,
    MixtralConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    Zamba2Config,
)

from costmodel.hardware import HardwareProfile
from costmodel.model_profile import ModelProfile, ModelProfileError, from_config, load_model_profile
from costmodel.step import forward_time

# hidden 32, 4 query heads of 8, 2 KV heads: one attention layer caches K and V = 2 * 2 * 8 = 32 elements
# a token, 64 bytes in bf16.
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
KV_LAYER_BF16 = 2 * 2 * 8 * 2
MEMBOUND = HardwareProfile("toy-mem", mem_bandwidth_GBps=1.0, bf16_tflops=1e9, fp8_tflops=None, l2_MB=0.0)


def profile_and_model(cfg, tmp_path) -> tuple[ModelProfile, torch.nn.Module]:
    """The profile of `cfg` read back from its saved config.json, and a tiny random model built from it."""
    cfg.save_pretrained(tmp_path)
    torch.manual_seed(0)
    return load_model_profile(tmp_path), AutoModelForCausalLM.from_config(cfg)


def measured(model: torch.nn.Module, experts: int = 0, top_k: int = 0) -> tuple[int, int]:
    """(total, active) parameters of a built model; weight-tied tensors count once."""
    total = sum(p.numel() for p in model.parameters())
    # DeepSeek-V3's e_score_correction_bias is a checkpoint tensor that transformers keeps as a buffer.
    total += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    routed = sum(sum(p.numel() for p in m.parameters()) for n, m in model.named_modules() if n.endswith(".experts"))
    unused = routed * (experts - top_k) // experts if experts else 0
    return total, total - unused


def assert_counts(m: ModelProfile, model: torch.nn.Module, experts: int = 0, top_k: int = 0) -> None:
    total, active = measured(model, experts, top_k)
    assert (m.total_params, m.active_params) == (total, active)


# -- dense ---------------------------------------------------------------------------------------


def test_llama_dense_with_biases(tmp_path):
    cfg = LlamaConfig(**SMALL, num_hidden_layers=2, attention_bias=True, mlp_bias=True)
    m, model = profile_and_model(cfg, tmp_path)
    assert_counts(m, model)
    assert m.active_params == m.total_params and m.num_moe_layers == 0
    assert m.kv_bytes_per_token(2.0) == 2 * KV_LAYER_BF16
    assert m.recurrent_state_bytes() == 0 and m.notes == ()


def test_gemma2_alternating_sliding_window(tmp_path):
    cfg = Gemma2Config(**SMALL, num_hidden_layers=4, head_dim=8, sliding_window=8)
    m, model = profile_and_model(cfg, tmp_path)
    assert_counts(m, model)  # tied embeddings, four norms a layer
    assert m.tie_word_embeddings and m.layer_types == ("sliding_attention", "full_attention") * 2
    assert m.kv_bytes_per_token(2.0) == 4 * KV_LAYER_BF16  # a new token is written into every layer
    # At 100 tokens of context the two sliding layers hold 8 tokens, the two global layers all 100.
    assert m.kv_cache_bytes(100) == (2 * 100 + 2 * 8) * KV_LAYER_BF16
    assert m.kv_cache_bytes(5) == 4 * 5 * KV_LAYER_BF16  # under the window nothing is capped
    step = forward_time(MEMBOUND, m, q=1, context=100, overheads=False)
    assert step.kv_bytes == (2 * 100 + 2 * 8) * KV_LAYER_BF16 + 4 * KV_LAYER_BF16
    # Without layer_types (transformers 4) the even layers slide: the same profile.
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["layer_types"]
    assert from_config(raw).layer_types == m.layer_types


# -- MoE -----------------------------------------------------------------------------------------


def test_mixtral_experts_are_intermediate_size_wide_and_windowed(tmp_path):
    cfg = MixtralConfig(**SMALL, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=16)
    m, model = profile_and_model(cfg, tmp_path)
    assert_counts(m, model, experts=4, top_k=2)
    assert (m.num_experts, m.experts_per_token, m.moe_intermediate_size) == (4, 2, 48)
    assert m.moe_layers == (True, True)
    assert m.layer_types == ("sliding_attention",) * 2 and m.kv_cache_bytes(1000) == 2 * 16 * KV_LAYER_BF16


def test_qwen2_moe_shared_expert_and_dense_layers(tmp_path):
    cfg = Qwen2MoeConfig(**SMALL, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                         shared_expert_intermediate_size=16, mlp_only_layers=[1])
    m, model = profile_and_model(cfg, tmp_path)
    assert_counts(m, model, experts=4, top_k=2)
    assert m.moe_layers == (True, False, True) and m.shared_expert_intermediate_size == 16
    assert m.kv_bytes_per_token(2.0) == 3 * KV_LAYER_BF16


def test_qwen3_moe_transformers5_naming(tmp_path):
    cfg = Qwen3MoeConfig(**SMALL, num_hidden_layers=3, head_dim=8, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=8, decoder_sparse_step=2)
    m, model = profile_and_model(cfg, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "num_local_experts" in raw or "num_experts" in raw  # transformers 5.24 writes num_local_experts
    assert_counts(m, model, experts=4, top_k=2)
    assert m.moe_layers == (False, True, False) and m.num_experts == 4
    # The transformers-4 spelling of the same config reads the same.
    four = {k: v for k, v in raw.items() if k not in ("num_local_experts", "num_experts")} | {"num_experts": 4}
    assert from_config(four).params == m.params
    # Two spellings that disagree, or an MoE type without an expert count, are refused naming the field.
    with pytest.raises(ModelProfileError, match="num_experts=8 and num_local_experts=4 disagree"):
        from_config(four | {"num_experts": 8, "num_local_experts": 4})
    with pytest.raises(ModelProfileError, match="num_local_experts"):
        from_config({k: v for k, v in four.items() if k != "num_experts"})


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_deepseek_mla_shared_experts_and_first_dense_layers(tmp_path, version):
    mla = dict(kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, n_group=2, topk_group=1)
    moe = dict(n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, moe_intermediate_size=8,
               first_k_dense_replace=1)
    common = {**SMALL, "num_key_value_heads": 4, "num_hidden_layers": 3, **mla, **moe}
    if version == "v3":
        cfg = DeepseekV3Config(**common, q_lora_rank=12)
    else:
        cfg = DeepseekV2Config(**common, q_lora_rank=None)
    m, model = profile_and_model(cfg, tmp_path)
    assert_counts(m, model, experts=8, top_k=2)
    assert m.moe_layers == (False, True, True)
    assert m.shared_expert_intermediate_size == 2 * 8  # two shared experts of moe_intermediate_size
    # MLA caches the latent and the RoPE key: (16 + 4) elements a layer, 2 bytes each.
    assert m.kv_bytes_per_token(2.0) == 3 * (16 + 4) * 2
    assert any("MLA" in note for note in m.notes)


# -- hybrid --------------------------------------------------------------------------------------


def test_jamba_mamba_attention_and_experts(tmp_path):
    cfg = JambaConfig(**SMALL, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
                      attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0, mamba_d_state=8,
                      mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=6)
    m, model = profile_and_model(cfg, tmp_path)
    assert_counts(m, model, experts=4, top_k=2)
    assert m.layer_types == ("mamba", "full_attention") * 2 and m.moe_layers == (True, False) * 2
    assert m.kv_bytes_per_token(2.0) == 2 * KV_LAYER_BF16
    # Two Mamba layers: state [d_inner 64, d_state 8] in fp32, conv window 64 channels x 3 in bf16.
    assert m.recurrent_state_bytes() == 2 * (64 * 8 * 4 + 64 * 3 * 2) == 4864


def test_bamba_mamba2_and_attention(tmp_path):
    cfg = BambaConfig(**SMALL, num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                      mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2)
    m, model = profile_and_model(cfg, tmp_path)
    assert_counts(m, model)
    assert m.layer_types == ("mamba2", "full_attention", "mamba2")
    assert m.kv_bytes_per_token(2.0) == KV_LAYER_BF16
    # Per Mamba2 layer: state 4 heads x 16 x 8 fp32, conv (64 + 2 groups x 8 x 2) = 96 channels x 3 bf16.
    assert m.recurrent_state_bytes() == 2 * (4 * 16 * 8 * 4 + 96 * 3 * 2) == 5248
    # An attention layer list that contradicts attn_layer_indices is refused.
    raw = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ModelProfileError, match="attn_layer_indices"):
        from_config(raw | {"layer_types": ["full_attention", "mamba", "mamba"]})


def test_mamba2_has_no_kv(tmp_path):
    cfg = Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, n_groups=2,
                       state_size=8, conv_kernel=4, expand=2)
    m, model = profile_and_model(cfg, tmp_path)
    assert_counts(m, model)
    assert m.num_attention_layers == 0 and m.kv_bytes_per_token(2.0) == 0 and m.kv_cache_bytes(10_000) == 0
    assert m.recurrent_state_bytes() == 2 * (4 * 16 * 8 * 4 + 96 * 3 * 2)
    # A step at any context moves the same state bytes and no KV.
    step = forward_time(MEMBOUND, m, q=1, context=50_000, overheads=False)
    assert (step.kv_bytes, step.state_bytes) == (0, 2 * m.recurrent_state_bytes())


def test_qwen3_next_gated_deltanet_and_moe(tmp_path):
    cfg = Qwen3NextConfig(**SMALL, num_hidden_layers=4, head_dim=8, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=8, shared_expert_intermediate_size=12, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                          linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2)
    m, model = profile_and_model(cfg, tmp_path)
    assert_counts(m, model, experts=4, top_k=2)
    assert m.num_linear_layers == 2 and m.num_moe_layers == 4
    assert m.kv_bytes_per_token(2.0) == 2 * KV_LAYER_BF16
    # Per DeltaNet layer: state 4 value heads x 8 x 6 fp32, conv (2 x 16 + 24) = 56 channels x 3 bf16.
    assert m.recurrent_state_bytes() == 2 * (4 * 8 * 6 * 4 + 56 * 3 * 2) == 2208


def test_lfm2_short_convolutions(tmp_path):
    cfg = Lfm2Config(**SMALL, num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2, conv_L_cache=3)
    m, model = profile_and_model(cfg, tmp_path)
    assert_counts(m, model)  # the MLP is built 256 wide (2/3 of 48, rounded up to block_multiple_of)
    assert m.intermediate_size == 256 and m.tie_word_embeddings
    assert m.kv_bytes_per_token(2.0) == 2 * KV_LAYER_BF16
    assert m.recurrent_state_bytes() == 2 * (32 * 2 * 2)  # no state matrix; conv window 32 channels x 2


def test_falcon_h1_attention_and_mamba2_in_every_layer(tmp_path):
    cfg = FalconH1Config(**SMALL, num_hidden_layers=2, head_dim=8, mamba_n_heads=4, mamba_d_head=16,
                         mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_d_ssm=64)
    m, model = profile_and_model(cfg, tmp_path)
    assert_counts(m, model)
    assert m.layer_types == ("hybrid", "hybrid") and m.num_attention_layers == m.num_recurrent_layers == 2
    assert m.kv_bytes_per_token(2.0) == 2 * KV_LAYER_BF16
    assert m.recurrent_state_bytes() == 2 * (4 * 16 * 8 * 4 + 96 * 3 * 2)


def test_zamba2_shared_blocks_stored_once_read_per_use(tmp_path):
    cfg = Zamba2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                       num_key_value_heads=4, num_hidden_layers=6, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                       mamba_ngroups=2, n_mamba_heads=4, num_mem_blocks=2, adapter_rank=4,
                       layers_block_type=["mamba", "hybrid"] * 3, use_shared_attention_adapter=True)
    m, model = profile_and_model(cfg, tmp_path)
    assert_counts(m, model)  # two shared blocks stored once each, three hybrid layers use them
    assert m.num_attention_layers == 3 and m.num_recurrent_layers == 6
    # Attention over [hidden, embeddings]: head_dim 2 * 32 / 4 = 16, 4 KV heads, per hybrid layer.
    assert m.kv_bytes_per_token(2.0) == 3 * 2 * 4 * 16 * 2
    # The third hybrid layer reads block 0 again: one block's attention, MLP and norms more per token.
    block = (64 * 64 * 3 + 64 * 32) + (32 * 96 + 48 * 32) + (64 + 32)
    assert m.params.reused == block
    assert m.weight_params_read(1) == m.total_params + block  # tied embeddings: read whole as the LM head


# -- refusals and notes --------------------------------------------------------------------------


def test_unknown_or_contradictory_configs_are_not_read_as_dense():
    llama = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 48, "vocab_size": 64}
    with pytest.raises(ModelProfileError, match="num_local_experts=8"):
        from_config(llama | {"num_local_experts": 8, "num_experts_per_tok": 2})
    with pytest.raises(ModelProfileError, match="layer_types has chunked_attention"):
        from_config(llama | {"layer_types": ["full_attention", "chunked_attention"]})
    with pytest.raises(ModelProfileError, match="layer_types lists 3 layers"):
        from_config(llama | {"layer_types": ["full_attention"] * 3})
    with pytest.raises(ModelProfileError, match="sliding_window"):
        from_config(llama | {"layer_types": ["sliding_attention"] * 2})
    mixtral = llama | {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    with pytest.raises(ModelProfileError, match="num_experts_per_tok=5"):
        from_config(mixtral | {"num_experts_per_tok": 5})
    # Fields the Hugging Face model ignores are kept as notes, and the count stays what it builds.
    noted = from_config(mixtral | {"n_shared_experts": 2, "first_k_dense_replace": 1})
    assert noted.params == from_config(mixtral).params
    assert any("n_shared_experts=2 ignored" in n for n in noted.notes)
    assert any("first_k_dense_replace=1 ignored" in n for n in noted.notes)
    assert noted.summary()["notes"] == list(noted.notes)
    with pytest.raises(ModelProfileError, match="layers_block_type"):
        from_config(llama | {"model_type": "zamba2"})
