"""A corpus datastore for retrieval drafting (mechanism `corpus-drafter`, after REST: He et al., 2024).

The index maps every context of 1..`nmax` tokens seen at least `min_count` times in a token corpus to
the token that most often followed it. A drafter continues the committed sequence from its longest
indexed suffix, token by token, backing off to shorter contexts: no forward at all, so a draft costs
a few binary searches. Lossless like every drafter (the target verifies); what the corpus buys is
acceptance, because a target trained on text like the corpus continues the way the corpus does.

One sorted array holds the contexts' hashes of every order (the order seeds the hash, so the orders
do not collide with each other); `np.searchsorted` finds one. Saved as one `.npz`
(`specpilot train drafter --kind corpus`, `TARGET/drafters/corpus.npz`).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

MASK = (1 << 64) - 1
MULT = 1_000_003  # hash multiplier: h(ctx) = fold(h * MULT + token + 1) over the context, seeded by its order


class DatastoreError(ValueError):
    """A corpus index that cannot be built or read; the message is one line naming the fix."""


def _hash(ctx: list[int]) -> int:
    h = len(ctx)
    for t in ctx:
        h = (h * MULT + t + 1) & MASK
    return h


def _order_keys(tokens: np.ndarray, n: int) -> np.ndarray:
    """Hashes of every n-token window of `tokens` (window i ends before position i + n), as `_hash` makes them."""
    length = len(tokens) - n
    key = np.full(length, n, dtype=np.uint64)
    mult = np.uint64(MULT)
    with np.errstate(over="ignore"):
        for j in range(n):
            key = key * mult + tokens[j : j + length] + np.uint64(1)
    return key


class CorpusIndex:
    """Most frequent next token per context of 1..nmax tokens (see the module docstring)."""

    def __init__(self, keys: np.ndarray, nexts: np.ndarray, nmax: int, min_count: int, vocab_size: int,
                 corpus_tokens: int) -> None:
        self.keys, self.nexts = keys, nexts
        self.nmax, self.min_count = nmax, min_count
        self.vocab_size, self.corpus_tokens = vocab_size, corpus_tokens

    @classmethod
    def build(cls, tokens: np.ndarray | list[int], vocab_size: int, nmax: int = 6, min_count: int = 2) -> CorpusIndex:
        """Index `tokens` (documents joined by EOS). Contexts seen fewer than `min_count` times are dropped:
        a continuation seen once predicts the target's no better than chance and would only lengthen drafts."""
        if nmax < 1 or min_count < 1:
            raise DatastoreError(f"nmax = {nmax}, min_count = {min_count}: both must be at least 1")
        a = np.asarray(tokens, dtype=np.uint64)
        if len(a) <= nmax:
            raise DatastoreError(f"the corpus has {len(a)} tokens; it needs more than nmax = {nmax}")
        keys, nexts = [], []
        for n in range(1, nmax + 1):
            key, nxt = _order_keys(a, n), a[n:]
            order = np.lexsort((nxt, key))
            key, nxt = key[order], nxt[order]
            run = np.flatnonzero(np.r_[True, (key[1:] != key[:-1]) | (nxt[1:] != nxt[:-1])])
            count = np.diff(np.r_[run, len(key)])
            key, nxt = key[run], nxt[run]
            best = np.lexsort((-count, key))  # per context, its most frequent next token first
            key, nxt, count = key[best], nxt[best], count[best]
            first = np.r_[True, key[1:] != key[:-1]] & (count >= min_count)
            keys.append(key[first])
            nexts.append(nxt[first])
        key, nxt = np.concatenate(keys), np.concatenate(nexts)
        order = np.argsort(key, kind="stable")
        dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
        return cls(key[order], nxt[order].astype(dtype), nmax, min_count, vocab_size, len(a))

    def save(self, path: Path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp.npz")  # np.savez keeps a name ending in .npz as given
        np.savez(tmp, keys=self.keys, nexts=self.nexts,
                 meta=np.array([self.nmax, self.min_count, self.vocab_size, self.corpus_tokens], dtype=np.int64))
        tmp.replace(path)  # a crash leaves the old index or none, never half of one

    @classmethod
    def load(cls, path: Path) -> CorpusIndex:
        try:
            with np.load(Path(path)) as z:
                nmax, min_count, vocab, n_tokens = (int(x) for x in z["meta"])
                return cls(z["keys"], z["nexts"], nmax, min_count, vocab, n_tokens)
        except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            why = "not a .npz archive" if "pickle" in why else why
            raise DatastoreError(f"{path}: not a corpus index ({why}); remake it with `specpilot train drafter "
                                 f"--kind corpus`") from None

    def __len__(self) -> int:
        return len(self.keys)

    def next_token(self, ctx: list[int], longest: int | None = None) -> tuple[int, int]:
        """(token, order): the most frequent continuation of the longest indexed suffix of `ctx` no longer
        than `longest` (default nmax); (-1, 0) when not even its last token is indexed."""
        top = min(self.nmax if longest is None else longest, len(ctx))
        keys = self.keys
        for n in range(top, 0, -1):
            h = _hash(ctx[len(ctx) - n :])
            i = int(keys.searchsorted(np.uint64(h)))
            if i < len(keys) and int(keys[i]) == h:
                return int(self.nexts[i]), n
        return -1, 0

    def alternative(self, ctx: list[int], exclude: int) -> int:
        """Mechanism corpus-tree: the continuation of the longest indexed suffix of `ctx` whose most frequent
        next token is not `exclude` (a shorter context often continues otherwise); -1 when none is."""
        keys = self.keys
        for n in range(min(self.nmax, len(ctx)), 0, -1):
            h = _hash(ctx[len(ctx) - n :])
            i = int(keys.searchsorted(np.uint64(h)))
            if i < len(keys) and int(keys[i]) == h and int(self.nexts[i]) != exclude:
                return int(self.nexts[i])
        return -1

    def draft(self, ctx: list[int], k: int) -> list[int]:
        """Up to k tokens continuing `ctx`, each from the longest indexed suffix (a drafted token's context
        is at most one longer than its predecessor's, so the search starts there)."""
        ctx = list(ctx[-self.nmax :])
        out: list[int] = []
        longest = self.nmax
        for _ in range(k):
            tok, n = self.next_token(ctx, longest)
            if tok < 0:
                break
            out.append(tok)
            ctx = ctx[1:] + [tok] if len(ctx) >= self.nmax else ctx + [tok]
            longest = n + 1
        return out
