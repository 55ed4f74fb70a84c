"""A lean forward for Llama-style decoders on decode and verify steps (mechanism `lean_forward`).

Loads its weights from the same Hugging Face model, fuses the Q/K/V and gate/up projections into
one matmul each, and keeps a preallocated KV buffer whose rollback is a length change. It skips
what the HF module stack pays for on every call (mask construction, cache objects, hooks, dispatch
through a dozen modules), which dominates a decode step of a small model on a CPU. The HF path stays
the reference: tests compare logits against it within the deployment's noise floor.

Architectures (`SUPPORTED`): Llama, Mistral (sliding window), Qwen2 (q/k/v biases, optional sliding
layers), Qwen3 (per-head q/k RMSNorm), Gemma (GELU-tanh, (1 + w) RMSNorm, embedding scaled by
sqrt(hidden)), Gemma 2 (Gemma plus sandwich norms, attention and final logit soft-capping,
query_pre_attn_scalar, alternating sliding-window layers) and Phi-3 (fused qkv and gate/up, partial
rotary). Each feature costs nothing when a model does not use it. Anything else is refused at
construction with a one-line `LeanUnsupported` (`lean_unsupported_reason` gives it from the config).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from decoder.archs import SUPPORTED, lean_unsupported_reason  # noqa: F401 (re-exported)
from decoder.archs import activation_name as _activation_name
from decoder.archs import layer_windows as _layer_windows
from decoder.capabilities import onednn_bf16_refusal
from decoder.config import MATMUL_BACKENDS
from kernels import cpu_bf16w

# hidden_act / hidden_activation -> the function HF's ACT2FN entry computes
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {  # keyed by archs.ACTIVATION_NAMES
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}
# attend(layer, q [T, H, hd], k [T, KV, hd], v [T, KV, hd]) -> [T, H * hd]: a forward's cache and mask
# Mechanism onednn-matmul: the row count oneDNN packs the weights for (any row count runs; measured on this CPU,
# SmolLM2 f32: packing for 4 or 16 rows gave the same ~30-40 ms per forward's matmuls at 1 to 8 rows).
ONEDNN_PACK_ROWS = 16
# oneDNN builds a primitive for every (row count, weight shape) it meets, the first time: 0.3-0.4 ms at a few rows
# and ~5 ms at a prefill's 2,000 (measured on this CPU, demo target), more than the matmul itself. So every new
# prompt length paid ~10 ms on its prefill (20 against 11 ms at 150-350 tokens) and every verify width its first
# time. The backend therefore pads a call's rows up to the next bucket of ONEDNN_BUCKETS (exact counts to 64, the
# verify widths; then steps of 64 rows to 1,024 rows and a step that doubles each doubling: at most 12.5% more
# rows, which cost the matmul nothing measurable) and builds every bucket's primitive when it packs, up to
# ONEDNN_WARM_MAX rows (the LM head, called at verify widths, up to 64). Padding rows are zeros, dropped after the
# call; each real row's product is bit-identical to the unpadded call's (tests/test_lean.py).
ONEDNN_BUCKETS = ((64, 1), (1024, 64), (2048, 128), (4096, 256), (8192, 512), (1 << 62, 1024))  # (up to, multiple of)
ONEDNN_WARM_MAX = 4096
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class FoldedMask:
    """An attention mask for grouped-query attention over several query rows, as `LeanLM.attention` reads it.

    Each KV head's rep = H / KV query heads run as ONE SDPA head of rep x q rows (row r*q + i: query head r of the
    group, query i), so SDPA reads each key and value once per group and never expands them per query head; the
    mask is additive (0 or -inf, the model's dtype), each query's row repeated per head of the group, built once
    per forward instead of converted from bool in every layer. Every row's scores, softmax and output are computed
    as before: bit-identical to SDPA with enable_gqa and the boolean mask (tests/test_lean.py), and 1.3-2.2x
    faster at 2-16 query rows on this CPU (batch 8, 9 rows, 330 keys: 635 -> 291 us a layer; one row: slower,
    so a single query keeps the plain path)."""

    add: torch.Tensor  # [B | 1, 1, rep * q, L]


class LeanUnsupported(ValueError):
    """The model's architecture is outside what the lean forward implements."""


def onednn_rows(t: int) -> int:
    """The row count a oneDNN call of t rows runs at (ONEDNN_BUCKETS)."""
    for limit, step in ONEDNN_BUCKETS:
        if t <= limit:
            return -(-t // step) * step
    raise AssertionError("the last bucket has no limit")


def _bucketed(x: torch.Tensor) -> torch.Tensor:
    """x [T, in] with zero rows appended up to its bucket (onednn_rows); the caller keeps the first T rows."""
    pad = onednn_rows(x.shape[0]) - x.shape[0]
    return torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] @ W^T (+ b) on oneDNN's packed weight, at a bucketed row count (see ONEDNN_BUCKETS)."""
    return torch.ops.mkldnn._linear_pointwise(_bucketed(x), packed, b, "none", [], "")[: x.shape[0]]


def _buckets(least: int, most: int) -> list[int]:
    """The bucketed row counts a call of `least`..`most` rows runs at."""
    return sorted({onednn_rows(t) for t in range(least, most + 1)})


def _warm_onednn(packed: list[tuple[torch.Tensor, int, int]], dtype: torch.dtype) -> None:
    """Build oneDNN's primitive of every bucketed row count up to each weight's limit: (packed weight, in, rows)."""
    for w, d_in, most in packed:
        for t in _buckets(1, most):
            torch.ops.mkldnn._linear_pointwise(torch.zeros(t, d_in, dtype=dtype), w, None, "none", [], "")


@dataclass
class LeanCache:
    """Preallocated KV buffer: k, v [layers, KV, max_len, head_dim]; `length` tokens are valid."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, keep: int) -> None:
        # Rollback is a length change: entries past `length` are overwritten by the next forward.
        self.length = min(self.length, keep)

    def compact(self, start: int, rows: torch.Tensor) -> None:
        """Keep the entries at slots start + rows (ascending offsets, e.g. a tree's accepted path) as slots
        start.. start + len(rows) - 1, in place, and drop the rest: after a tree verify the cache
        reads as if only the accepted path had been fed. rows: [n] long."""
        n = rows.shape[0]
        src = rows + start
        # Advanced indexing gathers into a new tensor first, so overlapping source and destination is safe.
        self.k[:, :, start : start + n] = self.k[:, :, src]
        self.v[:, :, start : start + n] = self.v[:, :, src]
        self.length = start + n


@dataclass(slots=True)
class LeanLayer:
    """One decoder layer's weights as the lean body reads them; None where the architecture lacks the piece."""

    ln1: torch.Tensor  # input norm
    wqkv: torch.Tensor  # [(H+2KV)*hd, D]
    bqkv: torch.Tensor | None  # Qwen2, attention_bias
    wo: torch.Tensor  # [D, H*hd]
    bo: torch.Tensor | None
    ln2: torch.Tensor  # norm before the MLP
    wgu: torch.Tensor  # [2I, D]: gate rows, then up rows
    bgu: torch.Tensor | None  # mlp_bias
    wdown: torch.Tensor  # [D, I]
    bdown: torch.Tensor | None
    q_norm: torch.Tensor | None = None  # Qwen3: RMSNorm over each head's q and k
    k_norm: torch.Tensor | None = None
    post_attn: torch.Tensor | None = None  # Gemma 2: norms on the attention and MLP outputs
    post_mlp: torch.Tensor | None = None
    window: int | None = None  # sliding window in tokens; None: full causal attention

    def tensors(self) -> list[torch.Tensor]:
        return [t for f in fields(self) if isinstance(t := getattr(self, f.name), torch.Tensor)]


def _fuse(mods) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate linear layers' weights (and biases, zeros where one has none) into one projection."""
    w = torch.cat([m.weight for m in mods]).contiguous()
    if all(m.bias is None for m in mods):
        return w, None
    return w, torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in mods])


