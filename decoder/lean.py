"""A lean Llama-family forward for decode and verify steps (mechanism `lean_forward`).

Loads its weights from the same Hugging Face model, fuses the Q/K/V and gate/up projections into
one matmul each, and keeps a preallocated KV buffer whose rollback is a length change. It skips
what the HF module stack pays for on every call (mask construction, cache objects, hooks, dispatch
through a dozen modules), which dominates a decode step of a small model on a CPU. The HF path stays
the reference: tests compare logits against it within the deployment's noise floor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED = ("llama", "qwen2", "mistral")


class LeanUnsupported(ValueError):
    """The model's architecture is outside what the lean forward implements."""


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


class LeanLM:
    """Batch-1 causal LM forward over a LeanCache. `forward(ids [q], cache, last_only)` -> logits [q|1, V]."""

    def __init__(self, model, max_len: int = 2048) -> None:
        cfg = model.config
        if cfg.model_type not in SUPPORTED:
            raise LeanUnsupported(f"lean forward: model_type {cfg.model_type!r} is not supported "
                                  f"(supported: {', '.join(SUPPORTED)}); use the HF path")
        if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False) or cfg.model_type == "qwen2":
            raise LeanUnsupported("lean forward: attention/MLP biases are not supported; use the HF path")
        self.config = cfg
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        inner = model.model
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.max_len = max_len
        self.embed = inner.embed_tokens.weight  # [V, D]
        self.lm_head = model.lm_head.weight  # [V, D] (the same tensor when tied)
        self.final_norm = inner.norm.weight
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append((
                layer.input_layernorm.weight,
                torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous(),  # [(H+2KV)*hd, D]
                a.o_proj.weight,
                layer.post_attention_layernorm.weight,
                torch.cat([m.gate_proj.weight, m.up_proj.weight]).contiguous(),  # [2I, D]
                m.down_proj.weight,
            ))
        # RoPE tables from the model's own rotary module, so scaled variants (llama3, yarn...) match.
        with torch.no_grad():
            pos = torch.arange(max_len, device=self.device)[None]
            dummy = torch.zeros(1, 1, self.head_dim, device=self.device, dtype=self.dtype)
            cos, sin = inner.rotary_emb(dummy, pos)
        self.cos, self.sin = cos[0], sin[0]  # [max_len, hd]
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.inter = self.layers[0][4].shape[0] // 2

    def new_cache(self, max_len: int | None = None) -> LeanCache:
        n = max_len or self.max_len
        shape = (len(self.layers), self.n_kv, n, self.head_dim)
        return LeanCache(torch.empty(shape, dtype=self.dtype, device=self.device),
                         torch.empty(shape, dtype=self.dtype, device=self.device))

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # As HF's LlamaRMSNorm: normalise in fp32, cast back, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * h.to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: LeanCache, last_only: bool = False) -> torch.Tensor:
        """Append `ids` [q] at positions cache.length.. and return their logits [q, V] (or [1, V])."""
        q = ids.shape[0]
        start = cache.length
        end = start + q
        if end > cache.k.shape[2]:
            raise ValueError(f"lean forward: sequence length {end} exceeds the KV buffer ({cache.k.shape[2]}); "
                             f"create the cache with a larger max_len")
        cos, sin = self.cos[start:end], self.sin[start:end]  # [q, hd]
        x = F.embedding(ids, self.embed)  # [q, D]
        mask = None
        if q > 1:  # block-causal: new token i sees the cache and new tokens 0..i
            mask = torch.ones(q, end, dtype=torch.bool, device=ids.device).tril(diagonal=start)
        for li, (ln1, wqkv, wo, ln2, wgu, wdown) in enumerate(self.layers):
            h = self._rms(x, ln1)
            qkv = F.linear(h, wqkv)  # [q, (H+2KV)*hd]
            qh = qkv[:, : self.q_size].view(q, self.n_heads, self.head_dim).transpose(0, 1)  # [H, q, hd]
            kh = qkv[:, self.q_size : self.q_size + self.kv_size].view(q, self.n_kv, self.head_dim).transpose(0, 1)
            vh = qkv[:, self.q_size + self.kv_size :].view(q, self.n_kv, self.head_dim).transpose(0, 1)
            qh = self._rope(qh, cos, sin)
            cache.k[li, :, start:end] = self._rope(kh, cos, sin)
            cache.v[li, :, start:end] = vh
            att = F.scaled_dot_product_attention(
                qh[None], cache.k[li : li + 1, :, :end], cache.v[li : li + 1, :, :end], attn_mask=mask,
                enable_gqa=self.n_kv != self.n_heads,
            )  # [1, H, q, hd]
            x = x + F.linear(att[0].transpose(0, 1).reshape(q, self.q_size), wo)
            h = self._rms(x, ln2)
            gu = F.linear(h, wgu)  # [q, 2I]
            x = x + F.linear(F.silu(gu[:, : self.inter]) * gu[:, self.inter :], wdown)
        cache.length = end
        if last_only:
            x = x[-1:]
        return F.linear(self._rms(x, self.final_norm), self.lm_head)  # [q|1, V]
