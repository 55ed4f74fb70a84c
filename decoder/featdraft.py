"""Feature drafters: drafters that read the target's own hidden states (mechanisms block-drafter,
mtp-heads and domain-routing).

- **BlockDrafter** (parallel block drafting, as in DFlash): a small transformer that keeps the target's
  hidden states from several layers, projected to its width, as a context KV cache, and drafts a whole
  block of k tokens in ONE non-causal forward: the block is the last committed token followed by k
  learned mask embeddings, bidirectional inside the block, attending to the whole context. It shares
  the target's embedding and LM head (frozen), so its weights are the small part only. Its context
  cache only ever receives the accepted prefix's features: the target's hidden states at positions
  it verified and accepted, so there is nothing to roll back.
- **MTPHeads** (multi-token prediction heads, Medusa-style with the next token's embedding): k light
  residual heads on the target's final hidden state at the last accepted position; head j predicts
  the token j+1 positions after the token the target itself just produced. All k heads run as one
  batched matmul.
- **DomainRouter**: a bag-of-tokens logistic regression over the prompt (code vs prose) choosing the
  drafter per request; a few microseconds, far under one decode step.

Both decode-time states are proposers of the one loop (`decoder.generate.speculative_generate`): they
set `capture`, so the verify forward hands them the target's hidden states of the accepted positions.
Their drafts are deterministic (argmax), so greedy verification commits the target's argmax and
rejection sampling with a one-hot q samples the target's distribution exactly: lossless either way.
Layout beside a target (the defaults of `specpilot train drafter`): `<target>/drafters/block/`,
`<target>/drafters/mtp/` (config.json, model.safetensors, recipe.json) and `<target>/drafters/router.json`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from decoder.capabilities import CORPUS_FILE, ROUTER_FILE, VOCAB_RANK_FILE
from decoder.capabilities import drafters_dir as drafters_dir  # re-exported: its callers import it from here
from decoder.datastore import CorpusIndex, DatastoreError
from decoder.proposer import Draft, Proposer, Verdict
from decoder.tree import comb_tree

DOMAINS = ("code", "prose")


class FeatureDrafterError(RuntimeError):
    """A feature drafter is missing or does not fit the target; the message names the path and the fix."""


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos(), emb.sin()  # [max_len, hd]


# ------------------------------------------------------------------------------------- block drafter


@dataclass
class BlockDrafterConfig:
    target_hidden: int
    target_layers: list[int]  # target layers whose outputs form the context (the last = final hidden)
    vocab_size: int
    num_layers: int = 1
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate: int = 1024
    block_size: int = 8  # draft tokens per block in training; a longer draft runs a longer block
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_position: int = 2048
    kind: str = "block"
    # Add the context state of the position before the anchor (the target's view of the token the anchor
    # follows, as EAGLE fuses feature and token) to every block slot's input.
    inject_prev: bool = False
    # A learned input per slot offset (instead of one shared mask embedding) plus the anchor token's
    # embedding in every slot: each slot knows which offset it predicts and from which token, directly.
    slot_inputs: bool = False

    @property
    def head_dim(self) -> int:
        return self.target_hidden // self.num_heads


class _BlockLayer(nn.Module):
    def __init__(self, c: BlockDrafterConfig) -> None:
        super().__init__()
        d, hd = c.target_hidden, c.head_dim
        self.ln1 = nn.Parameter(torch.ones(d))
        self.wq = nn.Linear(d, c.num_heads * hd, bias=False)
        self.wk = nn.Linear(d, c.num_kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, c.num_kv_heads * hd, bias=False)
        self.wo = nn.Linear(c.num_heads * hd, d, bias=False)
        self.ln2 = nn.Parameter(torch.ones(d))
        self.w_gate_up = nn.Linear(d, 2 * c.intermediate, bias=False)
        self.w_down = nn.Linear(c.intermediate, d, bias=False)


class BlockDrafter(nn.Module):
    """The trainable part of the block drafter; embedding and LM head are the target's (passed in)."""

    def __init__(self, c: BlockDrafterConfig) -> None:
        super().__init__()
        self.c = c
        d = c.target_hidden
        self.fc = nn.Linear(len(c.target_layers) * d, d, bias=False)  # target features -> context
        self.ctx_norm = nn.Parameter(torch.ones(d))
        self.mask_emb = nn.Parameter(torch.randn(d) * 0.02)
        if c.slot_inputs:
            self.slot_emb = nn.Parameter(torch.randn(c.block_size, d) * 0.02)
        self.layers = nn.ModuleList(_BlockLayer(c) for _ in range(c.num_layers))
        self.final_norm = nn.Parameter(torch.ones(d))
        cos, sin = _rope_tables(c.head_dim, c.max_position, c.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def slot_inputs(self, n_slots: int) -> torch.Tensor:
        """Inputs of the n mask slots [n, D]: per-offset embeddings (the last repeats past the trained block)
        or the shared mask embedding."""
        if not self.c.slot_inputs:
            return self.mask_emb.expand(n_slots, -1)
        idx = torch.arange(n_slots, device=self.slot_emb.device).clamp_max(self.c.block_size - 1)
        return self.mask_emb + self.slot_emb[idx]

    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features [..., n_layers * D] -> context states [..., D]."""
        return _rms(self.fc(feats), self.ctx_norm, self.c.rms_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """[..., q, n * hd] -> [..., n, q, hd]."""
        return x.view(*x.shape[:-1], n, self.c.head_dim).transpose(-3, -2)

    def _mlp(self, layer: _BlockLayer, x: torch.Tensor) -> torch.Tensor:
        gu = layer.w_gate_up(_rms(x, layer.ln2, self.c.rms_eps))
        g, u = gu.chunk(2, dim=-1)
        return x + layer.w_down(F.silu(g) * u)

    def forward_train(self, feats: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                      embed: torch.Tensor, lm_head: torch.Tensor, block: int | None = None) -> torch.Tensor:
        """Many blocks per sequence in one pass (each block sees only the context before its anchor).

        feats [B, T, F] target features of every position; tokens [B, T]; anchors [B, N] block starts
        (the block's first token is tokens[anchor], its k slots predict tokens[anchor+1 .. anchor+k]).
        Returns logits [B, N, k, V].
        """
        c = self.c
        k = block or c.block_size
        s = k + 1
        b, t, _ = feats.shape
        n = anchors.shape[1]
        ctx = self.context(feats)  # [B, T, D]
        x = self.slot_inputs(k).expand(b, n, k, -1)
        anchor_emb = F.embedding(tokens.gather(1, anchors), embed).to(x.dtype)  # [B, N, D]
        if c.slot_inputs:
            x = x + anchor_emb[:, :, None, :]
        x = torch.cat([anchor_emb[:, :, None, :], x], dim=2)  # [B, N, S, D]
        if c.inject_prev:
            prev = ctx.gather(1, (anchors - 1).clamp_min(0)[:, :, None].expand(b, n, ctx.shape[-1]))  # [B, N, D]
            x = x + prev[:, :, None, :].to(x.dtype)
        x = x.view(b, n * s, -1)
        pos = (anchors[:, :, None] + torch.arange(s, device=feats.device)).view(b, n * s)  # [B, Q]
        cos_b, sin_b = self.cos[pos][:, None], self.sin[pos][:, None]  # [B, 1, Q, hd]
        cos_c, sin_c = self.cos[:t], self.sin[:t]
        # Visibility: context key j for a query of block i iff j < anchor_i; block keys within the same block.
        ctx_vis = (torch.arange(t, device=feats.device)[None, None, :] < anchors[:, :, None])  # [B, N, T]
        ctx_vis = ctx_vis[:, :, None, :].expand(b, n, s, t).reshape(b, n * s, t)
        blk = torch.arange(n, device=feats.device).repeat_interleave(s)
        blk_vis = (blk[:, None] == blk[None, :]).expand(b, -1, -1)
        mask = torch.cat([ctx_vis, blk_vis], dim=-1)[:, None]  # [B, 1, Q, T + Q]
        for layer in self.layers:
            h = _rms(x, layer.ln1, c.rms_eps)
            q = _rope(self._heads(layer.wq(h), c.num_heads), cos_b, sin_b)
            kb = _rope(self._heads(layer.wk(h), c.num_kv_heads), cos_b, sin_b)
            vb = self._heads(layer.wv(h), c.num_kv_heads)
            kc = _rope(self._heads(layer.wk(ctx), c.num_kv_heads), cos_c, sin_c)
            vc = self._heads(layer.wv(ctx), c.num_kv_heads)
            att = F.scaled_dot_product_attention(q, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2),
                                                 attn_mask=mask, enable_gqa=c.num_kv_heads != c.num_heads)
            x = x + layer.wo(att.transpose(1, 2).reshape(b, n * s, -1))
            x = self._mlp(layer, x)
        h = _rms(x, self.final_norm, c.rms_eps).view(b, n, s, -1)[:, :, 1:]
        return F.linear(h, lm_head)


class FeatureState(Proposer):
    """A feature drafter at decode time, as a proposer of the one loop: its context is the target's hidden
    states of the prompt and of every accepted position (`extend`), and it drafts from the last token."""

    capture: tuple[int, ...]
    device: torch.device

    def clear(self) -> None:
        raise NotImplementedError

    def extend(self, feats: torch.Tensor) -> None:
        raise NotImplementedError

    def draft(self, last: torch.Tensor, k: int) -> torch.Tensor:
        raise NotImplementedError

    def reset(self, prompt: list[int] | None = None, hidden: torch.Tensor | None = None) -> None:
        self.clear()
        if hidden is not None:
            self.extend(hidden)

    def propose(self, tokens: list[int], k: int) -> Draft:
        return Draft(self.draft(torch.tensor(tokens[-1:], device=self.device), k))

    def accepted(self, tokens: list[int], verdict: Verdict) -> None:
        self.extend(verdict.hidden)


class BlockState(FeatureState):
    """The block drafter at decode time: its context KV cache, filled with the accepted prefix only."""

    name = "block"

    def __init__(self, model: BlockDrafter, embed: torch.Tensor, lm_head: torch.Tensor, max_len: int = 2048
                 ) -> None:
        c = model.c
        self.m, self.c = model, c
        self.embed, self.lm_head = embed, lm_head
        self.device = embed.device
        self.capture = tuple(c.target_layers)
        p = next(model.parameters())
        shape = (c.num_layers, c.num_kv_heads, min(max_len, c.max_position), c.head_dim)
        self.k = torch.empty(shape, dtype=p.dtype, device=p.device)
        self.v = torch.empty(shape, dtype=p.dtype, device=p.device)
        self.length = 0
        self.forwards = 0
        self.prev: torch.Tensor | None = None  # context state of the last context position (inject_prev)
        # Fused projections, built once: one matmul for q|k|v (block) and one for k|v (context).
        with torch.no_grad():
            self.wqkv = [torch.cat([ly.wq.weight, ly.wk.weight, ly.wv.weight]) for ly in model.layers]
            self.wkv = [torch.cat([ly.wk.weight, ly.wv.weight]) for ly in model.layers]
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim

    def clear(self) -> None:
        self.length = 0

    @torch.inference_mode()
    def extend(self, feats: torch.Tensor) -> None:
        """Append the target features [n, F] of the next n committed positions to the context."""
        m, c = self.m, self.c
        n = feats.shape[0]
        start, end = self.length, self.length + n
        ctx = m.context(feats)
        self.prev = ctx[-1]
        cos, sin = m.cos[start:end], m.sin[start:end]
        for li in range(c.num_layers):
            kv = F.linear(ctx, self.wkv[li])
            self.k[li, :, start:end] = _rope(m._heads(kv[:, : self.kv_size], c.num_kv_heads), cos, sin)
            self.v[li, :, start:end] = m._heads(kv[:, self.kv_size :], c.num_kv_heads)
        self.length = end

    @torch.inference_mode()
    def draft(self, last: torch.Tensor, k: int) -> torch.Tensor:
        """Draft k tokens after `last` [1] (at position self.length) in one forward; returns [k]."""
        m, c = self.m, self.c
        s = max(k, c.block_size) + 1
        start = self.length
        e = F.embedding(last, self.embed)  # [1, D]
        slots = m.slot_inputs(s - 1)
        x = torch.cat([e, slots + e if c.slot_inputs else slots])  # [S, D]
        if c.inject_prev:
            x = x + self.prev
        cos, sin = m.cos[start : start + s], m.sin[start : start + s]
        end = start + s
        if end > self.k.shape[2]:
            raise FeatureDrafterError(f"block drafter: position {end} exceeds its context buffer ({self.k.shape[2]})")
        for li, layer in enumerate(m.layers):
            qkv = F.linear(_rms(x, layer.ln1, c.rms_eps), self.wqkv[li])
            q = _rope(m._heads(qkv[:, : self.q_size], c.num_heads), cos, sin)[None]
            # The block's keys go in the slots after the context (the next extend overwrites them): no copy.
            kb = qkv[:, self.q_size : self.q_size + self.kv_size]
            self.k[li, :, start:end] = _rope(m._heads(kb, c.num_kv_heads), cos, sin)
            self.v[li, :, start:end] = m._heads(qkv[:, self.q_size + self.kv_size :], c.num_kv_heads)
            att = F.scaled_dot_product_attention(q, self.k[li : li + 1, :, :end], self.v[li : li + 1, :, :end],
                                                 enable_gqa=c.num_kv_heads != c.num_heads)
            x = x + layer.wo(att[0].transpose(0, 1).reshape(s, -1))
            x = m._mlp(layer, x)
        self.forwards += 1
        # max().indices: a drafter's tie-break is free (verification decides), and it is 4x faster than a
        # bf16 argmax on the CPU.
        return F.linear(_rms(x[1 : k + 1], m.final_norm, c.rms_eps), self.lm_head).max(-1).indices


# ---------------------------------------------------------------------------------------- MTP heads


@dataclass
class MTPConfig:
    target_hidden: int
    target_layers: list[int]  # [the target's last layer]: the heads read its final hidden state
    vocab_size: int
    num_heads: int = 4
    rms_eps: float = 1e-5
    kind: str = "mtp"


class MTPHeads(nn.Module):
    """k residual heads: head j maps (final hidden h_p, embedding of token p+1) to a hidden state whose
    logits under the target's norm and LM head predict token p+1+j (j = 1..k)."""

    def __init__(self, c: MTPConfig, final_norm: torch.Tensor | None = None) -> None:
        super().__init__()
        self.c = c
        d, n = c.target_hidden, c.num_heads
        self.norm_h = nn.Parameter(torch.ones(d))
        self.norm_e = nn.Parameter(torch.ones(d))
        self.w1 = nn.Parameter(torch.randn(n, 2 * d, d) / math.sqrt(2 * d))
        self.w2 = nn.Parameter(torch.zeros(n, d, d))  # zero: each head starts as the target's own head
        init = final_norm.detach().float() if final_norm is not None else torch.ones(d)
        self.out_norm = nn.Parameter(init.expand(n, d).clone())

    def hidden(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """h, e [..., D] -> per-head normed hidden [..., n, D]."""
        eps = self.c.rms_eps
        n, d = self.c.num_heads, self.c.target_hidden
        lead = h.shape[:-1]
        z = torch.cat([_rms(h, self.norm_h, eps), _rms(e, self.norm_e, eps)], dim=-1).reshape(-1, 2 * d)  # [M, 2D]
        # All heads' first layer as one [M, 2D] x [2D, n*D] matmul, the second as one bmm over heads
        # (einsum would broadcast the weights over M and copy them).
        u = F.silu(z @ self.w1.permute(1, 0, 2).reshape(2 * d, n * d)).view(-1, n, d)  # [M, n, D]
        r = torch.bmm(u.transpose(0, 1), self.w2).transpose(0, 1).contiguous()  # [M, n, D]
        h2 = h.reshape(-1, 1, d) + r
        return _rms(h2, self.out_norm, eps).view(*lead, n, d)


class MTPState(FeatureState):
    """The MTP heads at decode time: the final hidden state of the last accepted position."""

    name = "mtp"

    def __init__(self, model: MTPHeads, embed: torch.Tensor, lm_head: torch.Tensor,
                 vocab_ids: torch.Tensor | None = None, alts: int = 0) -> None:
        self.m, self.c = model, model.c
        # Mechanism mtp-tree: each head's next `alts` tokens hang beside its top-1 as leaves (a comb tree).
        self.alts = self._alts = alts
        self.embed = embed
        # A pruned head (draft_vocab): `lm_head` holds only the frequent sub-vocabulary's rows, `vocab_ids`
        # their token ids (the drafted index maps back through it).
        self.lm_head, self.vocab_ids = lm_head, vocab_ids
        self.device = embed.device
        self.capture = tuple(model.c.target_layers)
        self.h: torch.Tensor | None = None
        self.forwards = 0

    def clear(self) -> None:
        self.h = None

    def trees(self, on: bool) -> None:
        self.alts = self._alts if on else 0

    def extend(self, feats: torch.Tensor) -> None:
        self.h = feats[-1]  # [D]: the last accepted position's final hidden state

    @torch.inference_mode()
    def draft(self, last: torch.Tensor, k: int) -> torch.Tensor:
        return self._top(last, k)[:, 0]

    def _top(self, last: torch.Tensor, k: int) -> torch.Tensor:
        """[n, 1 + alts] token ids: each head's best, then its next `alts` (n = k cut to the heads)."""
        n = min(k, self.c.num_heads)  # a draft longer than the heads is cut to them
        self.forwards += 1
        hid = self.m.hidden(self.h, F.embedding(last[0], self.embed))[:n]  # [n, D]
        return self._best(hid)

    def _best(self, hid: torch.Tensor) -> torch.Tensor:
        scores = F.linear(hid, self.lm_head)
        idx = scores.topk(1 + self.alts, dim=-1).indices if self.alts else scores.max(-1).indices.unsqueeze(-1)
        return idx if self.vocab_ids is None else self.vocab_ids[idx]

    def _draft(self, top: torch.Tensor) -> Draft:
        """A chain of the heads' best tokens, or with alternatives the comb tree (decoder.tree.comb_tree)."""
        if not self.alts:
            return Draft(top[:, 0])
        tree = comb_tree(top[:, 0], top[:, 1:])
        return Draft(tree.tokens, tree=tree)

    @torch.inference_mode()
    def propose(self, tokens: list[int], k: int) -> Draft:
        return self._draft(self._top(torch.tensor(tokens[-1:], device=self.device), k))

    @classmethod
    @torch.inference_mode()
    def propose_many(cls, proposers: list[Proposer], tokens: list[list[int]], ks: list[int]) -> list[Draft]:
        """Every request's heads in one batched forward: [R, D] hidden states and last tokens through the
        heads, one LM-head matmul for the R x n rows; proposers that share one model (the engine's)."""
        groups: dict[tuple[int, int, int], list[int]] = {}
        for i, pr in enumerate(proposers):
            groups.setdefault((id(pr.m), id(pr.vocab_ids), pr.alts), []).append(i)
        out: list[Draft | None] = [None] * len(proposers)
        for idx in groups.values():
            first = proposers[idx[0]]
            n = min(max(ks[i] for i in idx), first.c.num_heads)
            h = torch.stack([proposers[i].h for i in idx])  # [R, D]
            last = torch.tensor([tokens[i][-1] for i in idx], device=first.device)  # [R]
            hid = first.m.hidden(h, F.embedding(last, first.embed))[:, :n]  # [R, n, D]
            toks = first._best(hid)  # [R, n, 1 + alts]
            for r, i in enumerate(idx):
                proposers[i].forwards += 1
                out[i] = first._draft(toks[r, : min(ks[i], first.c.num_heads)])
        return out


# ------------------------------------------------------------------------------------------- router


@dataclass
class DomainRouter:
    """Logistic regression on the prompt's normalised bag of tokens: p(prose) = sigmoid(b + mean w[tok])."""

    weights: list[float]
    bias: float
    labels: tuple[str, str] = DOMAINS  # (score < 0, score >= 0)
    recipe: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._w = [float(w) for w in self.weights]

    def score(self, prompt: list[int]) -> float:
        """Tens of microseconds for a prompt of hundreds of tokens: a plain Python sum over a list (numpy or
        torch here cost 0.3-0.9 ms on the first call after a decode, measured)."""
        if not prompt:
            return self.bias
        w, last = self._w, len(self._w) - 1
        return self.bias + sum(w[t] if 0 <= t <= last else w[last] for t in prompt) / len(prompt)

    def route(self, prompt: list[int]) -> str:
        return self.labels[1] if self.score(prompt) >= 0 else self.labels[0]

    def save(self, path: Path) -> None:
        d = asdict(self)
        d["weights"] = [round(w, 5) for w in self.weights]
        path.write_text(json.dumps(d))

    @classmethod
    def load(cls, path: Path) -> DomainRouter:
        d = json.loads(Path(path).read_text())
        return cls(d["weights"], d["bias"], tuple(d["labels"]), d.get("recipe", {}))


# ---------------------------------------------------------------------------------- loading, decoding


def _config_of(kind: str, d: dict):
    return BlockDrafterConfig(**d) if kind == "block" else MTPConfig(**d)


def build_model(kind: str, cfg, target_final_norm: torch.Tensor | None = None) -> nn.Module:
    return BlockDrafter(cfg) if kind == "block" else MTPHeads(cfg, target_final_norm)


def save_feature_drafter(model: nn.Module, out_dir: Path) -> None:
    """config.json and model.safetensors (bf16) of a block drafter or MTP heads, written atomically."""

    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(out_dir / "model.safetensors.tmp"))
    os.replace(out_dir / "model.safetensors.tmp", out_dir / "model.safetensors")
    (out_dir / "config.json.tmp").write_text(json.dumps(asdict(model.c), indent=2))
    os.replace(out_dir / "config.json.tmp", out_dir / "config.json")


def load_feature_drafter(path: Path, target_config, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A trained block drafter or MTP heads from `path`, checked against the target's shape."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").exists():
        raise FeatureDrafterError(f"no feature drafter at {path} (config.json missing); train one with "
                                  f"`specpilot train drafter --kind block|mtp --target DIR`")
    d = json.loads((path / "config.json").read_text())
    kind = d.get("kind")
    if kind not in ("block", "mtp"):
        raise FeatureDrafterError(f"{path}/config.json: kind {kind!r} is not block or mtp")
    cfg = _config_of(kind, d)
    if cfg.target_hidden != target_config.hidden_size or cfg.vocab_size != target_config.vocab_size or \
            max(cfg.target_layers) >= target_config.num_hidden_layers:
        raise FeatureDrafterError(
            f"{path} was trained for a target with hidden {cfg.target_hidden}, vocab {cfg.vocab_size} and layers "
            f"{cfg.target_layers}; this target has hidden {target_config.hidden_size}, vocab "
            f"{target_config.vocab_size} and {target_config.num_hidden_layers} layers: retrain it for this target")
    model = build_model(kind, cfg)
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    return model.to(device=device, dtype=dtype).eval()


class FeatureHeads:
    """A target's feature drafters and router, loaded lazily from `<target>/drafters` (or given)."""

    def __init__(self, root: Path | None, target_config, dtype: torch.dtype, device: torch.device) -> None:
        self.root = Path(root) if root is not None else None
        self.target_config = target_config
        self.dtype, self.device = dtype, device
        self._models: dict[str, nn.Module] = {}
        self._router: DomainRouter | None = None
        self._states: dict[tuple[str, int, int], object] = {}
        self._rank: list[int] | None = None
        self._vocab_ids: dict[int, torch.Tensor] = {}
        self._pruned: dict[tuple[int, int], torch.Tensor] = {}
        self._corpus: CorpusIndex | None = None

    def model(self, kind: str) -> nn.Module:
        if kind not in self._models:
            if self.root is None:
                raise FeatureDrafterError(f"drafter {kind!r} needs the target's feature drafters; none are loaded")
            self._models[kind] = load_feature_drafter(self.root / kind, self.target_config, self.dtype, self.device)
        return self._models[kind]

    def set_model(self, kind: str, model: nn.Module) -> None:
        self._models[kind] = model
        self._states = {k: v for k, v in self._states.items() if k[0] != kind}

    def set_router(self, router: DomainRouter) -> None:
        self._router = router

    def router(self) -> DomainRouter:
        if self._router is None:
            path = (self.root / ROUTER_FILE) if self.root is not None else None
            if path is None or not path.exists():
                raise FeatureDrafterError(f"drafter 'routed' needs a router at {path}; train one with "
                                          f"`specpilot train drafter --kind router --target DIR`")
            self._router = DomainRouter.load(path)
        return self._router

    def corpus(self) -> CorpusIndex:
        """The corpus datastore of drafter = "corpus" (`<root>/corpus.npz`), loaded once."""
        if self._corpus is None:
            path = self.root / CORPUS_FILE if self.root is not None else None
            if path is None or not path.is_file():
                raise FeatureDrafterError(f"drafter 'corpus' needs a corpus datastore at {path}; make it with "
                                          f"`specpilot train drafter --kind corpus --target DIR`")
            try:
                index = CorpusIndex.load(path)
            except DatastoreError as e:
                raise FeatureDrafterError(str(e)) from None
            vocab = self.target_config.vocab_size
            if index.vocab_size != vocab:
                raise FeatureDrafterError(f"{path} was built for a vocabulary of {index.vocab_size} tokens, the "
                                          f"target's has {vocab}: remake it with `specpilot train drafter --kind "
                                          f"corpus`")
            self._corpus = index
        return self._corpus

    def set_corpus(self, index: CorpusIndex) -> None:
        self._corpus = index

    def set_vocab_rank(self, ids: list[int]) -> None:
        """The token ranking a pruned head reads (instead of `<root>/vocab_rank.json`)."""
        self._rank, self._vocab_ids, self._pruned = list(ids), {}, {}
        self._states = {k: v for k, v in self._states.items() if k[2] == 0}

    def vocab_ids(self, n: int) -> torch.Tensor | None:
        """The `n` most frequent token ids (ascending) for a pruned drafter head; None for n = 0 (full head)."""
        if n == 0:
            return None
        if n not in self._vocab_ids:
            if self._rank is None:
                path = self.root / VOCAB_RANK_FILE if self.root is not None else None
                if path is None or not path.exists():
                    raise FeatureDrafterError(f"draft_vocab = {n} needs the target's token ranking at {path}; make "
                                              f"it with `specpilot train drafter --kind vocab --target DIR`, or set "
                                              f"draft_vocab = 0")
                self._rank = [int(t) for t in json.loads(path.read_text())["ids"]]
            vocab = self.target_config.vocab_size
            if len(self._rank) != vocab:
                raise FeatureDrafterError(f"the token ranking has {len(self._rank)} ids, the target's vocabulary "
                                          f"{vocab}: remake it with `specpilot train drafter --kind vocab`")
            self._vocab_ids[n] = torch.tensor(sorted(self._rank[:n]), dtype=torch.long, device=self.device)
        return self._vocab_ids[n]

    def state(self, kind: str, lean_target, draft_vocab: int = 0, alts: int = 0):
        """The decode-time state of drafter `kind` over the lean target's embedding and LM head; built
        once per (kind, target, pruned head, alternatives) and reset by each generation (its buffers and fused
        weights are reused)."""
        key = (kind, id(lean_target), draft_vocab, alts)
        st = self._states.get(key)
        if st is None:
            st = self._states[key] = self.new_state(kind, lean_target, draft_vocab, alts)
        return st

    def new_state(self, kind: str, lean_target, draft_vocab: int = 0, alts: int = 0) -> BlockState | MTPState:
        """A fresh decode-time state of drafter `kind` (one per request under batching); `draft_vocab` > 0
        scores only that many of the most frequent tokens (MTP; lossless: the target verifies); `alts` > 0
        drafts the MTP heads' comb tree (mechanism mtp-tree)."""
        m = self.model(kind)
        if kind == "block":
            return BlockState(m, lean_target.embed, lean_target.lm_head, lean_target.max_len)
        ids = self.vocab_ids(draft_vocab)
        if ids is None:
            return MTPState(m, lean_target.embed, lean_target.lm_head, alts=alts)
        key = (id(lean_target.lm_head), draft_vocab)
        if key not in self._pruned:  # one pruned copy of the head per target, shared by every request's state
            self._pruned[key] = lean_target.lm_head[ids].contiguous()
        return MTPState(m, lean_target.embed, self._pruned[key], ids, alts)