class LeanLM:
    """Batch-1 causal LM forward over a LeanCache. `forward(ids [q], cache, last_only)` -> logits [q|1, V]."""

    def __init__(self, model, max_len: int = 2048) -> None:
        cfg = model.config
        reason = lean_unsupported_reason(cfg)
        if reason is not None:
            raise LeanUnsupported(reason)
        self.config = cfg
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        inner = model.model
        mt = cfg.model_type
        gemma = mt in ("gemma", "gemma2")
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.gqa = self.n_kv != self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.max_len = max_len
        self.act = ACTIVATIONS[_activation_name(cfg)]
        # Gemma's RMSNorm scales by (1 + w) in fp32 and casts after; the stored weight is 1 + w, in fp32.
        self.norm = self._rms_gemma if gemma else self._rms
        nw = (lambda m: 1.0 + m.weight.float()) if gemma else (lambda m: m.weight)
        # Gemma 2: softmax scale from query_pre_attn_scalar, tanh soft-capping of scores and logits.
        self.scale = cfg.query_pre_attn_scalar ** -0.5 if mt == "gemma2" else None  # None: SDPA's 1/sqrt(hd)
        self.attn_softcap = getattr(cfg, "attn_logit_softcapping", None) if mt == "gemma2" else None
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None) if mt == "gemma2" else None
        self.embed = inner.embed_tokens.weight  # [V, D]
        self.embed_scale = None  # Gemma multiplies the embedding by sqrt(D), rounded to the model's dtype
        if gemma:
            scale = getattr(inner.embed_tokens, "embed_scale", None)
            scale = scale if scale is not None else torch.tensor(cfg.hidden_size ** 0.5)
            self.embed_scale = scale.to(device=self.device, dtype=self.dtype)
        if getattr(model.lm_head, "bias", None) is not None:
            raise LeanUnsupported("lean forward: an LM head with a bias is not supported; use the HF path")
        self.lm_head = model.lm_head.weight  # [V, D] (the same tensor when tied)
        self.final_norm = nw(inner.norm)
        windows = _layer_windows(cfg)
        self.layers: list[LeanLayer] = []
        for layer, window in zip(inner.layers, windows, strict=True):
            a, m = layer.self_attn, layer.mlp
            wqkv, bqkv = _fuse([a.qkv_proj] if hasattr(a, "qkv_proj") else [a.q_proj, a.k_proj, a.v_proj])
            wgu, bgu = _fuse([m.gate_up_proj] if hasattr(m, "gate_up_proj") else [m.gate_proj, m.up_proj])
            sandwich = mt == "gemma2"  # post_attention_layernorm is on the attention output there
            self.layers.append(LeanLayer(
                ln1=nw(layer.input_layernorm), wqkv=wqkv, bqkv=bqkv, wo=a.o_proj.weight, bo=a.o_proj.bias,
                ln2=nw(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm),
                wgu=wgu, bgu=bgu, wdown=m.down_proj.weight, bdown=m.down_proj.bias,
                q_norm=a.q_norm.weight if mt == "qwen3" else None, k_norm=a.k_norm.weight if mt == "qwen3" else None,
                post_attn=nw(layer.post_attention_layernorm) if sandwich else None,
                post_mlp=nw(layer.post_feedforward_layernorm) if sandwich else None, window=window,
            ))
        self.sliding = tuple(ly.window is not None for ly in self.layers)
        self.window = next((ly.window for ly in self.layers if ly.window is not None), None)
        hf_act = getattr(inner.layers[0].mlp, "act_fn", None) or getattr(inner.layers[0].mlp, "activation_fn", None)
        probe = torch.linspace(-6, 6, 49, device=self.device)
        if hf_act is not None and not torch.allclose(hf_act(probe), self.act(probe), atol=1e-5, rtol=1e-5):
            raise LeanUnsupported(f"lean forward: this transformers build computes activation "
                                  f"{_activation_name(cfg)!r} differently from torch's; use the HF path")
        # RoPE tables from the model's own rotary module, so scaled variants (llama3, yarn...) match.
        with torch.no_grad():
            pos = torch.arange(max_len, device=self.device)[None]
            dummy = torch.zeros(1, 1, self.head_dim, device=self.device, dtype=self.dtype)
            cos, sin = inner.rotary_emb(dummy, pos)
        self.cos, self.sin = cos[0], sin[0]  # [max_len, rot]: rot < hd with partial rotary (Phi-3)
        self.rope = self._rope if self.cos.shape[-1] == self.head_dim else self._rope_partial
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.inter = self.layers[0].wgu.shape[0] // 2
        self.t_rows, self._wt = 0, {}
        self.matmul_backend, self._packed = "torch", {}
        self.fused_rows, self._fused = 0, []  # mechanism fused-mlp: from this many rows, per layer (gate, up) packed
        # Packed weights and built primitives outlive a switch back to "torch": the batched engine sets the backend
        # each request's config names, and packing again (0.6 s on the demo) would land in a timed request.
        self._onednn_store: tuple[tuple[int, ...], dict[int, torch.Tensor]] | None = None
        self._bf16w: dict[int, tuple[torch.Tensor, int]] = {}  # mechanism bf16w-matmul: id(w) -> (panels, N)
        self._bf16w_store: tuple[tuple[int, ...], dict[int, tuple[torch.Tensor, int]]] | None = None
        self._fused_store: list | None = None
        self.bf16w_rows = cpu_bf16w.MAX_ROWS  # mechanism bf16w-matmul: calls of more rows run on F.linear
        self.fused_layer = False  # mechanism bf16w-fused-layer: a layer's work around attention in two kernel calls
        self._cos32: tuple = (None,)  # the fused layer on a bfloat16 model: (cos, its float32 copy, sin's)
        self._fused_warm = ONEDNN_WARM_MAX + 1  # fused primitives are built from this many rows up
        self._head_ids: torch.Tensor | None = None  # draft-vocab on a draft model: the tokens its head scores
        self._head_rows: torch.Tensor | None = None

    def _matmul_weights(self) -> list[torch.Tensor]:
        """Every weight `mm` multiplies by: fused QKV, O, gate/up and down of each layer, then the LM head."""
        head = [self.lm_head] + ([self._head_rows] if self._head_rows is not None else [])
        return [t for ly in self.layers for t in (ly.wqkv, ly.wo, ly.wgu, ly.wdown)] + head

    def set_head_vocab(self, ids: torch.Tensor | None) -> None:
        """Mechanism draft-vocab on a draft model: the LM head scores only the tokens `ids` ([n]); every other
        logit is -inf, so argmax, top-k and sampling work on the full vocabulary as before (a drafter's proposals
        only: the target verifies them). None restores the full head."""
        self._head_ids = ids
        self._head_rows = None if ids is None else self.lm_head[ids].contiguous()
        self._onednn_store = self._bf16w_store = None  # packed for the old head
        self.set_transposed_rows(self.t_rows)  # the pruned head's copies for the matmul mechanisms
        self.set_matmul_backend(self.matmul_backend)

    def set_matmul_backend(self, backend: str) -> None:
        """Mechanism onednn-matmul: "onednn" packs every weight once into oneDNN's blocked layout and multiplies
        with its linear primitive (bias fused), whose cost on a CPU is nearly flat from 1 to 16 rows where
        F.linear's float32 few-row matmuls are not; "torch" (stock) multiplies with F.linear again (the packed copies
        are kept, so switching back costs nothing: the batched engine follows each request's config). Same products,
        another summation order (float32: within ~1e-6 of F.linear; forcing judges any changed token)."""
        if backend not in MATMUL_BACKENDS:
            raise ValueError(f"matmul backend {backend!r}: choose one of {', '.join(MATMUL_BACKENDS)}")
        packed = {}
        if backend == "onednn":
            if self.device.type != "cpu" or not torch.backends.mkldnn.is_available():
                raise LeanUnsupported(f"lean forward: matmul_backend = \"onednn\" needs a CPU target and a torch "
                                      f"build with oneDNN (this one: {self.device.type}, oneDNN "
                                      f"{'available' if torch.backends.mkldnn.is_available() else 'absent'}); "
                                      f"use \"torch\"")
            if self.dtype not in (torch.float32, torch.bfloat16):
                raise LeanUnsupported(f"lean forward: matmul_backend = \"onednn\" packs float32 or bfloat16 "
                                      f"weights, not {self.dtype}; use \"torch\"")
            why = onednn_bf16_refusal() if self.dtype == torch.bfloat16 else None
            if why:
                raise LeanUnsupported(f"lean forward: {why}")
            key = tuple(id(w) for w in self._matmul_weights())
            if self._onednn_store is not None and self._onednn_store[0] == key:
                packed = self._onednn_store[1]
            else:
                with torch.no_grad():
                    for w in self._matmul_weights():
                        packed[id(w)] = torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_PACK_ROWS)
                    heads = {id(self.lm_head), id(self._head_rows)}
                    shapes = {(tuple(w.shape), id(w) in heads): w for w in self._matmul_weights()}  # one per shape
                    _warm_onednn([(packed[id(w)], w.shape[1], ONEDNN_BUCKETS[0][0] if head else ONEDNN_WARM_MAX)
                                  for (_, head), w in shapes.items()], self.dtype)
                self._onednn_store = (key, packed)
        self._bf16w = self._pack_bf16w() if backend == "bf16w" else {}
        self.matmul_backend, self._packed = backend, packed
        if self.fused_rows:
            self.set_fused_mlp_rows(self.fused_rows if packed else 0)
        if self.fused_layer and backend != "bf16w":
            self.fused_layer = False

    def fused_layer_refusal(self) -> str | None:
        """Why mechanism bf16w-fused-layer cannot run this model (one line), or None: the two kernel calls are a
        Llama-style layer (RMSNorm, full RoPE, SiLU MLP, biases allowed), not Gemma's norms, Qwen3's q/k norms or
        a partial rotary."""
        ly = self.layers[0]
        if self.norm != self._rms or self.act is not F.silu or self.rope != self._rope:
            kind = ("Gemma's RMSNorm" if self.norm != self._rms else "a partial rotary" if self.rope != self._rope
                    else f"activation {_activation_name(self.config)!r}")
            return f"fused_layer runs Llama-style layers (RMSNorm, SiLU MLP, full RoPE); this model has {kind}"
        if ly.q_norm is not None or ly.post_attn is not None or ly.post_mlp is not None:
            return "fused_layer runs Llama-style layers; this model normalises q/k or the sublayer outputs"
        if self.dtype not in (torch.float32, torch.bfloat16):
            return (f"fused_layer runs float32 or bfloat16 layers; this model is loaded as "
                    f"{str(self.dtype).removeprefix('torch.')}")
        return None

    def set_bf16w_rows(self, rows: int) -> None:
        """Mechanism bf16w-matmul: calls of up to `rows` rows (1 to cpu_bf16w.MAX_ROWS) run on the bf16w kernel,
        wider ones on F.linear (and, with the fused layer, op by op between F.linear's matmuls)."""
        if not 1 <= rows <= cpu_bf16w.MAX_ROWS:
            raise LeanUnsupported(f"lean forward: bf16w_rows = {rows}: use 1 to {cpu_bf16w.MAX_ROWS}")
        self.bf16w_rows = rows

    def set_fused_layer(self, on: bool) -> None:
        """Mechanism bf16w-fused-layer: with matmul_backend "bf16w", calls of up to cpu_bf16w.MAX_ROWS rows run
        each layer as two kernel calls around attention (norm, QKV, RoPE; then O, residual, norm, gate/up, SiLU and
        product, down, residual) instead of ~25 torch ops, each a few microseconds of dispatch at a step's few
        rows; a float32 prefill's many rows run the steps between F.linear's matmuls as single passes (a bfloat16
        one runs op by op). Per-row float32 arithmetic in another order than torch's, on a bfloat16 model rounded
        where its op-by-op layer rounds (forcing judges any changed token)."""
        if on and self.matmul_backend != "bf16w":
            raise LeanUnsupported("lean forward: fused_layer runs on the bf16w kernel's panels; set matmul_backend = "
                                  "\"bf16w\" first")
        why = self.fused_layer_refusal() if on else None
        if why:
            raise LeanUnsupported(f"lean forward: {why}; use fused_layer = false")
        self.fused_layer = on

    def _layer_fused(self, li: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     attend: Attend) -> torch.Tensor:
        """`layer` as two bf16w kernel calls around `attend` (mechanism bf16w-fused-layer); a prefill's many rows
        (above cpu_bf16w.MAX_ROWS) multiply with F.linear and run the steps between as single passes."""
        ly, w = self.layers[li], self._bf16w
        many = x.shape[0] > self.bf16w_rows  # float32 only: a bfloat16 prefill runs the op-by-op layer
        if cos.dtype != torch.float32:  # a bfloat16 model's tables, widened (exactly) once per forward
            if self._cos32[0] is not cos:
                self._cos32 = (cos, cos.float(), sin.float())
            cos, sin = self._cos32[1:]
        if many:
            qkv = cpu_bf16w.rope_(self.mm(cpu_bf16w.rms(x, ly.ln1, self.eps), ly.wqkv, ly.bqkv), cos, sin,
                                  self.n_heads + self.n_kv, self.head_dim)
        else:
            qkv = cpu_bf16w.pre_attn(x, ly.ln1, self.eps, w[id(ly.wqkv)], ly.bqkv, cos, sin, self.n_heads,
                                     self.n_kv, self.head_dim)
        att = attend(li, *self._split_qkv(qkv))
        if many:
            y, h = cpu_bf16w.add_rms(x, self.mm(att, ly.wo, ly.bo), ly.ln2, self.eps)
            return y.add_(self.mm(cpu_bf16w.silu_mul(self.mm(h, ly.wgu, ly.bgu)), ly.wdown, ly.bdown))
        return cpu_bf16w.post_attn(x, att, w[id(ly.wo)], ly.bo, ly.ln2, self.eps, w[id(ly.wgu)], ly.bgu,
                                   w[id(ly.wdown)], ly.bdown)

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused projections [T, (H + 2 KV) * hd] -> views q [T, H, hd], k and v [T, KV, hd]."""
        t = qkv.shape[0]
        return (qkv[:, : self.q_size].view(t, self.n_heads, self.head_dim),
                qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.n_kv, self.head_dim),
                qkv[:, self.q_size + self.kv_size :].view(t, self.n_kv, self.head_dim))

    def _pack_bf16w(self) -> dict[int, tuple[torch.Tensor, int]]:
        """Mechanism bf16w-matmul: every matmul weight as the CPU kernel's bf16 panels (kernels/cpu_bf16w.py), kept
        for a later switch back; refused in one line unless the weights are float32 values bf16 holds exactly."""
        key = tuple(id(w) for w in self._matmul_weights())
        if self._bf16w_store is not None and self._bf16w_store[0] == key:
            return self._bf16w_store[1]
        if self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16):
            raise LeanUnsupported(f"lean forward: matmul_backend = \"bf16w\" multiplies float32 or bfloat16 "
                                  f"activations on the CPU, not {self.dtype} on {self.device.type}; use dtype = "
                                  f"\"float32\" or \"bfloat16\" on the CPU or matmul_backend = \"torch\"")
        try:
            # a bfloat16 model on a CPU with AVX512-BF16: weights in pairs of k, multiplied by its dot products
            pairs = (self.dtype == torch.bfloat16 and cpu_bf16w.pairs_available()
                     and all(w.shape[1] % 2 == 0 for w in self._matmul_weights()))
            packed = {id(w): (cpu_bf16w.pack(w, pairs), w.shape[0]) for w in self._matmul_weights()}
        except (ValueError, cpu_bf16w.KernelUnavailable) as e:
            raise LeanUnsupported(f"lean forward: matmul_backend = \"bf16w\": {e}; use \"torch\" or "
                                  f"\"onednn\"") from None
        self._bf16w_store = (key, packed)
        return packed

    def set_fused_mlp_rows(self, rows: int) -> None:
        """Mechanism fused-mlp: calls of at least `rows` rows run the MLP as gate = swish(x Wg) and up = (x Wu) * gate,
        each one oneDNN matmul with the activation or the product fused as a post-op, instead of one gate/up matmul,
        SiLU and a product, each a pass over the [T, 2I] activations (a prefill's; at a few rows the two calls cost
        more than the passes save). The same products; the activation and product are applied before the bf16
        rounding of the matmul's output, so forcing judges any changed token by its margin. 0 turns it off."""
        if rows and not self._packed:
            raise LeanUnsupported("lean forward: fused_mlp_rows fuses into oneDNN's matmuls; set matmul_backend = "
                                  "\"onednn\" first")
        if rows and self.act is not F.silu:
            raise LeanUnsupported(f"lean forward: fused_mlp_rows fuses a SiLU MLP; this model's activation is "
                                  f"{_activation_name(self.config)!r}: use 0")
        if rows and self._fused_store is None:
            pack = functools.partial(torch.ops.mkldnn._reorder_linear_weight, batch_size=ONEDNN_PACK_ROWS)
            with torch.no_grad():
                self._fused_store = [
                    (pack(ly.wgu[: self.inter].contiguous()), pack(ly.wgu[self.inter :].contiguous()),
                     *((None, None) if ly.bgu is None else (ly.bgu[: self.inter], ly.bgu[self.inter :])))
                    for ly in self.layers]
        if rows and rows < self._fused_warm:  # their primitives, as packing builds the plain ones
            gate, up = self._fused_store[0][:2]
            x = functools.partial(torch.zeros, dtype=self.dtype)
            for t in _buckets(rows, min(self._fused_warm - 1, ONEDNN_WARM_MAX)):
                g = torch.ops.mkldnn._linear_pointwise(x(t, self.config.hidden_size), gate, None, "swish", [], "")
                torch.ops.mkldnn._linear_pointwise.binary(x(t, self.config.hidden_size), g, up, None, "mul")
            self._fused_warm = rows
        self.fused_rows, self._fused = rows, (self._fused_store if rows else [])

    def _fused_mlp(self, li: int, h: torch.Tensor) -> torch.Tensor:
        """silu(h Wg + bg) * (h Wu + bu) [T, I] in two oneDNN calls at a bucketed row count (mechanism fused-mlp)."""
        wg, wu, bg, bu = self._fused[li]
        hp = _bucketed(h)
        g = torch.ops.mkldnn._linear_pointwise(hp, wg, bg, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(hp, g, wu, bu, "mul")[: h.shape[0]]

    def set_transposed_rows(self, rows: int) -> None:
        """Mechanism transposed-matmul: calls of up to `rows` rows multiply by a contiguous transposed copy of each
        weight (x @ W^T) instead of F.linear(x, W); 0 drops the copies. Same products, another summation order."""
        self.t_rows = rows
        self._wt = {}
        if rows:
            for w in self._matmul_weights():
                self._wt[id(w)] = w.t().contiguous()

    def mm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] @ w [out, in]^T (+ b): the transposed copy at up to `t_rows` rows, else the bf16 panels at up
        to `bf16w_rows` rows when the backend is "bf16w", else oneDNN's packed weight when it is "onednn",
        else F.linear."""
        if x.shape[0] <= self.t_rows:
            y = x @ self._wt[id(w)]
            return y if b is None else y + b
        if self._bf16w and x.shape[0] <= self.bf16w_rows:
            panels, n = self._bf16w[id(w)]
            return cpu_bf16w.linear(x, panels, n, b)
        if self._packed:
            return _onednn_linear(x, self._packed[id(w)], b)
        return F.linear(x, w, b)

    def new_cache(self, max_len: int | None = None) -> LeanCache:
        n = max_len or self.max_len
        shape = (len(self.layers), self.n_kv, n, self.head_dim)
        return LeanCache(torch.empty(shape, dtype=self.dtype, device=self.device),
                         torch.empty(shape, dtype=self.dtype, device=self.device))

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # As HF's LlamaRMSNorm: normalise in fp32, cast back, then scale. torch's fused rms_norm computes the same
        # h * rsqrt(mean(h^2) + eps) in one kernel instead of five (tests/test_lean.py: bit-identical).
        return w * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def _rms_gemma(self, x: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
        # As HF's GemmaRMSNorm: normalise and scale by (1 + w) (w1, fp32) in fp32, then cast back.
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * w1).type_as(x)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    @staticmethod
    def _rope_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = cos.shape[-1]  # rotate the first r dims of each head, pass the rest through
        return torch.cat([LeanLM._rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> input rows [T, D]."""
        x = F.embedding(ids, self.embed)
        return x if self.embed_scale is None else x * self.embed_scale

    def fold_masks(self, mask: torch.Tensor | None, sw_mask: torch.Tensor | None, q: int) -> tuple:
        """A forward's full-attention and sliding-window masks of q query rows as every layer's `attention` reads
        them (`fold_mask`), each made once; the same object when both are."""
        folded = self.fold_mask(mask, q)
        return folded, folded if sw_mask is mask else self.fold_mask(sw_mask, q)

    def fold_mask(self, mask: torch.Tensor | None, q: int) -> torch.Tensor | FoldedMask | None:
        """The mask of a forward's q query rows, made once per forward for every layer's `attention`: at q > 1 with a
        mask (verify, tree, batched steps) a FoldedMask, so attention runs as grouped queries; else `mask` itself."""
        if mask is None or q == 1 or self.attn_softcap is not None:
            return mask
        m = mask
        while m.dim() < 4:
            m = m[None]
        rep = self.n_heads // self.n_kv
        add = torch.zeros(m.shape[0], 1, rep * q, m.shape[-1], dtype=self.dtype, device=m.device)
        return FoldedMask(add.masked_fill_(~m.expand(m.shape[0], 1, q, m.shape[-1]).repeat(1, 1, rep, 1),
                                           float("-inf")))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | FoldedMask | None, causal: bool = False) -> torch.Tensor:
        """q [B, H, q, hd], k and v [B, KV, L, hd], mask (True = may attend) broadcast to [B, H, q, L]
        or None -> [B, H, q, hd]. `causal` (mask None, q = L: a prefill from position 0): query i sees keys 0..i,
        which SDPA's flash kernel computes without the masked half (the same result as the lower-triangle mask).
        A FoldedMask (`fold_mask`) runs each KV head's query heads as one head of rep x q rows (see FoldedMask)."""
        if isinstance(mask, FoldedMask):
            b, h, n, hd = q.shape
            qf = q.reshape(b, self.n_kv, (h // self.n_kv) * n, hd)  # head g*rep + r, row i -> group g, row r*n + i
            return F.scaled_dot_product_attention(qf, k, v, attn_mask=mask.add, scale=self.scale).view(b, h, n, hd)
        if self.attn_softcap is None:
            b, h, n, hd = q.shape
            if mask is None and n == 1 and self.gqa and q.dtype == torch.bfloat16:
                # One bfloat16 query: SDPA with enable_gqa takes a path 5x slower on the CPU (166 against 33 us a
                # layer over 260 keys on a 2-core EPYC) than each KV head's query heads as rows of one head, which
                # gives bit-identical rows (tests/test_lean.py); float32 keeps the plain path (there it is faster).
                qf = q.reshape(b, self.n_kv, h // self.n_kv, hd)
                return F.scaled_dot_product_attention(qf, k, v, scale=self.scale).view(b, h, n, hd)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=self.gqa,
                                                  scale=self.scale)
        if causal:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        # Gemma 2 soft-caps the scores (tanh) before the mask and softmax, which SDPA cannot express.
        if self.gqa:
            rep = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        cap = self.attn_softcap
        s = torch.tanh(q @ k.transpose(-1, -2) * (self.scale or self.head_dim ** -0.5) / cap) * cap  # [B, H, q, L]
        if mask is not None:
            s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
        return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v

    def layer(self, li: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Decoder layer `li` on rows x [T, D], the one layer body of every forward (single request, static,
        batched): norm, fused QKV, RoPE (cos, sin [T, 1, rot]), `attend`, output projection, norm, fused
        gate/up MLP. `attend(li, q [T, H, hd], k [T, KV, hd], v [T, KV, hd])` stores k and v where its
        cache keeps them and returns the attention output [T, H * hd] (with layer li's window)."""
        t = x.shape[0]
        if self.fused_layer and (t <= self.bf16w_rows or self.dtype == torch.float32):
            return self._layer_fused(li, x, cos, sin, attend)
        ly = self.layers[li]
        q, k, v = self._split_qkv(self.mm(self.norm(x, ly.ln1), ly.wqkv, ly.bqkv))  # from [T, (H+2KV)*hd]
        if ly.q_norm is not None:  # Qwen3: per-head RMSNorm of q and k, before RoPE
            q, k = self._rms(q, ly.q_norm), self._rms(k, ly.k_norm)
        o = self.mm(attend(li, self.rope(q, cos, sin), self.rope(k, cos, sin), v), ly.wo, ly.bo)
        if ly.post_attn is not None:
            o = self.norm(o, ly.post_attn)
        x = x + o
        h = self.norm(x, ly.ln2)
        if self.fused_rows and t >= self.fused_rows:
            act = self._fused_mlp(li, h)
        else:
            gu = self.mm(h, ly.wgu, ly.bgu)  # [T, 2I]
            act = self.act(gu[:, : self.inter]) * gu[:, self.inter :]
        mlp = self.mm(act, ly.wdown, ly.bdown)
        if ly.post_mlp is not None:
            mlp = self.norm(mlp, ly.post_mlp)
        return x + mlp

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden rows [T, D] -> logits [T, V]."""
        h = self.norm(x, self.final_norm)
        logits = self.mm(h, self.lm_head if self._head_rows is None else self._head_rows)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        if self._head_ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.lm_head.shape[0]), float("-inf"))
        full[:, self._head_ids] = logits
        return full

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: LeanCache, last_only: bool = False,
                positions: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                capture: tuple[int, ...] | None = None):
        """Append `ids` [q] at positions cache.length.. and return their logits [q, V] (or [1, V]).

        With `capture` (layer indices), it returns (logits, hidden [q, len(capture) * D]): the residual
        stream after each listed layer, concatenated (the feature drafters' context, decoder/featdraft.py);
        the last layer's entry is the final hidden state before the norm. `last_only` trims logits only.

        Tree verification passes its own `positions` [q] (RoPE position of each node: its depth after
        the prefix) and `attn_mask` [q, cache.length + q] (True = may attend: the prefix and the node's
        ancestors and itself); the KV still lands in slots cache.length.. in node order.
        """
        q = ids.shape[0]
        start = cache.length
        end = start + q
        if end > cache.k.shape[2]:
            raise ValueError(f"lean forward: sequence length {end} exceeds the KV buffer ({cache.k.shape[2]}); "
                             f"create the cache with a larger max_len")
        if positions is None:
            cos, sin = self.cos[start:end, None], self.sin[start:end, None]  # [q, 1, rot]
        else:
            cos, sin = self.cos.index_select(0, positions)[:, None], self.sin.index_select(0, positions)[:, None]
        x = self.embed_ids(ids)  # [q, D]
        hidden: list[torch.Tensor] = []
        mask = attn_mask
        # A prefill from position 0 (no window in reach): plain causal attention, no mask to build or read.
        causal = mask is None and q > 1 and start == 0 and (self.window is None or end <= self.window)
        if mask is None and q > 1 and not causal:  # block-causal: new token i sees the cache and new tokens 0..i
            mask = torch.ones(q, end, dtype=torch.bool, device=ids.device).tril(diagonal=start)
        # Sliding-window layers: a query at position p sees keys at positions p - window < j <= p. Keys
        # before slot `lo` are outside every query's window, so those layers read the cache from lo on.
        lo, sw_mask = 0, mask
        if self.window is not None and end > self.window:
            if positions is None:  # slot = position
                lo = max(0, start - self.window + 1)
                qpos, kpos = torch.arange(start, end, device=ids.device), torch.arange(lo, end, device=ids.device)
            else:  # this call's keys sit at the given positions; cached keys' slots are their positions
                # (a draft tree grown over several calls measures its older nodes by slot: lossless anyway)
                qpos, kpos = positions, torch.cat([torch.arange(start, device=ids.device), positions])
            near = kpos[None, :] > qpos[:, None] - self.window  # [q, end - lo]
            sw_mask = near if mask is None else mask[:, lo:] & near
            if q == 1 and positions is None:  # one decode step: every key from lo on is in its window
                sw_mask = None

        mask, sw_mask = self.fold_masks(mask, sw_mask, q)

        def attend(li: int, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
            cache.k[li, :, start:end] = kh.transpose(0, 1)
            cache.v[li, :, start:end] = vh.transpose(0, 1)
            k0, m = (lo, sw_mask) if self.sliding[li] else (0, mask)
            att = self.attention(qh.transpose(0, 1)[None], cache.k[li : li + 1, :, k0:end],
                                 cache.v[li : li + 1, :, k0:end], m, causal)  # [1, H, q, hd]
            return att[0].transpose(0, 1).reshape(q, self.q_size)

        for li in range(len(self.layers)):
            x = self.layer(li, x, cos, sin, attend)
            if capture is not None and li in capture:
                hidden.append(x)
        cache.length = end
        logits = self.head(x[-1:] if last_only else x)  # [q|1, V]
        if capture is not None:
            return logits, torch.cat(hidden, dim=-1)
        return logits


BUCKETS = (1, 2, 4, 8, 16, 32)  # verify widths a step is padded to: one captured graph each


def bucket_for(q: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    """The smallest bucket that holds q tokens."""
    for b in buckets:
        if q <= b:
            return b
    raise ValueError(f"static forward: {q} tokens exceed the largest bucket ({buckets[-1]}); "
                     f"draft fewer tokens or add a bucket")


class StaticLeanLM:
    """LeanLM with every shape fixed per bucket (mechanism `cuda_graphs`, gap family host-overhead).

    A step of q tokens is padded to its bucket b; positions, the KV write (index_copy_) and the
    attention mask over the whole KV buffer are tensors, so nothing in the step depends on a Python
    int that changes between steps. On CUDA each bucket's step is captured once as a CUDA graph and
    replayed with new ids/positions copied into its static input buffers; on the CPU the same static
    step runs eagerly (which is how its shape logic is tested here). Padded rows write KV past the
    valid length, where the next step overwrites them, and their logits are dropped.
    """

    def __init__(self, lean: LeanLM, max_len: int = 1024, buckets: tuple[int, ...] = BUCKETS,
                 use_graphs: bool | None = None) -> None:
        self.lean = lean
        self.config = lean.config
        self.device = lean.device
        self.max_len = max_len
        self.buckets = buckets
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        self._graphs: dict[tuple[int, bool], tuple] = {}  # (bucket, last_only) -> (graph, ids, pos, out)
        self._graph_cache: LeanCache | None = None  # graphs are bound to one KV buffer
        self._keys = torch.arange(max_len, device=self.device)  # [max_len]

    @property
    def embed(self) -> torch.Tensor:  # the feature drafters share the target's embedding and LM head
        return self.lean.embed

    @property
    def lm_head(self) -> torch.Tensor:
        return self.lean.lm_head

    def new_cache(self, max_len: int | None = None) -> LeanCache:
        if self._graph_cache is not None:  # reuse the buffer the graphs were captured on
            self._graph_cache.length = 0
            return self._graph_cache
        shape = (len(self.lean.layers), self.lean.n_kv, self.max_len, self.lean.head_dim)
        # Zeros, not empty: masked keys still enter q·k, and garbage NaNs would poison the softmax.
        cache = LeanCache(torch.zeros(shape, dtype=self.lean.dtype, device=self.device),
                          torch.zeros(shape, dtype=self.lean.dtype, device=self.device))
        if self.use_graphs:
            # Capture every bucket now, while the buffer holds nothing: warm-up and capture write KV
            # at positions 0..b-1, which would clobber a sequence in progress.
            with torch.inference_mode():
                for b in self.buckets:
                    for last_only in (False, True):
                        self._graphs[(b, last_only)] = self._capture(b, last_only, cache)
            self._graph_cache = cache
        return cache

    def _step(self, ids: torch.Tensor, pos: torch.Tensor, cache: LeanCache, last_only: bool,
              capture: tuple[int, ...] = ()):
        """The static step: ids, pos [b] -> logits [b, V] (or [1, V]); shapes depend on b only. With
        `capture`, (logits, hidden [b, len(capture) * D]) as LeanLM.forward returns them."""
        lean = self.lean
        b = ids.shape[0]
        cos, sin = lean.cos.index_select(0, pos)[:, None], lean.sin.index_select(0, pos)[:, None]  # [b, 1, rot]
        mask = self._keys[None, :] <= pos[:, None]  # [b, max_len]: keys at or before each query
        sw_mask = mask  # sliding-window layers: and within the window (a tensor test, so graph-safe)
        if lean.window is not None and lean.window < self.max_len:
            sw_mask = mask & (self._keys[None, :] > pos[:, None] - lean.window)
        mask, sw_mask = lean.fold_masks(mask, sw_mask, b)

        def attend(li: int, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
            cache.k[li].index_copy_(1, pos, kh.transpose(0, 1))
            cache.v[li].index_copy_(1, pos, vh.transpose(0, 1))
            att = lean.attention(qh.transpose(0, 1)[None], cache.k[li : li + 1], cache.v[li : li + 1],
                                 sw_mask if lean.sliding[li] else mask)  # [1, H, b, hd]
            return att[0].transpose(0, 1).reshape(b, lean.q_size)

        x = lean.embed_ids(ids)  # [b, D]
        hidden: list[torch.Tensor] = []
        for li in range(len(lean.layers)):
            x = lean.layer(li, x, cos, sin, attend)
            if li in capture:
                hidden.append(x)
        logits = lean.head(x[-1:] if last_only else x)
        return (logits, torch.cat(hidden, dim=-1)) if capture else logits

    def _capture(self, b: int, last_only: bool, cache: LeanCache, capture: tuple[int, ...] = (),
                 at: int = 0) -> tuple:
        """Capture the bucket-b step as a graph. Warm-up runs it for real, writing KV at positions at..at+b-1:
        slots that hold nothing yet (the empty buffer, or past the sequence in progress)."""
        ids = torch.zeros(b, dtype=torch.long, device=self.device)
        pos = torch.arange(at, at + b, device=self.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture, as CUDA graphs require
            for _ in range(2):
                self._step(ids, pos, cache, last_only, capture)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._step(ids, pos, cache, last_only, capture)
        return graph, ids, pos, out

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: LeanCache, last_only: bool = False,
                capture: tuple[int, ...] | None = None):
        """Same contract as LeanLM.forward (with `capture`, (logits, hidden)); long prompts (beyond the
        largest bucket) go through LeanLM."""
        q = ids.shape[0]
        start = cache.length
        capture = tuple(capture or ())
        if q > self.buckets[-1]:  # prefill: one call, not worth a graph
            return self.lean.forward(ids, cache, last_only, capture=capture or None)
        b = bucket_for(q, self.buckets)
        if start + b > cache.k.shape[2]:
            raise ValueError(f"static forward: positions up to {start + b} exceed the KV buffer "
                             f"({cache.k.shape[2]}); create the cache with a larger max_len")
        # With last_only the real last token must be the last row: pad in front only for decode (q = b).
        pos = torch.arange(start, start + b, device=self.device)
        if q < b:
            ids = torch.cat([ids, ids.new_zeros(b - q)])
        graph_last = last_only and q == b
        if self.use_graphs:
            if cache is not self._graph_cache:
                raise ValueError("static forward: this cache was not made by new_cache(); graphs replay on theirs")
            key = (b, graph_last) if not capture else (b, graph_last, capture)
            if key not in self._graphs:  # a feature drafter's layers: captured on first use, past the sequence
                self._graphs[key] = self._capture(b, graph_last, cache, capture, at=cache.k.shape[2] - b)
            graph, ids_buf, pos_buf, out = self._graphs[key]
            ids_buf.copy_(ids)
            pos_buf.copy_(pos)
            graph.replay()
            # The hidden rows outlive this step (the drafter keeps them); the next replay overwrites `out`.
            out = (out[0], out[1].clone()) if capture else out
        else:
            out = self._step(ids, pos, cache, graph_last, capture)
        cache.length = start + q
        logits, hidden = out if capture else (out, None)
        if last_only and not graph_last:
            logits = logits[q - 1 : q]
        elif not graph_last:
            logits = logits[:q]
        return (logits, hidden[:q]) if capture else logits
