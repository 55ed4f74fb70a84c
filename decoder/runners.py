"""Runners: the one interface the decode loops call (`new_cache`, `forward(ids [q], cache, last_only)`,
`rollback(cache, keep, tokens)`), for the stock Hugging Face path and the lean paths.

Rollback is exact for every cache kind. An attention cache is cropped: an entry depends only on the tokens
before it. A recurrent layer (Mamba2, GatedDeltaNet, short convolutions: the hybrid models' linear-attention
layers) holds one state for the whole prefix, so a speculative step cannot crop it; `RollbackCache` keeps
the state as it was before the step's first forward and, when drafts are rejected, restores it and feeds
the accepted tokens again (one extra forward over n + 1 tokens, only on steps that rejected a draft).
"""

from __future__ import annotations

import inspect

import torch

from decoder.archs import recurrent_layers  # noqa: F401 (re-exported)
from decoder.lean import LeanCache, LeanLM, StaticLeanLM

# A recurrent cache rolled back after a rejected draft feeds the accepted tokens again with the next forward
# (one forward per step) while there are at most this many; more are fed at once, in their own forward.
LAZY_REFEED = 8


class RollbackCache:
    """A Hugging Face cache of a model with recurrent layers, with exact rollback to a committed length.

    The first forward after a commit point (a rollback, or the prefill) saves every recurrent layer's conv
    and recurrent state; `HFRunner.rollback` crops the attention layers and restores that state, then
    re-feeds the committed tokens past it."""

    def __init__(self, hf) -> None:
        self.hf = hf  # the transformers cache the model reads and writes
        self.length = 0  # tokens the cache has seen
        self._saved: tuple[int, list] | None = None  # (length, per recurrent layer (conv states, rec states))
        self.branches: list[list[int]] | None = None  # a tree step's root-to-leaf node paths, one batch row each

    def get_seq_length(self) -> int:
        return self.length

    def _states(self):
        for layer in self.hf.layers:
            if hasattr(layer, "recurrent_states") and hasattr(layer, "conv_states"):
                yield layer

    def save(self) -> None:
        """Keep the recurrent state at the current length (a commit point)."""
        saved = []
        for layer in self._states():
            conv = {i: (t.clone() if t is not None else None) for i, t in layer.conv_states.items()}
            rec = {i: (t.clone() if t is not None else None) for i, t in layer.recurrent_states.items()}
            saved.append((conv, rec))
        self._saved = (self.length, saved)

    def saved_length(self) -> int | None:
        return self._saved[0] if self._saved is not None else None

    def restore(self) -> int:
        """Back to the saved commit point: recurrent states copied back, attention KV cropped; its length."""
        length, saved = self._saved
        for layer, (conv, rec) in zip(self._states(), saved, strict=True):
            for i, t in conv.items():
                if t is not None:
                    layer.conv_states[i] = t.clone()
            for i, t in rec.items():
                if t is not None:
                    layer.recurrent_states[i].copy_(t)
        for layer in self.hf.layers:
            keys = getattr(layer, "keys", None)
            if isinstance(keys, torch.Tensor) and keys.dim() == 4 and keys.shape[-2] > length:
                layer.keys = keys[..., :length, :]
                layer.values = layer.values[..., :length, :]
        self.length = length
        self._saved = None
        return length

    def commit(self) -> None:
        self._saved = None

    def compact(self, start: int, rows: torch.Tensor) -> None:
        """After a tree step: keep the batch row of a branch that holds the accepted path (`rows`: node indices,
        the root first). The row saw its whole branch; `rollback` then restores and re-feeds what it needs."""
        path = rows.tolist()
        b = next(i for i, br in enumerate(self.branches) if br[: len(path)] == path)
        self.hf.reorder_cache(torch.tensor([b], device=rows.device))
        self.branches = None

    def hold(self) -> None:
        """The current state is a commit point already: the next forward need not save it."""
        self._saved = (self.length, [])


