"""A lean Llama-family forward for decode and verify steps (mechanism `lean_forward`).

Loads its weights from the same Hugging Face model, fuses the Q/K/V and gate/up projections into
one matmul each, and keeps a preallocated KV buffer whose rollback is a length change. It skips
what the HF module stack pays for on every call (mask construction, cache objects, hooks, dispatch
through a dozen modules), which dominates a decode step of a small model on a CPU. The HF path stays
the reference: tests compare logits against it within the deployment's noise floor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED = ("llama", "qwen2", "mistral")
# attend(layer, q [T, H, hd], k [T, KV, hd], v [T, KV, hd]) -> [T, H * hd]: a forward's cache and mask
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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

    def compact(self, start: int, rows: torch.Tensor) -> None:
        """Keep the entries at slots start + rows (ascending offsets, e.g. a tree's accepted path) as
        slots start.. start + len(rows) - 1, in place, and drop the rest: after a tree verify the cache
        reads as if only the accepted path had been fed. rows: [n] long."""
        n = rows.shape[0]
        src = rows + start
        # Advanced indexing gathers into a new tensor first, so overlapping source and destination is safe.
        self.k[:, :, start : start + n] = self.k[:, :, src]
        self.v[:, :, start : start + n] = self.v[:, :, src]
        self.length = start + n


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

    def layer(self, li: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Decoder layer `li` on rows x [T, D], the one layer body of every forward (single request, static,
        batched): norm, fused QKV, RoPE (cos, sin [T, 1, hd]), `attend`, output projection, norm, fused
        gate/up MLP. `attend(li, q [T, H, hd], k [T, KV, hd], v [T, KV, hd])` stores k and v where its
        cache keeps them and returns the attention output [T, H * hd]."""
        ln1, wqkv, wo, ln2, wgu, wdown = self.layers[li]
        t = x.shape[0]
        qkv = F.linear(self._rms(x, ln1), wqkv)  # [T, (H+2KV)*hd]
        q = qkv[:, : self.q_size].view(t, self.n_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.n_kv, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.n_kv, self.head_dim)
        x = x + F.linear(attend(li, self._rope(q, cos, sin), self._rope(k, cos, sin), v), wo)
        gu = F.linear(self._rms(x, ln2), wgu)  # [T, 2I]
        return x + F.linear(F.silu(gu[:, : self.inter]) * gu[:, self.inter :], wdown)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden rows [T, D] -> logits [T, V]."""
        return F.linear(self._rms(x, self.final_norm), self.lm_head)

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
            cos, sin = self.cos[start:end, None], self.sin[start:end, None]  # [q, 1, hd]
        else:
            cos, sin = self.cos.index_select(0, positions)[:, None], self.sin.index_select(0, positions)[:, None]
        x = F.embedding(ids, self.embed)  # [q, D]
        hidden: list[torch.Tensor] = []
        mask = attn_mask
        if mask is None and q > 1:  # block-causal: new token i sees the cache and new tokens 0..i
            mask = torch.ones(q, end, dtype=torch.bool, device=ids.device).tril(diagonal=start)
        gqa = self.n_kv != self.n_heads

        def attend(li: int, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
            cache.k[li, :, start:end] = kh.transpose(0, 1)
            cache.v[li, :, start:end] = vh.transpose(0, 1)
            att = F.scaled_dot_product_attention(
                qh.transpose(0, 1)[None], cache.k[li : li + 1, :, :end], cache.v[li : li + 1, :, :end],
                attn_mask=mask, enable_gqa=gqa,
            )  # [1, H, q, hd]
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
        cos, sin = lean.cos.index_select(0, pos)[:, None], lean.sin.index_select(0, pos)[:, None]  # [b, 1, hd]
        mask = self._keys[None, :] <= pos[:, None]  # [b, max_len]: keys at or before each query
        gqa = lean.n_kv != lean.n_heads

        def attend(li: int, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
            cache.k[li].index_copy_(1, pos, kh.transpose(0, 1))
            cache.v[li].index_copy_(1, pos, vh.transpose(0, 1))
            att = F.scaled_dot_product_attention(
                qh.transpose(0, 1)[None], cache.k[li : li + 1], cache.v[li : li + 1], attn_mask=mask, enable_gqa=gqa,
            )  # [1, H, b, hd]
            return att[0].transpose(0, 1).reshape(b, lean.q_size)

        x = F.embedding(ids, lean.embed)  # [b, D]
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
