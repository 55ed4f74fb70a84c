"""Model profiles from a Hugging Face config (no weights): parameters, bytes, KV and state, FLOPs.

Counts follow the Hugging Face modules of each `model_type` tensor by tensor (projections, biases,
norms, routers, SSM parameters), so they match the checkpoint's parameter count, not a rounded
headline. Config fields are read under both the transformers-4 and -5 names (`num_experts` /
`num_local_experts` / `n_routed_experts`, `layer_types` / `layers_block_type`, ...).

Supported:
- dense: llama, mistral, qwen2, qwen3, gemma2 (alternating sliding-window attention);
- MoE: mixtral, qwen2_moe, qwen3_moe (routed experts, Qwen's gated shared expert), deepseek_v2 and
  deepseek_v3 (MLA attention, DeepSeek's shared experts, `first_k_dense_replace`);
- hybrid: qwen3_next (gated DeltaNet + gated attention), jamba (Mamba + attention, MoE), bamba
  (Mamba2 + attention), mamba2, falcon_h1 (attention and Mamba2 side by side in every layer),
  zamba2 (Mamba2 + one weight-shared attention block reused), lfm2 (short convolutions + attention).

Attention layers add KV bytes per token (a sliding-window layer holds at most its window); recurrent
layers (DeltaNet, Mamba, short conv) hold a fixed state that each step reads and writes instead.
A config whose fields contradict each other, or that names experts the model type cannot have, is
refused with the field named; a field the Hugging Face model ignores is kept as a note on the profile.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"

# Bytes per stored weight, and the dtype its matmuls run in (weight-only formats dequantize to bf16).
WEIGHT_FORMATS: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0, "w12": 1.5, "int8": 1.0}
COMPUTE_DTYPE: dict[str, str] = {"fp32": "fp32", "bf16": "bf16", "fp8": "fp8", "w12": "bf16", "int8": "bf16"}

DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
HYBRID_TYPES = ("qwen3_next", "jamba", "bamba", "mamba2", "falcon_h1", "zamba2", "lfm2")
SUPPORTED_TYPES = (*DENSE_TYPES, *MOE_TYPES, *HYBRID_TYPES)

# Layer kinds. LINEAR is Qwen3-Next's gated DeltaNet; HYBRID runs attention and a Mamba2 mixer in one
# layer (Falcon-H1, Zamba2's shared-block layers).
FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
MAMBA, MAMBA2, CONV, HYBRID = "mamba", "mamba2", "conv", "hybrid"
ATTENTION_KINDS = (FULL, SLIDING, HYBRID)  # layers with a KV cache
RECURRENT_KINDS = (LINEAR, MAMBA, MAMBA2, CONV, HYBRID)  # layers with a fixed-size state
# FLOPs per recurrent-state element per token: the delta rule (decay, rank-1 update, readout) about 7,
# a selective scan (decay, input, readout) about 5; a short conv has no state matrix.
STATE_FLOPS: dict[str, int] = {LINEAR: 7, MAMBA: 5, MAMBA2: 5, HYBRID: 5, CONV: 0}

# What each family's config calls its layer kinds (transformers 4 and 5 spellings).
_ATTENTION_NAMES = {FULL: FULL, SLIDING: SLIDING}
_LAYER_NAMES: dict[str, dict[str, str]] = {
    "qwen3_next": {FULL: FULL, LINEAR: LINEAR},
    "jamba": {"attention": FULL, FULL: FULL, "mamba": MAMBA},
    "bamba": {"attention": FULL, FULL: FULL, "mamba": MAMBA2, LINEAR: MAMBA2},
    "mamba2": {"mamba": MAMBA2, LINEAR: MAMBA2},
    "falcon_h1": {"hybrid": HYBRID},
    "zamba2": {"mamba": MAMBA2, LINEAR: MAMBA2, "hybrid": HYBRID},
    "lfm2": {FULL: FULL, "conv": CONV},
}
_MIXERS = {"qwen3_next": LINEAR, "jamba": MAMBA, "bamba": MAMBA2, "mamba2": MAMBA2, "falcon_h1": MAMBA2,
           "zamba2": MAMBA2, "lfm2": CONV}

# MoE fields under their transformers-4/5 and family names.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk")
# Which families place their MoE layers by which field, and the values that change nothing (the field
# from another family is ignored by Hugging Face: a value that would matter there becomes a note).
_QWEN_MOE = ("qwen2_moe", "qwen3_moe", "qwen3_next")
_PLACEMENT_FIELDS: dict[str, tuple[tuple[str, ...], tuple]] = {
    "decoder_sparse_step": (_QWEN_MOE, (None, 1)), "mlp_only_layers": (_QWEN_MOE, (None, [])),
    "first_k_dense_replace": (("deepseek_v2", "deepseek_v3"), (None, 0)),
    "expert_layer_period": (("jamba",), (None, 1)), "expert_layer_offset": (("jamba",), (None, 0)),
}
# Families whose experts have `intermediate_size` (the rest use `moe_intermediate_size`).
_EXPERTS_USE_INTERMEDIATE = ("mixtral", "jamba")
# tie_word_embeddings when a config.json leaves it out (the family's Hugging Face default).
_TIED_BY_DEFAULT = ("gemma2", "lfm2", "zamba2")
# Families whose dense MLP (and DeepSeek-V2's shared experts) honour `mlp_bias`.
_MLP_BIAS_TYPES = ("llama", "deepseek_v2", "bamba", "falcon_h1")
# Families whose q/k/v/o carry biases when `attention_bias` is set.
_ATTENTION_BIAS_TYPES = ("llama", "qwen3", "qwen3_moe", "qwen3_next", "gemma2", "bamba", "falcon_h1")
_QK_NORM_TYPES = ("qwen3", "qwen3_moe", "qwen3_next", "lfm2")  # a per-head RMSNorm on q and k


class ModelProfileError(ValueError):
    """A config cannot be profiled; the message names the value and the fix."""


def bytes_per_weight(fmt: str) -> float:
    """Bytes per stored weight in format `fmt` (fp32, bf16, fp8, w12, int8)."""
    if fmt not in WEIGHT_FORMATS:
        raise ModelProfileError(f"weight format {fmt!r} is unknown; use one of {', '.join(WEIGHT_FORMATS)}")
    return WEIGHT_FORMATS[fmt]


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by part of the network (each an exact count)."""

    embedding: int  # input embedding table
    lm_head: int  # 0 when tied to the embedding
    attention: int  # attention layers: q, k, v, o (+ biases, q/k norms, MLA's low-rank parts)
    linear_attention: int  # recurrent mixers: gated DeltaNet, Mamba, Mamba2, short conv
    dense_mlp: int  # dense MLP layers
    router: int  # MoE routers (and shared-expert gates)
    shared_experts: int
    experts_total: int  # all routed experts
    experts_active: int  # routed experts one token uses
    norms: int
    reused: int = 0  # extra parameter reads of weight-shared blocks run more than once (Zamba2); not in total

    @property
    def total(self) -> int:
        return (self.embedding + self.lm_head + self.attention + self.linear_attention + self.dense_mlp
                + self.router + self.shared_experts + self.experts_total + self.norms)

    @property
    def active(self) -> int:
        """Parameters one token touches (the whole network less the routed experts it does not pick)."""
        return self.total - self.experts_total + self.experts_active