class HFRunner:
    """The stock path: a Hugging Face causal LM with a DynamicCache, behind the runner interface
    (`new_cache`, `forward(ids [q], cache, last_only) -> logits [q|1, V]`, `rollback`) that LeanLM shares."""

    def __init__(self, model) -> None:
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.recurrent = recurrent_layers(model.config)
        # transformers >= 5.2x names the argument `cache` (and warns on `past_key_values`); 5.17 has only the latter.
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def new_cache(self):
        from transformers import DynamicCache

        if self.recurrent:  # the model's own layer kinds (linear attention beside attention) need its config
            return RollbackCache(DynamicCache(config=self.config))
        # Without the config every layer keeps its whole KV, so a sliding-window model's cache crops like any
        # other; the model's attention mask still applies the window.
        return DynamicCache()

    def forward(self, ids: torch.Tensor, cache, last_only: bool = False, positions: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        hf = cache
        if isinstance(cache, RollbackCache):
            if cache.length > 0 and cache.saved_length() is None:
                cache.save()
            if attn_mask is not None:
                return self._tree_forward(ids, cache, attn_mask)
            hf = cache.hf
            cache.length += ids.shape[0]
        elif attn_mask is not None:
            raise ValueError("tree verification on the HF path needs a target with recurrent layers; use the "
                             "lean forward (lean_forward = true)")
        return self.model(input_ids=ids.view(1, -1), **{self._cache_kw: hf}, use_cache=True,
                          logits_to_keep=1 if last_only else 0).logits[0]

    def _tree_forward(self, ids: torch.Tensor, cache: RollbackCache, attn_mask: torch.Tensor) -> torch.Tensor:
        """A tree of q nodes (node 0 the root) verified as one batch row per root-to-leaf branch: a recurrent
        layer reads a sequence, so each branch gets its own copy of the state (the cache expanded to the
        branches, `RollbackCache.compact` keeps one). Rows are padded to the longest branch by repeating their
        leaf. Returns each node's logits [q, V] in node order, read from the first branch that holds it."""
        start, q = cache.length, ids.shape[0]
        anc = attn_mask[:, start : start + q]  # [q, q]: node i sees its ancestors and itself
        leaves = [i for i in range(q) if int(anc[:, i].sum()) == 1]  # no one else sees them
        branches = [anc[leaf].nonzero().flatten().tolist() for leaf in leaves]  # node order = depth order
        width = max(len(b) for b in branches)
        rows = torch.stack([ids[b + [b[-1]] * (width - len(b))] for b in branches])  # [B, width]
        cache.hf.reorder_cache(torch.zeros(len(branches), dtype=torch.long, device=ids.device))
        logits = self.model(input_ids=rows, **{self._cache_kw: cache.hf}, use_cache=True).logits  # [B, width, V]
        cache.length = start + width
        cache.branches = branches
        where = {}
        for bi, b in enumerate(branches):
            for pos, node in enumerate(b):
                where.setdefault(node, (bi, pos))
        index = torch.tensor([where[i] for i in range(q)], device=ids.device)
        return logits[index[:, 0], index[:, 1]]  # [q, V]


def as_runner(model):
    """A runner for `model`: runners pass through, a Hugging Face model gets wrapped."""
    return model if isinstance(model, (HFRunner, LeanLM, StaticLeanLM)) else HFRunner(model)


def crop_cache(cache, keep: int) -> None:
    """Roll an attention cache back to its first `keep` tokens (a length change for LeanCache; transformers 5
    crops a DynamicCache by a negative count). A RollbackCache needs the tokens: use `rollback`."""
    if isinstance(cache, LeanCache):
        cache.crop(keep)
        return
    if isinstance(cache, RollbackCache):
        raise TypeError("a cache with recurrent layers rolls back through rollback(runner, cache, keep, tokens)")
    drop = cache.get_seq_length() - keep
    if drop > 0:
        cache.crop(-drop)


def rollback(runner, cache, keep: int, tokens: list[int], lazy: int = 0) -> int:
    """Roll `cache` back to `tokens[:keep]` (a prefix of what it holds). Attention caches crop; a
    RollbackCache restores its saved state and feeds `tokens[saved:keep]` again, leaving a commit point.
    With `lazy`, up to that many tokens are not fed now: the cache stays at the saved point (read
    `cache.get_seq_length()`) and the caller feeds them with its next forward, which costs little more on a
    target whose forward cost is flat in its width. Returns how many tokens were fed again (0: no forward)."""
    if not isinstance(cache, RollbackCache):
        crop_cache(cache, keep)
        return 0
    if keep >= cache.length:
        cache.commit()
        return 0
    start = cache.restore()
    if keep < start:
        raise ValueError(f"rollback to {keep} tokens: the recurrent state was saved at {start}; a step cannot "
                         f"roll back past its own start")
    if keep - start <= lazy:
        return 0  # the next forward feeds them; it saves the state here first
    if keep > start:
        cache.hold()
        runner.forward(torch.tensor(tokens[start:keep], device=runner.device), cache, last_only=True)
    cache.commit()
    return keep - start
