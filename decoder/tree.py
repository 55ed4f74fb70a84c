"""Tree verification and two-level verification on the lean forward (gap family acceptance).

**Tree verification** (`verify = "tree"`). The draft model grows a tree of candidate continuations
from the last committed token (the root), one batched drafter forward per depth:
- static shape (`tree_shape = "4,2,1,1"`): every node at depth d gets the drafter's top-w_d tokens;
- dynamic (`tree_shape = "dynamic"`, EAGLE-2 style): at each depth the `tree_topk` nodes with the highest
  cumulative drafter confidence (product of drafter probabilities along the path) are expanded with
  their top-`tree_topk` children; after `tree_depth` depths the `tree_budget` most confident nodes are
  kept (a child is never more confident than its parent, so that set is closed under ancestors).
The target scores the root and every node in one forward: node i sits at position prefix + depth(i)
and attends to the prefix and to its ancestors only (`tree_attention_mask`). Greedy acceptance takes the
deepest node whose whole path matches the target's argmax at each parent; the accepted path's KV rows
are gathered to contiguous slots of the preallocated cache (`LeanCache.compact`), so the cache reads as
if only that path had been fed. A chain is a tree of width one (`tree_shape = "1,1,1"`).

**Two-level verification** (`verify = "two-level"`). Level 1 is chain SD's draft: the draft model's
top-1 chain of `draft_len` tokens, drafted one plain forward at a time (no tree forwards, no masks).
Level 2 is one layer of alternatives: at every chain position the drafter's next `two_level_alts` best
tokens, read from the logits level 1 already computed, hang as leaves beside the chain node (node j's
alternatives see the prefix and chain nodes 0..j-1). One target forward verifies both levels; where the
chain breaks, an alternative that equals the target's token is accepted too, and the target's token after
it is the bonus: one more token per step at no drafter cost. Relative to a tree of the same depth it saves
target work (q = 1 + k * (1 + alts): no alternative is expanded) and drafter work (k forwards of one token,
none batched over branches); relative to the chain it spends a slightly wider target forward. It wins
where the drafter's top-1 misses often but its top-few holds the target's token, and the target's cost is
flat in the verify width (batch 1, overhead- or memory-bound): the demo on this CPU (README).

Both are greedy (temperature 0) and need the lean forward for target and drafter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoder.config import DecodeConfig, parse_tree_shape
from decoder.lean import LeanCache, LeanLM
from decoder.proposer import Draft, Proposer, Verdict
from decoder.verify import argmax_tokens


@dataclass
class DraftTree:
    """A draft tree; nodes are numbered so that every parent precedes its children."""

    tokens: torch.Tensor  # [N] node tokens
    parents: torch.Tensor  # [N] parent node, -1 = the root (the last committed token)
    depth: torch.Tensor  # [N] 0 = child of the root
    anc: torch.Tensor  # [N, N] bool: anc[i, j] = node j is node i or one of its ancestors
    score: torch.Tensor  # [N] product of the drafter's probabilities along the path to the node
    fed: torch.Tensor  # [N] the drafter cache slot (offset from `prefix_len`) of nodes it fed, else -1
    prefix_len: int  # drafter cache length before the tree's slots

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def select(self, keep: torch.Tensor) -> DraftTree:
        """The subtree of nodes `keep` ([M] ascending, closed under ancestors), renumbered 0..M-1."""
        n = self.size
        new_index = torch.full((n + 1,), -1, dtype=torch.long, device=keep.device)  # [-1] maps the root
        new_index[keep] = torch.arange(keep.shape[0], device=keep.device)
        return DraftTree(self.tokens[keep], new_index[self.parents[keep]], self.depth[keep],
                         self.anc[keep][:, keep], self.score[keep], self.fed[keep], self.prefix_len)


def tree_attention_mask(anc: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Mask [1 + N, prefix_len + 1 + N] for a forward of (root, nodes) after `prefix_len` cached tokens:
    everyone sees the prefix and the root; node i sees the nodes in anc[i] (its ancestors and itself)."""
    n = anc.shape[0]
    dev = anc.device
    tree = torch.cat([torch.ones(n, 1, dtype=torch.bool, device=dev), anc], dim=1)  # [N, 1 + N]
    root = torch.zeros(1, 1 + n, dtype=torch.bool, device=dev)
    root[0, 0] = True
    return torch.cat([torch.ones(1 + n, prefix_len, dtype=torch.bool, device=dev), torch.cat([root, tree])], dim=1)