@dataclass(frozen=True)
class ModelProfile:
    """Shapes of one decoder-only model and the arithmetic over them."""

    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int  # the dense MLP's width as built (LFM2's after its auto-adjustment)
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]  # per layer: FULL, SLIDING, LINEAR, MAMBA, MAMBA2, CONV or HYBRID
    moe_layers: tuple[bool, ...]  # True where the layer's MLP is a routed MoE
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int  # one routed expert's width
    shared_expert_intermediate_size: int  # all shared experts of a layer together
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    params: ParamCounts
    sliding_window: int = 0  # tokens a SLIDING layer attends to (0: no sliding layers)
    kv_lora_rank: int = 0  # MLA: the cached latent's width (0: plain K and V heads)
    qk_rope_head_dim: int = 0  # MLA: the decoupled RoPE key cached beside the latent
    recurrent_state_size: int = 0  # elements of one recurrent layer's state matrix (DeltaNet / SSM)
    conv_state_size: int = 0  # elements of one recurrent layer's causal-conv window
    notes: tuple[str, ...] = ()  # what the profile assumed or ignored in the config

    # -- counts ---------------------------------------------------------------------------------

    @property
    def total_params(self) -> int:
        return self.params.total

    @property
    def active_params(self) -> int:
        return self.params.active

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV cache (full, sliding-window, and hybrid attention+SSM layers)."""
        return sum(t in ATTENTION_KINDS for t in self.layer_types)

    @property
    def num_sliding_layers(self) -> int:
        return sum(t == SLIDING for t in self.layer_types)

    @property
    def num_linear_layers(self) -> int:
        """Gated DeltaNet layers (Qwen3-Next)."""
        return sum(t == LINEAR for t in self.layer_types)

    @property
    def num_recurrent_layers(self) -> int:
        """Layers with a fixed-size state: DeltaNet, Mamba, Mamba2, short conv, hybrid."""
        return sum(t in RECURRENT_KINDS for t in self.layer_types)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def params_per_expert(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size  # gate, up, down

    @property
    def fingerprint(self) -> str:
        """Short hash of the shapes: tells whether a stored measurement was taken on this model."""
        shape = json.dumps([self.model_type, self.hidden_size, self.num_layers, self.num_heads, self.num_kv_heads,
                            self.head_dim, self.vocab_size, self.intermediate_size, self.total_params])
        return hashlib.sha256(shape.encode()).hexdigest()[:12]

    # -- bytes ----------------------------------------------------------------------------------

    @property
    def kv_width(self) -> int:
        """Elements one attention layer caches per token: K and V of each KV head (GQA-aware), or
        MLA's compressed latent plus its RoPE key."""
        if self.kv_lora_rank:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, kv_bytes: float = 2.0) -> float:
        """KV cache bytes one token adds (written into every attention layer, sliding ones included)."""
        return self.num_attention_layers * self.kv_width * kv_bytes

    def kv_cache_bytes(self, context: float, kv_bytes: float = 2.0) -> float:
        """KV cache bytes of one sequence `context` tokens long: a sliding-window layer keeps at most
        its window, every other attention layer the whole context."""
        full = self.num_attention_layers - self.num_sliding_layers
        sliding = self.num_sliding_layers * min(context, self.sliding_window)
        return (full * context + sliding) * self.kv_width * kv_bytes

    def recurrent_state_bytes(self, state_bytes: float = 4.0, conv_bytes: float = 2.0) -> float:
        """Fixed-size state of one sequence in the recurrent layers: the DeltaNet / SSM state matrix
        (kept in fp32 by the reference kernels) and the causal-conv window."""
        return self.num_recurrent_layers * (self.recurrent_state_size * state_bytes
                                            + self.conv_state_size * conv_bytes)

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct routed experts per MoE layer for `tokens` tokens, each picking
        `experts_per_token` of `num_experts` independently and uniformly (real routing is more
        correlated, so this is an upper estimate of the expert bytes a step reads)."""
        if self.num_experts == 0 or tokens <= 0:
            return 0.0
        miss = (1 - self.experts_per_token / self.num_experts) ** tokens
        return self.num_experts * (1 - miss)

    def weight_params_read(self, tokens: int) -> float:
        """Parameters a forward over `tokens` tokens reads from memory: every dense matrix once (a
        weight-shared block once per use), the experts the tokens route to once each, and only
        `tokens` rows of an untied input embedding."""
        p = self.params
        dense = p.total - p.experts_total - p.embedding + p.reused
        embedding = p.embedding if self.tie_word_embeddings else min(tokens, self.vocab_size) * self.hidden_size
        experts = self.num_moe_layers * self.experts_touched(tokens) * self.params_per_expert
        return dense + embedding + experts

    def weight_bytes(self, fmt: str, tokens: int = 1) -> float:
        """Bytes of weights a forward over `tokens` tokens reads in format `fmt`."""
        return self.weight_params_read(tokens) * bytes_per_weight(fmt)

    # -- FLOPs ----------------------------------------------------------------------------------

    @property
    def matmul_params_per_token(self) -> int:
        """Parameters one token multiplies with: active parameters (a weight-shared block once per use)
        less the input embedding, which is a row lookup (with tied embeddings the same matrix still
        counts once, as the LM head)."""
        return self.params.active + self.params.reused - (0 if self.tie_word_embeddings else self.params.embedding)

    @property
    def attention_flops_per_context_token(self) -> int:
        """FLOPs one query spends per cached token in one attention layer: QK^T and PV over every
        head (MLA in its absorbed form scores against the latent and its RoPE key)."""
        if self.kv_lora_rank:
            return 2 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return 4 * self.num_heads * self.head_dim

    def flops_per_token(self, context: float) -> float:
        """FLOPs for one token attending to `context` earlier tokens: 2 per matmul parameter, plus
        QK^T and PV in each attention layer (a sliding one over at most its window), plus the state
        update and readout in each recurrent layer (STATE_FLOPS per state element)."""
        matmul = 2 * self.matmul_params_per_token
        full = self.num_attention_layers - self.num_sliding_layers
        attended = full * context + self.num_sliding_layers * min(context, self.sliding_window)
        attention = attended * self.attention_flops_per_context_token
        state = sum(STATE_FLOPS[t] for t in self.layer_types if t in RECURRENT_KINDS) * self.recurrent_state_size
        return matmul + attention + state

    def summary(self) -> dict:
        return {
            "name": self.name, "model_type": self.model_type, "layers": self.num_layers,
            "attention_layers": self.num_attention_layers, "linear_attention_layers": self.num_linear_layers,
            "sliding_attention_layers": self.num_sliding_layers, "recurrent_layers": self.num_recurrent_layers,
            "moe_layers": self.num_moe_layers,
            "total_params": self.total_params, "active_params": self.active_params,
            "kv_bytes_per_token_bf16": self.kv_bytes_per_token(2.0),
            "recurrent_state_bytes": self.recurrent_state_bytes(),
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------------------------------------
# Building a profile from a config


def _get(cfg: dict, key: str, name: str, default=None):
    value = cfg.get(key, default)
    if value is None:
        raise ModelProfileError(f"config {name} lacks {key!r}; pass a Hugging Face config.json of a decoder-only model")
    return value


def _one_of(cfg: dict, keys: tuple[str, ...], name: str) -> tuple[str | None, int | None]:
    """The value a config gives under any of `keys` (aliases across versions and families), and the
    key it was found under; two aliases with different values are a contradiction."""
    found = {}
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, list) and value and all(v == value[0] for v in value):
            value = value[0]  # a per-layer list with one value (Hunyuan's moe_topk)
        if value is not None:
            found[key] = value
    if len({json.dumps(v) for v in found.values()}) > 1:
        shown = " and ".join(f"{k}={v}" for k, v in found.items())
        raise ModelProfileError(f"config {name}: {shown} disagree; keep one of them")
    for key, value in found.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise ModelProfileError(f"config {name}: {key}={value!r} must be one integer")
        return key, value
    return None, None


# -- layer kinds --------------------------------------------------------------------------------


def _window(cfg: dict) -> int:
    """The sliding window the config turns on, 0 when off (`use_sliding_window: false` turns it off)."""
    if cfg.get("use_sliding_window") is False:
        return 0
    return cfg.get("sliding_window") or 0


def _explicit_layer_kinds(cfg: dict, mtype: str, layers: int, name: str) -> tuple[tuple[str, ...], str] | None:
    """Layer kinds a family states through its own fields, and the field; None when it does not."""
    r = range(layers)
    if mtype == "qwen3_next" and cfg.get("full_attention_interval"):
        interval = cfg["full_attention_interval"]  # every interval-th layer is gated attention
        return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in r), "full_attention_interval"
    if mtype == "jamba" and ("attn_layer_period" in cfg or "attn_layer_offset" in cfg):
        period, offset = _get(cfg, "attn_layer_period", name), _get(cfg, "attn_layer_offset", name)
        return tuple(FULL if i % period == offset else MAMBA for i in r), "attn_layer_period/attn_layer_offset"
    if mtype == "bamba" and "attn_layer_indices" in cfg:
        indices = set(cfg["attn_layer_indices"] or ())
        return tuple(FULL if i in indices else MAMBA2 for i in r), "attn_layer_indices"
    if mtype == "lfm2" and cfg.get("full_attn_idxs") is not None:
        indices = set(cfg["full_attn_idxs"])
        return tuple(FULL if i in indices else CONV for i in r), "full_attn_idxs"
    if mtype == "mamba2":
        return (MAMBA2,) * layers, "model_type"
    if mtype == "falcon_h1":
        return (HYBRID,) * layers, "model_type"
    return None


def _default_layer_kinds(cfg: dict, mtype: str, layers: int, name: str) -> tuple[str, ...]:
    """Layer kinds of a config without `layer_types`, by the rule the installed transformers applies."""
    window, r = _window(cfg), range(layers)
    if mtype == "gemma2":  # even layers slide, odd layers attend globally
        return tuple(SLIDING if (i + 1) % 2 else FULL for i in r)
    if mtype in ("mistral", "mixtral", "qwen3_moe") and window:
        return (SLIDING,) * layers
    if mtype in ("qwen2", "qwen3") and window:
        top = cfg.get("max_window_layers", 28)
        return tuple(SLIDING if i >= top else FULL for i in r)
    if mtype == "qwen2_moe" and window:
        top = cfg.get("max_window_layers", 28)
        return tuple(SLIDING if (i + 1) % 2 and i < top else FULL for i in r)
    if mtype in _MIXERS:
        needs = {"qwen3_next": "full_attention_interval", "jamba": "attn_layer_period and attn_layer_offset",
                 "bamba": "attn_layer_indices", "zamba2": "layers_block_type", "lfm2": "full_attn_idxs"}[mtype]
        raise ModelProfileError(f"config {name}: a {mtype} config needs layer_types or {needs} to say which layers "
                                f"attend; neither is set")
    return (FULL,) * layers


def _layer_kinds(cfg: dict, mtype: str, layers: int, name: str) -> tuple[str, ...]:
    explicit = _explicit_layer_kinds(cfg, mtype, layers, name)
    key = next((k for k in ("layer_types", "layers_block_type") if cfg.get(k)), None)
    if key is None:
        return explicit[0] if explicit else _default_layer_kinds(cfg, mtype, layers, name)
    listed, names = list(cfg[key]), _LAYER_NAMES.get(mtype, _ATTENTION_NAMES)
    if len(listed) != layers:
        raise ModelProfileError(f"config {name}: {key} lists {len(listed)} layers but num_hidden_layers is {layers}")
    odd = sorted({str(t) for t in listed if t not in names})
    if odd:
        raise ModelProfileError(f"config {name}: {key} has {', '.join(odd)}, which {mtype} does not build; "
                                f"expected {', '.join(sorted(names))}")
    kinds = tuple(names[t] for t in listed)
    if explicit and explicit[0] != kinds:
        raise ModelProfileError(f"config {name}: {key} and {explicit[1]} name different attention layers; "
                                f"keep one of them")
    return kinds


# -- experts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _MoE:
    layers: tuple[bool, ...]
    experts: int = 0
    top_k: int = 0
    expert_size: int = 0  # one routed expert's intermediate width
    shared_size: int = 0  # the shared experts' intermediate width, all together
    shared_gate: bool = False  # Qwen's sigmoid gate on the shared expert (hidden -> 1)
    router_bias: bool = False  # DeepSeek-V3's e_score_correction_bias (one per expert)


def _moe(cfg: dict, mtype: str, layers: int, name: str, notes: list[str]) -> _MoE:
    count_key, experts = _one_of(cfg, EXPERT_COUNT_KEYS, name)
    top_key, top_k = _one_of(cfg, TOP_K_KEYS, name)
    if mtype not in (*MOE_TYPES, "qwen3_next", "jamba"):
        if (experts or 0) > 1 or (experts is None and top_k):
            field = f"{count_key}={experts}" if (experts or 0) > 1 else f"{top_key}={top_k}"
            raise ModelProfileError(f"config {name}: model_type {mtype} is dense but the config sets {field}; "
                                    f"fix model_type or drop the MoE fields")
        return _MoE((False,) * layers)
    if experts is None:
        raise ModelProfileError(f"config {name}: a {mtype} config must give its routed-expert count as "
                                f"{' or '.join(EXPERT_COUNT_KEYS)}; none is set")
    for field, (families, trivial) in _PLACEMENT_FIELDS.items():
        if mtype not in families and cfg.get(field) not in trivial:
            notes.append(f"{field}={cfg[field]} ignored: {mtype} does not place its MoE layers by it")
    r, where = range(layers), (False,) * layers
    if mtype == "jamba":
        dense = experts <= 1  # Jamba writes num_experts=1 for a dense model
        if not dense:
            period, offset = _get(cfg, "expert_layer_period", name), _get(cfg, "expert_layer_offset", name)
            where = tuple(i % period == offset for i in r)
    elif mtype in ("deepseek_v2", "deepseek_v3"):
        first_dense = cfg.get("first_k_dense_replace") or 0
        where = tuple(i >= first_dense for i in r)
        if cfg.get("moe_layer_freq") not in (None, 1):
            notes.append(f"moe_layer_freq={cfg['moe_layer_freq']} ignored, as Hugging Face {mtype} does: every "
                         f"layer from first_k_dense_replace on is MoE")
        dense = experts == 0
    elif mtype == "mixtral":
        where, dense = (True,) * layers, experts == 0
    else:  # the Qwen MoE families
        step = cfg.get("decoder_sparse_step") or 1
        dense_only = set(cfg.get("mlp_only_layers") or ())
        where, dense = tuple(i not in dense_only and (i + 1) % step == 0 for i in r), experts == 0
    if dense:
        return _MoE((False,) * layers)
    if top_k is None or not 0 < top_k <= experts:
        raise ModelProfileError(f"config {name}: {top_key or TOP_K_KEYS[0]}={top_k} must be between 1 and "
                                f"{count_key}={experts}")
    if mtype in _EXPERTS_USE_INTERMEDIATE:
        size = _get(cfg, "intermediate_size", name)
        if cfg.get("moe_intermediate_size") not in (None, size):
            notes.append(f"moe_intermediate_size={cfg['moe_intermediate_size']} ignored: {mtype} experts are "
                         f"intermediate_size={size} wide")
    else:
        size = _get(cfg, "moe_intermediate_size", name)
    n_shared, shared_size = cfg.get("n_shared_experts"), cfg.get("shared_expert_intermediate_size")
    if mtype in ("deepseek_v2", "deepseek_v3"):
        n_shared = _get(cfg, "n_shared_experts", name)
        if shared_size not in (None, n_shared * size):
            raise ModelProfileError(f"config {name}: shared_expert_intermediate_size={shared_size} contradicts "
                                    f"n_shared_experts={n_shared} x moe_intermediate_size={size}")
        return _MoE(where, experts, top_k, size, n_shared * size, router_bias=mtype == "deepseek_v3")
    if mtype in ("qwen2_moe", "qwen3_next"):
        shared_size = _get(cfg, "shared_expert_intermediate_size", name)
        if n_shared not in (None, 1):
            notes.append(f"n_shared_experts={n_shared} ignored: {mtype} has one shared expert of "
                         f"shared_expert_intermediate_size={shared_size}")
        return _MoE(where, experts, top_k, size, shared_size, shared_gate=True)
    for field in ("n_shared_experts", "shared_expert_intermediate_size"):
        if cfg.get(field):
            notes.append(f"{field}={cfg[field]} ignored: Hugging Face {mtype} builds no shared expert")
    return _MoE(where, experts, top_k, size)


# -- recurrent mixers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Mixer:
    params: int  # one recurrent layer's mixer parameters
    state: int = 0  # its state matrix elements
    conv_state: int = 0  # its causal-conv window elements (kernel - 1 past inputs per channel)


_LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim")


def _gated_deltanet(lin: dict[str, int], h: int) -> _Mixer:
    """Qwen3-Next: in_proj_qkvz, in_proj_ba, depthwise conv over q, k, v, dt_bias, A_log, gated norm, out_proj."""
    key_dim = lin["linear_num_key_heads"] * lin["linear_key_head_dim"]
    value_dim = lin["linear_num_value_heads"] * lin["linear_value_head_dim"]
    v_heads, kernel = lin["linear_num_value_heads"], lin["linear_conv_kernel_dim"]
    conv_dim = 2 * key_dim + value_dim
    params = (h * (2 * key_dim + 2 * value_dim) + h * 2 * v_heads + conv_dim * kernel + 2 * v_heads
              + lin["linear_value_head_dim"] + value_dim * h)
    state = v_heads * lin["linear_key_head_dim"] * lin["linear_value_head_dim"]  # [v_heads, k_dim, v_dim]
    return _Mixer(params, state, conv_dim * (kernel - 1))


def _mamba(cfg: dict, h: int, name: str) -> _Mixer:
    """Jamba's Mamba (v1): in_proj (x, z), conv, x_proj (dt, B, C), dt_proj, A_log, D, out_proj, and the
    RMSNorms Jamba puts on dt, B and C."""
    inner = int(_get(cfg, "mamba_expand", name) * h)
    n, kernel = _get(cfg, "mamba_d_state", name), _get(cfg, "mamba_d_conv", name)
    rank = cfg.get("mamba_dt_rank", "auto")
    rank = math.ceil(h / 16) if rank in (None, "auto") else rank
    proj_bias, conv_bias = bool(cfg.get("mamba_proj_bias", False)), bool(cfg.get("mamba_conv_bias", True))
    params = (h * 2 * inner + (2 * inner if proj_bias else 0) + inner * kernel + (inner if conv_bias else 0)
              + inner * (rank + 2 * n) + rank * inner + inner + inner * n + inner + inner * h
              + (h if proj_bias else 0) + rank + 2 * n)
    return _Mixer(params, inner * n, inner * (kernel - 1))


# Mamba2 field names per family: heads, head dim, state size, groups, conv kernel, expand.
_MAMBA2_KEYS = {
    "mamba2": ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "expand"),
    "bamba": ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv", "mamba_expand"),
    "falcon_h1": ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv", "mamba_expand"),
    "zamba2": ("n_mamba_heads", "mamba_headdim", "mamba_d_state", "mamba_ngroups", "mamba_d_conv", "mamba_expand"),
}


def _mamba2(cfg: dict, mtype: str, h: int, name: str) -> _Mixer:
    """A Mamba2 mixer: in_proj (z, x, B, C, dt), conv over x/B/C, dt_bias, A_log, D, gated norm, out_proj."""
    heads_key, dim_key, state_key, groups_key, kernel_key, expand_key = _MAMBA2_KEYS[mtype]
    heads, n = _get(cfg, heads_key, name), _get(cfg, state_key, name)
    groups, kernel = _get(cfg, groups_key, name, 1), _get(cfg, kernel_key, name)
    inner = cfg.get("mamba_d_ssm") if mtype == "falcon_h1" else None
    inner = inner or int(_get(cfg, expand_key, name) * h)
    head_dim = cfg.get(dim_key)
    head_dim = inner // heads if head_dim in (None, "auto") else head_dim
    if heads * head_dim != inner:
        raise ModelProfileError(f"config {name}: {heads_key}={heads} x {dim_key}={head_dim} must equal the Mamba2 "
                                f"inner width {inner}")
    if mtype == "mamba2":
        in_bias = out_bias = bool(cfg.get("use_bias", False))
        conv_bias, norm = bool(cfg.get("use_conv_bias", True)), True
    elif mtype == "zamba2":
        in_bias = out_bias = bool(cfg.get("add_bias_linear", False))
        conv_bias, norm = True, True
    else:
        in_bias = bool(cfg.get("mamba_proj_bias", False))
        out_bias = bool(cfg.get("projectors_bias", False)) if mtype == "falcon_h1" else in_bias
        conv_bias = bool(cfg.get("mamba_conv_bias", True))
        norm = bool(cfg.get("mamba_rms_norm", False)) if mtype == "falcon_h1" else True
    conv_dim = inner + 2 * groups * n
    projected = inner + conv_dim + heads  # z, (x, B, C), dt
    params = (h * projected + (projected if in_bias else 0) + conv_dim * kernel + (conv_dim if conv_bias else 0)
              + 3 * heads + (inner if norm else 0) + inner * h + (h if out_bias else 0))
    return _Mixer(params, heads * head_dim * n, conv_dim * (kernel - 1))


def _short_conv(cfg: dict, h: int, name: str) -> _Mixer:
    """LFM2's gated short convolution: in_proj (B, C, x), depthwise conv, out_proj."""
    kernel, bias = _get(cfg, "conv_L_cache", name), bool(cfg.get("conv_bias", False))
    params = h * 3 * h + (3 * h if bias else 0) + h * kernel + (h if bias else 0) + h * h + (h if bias else 0)
    return _Mixer(params, 0, h * (kernel - 1))


