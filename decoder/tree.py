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

**Two-level verification** (`verify = "two-level"`). Level 1: the target verifies the drafter's top-1
chain of `draft_len` tokens, exactly as chain SD (same target work, q = k + 1). Level 2: in the same
batched drafter forwards, the drafter also keeps its top-`two_level_alts` alternatives at every chain
position and extends each greedily to the chain's depth; the target never scores them. Where the chain
breaks, the target's own token is already known (the bonus); if it equals one of the alternatives held
at that position, that alternative's pre-drafted continuation is exactly what the greedy drafter would
draft next, so the next step starts from it and needs fewer drafter forwards. It is lossless for the same
reason chain SD is (every committed token is the target's argmax); it saves the target work a tree
spends on alternatives that mostly fail, and saves drafter forwards after a break. It wins where the
target's cost grows with the verify width (bigger batches, compute-bound steps) and drafting is a large
part of a step; on the demo it trades with the tree (README).

Both are greedy (temperature 0) and need the lean forward for target and drafter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from decoder.config import DecodeConfig, parse_tree_shape
from decoder.lean import LeanCache, LeanLM
from decoder.profiler import DecodeStats, PhaseTimer
from decoder.verify import greedy_accept


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
    main: list[int]  # two-level: the main chain's node at each depth (else empty)
    main_fed: list[int]  # two-level: drafter slot offsets of the main chain nodes the drafter fed

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def select(self, keep: torch.Tensor) -> DraftTree:
        """The subtree of nodes `keep` ([M] ascending, closed under ancestors), renumbered 0..M-1."""
        n = self.size
        new_index = torch.full((n + 1,), -1, dtype=torch.long, device=keep.device)  # [-1] maps the root
        new_index[keep] = torch.arange(keep.shape[0], device=keep.device)
        return DraftTree(self.tokens[keep], new_index[self.parents[keep]], self.depth[keep],
                         self.anc[keep][:, keep], self.score[keep], self.fed[keep], self.prefix_len, [], [])


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
    n_nodes = tree.size
    dev = logits.device
    pred = logits.argmax(dim=-1)  # [1 + N]
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


class TreeDrafter:
    """A lean draft model that grows draft trees level by level, one batched forward per depth, and keeps
    its own cache equal to the committed sequence's prefix (accepted tree rows compacted in place)."""

    def __init__(self, model: LeanLM) -> None:
        if not isinstance(model, LeanLM):
            raise TypeError("tree drafting runs on the lean forward: pass a LeanLM draft model")
        self.model = model
        self.device = model.device
        self.cache: LeanCache = model.new_cache()
        self.cache_len = 0  # committed tokens whose KV the cache holds (a prefix of the sequence)
        self.forwards = 0
        self._index_cache: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._iota = torch.arange(1024, device=self.device)

    def reset(self) -> None:
        self.cache.length = 0
        self.cache_len = 0

    @torch.inference_mode()
    def grow(self, tokens: list[int], extra: list[int], depth: int, kind: str, width: int | tuple[int, ...],
             alts: int = 0) -> DraftTree:
        """Grow a tree of `depth` levels below the root tokens[-1] (or extra[-1]; `extra` are committed-to-be
        tokens fed causally before the root, e.g. a pending two-level draft).

        kind: "static" (width = children per depth), "dynamic" (width = top-k expanded per depth, each with
        top-k children) or "two-level" (the main chain gets 1 + alts children, every other node one).
        """
        model, cache, dev = self.model, self.cache, self.device
        cache.length = self.cache_len
        feed = tokens[self.cache_len:] + extra
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
        elif kind == "dynamic":
            k = int(width)
            n_max = k + (depth - 1) * k * k
        else:
            n_max = depth * (1 + alts) + alts * depth * (depth - 1) // 2
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
        main: list[int] = []
        main_fed: list[int] = []
        for d in range(depth):
            probs = torch.softmax(logits.float(), dim=-1)  # [F, V]
            if kind == "static":
                counts = [widths[d]] * f_count
            elif kind == "dynamic":
                counts = [int(width)] * f_count
            else:
                counts = [1 + alts] + [1] * (f_count - 1)
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
            if kind == "two-level":
                main.append(n)  # the main node's top-1 child comes first
            n += c_new
            if d == depth - 1:
                break
            if kind == "dynamic" and c_new > int(width):
                frontier = new[score[new].topk(int(width)).indices.sort().values]
            else:
                frontier = new
            f_count = frontier.shape[0]
            if kind == "two-level":
                main_fed.append(n_fed)  # the main chain node is first in every frontier
            fed[frontier] = self._arange(n_fed, n_fed + f_count)
            fed_ids.append(frontier)
            n_fed += f_count
            mask = torch.cat([torch.ones(f_count, prefix, dtype=torch.bool, device=dev),
                              anc[frontier][:, torch.cat(fed_ids)]], dim=1)  # [F, prefix + fed]
            logits = model.forward(toks[frontier], cache, positions=prefix + depths[frontier], attn_mask=mask)
            self.forwards += 1
        return DraftTree(toks[:n], parents[:n], depths[:n], anc[:n, :n], score[:n], fed[:n], prefix, main, main_fed)

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


def _finish(new: list[int], cfg: DecodeConfig, eos_id: int | None) -> tuple[list[int], bool]:
    from decoder.generate import _finish as finish

    return finish(new, cfg, eos_id)


def _prefill(target: LeanLM, prompt: list[int], stats: DecodeStats) -> tuple[LeanCache, list[int]]:
    cache = target.new_cache()
    logits = target.forward(torch.tensor(prompt, device=target.device), cache, last_only=True)  # [1, V]
    stats.target_forwards += 1
    stats.target_tokens += len(prompt)
    return cache, [*prompt, int(logits.argmax(dim=-1).item())]


def _eos(target: LeanLM) -> int | None:
    eos = target.config.eos_token_id
    return eos[0] if isinstance(eos, list) else eos


def tree_spec(cfg: DecodeConfig) -> tuple[str, int | tuple[int, ...], int]:
    """(kind, width, depth) of the config's tree: static widths or dynamic top-k."""
    widths = parse_tree_shape(cfg.tree_shape)
    if widths is None:
        return "dynamic", cfg.tree_topk, cfg.tree_depth
    return "static", widths, len(widths)


@torch.inference_mode()
def tree_generate(target: LeanLM, drafter: LeanLM, prompt: list[int], cfg: DecodeConfig,
                  profile_sync: bool = False) -> object:
    """Greedy SD with tree verification (see the module docstring): commits the target's argmax sequence."""
    from decoder.generate import Generation

    stats = DecodeStats()
    timer = PhaseTimer(stats, target.device, profile_sync)
    t0 = time.perf_counter()
    eos = _eos(target)
    kind, width, max_depth = tree_spec(cfg)
    cache, tokens = _prefill(target, prompt, stats)
    tdraft = TreeDrafter(drafter)
    timer.mark("prefill")
    _, done = _finish(tokens[len(prompt):], cfg, eos)
    while not done:
        remaining = cfg.max_new_tokens - (len(tokens) - len(prompt))
        depth = min(max_depth, remaining - 1)
        start = cache.length  # = len(tokens) - 1: the root's slot
        if depth < 1:  # one token left: a plain target step
            logits = target.forward(torch.tensor(tokens[-1:], device=target.device), cache, last_only=True)
            committed, n = [int(logits.argmax(dim=-1).item())], 0
            stats.target_forwards += 1
            stats.target_tokens += 1
        else:
            tree = tdraft.grow(tokens, [], depth, kind, width)
            if kind == "dynamic" and tree.size > cfg.tree_budget:
                keep = torch.sort(-tree.score, stable=True).indices[: cfg.tree_budget].sort().values
                tree = tree.select(keep)
            timer.mark("draft")
            ids = torch.cat([torch.tensor(tokens[-1:], device=target.device), tree.tokens])
            logits = target.forward(ids, cache, positions=tree_positions(tree.depth, start),
                                    attn_mask=tree_attention_mask(tree.anc, start))  # [1 + N, V]
            stats.target_forwards += 1
            stats.target_tokens += ids.shape[0]
            timer.mark("verify")
            res = greedy_tree_accept(logits, tree)
            fed = torch.cat([tree.fed, tree.fed.new_full((1,), -1)])[res[2 : 2 + tree.size]]
            out = torch.cat([res, fed]).tolist()  # the step's one device-to-host copy
            m = tree.size
            n, bonus = out[0], out[1]
            path = out[2 : 2 + n]
            committed = [*out[2 + m : 2 + m + n], bonus]
            cache.compact(start, torch.tensor([0] + [p + 1 for p in path], device=target.device))
            tdraft.keep_path([s for s in out[2 + 2 * m : 2 + 2 * m + n] if s >= 0])
            stats.draft_steps += 1
            stats.drafted += m
            stats.accepted += n
            stats.accept_hist[n] += 1
        tokens.extend(committed)
        done = len(tokens) - len(prompt) >= cfg.max_new_tokens or (cfg.stop_at_eos and eos in committed)
        timer.mark("accept")
    new, _ = _finish(tokens[len(prompt):], cfg, eos)
    stats.new_tokens = len(new)
    stats.drafter_forwards = tdraft.forwards
    stats.wall_s = time.perf_counter() - t0
    return Generation(new, stats)


def _alternative_lookup(tree: DraftTree, pred: torch.Tensor, n: torch.Tensor, pending: int, k: int) -> torch.Tensor:
    """Two-level, level 2 on the device: if the chain broke at draft position n (< k, past the pending part)
    and the target's token pred[n] is an alternative held at that position, return (1, length, continuation
    [D-1]) of that alternative's pre-drafted branch, else (0, 0, padding)."""
    dev = pred.device
    depth = len(tree.main)
    size = tree.size
    main_t = torch.tensor(tree.main, device=dev)
    main_parent = torch.tensor([-1, *tree.main[:-1]], device=dev)
    j = (n - pending).clamp(0, depth - 1)  # the tree depth where the chain broke
    c = pred[n.clamp(max=pred.shape[0] - 1)]
    cand = (tree.parents == main_parent[j]) & (torch.arange(size, device=dev) != main_t[j]) & (tree.tokens == c)
    valid = cand.any() & (n < k) & (n >= pending)
    alt = cand.to(torch.int64).argmax()
    below = tree.anc[:, alt] & (torch.arange(size, device=dev) != alt)  # the alternative's greedy branch
    cont_idx = torch.where(below, torch.arange(size, device=dev), size).sort().values[: max(depth - 1, 1)]
    cont = torch.cat([tree.tokens, tree.tokens.new_zeros(1)])[cont_idx]
    length = torch.where(valid, below.sum(), 0)
    return torch.cat([valid.to(torch.int64).view(1), length.view(1), cont])


@torch.inference_mode()
def two_level_generate(target: LeanLM, drafter: LeanLM, prompt: list[int], cfg: DecodeConfig,
                       profile_sync: bool = False) -> object:
    """Greedy SD with two-level verification (see the module docstring): commits the target's argmax sequence."""
    from decoder.generate import Generation

    stats = DecodeStats()
    timer = PhaseTimer(stats, target.device, profile_sync)
    t0 = time.perf_counter()
    eos = _eos(target)
    dev = target.device
    cache, tokens = _prefill(target, prompt, stats)
    tdraft = TreeDrafter(drafter)
    pending: list[int] = []  # the alternative branch taken after the last break: the next draft's start
    timer.mark("prefill")
    _, done = _finish(tokens[len(prompt):], cfg, eos)
    while not done:
        remaining = cfg.max_new_tokens - (len(tokens) - len(prompt))
        k = min(cfg.draft_len, remaining - 1)
        pending = pending[: max(k, 0)]
        p = len(pending)
        tree = None
        if k - p >= 1:
            tree = tdraft.grow(tokens, pending, k - p, "two-level", 1, alts=cfg.two_level_alts)
            draft = torch.cat([torch.tensor(pending, dtype=torch.long, device=dev), tree.tokens[tree.main]])
        else:
            draft = torch.tensor(pending, dtype=torch.long, device=dev)  # a pending draft fills the step
        timer.mark("draft")
        ids = torch.cat([torch.tensor(tokens[-1:], device=dev), draft])  # [k + 1]
        logits = target.forward(ids, cache)  # [k + 1, V]
        stats.target_forwards += 1
        stats.target_tokens += ids.shape[0]
        timer.mark("verify")
        res = greedy_accept(logits, draft)  # (n, argmax [k + 1])
        if tree is not None:
            res = torch.cat([res, _alternative_lookup(tree, res[1:], res[0], p, k)])
        out = res.tolist()  # the step's one device-to-host copy
        n = out[0]
        committed = out[1 : n + 2]
        cache.crop(len(tokens) + n)
        if tree is not None and n >= p:
            tdraft.keep_path(tree.main_fed[: n - p])  # drafter: prefix + pending + fed accepted main nodes
        else:
            tdraft.cache_len = min(tdraft.cache_len, len(tokens) + n)
        pending = []
        if tree is not None and out[k + 2]:
            length = out[k + 3]
            pending = out[k + 4 : k + 4 + length]
        tokens.extend(committed)
        if k > 0:
            stats.draft_steps += 1
            stats.drafted += k
            stats.accepted += n
            stats.accept_hist[n] += 1
        done = len(tokens) - len(prompt) >= cfg.max_new_tokens or (cfg.stop_at_eos and eos in committed)
        timer.mark("accept")
    new, _ = _finish(tokens[len(prompt):], cfg, eos)
    stats.new_tokens = len(new)
    stats.drafter_forwards = tdraft.forwards
    stats.wall_s = time.perf_counter() - t0
    return Generation(new, stats)