def tree_positions(depth: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """RoPE positions [1 + N] of (root, nodes): the root right after the prefix, node i at its depth + 1 past it."""
    root = torch.zeros(1, dtype=torch.long, device=depth.device)
    return prefix_len + torch.cat([root, depth + 1])


def greedy_tree_accept(logits: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """The deepest node whose whole path equals the target's argmax at each parent, plus the target's token.

    logits: [1 + N, V] at (root, nodes). Returns one tensor [2 + 2N] = (n, bonus, path [N], path_tokens [N]):
    the first n entries of `path` are the accepted nodes in depth order (the rest is padding N).
    """
    return accept_on_pred(argmax_tokens(logits), tree)


def accept_on_pred(pred: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """greedy_tree_accept on the target's argmax pred [1 + N] at (root, nodes)."""
    n_nodes = tree.size
    dev = pred.device
    match = tree.tokens == pred[tree.parents + 1]  # [N]: parent -1 (root) reads row 0
    ok = ~(tree.anc & ~match[None, :]).any(dim=-1)  # [N]: every node on the path matches
    path_len = tree.anc.sum(dim=-1)  # [N] = depth + 1
    acc = torch.where(ok, path_len, 0)
    best = acc.argmax()
    n = acc[best]  # 0 when no node matched: only the root is kept
    on_path = tree.anc[best] & (n > 0)  # [N]
    idx = torch.arange(n_nodes, device=dev)
    path = torch.where(on_path, idx, n_nodes).sort().values  # ancestors precede: index order = depth order
    bonus = pred[torch.where(n > 0, best + 1, 0)]
    tokens = torch.cat([tree.tokens, tree.tokens.new_zeros(1)])[path]
    return torch.cat([n.view(1), bonus.view(1), path, tokens])


def tree_result(pred: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """Greedy acceptance of a verified tree on the device: [2 + 3N] = (n, bonus, path [N], path tokens [N],
    drafter cache slots of the path nodes [N]); `read_tree_result` reads it after the step's host copy."""
    res = accept_on_pred(pred, tree)
    fed = torch.cat([tree.fed, tree.fed.new_full((1,), -1)])[res[2 : 2 + tree.size]]
    return torch.cat([res, fed])


def read_tree_result(out: list[int], m: int) -> tuple[int, list[int], list[int], list[int]]:
    """(n accepted nodes, committed tokens (path + bonus), path node indices in depth order, drafter cache
    slots of the fed path nodes) from a tree_result of an m-node tree, copied to the host."""
    n, bonus = out[0], out[1]
    return n, [*out[2 + m : 2 + m + n], bonus], out[2 : 2 + n], [s for s in out[2 + 2 * m : 2 + 2 * m + n] if s >= 0]


def tree_accept(logits: torch.Tensor, tree: DraftTree) -> tuple[int, list[int], list[int], list[int]]:
    """Greedy acceptance of a verified tree (logits [1 + N, V] at root and nodes) with the step's one
    device-to-host copy: read_tree_result's tuple."""
    return read_tree_result(tree_result(argmax_tokens(logits), tree).tolist(), tree.size)


class TreeDrafter(Proposer):
    """A lean draft model that grows draft trees level by level, one batched forward per depth, and keeps
    its own cache equal to the committed sequence's prefix (accepted tree rows compacted in place).

    As a proposer it grows the config's tree (`tree_spec`): `kind` "static" (width = children per depth)
    or "dynamic" (width = top-k expanded per depth, each with top-k children, then the `budget` most
    confident nodes kept)."""

    name = "tree"

    def __init__(self, model: LeanLM, kind: str = "dynamic", width: int | tuple[int, ...] = 4, depth: int = 3,
                 budget: int | None = None) -> None:
        if not isinstance(model, LeanLM):
            raise TypeError("tree drafting runs on the lean forward: pass a LeanLM draft model")
        self.model = model
        self.kind, self.width, self.depth, self.budget = kind, width, depth, budget
        self.device = model.device
        self.cache: LeanCache = model.new_cache()
        self.cache_len = 0  # committed tokens whose KV the cache holds (a prefix of the sequence)
        self.forwards = 0
        self._index_cache: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._iota = torch.arange(1024, device=self.device)

    @classmethod
    def from_config(cls, model: LeanLM, cfg: DecodeConfig) -> TreeDrafter:
        kind, width, depth = tree_spec(cfg)
        return cls(model, kind, width, depth, cfg.tree_budget)

    def reset(self, prompt: list[int] | None = None, hidden: torch.Tensor | None = None) -> None:
        self.cache.length = 0
        self.cache_len = 0

    def propose(self, tokens: list[int], k: int) -> Draft:
        tree = self.grow(tokens, k, self.kind, self.width)
        if self.kind == "dynamic" and self.budget is not None and tree.size > self.budget:
            keep = torch.sort(-tree.score, stable=True).indices[: self.budget].sort().values
            tree = tree.select(keep)
        return Draft(tree.tokens, tree=tree)

    def accepted(self, tokens: list[int], verdict: Verdict) -> None:
        self.keep_path(verdict.fed)

    @torch.inference_mode()
    def grow(self, tokens: list[int], depth: int, kind: str, width: int | tuple[int, ...]) -> DraftTree:
        """Grow a tree of `depth` levels below the root tokens[-1].

        kind: "static" (width = children per depth) or "dynamic" (width = top-k expanded per depth, each
        with top-k children).
        """
        model, cache, dev = self.model, self.cache, self.device
        cache.length = self.cache_len
        feed = tokens[self.cache_len:]
        logits = model.forward(torch.tensor(feed, device=dev), cache, last_only=True)  # [1, V]
        self.forwards += 1
        prefix = cache.length
        self.cache_len = prefix
        if kind == "static":
            widths = tuple(width)[:depth]
            n_max, level = 0, 1
            for w in widths:
                level *= w
                n_max += level
        else:
            k = int(width)
            n_max = k + (depth - 1) * k * k
        root = n_max  # row n_max stands for the root: no ancestors, depth -1, score 1
        anc = torch.zeros(n_max + 1, n_max + 1, dtype=torch.bool, device=dev)
        parents = torch.full((n_max + 1,), -1, dtype=torch.long, device=dev)
        depths = torch.full((n_max + 1,), -1, dtype=torch.long, device=dev)
        score = torch.ones(n_max + 1, device=dev)
        toks = torch.zeros(n_max + 1, dtype=torch.long, device=dev)
        fed = torch.full((n_max + 1,), -1, dtype=torch.long, device=dev)
        frontier = torch.tensor([root], device=dev)
        f_count = 1
        fed_ids: list[torch.Tensor] = []
        n = n_fed = 0
        for d in range(depth):
            probs = torch.softmax(logits.float(), dim=-1)  # [F, V]
            counts = [widths[d] if kind == "static" else int(width)] * f_count
            vals, idx = probs.topk(max(counts), dim=-1)  # [F, m]
            r_t, c_t = self._children_index(tuple(counts))
            c_new = r_t.shape[0]
            new = self._arange(n, n + c_new)
            par = frontier[r_t]  # [c]
            toks[new] = idx[r_t, c_t]
            score[new] = score[par] * vals[r_t, c_t]
            parents[new] = torch.where(par == root, -1, par)
            depths[new] = depths[par] + 1
            anc[new] = anc[par]
            anc[new, new] = True
            n += c_new
            if d == depth - 1:
                break
            if kind == "dynamic" and c_new > int(width):
                frontier = new[score[new].topk(int(width)).indices.sort().values]
            else:
                frontier = new
            f_count = frontier.shape[0]
            fed[frontier] = self._arange(n_fed, n_fed + f_count)
            fed_ids.append(frontier)
            n_fed += f_count
            mask = torch.cat([torch.ones(f_count, prefix, dtype=torch.bool, device=dev),
                              anc[frontier][:, torch.cat(fed_ids)]], dim=1)  # [F, prefix + fed]
            logits = model.forward(toks[frontier], cache, positions=prefix + depths[frontier], attn_mask=mask)
            self.forwards += 1
        return DraftTree(toks[:n], parents[:n], depths[:n], anc[:n, :n], score[:n], fed[:n], prefix)

    def _children_index(self, counts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(frontier row, child rank) of every child when frontier row r gets counts[r] children; cached,
        since a tree's shape per level repeats every step."""
        hit = self._index_cache.get(counts)
        if hit is None:
            rows = [r for r, c in enumerate(counts) for _ in range(c)]
            cols = [j for c in counts for j in range(c)]
            hit = (torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device))
            self._index_cache[counts] = hit
        return hit

    def _arange(self, lo: int, hi: int) -> torch.Tensor:
        if hi > self._iota.shape[0]:
            self._iota = torch.arange(2 * hi, device=self.device)
        return self._iota[lo:hi]

    def keep_path(self, fed_rows: list[int]) -> None:
        """After verification: keep the prefix plus the fed accepted nodes (slot offsets, depth order)."""
        rows = torch.tensor(fed_rows, dtype=torch.long, device=self.device)
        self.cache.compact(self.cache_len, rows)
        self.cache_len = self.cache.length


def tree_spec(cfg: DecodeConfig) -> tuple[str, int | tuple[int, ...], int]:
    """(kind, width, depth) of the config's tree: static widths or dynamic top-k."""
    widths = parse_tree_shape(cfg.tree_shape)
    if widths is None:
        return "dynamic", cfg.tree_topk, cfg.tree_depth
    return "static", widths, len(widths)


_COMB: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def comb_tree(main: torch.Tensor, alts: torch.Tensor) -> DraftTree:
    """The two-level tree: chain nodes 0..k-1 (main [k]) and, beside chain node j, its alternatives
    alts[j] [a] (children of chain node j-1, or of the root). Alternative (j, r) is node k + j * a + r."""
    k, a = alts.shape
    key = (k, a, str(main.device))
    if key not in _COMB:
        n = k * (1 + a)
        parents = list(range(-1, k - 1)) + [j - 1 for j in range(k) for _ in range(a)]
        depth = list(range(k)) + [j for j in range(k) for _ in range(a)]
        anc = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                anc[i, j] = True
                j = parents[j]
        _COMB[key] = (torch.tensor(parents, device=main.device), torch.tensor(depth, device=main.device),
                      anc.to(main.device))
    parents, depth, anc = _COMB[key]
    n = parents.shape[0]
    return DraftTree(torch.cat([main, alts.reshape(-1)]), parents, depth, anc,
                     torch.ones(n, device=main.device), torch.full((n,), -1, dtype=torch.long, device=main.device), 0)


_PARENTS: dict[tuple[tuple[int, ...], str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def parents_tree(tokens: list[int], parents: list[int], device: torch.device) -> DraftTree:
    """A draft tree of host-side nodes: tokens [N] and parents [N] (-1 = the root; every parent precedes its
    child). Shapes recur step after step (a chain with a few branches), so each one's tensors are built once."""
    key = (tuple(parents), str(device))
    if key not in _PARENTS:
        n = len(parents)
        depth = [0] * n
        anc = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ValueError(f"draft tree: node {i}'s parent {p} does not precede it")
            depth[i] = depth[p] + 1 if p >= 0 else 0
            if p >= 0:
                anc[i] = anc[p]
            anc[i, i] = True
        _PARENTS[key] = (torch.tensor(parents, device=device), torch.tensor(depth, device=device), anc.to(device))
    par, depth, anc = _PARENTS[key]
    n = par.shape[0]
    return DraftTree(torch.tensor(tokens, dtype=torch.long, device=device), par, depth, anc,
                     torch.ones(n, device=device), torch.full((n,), -1, dtype=torch.long, device=device), 0)


class TwoLevelDrafter(Proposer):
    """Two-level verification's proposer (see the module docstring): the draft model's top-1 chain plus,
    beside every chain node, its next `alts` tokens, drafted with k plain one-token forwards."""

    name = "two-level"

    def __init__(self, model: LeanLM, alts: int, depth: int | None = None) -> None:
        if not isinstance(model, LeanLM):
            raise TypeError("two-level drafting runs on the lean forward: pass a LeanLM draft model")
        self.model = model
        self.alts = alts
        self.depth = depth
        self.cache: LeanCache = model.new_cache()
        self.cache_len = 0  # committed tokens whose KV the drafter's cache holds
        self.forwards = 0
        self.alternatives_accepted = 0
        self._k = 0

    def reset(self, prompt: list[int], hidden: torch.Tensor | None = None) -> None:
        self.cache.length = 0
        self.cache_len = 0

    @torch.inference_mode()
    def propose(self, tokens: list[int], k: int) -> Draft:
        # Level 1 and level 2 from the same k one-token drafter forwards: top-1 is the chain, the next
        # `alts` are the alternatives.
        self.cache.length = self.cache_len
        inp = torch.tensor(tokens[self.cache_len:], device=self.model.device)
        top = []
        for _ in range(k):
            logits = self.model.forward(inp, self.cache, last_only=True)  # [1, V]
            top.append(logits.topk(1 + self.alts, dim=-1).indices)  # [1, 1 + a]
            inp = top[-1][0, :1]
        self.forwards += k
        self._k = k
        top_t = torch.cat(top)  # [k, 1 + a]
        tree = comb_tree(top_t[:, 0], top_t[:, 1:])
        return Draft(tree.tokens, tree=tree)

    def accepted(self, tokens: list[int], verdict: Verdict) -> None:
        n, k = verdict.n, self._k
        on_chain = n if n == 0 or verdict.path[-1] < k else n - 1  # the path ends in an alternative or not
        self.alternatives_accepted += n - on_chain
        before = len(tokens) - n - 1
        self.cache_len = before + min(on_chain, k - 1)  # the drafter fed the chain's first k - 1 nodes
