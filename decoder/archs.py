"""Which architectures each decoding path covers, read from a model's config alone (no weights, no torch):
the lean forward's coverage (`lean_unsupported_reason`, decoder/lean.py builds on it) and the layer kinds that
hold a recurrent state (`recurrent_layers`, decoder/runners.py rolls them back). decoder/capabilities.py and
the workbench read these without loading the engine."""

from __future__ import annotations

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")
# hidden_act / hidden_activation values the lean forward computes (decoder/lean.py: ACTIVATIONS)
ACTIVATION_NAMES = ("silu", "swish", "gelu", "gelu_pytorch_tanh")
# RoPE variants whose cos/sin depend on the position only: the table comes from the model's own rotary
# module. "dynamic" and "longrope" (Phi-3's su/yarn) rescale with the sequence length and are refused.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Why a model type outside SUPPORTED differs, for the refusal's one line.
REFUSED_WHY = {
    "gpt2": "GPT-2 blocks: LayerNorm, learned positions, Conv1D c_attn",
    "gpt_neox": "GPT-NeoX blocks: LayerNorm, parallel residual, partial rotary",
    "gptj": "GPT-J blocks: parallel residual, interleaved rotary",
    "phi": "Phi-1/2 blocks: LayerNorm, parallel residual",
    "falcon": "Falcon blocks: parallel attention/MLP, multi-query layout",
    "bloom": "ALiBi positions", "mpt": "ALiBi positions",
    "opt": "learned positions, LayerNorm",
    "mixtral": "mixture-of-experts MLP", "qwen2_moe": "mixture-of-experts MLP",
    "qwen3_moe": "mixture-of-experts MLP", "phimoe": "mixture-of-experts MLP", "olmoe": "mixture-of-experts MLP",
    "deepseek_v2": "mixture-of-experts MLP, latent attention",
    "deepseek_v3": "mixture-of-experts MLP, latent attention",
    "gpt_oss": "mixture-of-experts MLP, attention sinks",
    "mamba": "recurrent (state-space) layers", "mamba2": "recurrent (state-space) layers",
    "falcon_mamba": "recurrent (state-space) layers", "recurrent_gemma": "recurrent layers",
    "jamba": "recurrent (Mamba) layers", "bamba": "recurrent (Mamba2) layers",
    "falcon_h1": "recurrent (Mamba2) layers", "zamba2": "recurrent (Mamba2) layers",
    "lfm2": "recurrent (short convolution) layers",
    "qwen3_next": "linear-attention (recurrent) layers",
    "gemma3": "per-layer-type RoPE, q/k norms", "gemma3_text": "per-layer-type RoPE, q/k norms",
    "cohere": "LayerNorm, parallel residual", "olmo2": "q/k norms over all heads, post-norms",
}
LAYER_TYPES = ("full_attention", "sliding_attention")


def activation_name(config) -> str | None:
    if config.model_type in ("gemma", "gemma2"):  # Gemma 2 names it hidden_activation
        return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    return getattr(config, "hidden_act", None)


def rope_type(config) -> str:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if any(isinstance(v, dict) for v in rope.values()):
        return "per-layer-type"  # one RoPE per attention kind (Gemma 3 style)
    return rope.get("rope_type") or rope.get("type") or "default"


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window (None: full causal attention), as the HF model applies it."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if config.model_type in ("mistral", "phi3"):  # one window for every layer when the config sets one
        return [window] * n
    if config.model_type not in ("qwen2", "qwen3", "gemma2"):
        return [None] * n
    types = getattr(config, "layer_types", None)
    if types is None:  # transformers without layer_types: the rule those versions applied
        if config.model_type == "gemma2":
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        elif getattr(config, "use_sliding_window", False):
            types = ["sliding_attention" if i >= config.max_window_layers else "full_attention" for i in range(n)]
        else:
            return [None] * n
    return [window if t == "sliding_attention" else None for t in types]


def lean_unsupported_reason(config) -> str | None:
    """Why the lean forward cannot run a model with this config, in one line; None when it can.
    Reads the config only (no weights), so a caller can decide which methods to run before loading."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED:
        why = REFUSED_WHY.get(mt)
        experts = next((getattr(config, a) for a in ("num_local_experts", "num_experts", "n_routed_experts")
                        if getattr(config, a, None)), None)
        if experts and "mixture-of-experts" not in (why or ""):  # read from the config: a type can go dense
            why = f"{why}, " if why else ""
            why += f"mixture-of-experts MLP, {experts} experts"
        return (f"lean forward: model_type {mt!r}{f' ({why})' if why else ''} is not supported "
                f"(supported: {', '.join(SUPPORTED)}); use the HF path")
    act = activation_name(config)
    if act not in ACTIVATION_NAMES:
        return (f"lean forward: activation {act!r} is not supported (supported: {', '.join(ACTIVATION_NAMES)}); "
                f"use the HF path")
    rope = rope_type(config)
    if rope not in ROPE_TYPES:
        return (f"lean forward: RoPE scaling {rope!r} is not implemented (implemented: {', '.join(ROPE_TYPES)}); "
                f"use the HF path")
    if mt in ("qwen2", "qwen3", "gemma2"):
        odd = sorted({t for t in getattr(config, "layer_types", None) or () if t not in LAYER_TYPES})
        if odd:
            return (f"lean forward: attention layer type {', '.join(map(repr, odd))} is not supported "
                    f"(supported: {', '.join(LAYER_TYPES)}); use the HF path")
    bad = next((w for w in layer_windows(config) if w is not None and (not isinstance(w, int) or w < 1)), None)
    if bad is not None:
        return (f"lean forward: sliding_window = {bad!r} is not a positive token count; fix the config "
                f"or use the HF path")
    return None


def recurrent_layers(config) -> list[str]:
    """Layer kinds of `config` that hold a recurrent state instead of (or beside) attention KV: empty for a
    pure attention model. Read from the config alone (no weights)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = set(getattr(cfg, "layer_types", None) or [])
    kinds |= set(getattr(cfg, "layers_block_type", None) or [])
    kinds -= {"attention", "full_attention", "sliding_attention", "chunked_attention", "hybrid_attention"}
    if cfg.model_type in ("mamba", "mamba2", "falcon_mamba", "bamba", "jamba", "falcon_h1", "zamba", "zamba2",
                          "granitemoehybrid", "nemotron_h", "qwen3_next", "lfm2", "lfm2_moe", "rwkv"):
        kinds.add(cfg.model_type)
    return sorted(kinds)