# -- attention and MLP --------------------------------------------------------------------------


def _attention(cfg: dict, mtype: str, h: int, heads: int, kv_heads: int, head_dim: int, notes: list[str]) -> int:
    """One attention layer: q, k, v, o with the family's biases and q/k norms. Qwen3-Next's gated
    attention doubles q_proj (query and output gate)."""
    q_out = heads * head_dim * (2 if mtype == "qwen3_next" else 1)
    kv_out = kv_heads * head_dim
    params = h * q_out + 2 * h * kv_out + heads * head_dim * h
    if mtype == "qwen2" or (mtype == "qwen2_moe" and cfg.get("qkv_bias", True)):
        params += q_out + 2 * kv_out  # q, k, v carry biases; o does not
    elif cfg.get("attention_bias"):
        if mtype in _ATTENTION_BIAS_TYPES:
            params += q_out + 2 * kv_out + h
        else:
            notes.append(f"attention_bias ignored: Hugging Face {mtype} builds its projections without biases")
    if mtype in _QK_NORM_TYPES:
        params += 2 * head_dim
    return params


def _mla(cfg: dict, h: int, heads: int, name: str) -> tuple[int, int, int]:
    """DeepSeek's multi-head latent attention: (parameters, kv_lora_rank, qk_rope_head_dim)."""
    q_rank, kv_rank = cfg.get("q_lora_rank"), _get(cfg, "kv_lora_rank", name)
    rope, nope = _get(cfg, "qk_rope_head_dim", name), _get(cfg, "qk_nope_head_dim", name)
    v_dim, bias = _get(cfg, "v_head_dim", name), bool(cfg.get("attention_bias"))
    qk = nope + rope
    if q_rank:  # q_a_proj, q_a_layernorm, q_b_proj
        q = h * q_rank + (q_rank if bias else 0) + q_rank + q_rank * heads * qk
    else:
        q = h * heads * qk
    kv = h * (kv_rank + rope) + ((kv_rank + rope) if bias else 0) + kv_rank + kv_rank * heads * (nope + v_dim)
    return q + kv + heads * v_dim * h + (h if bias else 0), kv_rank, rope


