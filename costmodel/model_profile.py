"""Model profiles from a Hugging Face config (no weights): parameters, bytes, KV and state, FLOPs.

Counts follow the Hugging Face modules of each `model_type` tensor by tensor (projections, biases,
norms, routers), so they match the checkpoint's parameter count, not a rounded headline.
Supported: llama, mistral, qwen2, qwen3 (dense), qwen3_moe (MoE), qwen3_next (hybrid gated
DeltaNet / gated attention, MoE with a shared expert).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"

# Bytes per stored weight, and the dtype its matmuls run in (weight-only formats dequantize to bf16).
WEIGHT_FORMATS: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0, "w12": 1.5, "int8": 1.0}
COMPUTE_DTYPE: dict[str, str] = {"fp32": "fp32", "bf16": "bf16", "fp8": "fp8", "w12": "bf16", "int8": "bf16"}

DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_TYPES = (*DENSE_TYPES, "qwen3_moe", "qwen3_next")
FULL, LINEAR = "full_attention", "linear_attention"


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
    attention: int  # full-attention layers: q, k, v, o (+ biases, q/k norms)
    linear_attention: int  # gated DeltaNet layers: in/out projections, conv, gates, norm
    dense_mlp: int  # dense MLP layers
    router: int  # MoE routers (and shared-expert gates)
    shared_experts: int
    experts_total: int  # all routed experts
    experts_active: int  # routed experts one token uses
    norms: int

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
    intermediate_size: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]  # FULL or LINEAR per layer
    moe_layers: tuple[bool, ...]  # True where the layer's MLP is a routed MoE
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    params: ParamCounts

    # -- counts ---------------------------------------------------------------------------------

    @property
    def total_params(self) -> int:
        return self.params.total

    @property
    def active_params(self) -> int:
        return self.params.active

    @property
    def num_attention_layers(self) -> int:
        return sum(t == FULL for t in self.layer_types)

    @property
    def num_linear_layers(self) -> int:
        return sum(t == LINEAR for t in self.layer_types)

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

    def kv_bytes_per_token(self, kv_bytes: float = 2.0) -> float:
        """KV cache bytes one token adds: K and V for each attention layer's KV heads (GQA-aware)."""
        return 2 * self.num_attention_layers * self.num_kv_heads * self.head_dim * kv_bytes

    def recurrent_state_bytes(self, state_bytes: float = 4.0, conv_bytes: float = 2.0) -> float:
        """Fixed-size state of one sequence in the linear-attention layers: the delta-rule matrix
        [v_heads, k_dim, v_dim] (kept in fp32 by the reference kernels) and the causal-conv window."""
        delta_state = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        conv_state = self._linear_conv_dim * (self.linear_conv_kernel_dim - 1)
        return self.num_linear_layers * (delta_state * state_bytes + conv_state * conv_bytes)

    @property
    def _linear_conv_dim(self) -> int:
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        return 2 * key_dim + value_dim  # the conv runs over q, k and v

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct routed experts per MoE layer for `tokens` tokens, each picking
        `experts_per_token` of `num_experts` independently and uniformly (real routing is more
        correlated, so this is an upper estimate of the expert bytes a step reads)."""
        if self.num_experts == 0 or tokens <= 0:
            return 0.0
        miss = (1 - self.experts_per_token / self.num_experts) ** tokens
        return self.num_experts * (1 - miss)

    def weight_params_read(self, tokens: int) -> float:
        """Parameters a forward over `tokens` tokens reads from memory: every dense matrix once, the
        experts the tokens route to once each, and only `tokens` rows of an untied input embedding."""
        p = self.params
        dense = p.total - p.experts_total - p.embedding
        embedding = p.embedding if self.tie_word_embeddings else min(tokens, self.vocab_size) * self.hidden_size
        experts = self.num_moe_layers * self.experts_touched(tokens) * self.params_per_expert
        return dense + embedding + experts

    def weight_bytes(self, fmt: str, tokens: int = 1) -> float:
        """Bytes of weights a forward over `tokens` tokens reads in format `fmt`."""
        return self.weight_params_read(tokens) * bytes_per_weight(fmt)

    # -- FLOPs ----------------------------------------------------------------------------------

    @property
    def matmul_params_per_token(self) -> int:
        """Parameters one token multiplies with: active parameters less the input embedding, which is
        a row lookup (with tied embeddings the same matrix still counts once, as the LM head)."""
        return self.params.active - (0 if self.tie_word_embeddings else self.params.embedding)

    def flops_per_token(self, context: float) -> float:
        """FLOPs for one token attending to `context` earlier tokens: 2 per matmul parameter, plus
        QK^T and PV in each attention layer (4 * context * heads * head_dim), plus the delta-rule
        state update and readout in each linear-attention layer (about 7 per state element)."""
        matmul = 2 * self.matmul_params_per_token
        attention = 4 * context * self.num_attention_layers * self.num_heads * self.head_dim
        delta_rule = 7 * self.num_linear_layers * self.linear_num_value_heads * self.linear_key_head_dim \
            * self.linear_value_head_dim
        return matmul + attention + delta_rule

    def summary(self) -> dict:
        return {
            "name": self.name, "model_type": self.model_type, "layers": self.num_layers,
            "attention_layers": self.num_attention_layers, "linear_attention_layers": self.num_linear_layers,
            "total_params": self.total_params, "active_params": self.active_params,
            "kv_bytes_per_token_bf16": self.kv_bytes_per_token(2.0),
            "recurrent_state_bytes": self.recurrent_state_bytes(),
        }


# ---------------------------------------------------------------------------------------------
# Building a profile from a config


def _get(cfg: dict, key: str, name: str, default=None):
    value = cfg.get(key, default)
    if value is None:
        raise ModelProfileError(f"config {name} lacks {key!r}; pass a Hugging Face config.json of a decoder-only model")
    return value


def _layer_types(cfg: dict, layers: int, name: str) -> tuple[str, ...]:
    if cfg.get("layer_types"):
        types = tuple(cfg["layer_types"])
        if len(types) != layers or any(t not in (FULL, LINEAR) for t in types):
            raise ModelProfileError(f"config {name}: layer_types must list {layers} entries of {FULL!r} or "
                                    f"{LINEAR!r}; got {len(types)} ({sorted(set(types))})")
        return types
    interval = cfg.get("full_attention_interval")
    if cfg.get("model_type") == "qwen3_next" and interval:
        # Qwen3-Next: every interval-th layer is gated full attention, the rest gated DeltaNet.
        return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers))
    return (FULL,) * layers


def _moe_layers(cfg: dict, layers: int) -> tuple[bool, ...]:
    experts = cfg.get("num_experts") or 0
    if experts == 0:
        return (False,) * layers
    step = cfg.get("decoder_sparse_step") or 1
    dense_only = set(cfg.get("mlp_only_layers") or [])
    return tuple(i not in dense_only and (i + 1) % step == 0 for i in range(layers))


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
    h = _get(config, "hidden_size", name)
    layers = _get(config, "num_hidden_layers", name)
    heads = _get(config, "num_attention_heads", name)
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    vocab = _get(config, "vocab_size", name)
    inter = config.get("intermediate_size") or 0
    tied = bool(config.get("tie_word_embeddings", False))
    types = _layer_types(config, layers, name)
    moe = _moe_layers(config, layers)
    n_experts = config.get("num_experts") or 0
    top_k = config.get("num_experts_per_tok") or 0
    moe_inter = config.get("moe_intermediate_size") or 0
    shared_inter = config.get("shared_expert_intermediate_size") or 0
    if n_experts and not (0 < top_k <= n_experts and moe_inter):
        raise ModelProfileError(f"config {name}: an MoE config needs 0 < num_experts_per_tok <= num_experts and "
                                f"moe_intermediate_size; got {top_k}, {n_experts}, {moe_inter}")
    if any(not m for m in moe) and not inter:
        raise ModelProfileError(f"config {name} lacks 'intermediate_size' for its dense MLP layers")
    lin = {k: config.get(k) or 0 for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                           "linear_value_head_dim", "linear_conv_kernel_dim")}
    if LINEAR in types and not all(lin.values()):
        missing = [k for k, v in lin.items() if not v]
        raise ModelProfileError(f"config {name} has linear-attention layers but lacks {', '.join(missing)}")

    # Full attention. Qwen3-Next's gated attention doubles q_proj (query and output gate).
    gated = mtype == "qwen3_next"
    q_out = heads * head_dim * (2 if gated else 1)
    kv_out = kv_heads * head_dim
    attn = h * q_out + 2 * h * kv_out + heads * head_dim * h
    if mtype == "qwen2":  # q, k, v carry biases; o does not
        attn += q_out + 2 * kv_out
    elif config.get("attention_bias"):
        attn += q_out + 2 * kv_out + h
    if mtype in ("qwen3", "qwen3_moe", "qwen3_next"):
        attn += 2 * head_dim  # per-head RMSNorm on q and k

    # Gated DeltaNet (Qwen3-Next): in_proj_qkvz, in_proj_ba, depthwise conv, dt_bias, A_log, gated norm, out_proj.
    key_dim = lin["linear_num_key_heads"] * lin["linear_key_head_dim"]
    value_dim = lin["linear_num_value_heads"] * lin["linear_value_head_dim"]
    v_heads = lin["linear_num_value_heads"]
    linear_attn = (h * (2 * key_dim + 2 * value_dim) + h * 2 * v_heads
                   + (2 * key_dim + value_dim) * lin["linear_conv_kernel_dim"] + 2 * v_heads
                   + lin["linear_value_head_dim"] + value_dim * h)

    mlp_bias = (2 * inter + h) if config.get("mlp_bias") else 0
    dense_mlp = 3 * h * inter + mlp_bias
    per_expert = 3 * h * moe_inter
    shared = 3 * h * shared_inter
    router = h * n_experts + (h if shared_inter else 0)  # shared_expert_gate: h -> 1

    n_full, n_linear, n_moe = types.count(FULL), types.count(LINEAR), sum(moe)
    params = ParamCounts(
        embedding=vocab * h,
        lm_head=0 if tied else vocab * h,
        attention=n_full * attn,
        linear_attention=n_linear * (linear_attn if n_linear else 0),
        dense_mlp=(layers - n_moe) * dense_mlp,
        router=n_moe * router,
        shared_experts=n_moe * shared,
        experts_total=n_moe * n_experts * per_expert,
        experts_active=n_moe * top_k * per_expert,
        norms=layers * 2 * h + h,  # input and post-attention norms per layer, one final norm
    )
    return ModelProfile(
        name=str(name), model_type=mtype, hidden_size=h, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, vocab_size=vocab, intermediate_size=inter, tie_word_embeddings=tied, layer_types=types,
        moe_layers=moe, num_experts=n_experts, experts_per_token=top_k, moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=shared_inter, params=params, **lin,
    )


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
    if config.get("layer_types"):
        config["layer_types"] = config["layer_types"][:num_layers]
    return config