def _lfm2_intermediate(cfg: dict, size: int) -> int:
    """The MLP width LFM2 builds: 2/3 of intermediate_size, times the multiplier, rounded up."""
    if not cfg.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        multiple = cfg.get("block_multiple_of", 256)
        size = int(multiplier * size)
        size = multiple * ((size + multiple - 1) // multiple)
    return size


def from_config(config: dict, name: str | None = None) -> ModelProfile:
    """A ModelProfile from a Hugging Face config dict (a `text_config` inside is unwrapped)."""
    if not isinstance(config, dict):
        raise ModelProfileError(f"config {name}: expected a JSON object, got {type(config).__name__}")
    if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    name = name or config.get("_name_or_path") or config.get("model_type") or "model"
    mtype = config.get("model_type")
    if mtype not in SUPPORTED_TYPES:
        raise ModelProfileError(f"config {name}: model_type {mtype!r} is not supported; supported: "
                                f"{', '.join(SUPPORTED_TYPES)}")
    notes: list[str] = []
    h = _get(config, "hidden_size", name)
    layers = _get(config, "num_hidden_layers", name)
    heads = 0 if mtype == "mamba2" else _get(config, "num_attention_heads", name)  # Mamba2 has no attention
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = (config.get("head_dim") or h // heads) if heads else 0
    if mtype == "zamba2":  # the shared block attends over [hidden, input embeddings]: twice the width
        head_dim = 2 * h // heads
    vocab = _get(config, "vocab_size", name)
    tied = config.get("tie_word_embeddings")
    tied = mtype in _TIED_BY_DEFAULT if tied is None else bool(tied)
    types = _layer_kinds(config, mtype, layers, name)
    window = _window(config) if SLIDING in types else 0
    if SLIDING in types and not window:
        raise ModelProfileError(f"config {name}: layer_types has sliding_attention layers but sliding_window is "
                                f"{config.get('sliding_window')!r}; set the window")
    moe = _moe(config, mtype, layers, name, notes)

    lin = {k: config.get(k) or 0 for k in _LINEAR_KEYS}
    mixer = _Mixer(0)
    if any(t in RECURRENT_KINDS for t in types):
        kind = _MIXERS[mtype]
        if kind == LINEAR:
            missing = [k for k, v in lin.items() if not v]
            if missing:
                raise ModelProfileError(f"config {name} has linear-attention layers but lacks {', '.join(missing)}")
            mixer = _gated_deltanet(lin, h)
        elif kind == MAMBA:
            mixer = _mamba(config, h, name)
        elif kind == MAMBA2:
            mixer = _mamba2(config, mtype, h, name)
        else:
            mixer = _short_conv(config, h, name)

    kv_rank = rope = 0
    if mtype in ("deepseek_v2", "deepseek_v3"):
        attn, kv_rank, rope = _mla(config, h, heads, name)
        head_dim = config["qk_nope_head_dim"] + rope  # per-head query/key width
        notes.append("MLA: KV counted as the cached latent (kv_lora_rank + qk_rope_head_dim per layer), as serving "
                     "engines keep it; the Hugging Face cache holds full per-head K and V")
        if config.get("num_nextn_predict_layers"):
            notes.append(f"num_nextn_predict_layers={config['num_nextn_predict_layers']} MTP layer(s) not counted "
                         f"(Hugging Face does not build them)")
    elif heads:
        attn = _attention(config, mtype, h, heads, kv_heads, head_dim, notes)
    else:
        attn = 0

    # The dense MLP, in every layer that has one (pure Mamba2 layers have none).
    inter = config.get("intermediate_size") or 0
    if mtype == "lfm2":
        inter = _lfm2_intermediate(config, inter)
    mlp_layers = 0 if mtype in ("mamba2", "zamba2") else layers
    if mlp_layers > sum(moe.layers) and not inter:
        raise ModelProfileError(f"config {name} lacks 'intermediate_size' for its dense MLP layers")
    mlp_bias = mtype in _MLP_BIAS_TYPES and bool(config.get("mlp_bias"))
    dense_mlp = 3 * h * inter + ((2 * inter + h) if mlp_bias else 0)
    shared = 3 * h * moe.shared_size + ((2 * moe.shared_size + h) if mlp_bias and moe.shared_size else 0)
    router = h * moe.experts + (moe.experts if moe.router_bias else 0) + (h if moe.shared_gate else 0)
    per_expert = 3 * h * moe.expert_size

    n_attn = sum(t in ATTENTION_KINDS for t in types)
    n_rec = sum(t in RECURRENT_KINDS for t in types)
    n_moe = sum(moe.layers)
    norms_per_layer = {"gemma2": 4, "mamba2": 1, "zamba2": 1}.get(mtype, 2)  # gemma2: pre and post norms
    attention, mlp, reused = n_attn * attn, (mlp_layers - n_moe) * dense_mlp, 0
    norms = (layers * norms_per_layer + 1) * h  # + the final norm
    if mtype == "zamba2":
        attention, mlp, extra_norms, reused = _zamba2_shared(config, types, h, heads, kv_heads, head_dim, name)
        norms += extra_norms
    params = ParamCounts(
        embedding=vocab * h,
        lm_head=0 if tied else vocab * h,
        attention=attention,
        linear_attention=n_rec * mixer.params,
        dense_mlp=mlp,
        router=n_moe * router,
        shared_experts=n_moe * shared,
        experts_total=n_moe * moe.experts * per_expert,
        experts_active=n_moe * moe.top_k * per_expert,
        norms=norms,
        reused=reused,
    )
    return ModelProfile(
        name=str(name), model_type=mtype, hidden_size=h, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, vocab_size=vocab, intermediate_size=inter, tie_word_embeddings=tied, layer_types=types,
        moe_layers=moe.layers, num_experts=moe.experts, experts_per_token=moe.top_k,
        moe_intermediate_size=moe.expert_size, shared_expert_intermediate_size=moe.shared_size, params=params,
        sliding_window=window, kv_lora_rank=kv_rank, qk_rope_head_dim=rope, recurrent_state_size=mixer.state,
        conv_state_size=mixer.conv_state, notes=tuple(notes), **lin,
    )


def _zamba2_shared(cfg: dict, types: tuple[str, ...], h: int, heads: int, kv_heads: int, head_dim: int,
                   name: str) -> tuple[int, int, int, int]:
    """Zamba2's weight-shared transformer blocks: (attention, MLP, norm parameters, reused reads).

    `num_mem_blocks` blocks (attention over [hidden, embeddings] and an MLP) serve the hybrid layers in
    turn; each hybrid layer adds its own LoRA adapters and an output linear. A block serving several
    layers is stored once but read once per use."""
    hybrid = types.count(HYBRID)
    blocks = min(cfg.get("num_mem_blocks") or 1, hybrid)
    inter, rank = _get(cfg, "intermediate_size", name), cfg.get("adapter_rank") or 0
    wide = 2 * h
    attn_core = wide * heads * head_dim + 2 * wide * kv_heads * head_dim + heads * head_dim * h
    mlp_core = h * 2 * inter + inter * h + ((2 * inter + h) if cfg.get("add_bias_linear") else 0)
    block_norms = wide + h  # input_layernorm over the concatenation, pre_ff_layernorm
    qkv_adapters = 3 * 2 * wide * rank if cfg.get("use_shared_attention_adapter") else 0
    mlp_adapter = h * rank + rank * 2 * inter
    attention = blocks * attn_core + hybrid * (qkv_adapters + h * h)
    mlp = blocks * mlp_core + hybrid * mlp_adapter
    reused = (hybrid - blocks) * (attn_core + mlp_core + block_norms)
    return attention, mlp, blocks * block_norms, reused


def shipped_configs() -> list[str]:
    """Names of the configs shipped in costmodel/data (usable as --target-config NAME)."""
    return sorted(p.stem for p in DATA_DIR.glob("*.json"))


def load_model_profile(spec: str | Path, num_layers: int | None = None) -> ModelProfile:
    """A profile from a shipped config name (qwen3-8b, ...), a config.json path, or a model directory.

    `num_layers` keeps only the first layers (a block drafter built from its target's shape).
    """
    text = str(spec)
    if text in shipped_configs():
        path = DATA_DIR / f"{text}.json"
        name = text
    else:
        path = Path(text).expanduser()
        if path.is_dir():
            path = path / "config.json"
        name = path.parent.name if path.name == "config.json" else path.stem
        if not path.is_file():
            raise ModelProfileError(f"config {text}: not a shipped config nor a config.json / model directory; "
                                    f"use one of {', '.join(shipped_configs())} or a path")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelProfileError(f"{path} is not valid JSON ({e.msg}); pass a Hugging Face config.json") from e
    if num_layers is not None:
        config = _truncated(config, num_layers, name)
        name = f"{name}[{num_layers} layers]"
    return from_config(config, name)


def _truncated(config: dict, num_layers: int, name: str) -> dict:
    if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    layers = config.get("num_hidden_layers") or 0
    if not 1 <= num_layers <= layers:
        raise ModelProfileError(f"--drafter-layers {num_layers}: must be between 1 and {name}'s {layers} layers")
    config = {**config, "num_hidden_layers": num_layers}
    for key in ("layer_types", "layers_block_type"):  # per-layer lists; index lists need no cut
        if config.get(key):
            config[key] = config[key][:num_layers]
    return config
