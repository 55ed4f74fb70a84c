"""Batched AR and batched speculative decoding with ragged acceptance, on the lean forward.

Each request owns a slot of a preallocated KV buffer [layers, slots, KV, max_len, head_dim] with its
own length, so requests advance by different numbers of tokens each step and a rollback is a length
change. One step: draft for every live request (batched draft-model forwards, or n-gram lookups),
verify all drafts in one target forward, accept per request on tensors, one device-to-host copy.

Three batching mechanisms (DecodeConfig keys; all off in stock):
- `ragged_verify`: a forward computes only real rows. Off, every forward is a padded rectangle
  [batch slots, widest request] as a static batch computes it (finished requests of the batch included).
  On, the real rows of all requests are packed into one [sum q_i] token batch for the projections and
  MLP (the bulk of the work; weights are read once for the batch); attention runs on a per-slot view
  of the cache with each request's own positions and causal mask.
- `load_aware_draft`: each request's draft length is chosen per step from the batch size and its running
  acceptance (`choose_draft_lens`), so a full batch stops paying verify rows for drafts it will reject.
- `continuous_batching`: a finished request leaves its slot at once and a waiting one joins before the
  next step (its prefill is one forward); off, a batch is admitted only when the previous one is done.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from decoder.config import FEATURE_DRAFTERS, LOOKUP_DRAFTERS, DecodeConfig, scheduled_draft_len, verify_width
from decoder.drafters import NgramDrafter
from decoder.generate import make_proposer
from decoder.lean import LeanLM
from decoder.profiler import DecodeStats, PhaseTimer
from decoder.proposer import Draft, Proposer, Verdict
from decoder.tree import read_tree_result, tree_result
from decoder.verify import argmax_tokens


@dataclass
class BatchCache:
    """Per-slot KV buffer: k, v [layers, slots, KV, max_len, hd]; slot s holds `lengths[s]` valid tokens."""

    k: torch.Tensor
    v: torch.Tensor
    lengths: list[int]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def compact(self, slot: int, start: int, rows: torch.Tensor) -> None:
        """Keep slot `slot`'s entries at start + rows (ascending, e.g. a tree's accepted path) as slots
        start.. start + len(rows) - 1 and drop the rest (LeanCache.compact, one slot)."""
        n = rows.shape[0]
        self.k[:, slot, :, start : start + n] = self.k[:, slot, :, start + rows]
        self.v[:, slot, :, start : start + n] = self.v[:, slot, :, start + rows]
        self.lengths[slot] = start + n


def ragged_index(qlens: list[int], width: int, device: torch.device) -> torch.Tensor:
    """Flat indices of the real rows of a [R, width] padded layout where request r has qlens[r] rows."""
    q = torch.tensor(qlens, device=device)  # [R]
    total = sum(qlens)
    req = torch.repeat_interleave(torch.arange(len(qlens), device=device), q, output_size=total)  # [T]
    offs = torch.cumsum(q, 0) - q  # [R] first flat row of each request
    return req * width + torch.arange(total, device=device) - offs[req]  # [T]


class BatchLM:
    """A LeanLM with a slot dimension: packed forwards over several requests' caches at once."""

    def __init__(self, model) -> None:
        self.lean = model if isinstance(model, LeanLM) else LeanLM(model)
        self.config = self.lean.config
        self.device = self.lean.device
        self.dtype = self.lean.dtype

    def new_cache(self, slots: int, max_len: int) -> BatchCache:
        lean = self.lean
        if max_len > lean.cos.shape[0]:
            raise ValueError(f"batched forward: max_len {max_len} exceeds the RoPE table ({lean.cos.shape[0]})")
        shape = (len(lean.layers), slots, lean.n_kv, max_len, lean.head_dim)
        # Zeros, not empty: padded query rows may attend to unwritten keys, and NaN garbage would spread.
        return BatchCache(torch.zeros(shape, dtype=self.dtype, device=self.device),
                          torch.zeros(shape, dtype=self.dtype, device=self.device), [0] * slots)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, slots: list[int], qlens: list[int], cache: BatchCache,
                advance: list[int] | None = None, last_rows: list[int] | None = None,
                trees: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
                capture: tuple[int, ...] | None = None):
        """Append ids [T = sum(qlens)], packed request by request, to the caches of `slots`.

        Request r's rows sit at KV slots cache.lengths[slots[r]] + 0..qlens[r]-1 and see their own
        cache and their earlier rows. Each slot's length then grows by advance[r] (default qlens[r]:
        a padded request advances by its real rows only). Returns logits [T, V], or [R, V] at row
        last_rows[r] of each request.

        trees[r] = (depth [n], anc [n, n]) makes request r's first 1 + n rows a draft tree (root, nodes):
        node i at RoPE position start + depth[i] + 1, seeing the cache, the root and its ancestors (the
        single-request tree verify, decoder/tree.py). With `capture` it returns (logits, hidden [T, F]),
        the residual stream after each listed layer for every row (decoder/featdraft.py).
        """
        lean = self.lean
        dev = self.device
        R = len(slots)
        T = ids.shape[0]
        qmax = max(qlens)
        starts = [cache.lengths[s] for s in slots]
        ends = [s + q for s, q in zip(starts, qlens, strict=True)]
        if max(ends) > cache.max_len:
            raise ValueError(f"batched forward: position {max(ends)} exceeds the KV buffer ({cache.max_len}); "
                             f"create the cache with a larger max_len")
        # Attention runs on the contiguous slot range [lo, hi): a view of the cache, no copy. Slots in
        # the range that are not in this forward get zero queries whose outputs are dropped.
        lo, hi = min(slots), max(slots) + 1
        n_range = hi - lo
        Lk = max(ends)
        q_t = torch.tensor(qlens, device=dev)  # [R]
        slot_t = torch.tensor(slots, device=dev)  # [R]
        req = torch.repeat_interleave(torch.arange(R, device=dev), q_t, output_size=T)  # [T]
        offs = torch.cumsum(q_t, 0) - q_t
        row_i = torch.arange(T, device=dev) - offs[req]  # [T] row within its request
        pos = torch.tensor(starts, device=dev)[req] + row_i  # [T] KV slot of each row
        rope_pos = pos
        if trees is not None and any(t is not None for t in trees):
            rel = [torch.cat([torch.zeros(1, dtype=torch.long, device=dev), t[0] + 1,
                              torch.arange(1 + t[0].shape[0], q, device=dev)]) if t is not None else
                   torch.arange(q, device=dev) for t, q in zip(trees, qlens, strict=True)]
            rope_pos = torch.tensor(starts, device=dev)[req] + torch.cat(rel)  # [T] RoPE position of each row
        row_slot = slot_t[req]  # [T]
        dest = (row_slot - lo) * qmax + row_i  # [T] row in the padded [n_range, qmax] attention layout
        range_start = torch.zeros(n_range, dtype=torch.long, device=dev)
        range_start[slot_t - lo] = torch.tensor(starts, device=dev)
        qpos = range_start[:, None] + torch.arange(qmax, device=dev)[None, :]  # [n_range, qmax]
        # Key j is visible to a query at position p when j <= p: own cache plus own earlier rows.
        # A prefill of every request from position 0 (no tree, no window in reach): each row sees keys 0..its own
        # row, which SDPA computes as plain causal attention over the padded layout (Lk = qmax), without a mask.
        causal = (max(starts) == 0 and not any(t is not None for t in trees or ()) and Lk == qmax
                  and (lean.window is None or Lk <= lean.window))
        mask = None if causal else (
            torch.arange(Lk, device=dev)[None, None, :] <= qpos[:, :, None])[:, None]  # [n_range, 1, qmax, Lk]
        for r, t in enumerate(trees or ()):
            if t is not None:  # the root and the nodes see the root and their ancestors only, not the siblings
                n, st, row = t[1].shape[0], starts[r], slots[r] - lo
                mask[row, 0, 1 : n + 1, st : st + n + 1] = torch.cat(
                    [torch.ones(n, 1, dtype=torch.bool, device=dev), t[1]], dim=1)
        sw_mask = mask  # sliding-window layers: a query at position p sees keys at p - window < j <= p
        if lean.window is not None and Lk > lean.window:
            qr, kr = qpos, torch.arange(Lk, device=dev)[None, :]  # positions of queries [n_range, qmax], keys
            if rope_pos is not pos:  # tree rows (and their keys) sit at their own positions, not their slots
                qr = qpos.clone().view(-1)
                qr[dest] = rope_pos
                qr = qr.view(n_range, qmax)
                kr = kr.repeat(n_range, 1)
                kr[row_slot - lo, pos] = rope_pos
            sw_mask = mask & (kr[:, None, :] > qr[:, :, None] - lean.window)[:, None]  # [n_range, 1, qmax, Lk]
        mask, sw_mask = lean.fold_masks(mask, sw_mask, qmax)
        cos = lean.cos.index_select(0, rope_pos)[:, None, :]  # [T, 1, rot]
        sin = lean.sin.index_select(0, rope_pos)[:, None, :]
        x = lean.embed_ids(ids)  # [T, D]

        # A causal prefill attends request by request over its own rows: the padded layout would pay for every
        # request's padding (attention's cost grows with the square of the widest prompt; 29% of a prefill's
        # attention on eight ~250-token prompts), and each request's causal attention needs no other's rows.
        per_request = causal and R > 1 and lean.attn_softcap is None
        bounds = [0, *itertools.accumulate(qlens)]
        qpad = None if per_request else torch.zeros(n_range * qmax, lean.n_heads, lean.head_dim, dtype=self.dtype,
                                                    device=dev)

        def attend(li: int, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
            cache.k[li][row_slot, :, pos] = kh  # [T, KV, hd] into (slot, :, pos)
            cache.v[li][row_slot, :, pos] = vh
            if per_request:
                return torch.cat([
                    lean.attention(qh[a:b].transpose(0, 1)[None], kh[a:b].transpose(0, 1)[None],
                                   vh[a:b].transpose(0, 1)[None], None, True)[0].transpose(0, 1)
                    for a, b in itertools.pairwise(bounds)]).reshape(T, lean.q_size)
            qpad[dest] = qh
            att = lean.attention(
                qpad.view(n_range, qmax, lean.n_heads, lean.head_dim).transpose(1, 2),
                cache.k[li, lo:hi, :, :Lk], cache.v[li, lo:hi, :, :Lk], sw_mask if lean.sliding[li] else mask,
                causal,
            )  # [n_range, H, qmax, hd]
            return att.transpose(1, 2).reshape(n_range * qmax, lean.q_size)[dest]  # [T, H*hd]

        hidden: list[torch.Tensor] = []
        for li in range(len(lean.layers)):
            x = lean.layer(li, x, cos, sin, attend)
            if capture is not None and li in capture:
                hidden.append(x)
        for s, st, a in zip(slots, starts, advance if advance is not None else qlens, strict=True):
            cache.lengths[s] = st + a
        feats = torch.cat(hidden, dim=-1) if capture is not None else None  # [T, F]
        if last_rows is not None:
            x = x[offs + torch.tensor(last_rows, device=dev)]  # [R, D]
        logits = lean.head(x)  # [T|R, V]
        return (logits, feats) if capture is not None else logits


def choose_draft_lens(caps: list[int], alphas: list[float], fixed_rows: float, draft_cost: float) -> list[int]:
    """Load-aware draft lengths: maximise expected tokens per unit of step cost (in target rows).

    A step over R requests yields R tokens (each one's target token) for `fixed_rows` + R rows. Draft
    token j of request r (j <= caps[r]) adds alphas[r]**j expected tokens for 1 + draft_cost rows (its
    verify row and its drafter row); drafting D rounds costs D * fixed_rows * draft_cost more (the
    drafter's own fixed cost per forward). For each depth D the best allocation takes tokens by
    decreasing yield while the yield beats the current tokens per row (the greedy rule for a ratio
    objective); the best depth wins. A small batch (cost dominated by fixed_rows) drafts long, a full
    batch keeps only the tokens likely to be accepted.
    """
    R = len(caps)
    items = sorted(((alphas[r] ** j, r, j) for r in range(R) for j in range(1, caps[r] + 1)),
                   key=lambda t: (-t[0], t[2]))
    best_ratio, best = R / (fixed_rows + R), [0] * R
    for depth in range(1, max(caps, default=0) + 1):
        tokens, cost = float(R), fixed_rows + R + depth * fixed_rows * draft_cost
        lens = [0] * R
        for gain, r, j in items:
            if j > depth or j != lens[r] + 1:
                continue
            if gain * cost < tokens * (1 + draft_cost):
                break  # yields only fall from here
            lens[r] = j
            tokens += gain
            cost += 1 + draft_cost
        if tokens / cost > best_ratio:
            best_ratio, best = tokens / cost, lens
    return best


@dataclass
class Request:
    prompt: list[int]
    arrival_s: float = 0.0  # seconds after the run starts
    id: str | int | None = None


@dataclass
class RequestResult:
    tokens: list[int]
    stats: DecodeStats
    arrival_s: float
    start_s: float  # admitted (prefill began), seconds after the run started
    finish_s: float


@dataclass
class LiveSteps:
    """The steps a run took at one live-request count: how many, the tokens they committed, their seconds."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0


@dataclass
class BatchRun:
    results: list[RequestResult]  # in the order of the requests given
    wall_s: float
    steps: int  # batched target forwards after prefill
    stats: DecodeStats = field(default_factory=DecodeStats)  # summed over requests; phase_s for the run
    live_steps: int = 0  # live requests summed over the steps: the concurrency the engine actually saw
    # Per live count, what a load schedule is looked up by (#21): the loads a run really reached and their steps.
    by_live: dict[int, LiveSteps] = field(default_factory=dict)

    @property
    def mean_live(self) -> float:
        """Mean live requests per step; below the batch size when requests finish early (an EOS at once)."""
        return self.live_steps / self.steps if self.steps else 0.0

    @property
    def new_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.results)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0


@dataclass
class _Slot:
    req: int  # index into the run's requests
    tokens: list[int]  # prompt + committed
    prompt_len: int
    stats: DecodeStats
    start_s: float
    ngram: NgramDrafter | None = None
    proposer: Proposer | None = None  # a per-request proposer (tree, two-level, D-cut, feature drafters)
    done: bool = False
    k: int = 0  # this step's draft length
    accepted: int = 0  # running acceptance for load-aware drafting
    drafted: int = 0


class BatchEngine:
    """Batched AR (cfg.method = "ar") or SD (cfg.drafter: draft model or n-gram) over up to
    `max_batch` requests at once, greedy or sampled, with the batching mechanisms of `cfg`."""

    def __init__(self, target, cfg: DecodeConfig, max_batch: int, drafter_model=None,
                 eos_id: int | None = None, heads=None) -> None:
        if max_batch < 1:
            raise ValueError(f"batched decoding: max_batch = {max_batch} is invalid; use 1 or more")
        uses_model = cfg.drafter == "draft-model" or (cfg.drafter == "routed" and "draft-model" in
                                                      (cfg.route_code, cfg.route_prose))
        if cfg.method == "sd" and uses_model and drafter_model is None:
            raise ValueError("batched decoding: drafter = 'draft-model' needs a draft model; pass one or "
                             "use drafter = 'ngram'")
        self.cfg = cfg
        self.max_batch = max_batch
        self.target = target if isinstance(target, BatchLM) else BatchLM(target)
        self.device = self.target.device
        self.vocab = self.target.config.vocab_size
        # The batched draft model drafts for every request in one forward per position (chain drafts);
        # every other drafter runs as one proposer per request (the single-request loop's proposers).
        self.per_request = cfg.method == "sd" and (cfg.drafter in FEATURE_DRAFTERS or cfg.verify != "chain"
                                                   or cfg.dcut or cfg.corpus_tree_alts > 0)
        self.use_draft_model = cfg.method == "sd" and cfg.drafter == "draft-model" and not self.per_request
        self.heads = heads
        self.drafter = None
        self.draft_cost = 0.0  # drafter cost per token in target rows (parameter ratio): load-aware rule
        if cfg.method == "sd" and uses_model:
            self.drafter = drafter_model if isinstance(drafter_model, BatchLM) else BatchLM(drafter_model)
            self.draft_cost = _n_params(self.drafter.lean) / _n_params(self.target.lean)
        # Mechanisms transposed-matmul, onednn-matmul, fused-mlp, bf16w-matmul, bf16w-fused-layer: this config decides.
        for lm in (self.target, self.drafter):
            if lm is not None and lm.lean.t_rows != cfg.matmul_t_rows:
                lm.lean.set_transposed_rows(cfg.matmul_t_rows)
            if lm is not None and lm.lean.matmul_backend != cfg.matmul_backend:
                lm.lean.set_matmul_backend(cfg.matmul_backend)
            if lm is not None and lm.lean.fused_rows != cfg.fused_mlp_rows:  # mechanism fused-mlp
                lm.lean.set_fused_mlp_rows(cfg.fused_mlp_rows)
            if lm is not None and lm.lean.bf16w_rows != cfg.bf16w_rows:  # mechanism bf16w-matmul
                lm.lean.set_bf16w_rows(cfg.bf16w_rows)
            if lm is not None and lm.lean.fused_layer != cfg.fused_layer:  # mechanism bf16w-fused-layer
                lm.lean.set_fused_layer(cfg.fused_layer)
        self.capture = None
        if self.per_request and cfg.drafter in FEATURE_DRAFTERS:
            if heads is None:
                raise ValueError(f"batched decoding: drafter = {cfg.drafter!r} needs the target's feature drafters "
                                 f"(FeatureHeads)")
            kinds = {cfg.route_code, cfg.route_prose} if cfg.drafter == "routed" else {cfg.drafter}
            layers = {li for k in kinds & {"block", "mtp"} for li in heads.model(k).c.target_layers}
            self.capture = tuple(sorted(layers)) or None
        if eos_id is None:
            eos = self.target.config.eos_token_id
            eos_id = eos[0] if isinstance(eos, list) else eos
        self.eos = eos_id if cfg.stop_at_eos else None

    # -- scheduling -------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, requests: list[Request], clock: Callable[[], float] = time.perf_counter,
            sleep: Callable[[float], None] = time.sleep, profile_sync: bool = False) -> BatchRun:
        """Decode every request; each is admitted once it has arrived and a slot is free."""
        if not requests:
            raise ValueError("batched decoding: no requests given")
        cfg = self.cfg
        # Margin: padded rows (rectangle mode) and a drafter's catch-up may write past a request's end.
        max_len = max(len(r.prompt) for r in requests) + cfg.max_new_tokens + 2 * verify_width(cfg) + 16
        self.cache = self.target.new_cache(self.max_batch, max_len)
        self.dcache = self.drafter.new_cache(self.max_batch, max_len) if self.use_draft_model else None
        self.gen = torch.Generator(device=self.device).manual_seed(cfg.seed) if cfg.temperature > 0 else None
        self.run_stats = DecodeStats()
        self.timer = PhaseTimer(self.run_stats, self.device, profile_sync)
        self.acc_total, self.drafted_total = 0, 0
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
        pending = deque(order)
        slots: list[_Slot | None] = [None] * self.max_batch
        results: list[RequestResult | None] = [None] * len(requests)
        t0 = clock()
        steps = live_steps = 0
        by_live: dict[int, LiveSteps] = {}
        while pending or any(s is not None for s in slots):
            now = clock() - t0
            if cfg.continuous_batching:
                for i, s in enumerate(slots):  # finished requests leave at once
                    if s is not None and s.done:
                        slots[i] = None
                free = [i for i, s in enumerate(slots) if s is None]
            else:  # static: a new batch only when every request of the current one is done
                if all(s is None or s.done for s in slots):
                    slots = [None] * self.max_batch
                free = [i for i, s in enumerate(slots) if s is None] if all(s is None for s in slots) else []
            joining = []
            while free and pending and requests[pending[0]].arrival_s <= now:
                i = pending.popleft()
                joining.append((free.pop(0), i))
            if joining:
                self._admit(joining, requests, slots, now)
                for si, _ in joining:
                    self._finish_if_done(slots[si], results, requests, clock() - t0)
            live = [i for i, s in enumerate(slots) if s is not None and not s.done]
            if not live:
                if pending and not joining and all(s is None or s.done for s in slots):
                    sleep(max(0.0, requests[pending[0]].arrival_s - (clock() - t0)))
                continue
            before = sum(len(slots[i].tokens) for i in live)
            t_step = clock()
            self._step(slots, live)
            t_end = clock()  # the step's one device-to-host copy has synchronised
            steps += 1
            live_steps += len(live)
            at = by_live.setdefault(len(live), LiveSteps())
            at.steps += 1
            at.tokens += sum(len(slots[i].tokens) for i in live) - before  # committed, cut at EOS / max_new_tokens
            at.seconds += t_end - t_step
            now = t_end - t0
            for i in live:
                self._finish_if_done(slots[i], results, requests, now)
        wall = clock() - t0
        self.timer.mark("other")
        for r in results:
            self.run_stats.merge(r.stats)
        self.run_stats.wall_s = wall
        return BatchRun(results, wall, steps, self.run_stats, live_steps, dict(sorted(by_live.items())))

    def _finish_if_done(self, s: _Slot, results: list, requests: list[Request], now: float) -> None:
        if not s.done or results[s.req] is not None:
            return
        new = s.tokens[s.prompt_len:]
        s.stats.new_tokens = len(new)
        results[s.req] = RequestResult(new, s.stats, requests[s.req].arrival_s, s.start_s, now)

    def _check_done(self, s: _Slot) -> None:
        """Cut at max_new_tokens and after the first EOS, as the single-request loops do."""
        new = s.tokens[s.prompt_len:]
        if self.eos is not None and self.eos in new:
            del s.tokens[s.prompt_len + new.index(self.eos) + 1 :]
            s.done = True
        if len(s.tokens) - s.prompt_len >= self.cfg.max_new_tokens:
            del s.tokens[s.prompt_len + self.cfg.max_new_tokens :]
            s.done = True

    def _admit(self, joining: list[tuple[int, int]], requests: list[Request], slots: list, now: float) -> None:
        """Prefill the joining requests in one target forward (and one drafter forward)."""
        cfg = self.cfg
        ids_list = [requests[i].prompt for _, i in joining]
        slot_ids = [si for si, _ in joining]
        qlens = [len(p) for p in ids_list]
        for si in slot_ids:
            self.cache.lengths[si] = 0
            if self.dcache is not None:
                self.dcache.lengths[si] = 0
        ids, qpad, last = self._pack(ids_list, qlens)
        out = self.target.forward(ids, slot_ids, qpad, self.cache, advance=qlens, last_rows=last,
                                  capture=self.capture)  # [R, V]
        logits, feats = out if self.capture else (out, None)
        first = self._select(logits).tolist()  # one host copy for the joining group
        # Under a load schedule whose length at this load is 0 (AR steps), the drafter's prefill waits: its first
        # draft round feeds whatever its cache has not seen (ragged packing: real rows only), so a request that
        # never drafts never pays it.
        live = sum(s is not None and not s.done for s in slots) + len(joining)
        defer = cfg.ragged_verify and scheduled_draft_len(cfg, live) == 0
        if self.use_draft_model and not defer:
            self.drafter.forward(ids, slot_ids, qpad, self.dcache, advance=qlens, last_rows=last)
        row0 = 0
        for (si, i), tok, q, w in zip(joining, first, qlens, qpad, strict=True):
            stats = DecodeStats(target_forwards=1)
            s = _Slot(i, list(requests[i].prompt) + [tok], len(requests[i].prompt), stats, now)
            if cfg.method == "sd" and cfg.drafter in LOOKUP_DRAFTERS and not self.per_request:
                s.ngram = make_proposer(cfg, None, self.device, heads=self.heads)  # the loop's lookup drafter
                s.ngram.reset(requests[i].prompt)
            if self.per_request:
                s.proposer = self._proposer(requests[i].prompt, stats)
                s.proposer.reset(requests[i].prompt, feats[row0 : row0 + q] if feats is not None else None)
            row0 += w
            self._check_done(s)
            slots[si] = s
        self.timer.mark("prefill")

    def _proposer(self, prompt: list[int], stats: DecodeStats) -> Proposer:
        """A request's own proposer, as the single-request loop builds it (the router picks per request)."""
        cfg = self.cfg
        if cfg.drafter == "routed":
            domain = self.heads.router().route(prompt)
            chosen = cfg.route_code if domain == "code" else cfg.route_prose
            stats.routes[f"{domain}:{chosen}"] += 1
            cfg = dataclasses.replace(cfg, drafter=chosen)
        if cfg.drafter in FEATURE_DRAFTERS:  # its own state: a shared one would mix requests' contexts
            mtp = cfg.drafter == "mtp"
            return self.heads.new_state(cfg.drafter, self.target.lean, cfg.draft_vocab if mtp else 0,
                                        cfg.mtp_tree_alts if mtp else 0)
        return make_proposer(cfg, self.drafter.lean if self.drafter else None, self.device, self.gen, heads=self.heads)

    def _pack(self, rows: list[list[int]], qlens: list[int]) -> tuple[torch.Tensor, list[int], list[int]]:
        """Host token rows -> (ids [T], per-request widths, last real row of each request). Ragged packing
        concatenates real rows; the padded rectangle pads every request to the widest with token 0."""
        if self.cfg.ragged_verify:
            return (torch.tensor([t for r in rows for t in r], device=self.device), qlens,
                    [q - 1 for q in qlens])
        w = max(qlens)
        return (torch.tensor([r + [0] * (w - len(r)) for r in rows], device=self.device).view(-1),
                [w] * len(rows), [q - 1 for q in qlens])

    def _select(self, logits: torch.Tensor) -> torch.Tensor:
        if self.cfg.temperature > 0:
            probs = torch.softmax(logits.float() / self.cfg.temperature, dim=-1)
            return torch.multinomial(probs, 1, generator=self.gen).squeeze(-1)
        return argmax_tokens(logits)

    # -- one step ---------------------------------------------------------------------------------

    def _draft_lens(self, slots: list, live: list[int], proposals: dict[int, int], k_load: int) -> list[int]:
        cfg = self.cfg
        caps = []
        for i in live:
            s = slots[i]
            remaining = cfg.max_new_tokens - (len(s.tokens) - s.prompt_len)
            depth = (s.proposer.depth if s.proposer is not None else None) or k_load
            if cfg.load_schedule:  # the schedule's length for this load caps a proposer's own depth too
                depth = min(depth, k_load)
            cap = min(depth, remaining - 1) if cfg.method == "sd" else 0
            caps.append(min(cap, proposals[i]) if i in proposals else max(cap, 0))
        if not cfg.load_aware_draft:
            return caps
        prior = (self.acc_total + 2.0) / (self.drafted_total + 4.0)  # batch-wide acceptance, prior 0.5
        alphas = [min(0.99, (slots[i].accepted + 4 * prior) / (slots[i].drafted + 4)) for i in live]
        return choose_draft_lens(caps, alphas, cfg.load_aware_fixed_rows, self.draft_cost)

    def _step(self, slots: list, live: list[int]) -> None:
        cfg = self.cfg
        dev = self.device
        sampled = cfg.temperature > 0
        # The forward's rows: live requests, plus (padded rectangle, static batch) finished ones.
        rect = live if cfg.ragged_verify else [i for i, s in enumerate(slots) if s is not None]
        R = len(rect)
        pos_of = {si: r for r, si in enumerate(rect)}
        # The load schedule's draft length for this many live requests (0: an AR step), else draft_len.
        k_load = scheduled_draft_len(cfg, len(live))
        k_load = cfg.draft_len if k_load is None else k_load
        proposals: dict[int, list[int]] = {}
        if cfg.method == "sd" and cfg.drafter in LOOKUP_DRAFTERS and k_load > 0 and not self.per_request:
            for i in live:  # asked for what the step can take, as the single-request loop asks
                s = slots[i]
                remaining = cfg.max_new_tokens - (len(s.tokens) - s.prompt_len)
                proposals[i] = s.ngram.lookup(s.tokens, max(1, min(k_load, remaining - 1)))
        lens = self._draft_lens(slots, live, {i: len(p) for i, p in proposals.items()}, k_load)
        k_of = dict.fromkeys(rect, 0)
        k_of.update(zip(live, lens, strict=True))
        drafts: dict[int, Draft] = {}
        if self.per_request:  # each request's own proposer, batched per class; a tree's size is its node count
            by_class: dict[type, list[int]] = {}
            trees_on = not cfg.tree_max_live or len(live) <= cfg.tree_max_live  # mechanism load-tree
            for i in live:
                slots[i].proposer.trees(trees_on)
                if k_of[i] > 0:
                    by_class.setdefault(type(slots[i].proposer), []).append(i)
            for cls, idx in by_class.items():
                f0 = [slots[i].proposer.forwards for i in idx]
                got = cls.propose_many([slots[i].proposer for i in idx], [slots[i].tokens for i in idx],
                                       [k_of[i] for i in idx])
                for i, d, f in zip(idx, got, f0, strict=True):
                    drafts[i] = d
                    slots[i].stats.drafter_forwards += slots[i].proposer.forwards - f
                    k_of[i] = d.size
        kmax = max(k_of.values())
        ks = [k_of[i] for i in rect]
        draft = torch.full((R, kmax), -2, dtype=torch.long, device=dev)  # [R, kmax]; -2 never matches
        qprobs = torch.zeros(R, kmax, self.vocab, device=dev) if sampled and kmax else None  # [R, kmax, V]
        if kmax and self.use_draft_model:
            self._draft_model(slots, rect, ks, draft, qprobs)
        elif kmax:
            for r, i in enumerate(rect):
                if i in drafts:
                    draft[r, : k_of[i]] = drafts[i].tokens
                elif i in proposals:
                    draft[r, : k_of[i]] = torch.tensor(proposals[i][: k_of[i]], dtype=torch.long, device=dev)
            if qprobs is not None:  # a deterministic drafter's q is one-hot
                qprobs = F.one_hot(draft.clamp_min(0), self.vocab).float() * (draft >= 0)[..., None]
                for r, i in enumerate(rect):
                    if i in drafts and drafts[i].probs is not None:
                        qprobs[r, : k_of[i]] = drafts[i].probs
        trees = [drafts[i].tree if i in drafts else None for i in rect]
        self.timer.mark("draft")

        # Verify: each request feeds its last committed token and its draft.
        W = kmax + 1
        last = torch.tensor([slots[i].tokens[-1] for i in rect], device=dev)
        full = torch.cat([last[:, None], draft.clamp_min(0)], 1)  # [R, W]
        real = [k + 1 if slots[i] is not None and not slots[i].done else 0 for i, k in zip(rect, ks, strict=True)]
        if cfg.ragged_verify:
            flat_idx = ragged_index(real, W, dev)  # [T]
            ids, qlens = full.view(-1)[flat_idx], real
        else:
            flat_idx = None
            ids, qlens = full.view(-1), [W] * R
        out = self.target.forward(ids, rect, qlens, self.cache, advance=real, capture=self.capture,
                                  trees=[(t.depth, t.anc) if t is not None else None for t in trees])  # [T, V]
        logits, feats = out if self.capture else (out, None)
        self.timer.mark("verify")

        if sampled:
            n, toks = self._rejection_accept(logits, flat_idx, draft, qprobs, R, W, ks)
        else:
            pred = argmax_tokens(logits)  # [T]
            if flat_idx is not None:
                toks = torch.full((R * W,), -1, dtype=torch.long, device=dev)
                toks[flat_idx] = pred
                toks = toks.view(R, W)
            else:
                toks = pred.view(R, W)
            n = (draft == toks[:, :kmax]).to(torch.int64).cumprod(1).sum(1)  # [R]
        # Tree drafts (greedy): each tree's accepted path on the device, read in the same host copy.
        tree_out = [tree_result(toks[r, : 1 + t.size], t) for r, t in enumerate(trees) if t is not None]
        host = torch.cat([n, toks.reshape(-1), *tree_out]).tolist()  # the step's one device-to-host copy
        at = R + R * W  # where the next tree's result starts in `host`
        first_row = (torch.cumsum(torch.tensor([0, *real[:-1]]), 0).tolist() if flat_idx is not None
                     else [r * W for r in range(R)])  # each request's first row in the forward
        for i in live:
            r = pos_of[i]
            s, k, na = slots[i], ks[r], host[r]
            before = len(s.tokens)
            tree = trees[r]
            if tree is not None:
                na, committed, path, fed = read_tree_result(host[at : at + 2 + 3 * tree.size], tree.size)
                at += 2 + 3 * tree.size
                rows = [0] + [j + 1 for j in path]
                self.cache.compact(i, before - 1, torch.tensor(rows, device=dev))  # the accepted path only
            else:
                committed = host[R + r * W : R + r * W + na + 1]
                path, fed, rows = list(range(na)), [], list(range(na + 1))
                self.cache.lengths[i] = before + na  # keep the last committed token and the n accepted drafts
            s.tokens.extend(committed)
            if self.dcache is not None and k > 0:  # the drafter saw tokens[:before] and k-1 drafts
                self.dcache.lengths[i] = min(self.dcache.lengths[i], before + min(na, k - 1))
            if s.proposer is not None:
                hid = feats[first_row[r] + torch.tensor(rows, device=dev)] if feats is not None else None
                alts0 = s.proposer.alternatives_accepted
                s.proposer.accepted(s.tokens, Verdict(na, path, fed, hid))
                s.stats.alternatives_accepted += s.proposer.alternatives_accepted - alts0
            s.stats.target_forwards += 1
            if k > 0:
                s.stats.draft_steps += 1
                s.stats.drafted += k
                s.stats.accepted += na
                s.stats.accept_hist[na] += 1
                s.drafted += k
                s.accepted += na
                self.drafted_total += k
                self.acc_total += na
            self._check_done(s)
        self.timer.mark("accept")

    def _draft_model(self, slots: list, rect: list[int], ks: list[int], draft: torch.Tensor,
                     qprobs: torch.Tensor | None) -> None:
        """Draft ks[r] tokens per request with batched draft-model forwards, one round per position.
        Round 0 feeds what each drafter cache has not seen (1-2 tokens); round j feeds draft j-1."""
        dev = self.device
        kmax = max(ks)
        ragged = self.cfg.ragged_verify
        members = [r for r, k in enumerate(ks) if k > 0]
        rows = [slots[rect[r]].tokens[self.dcache.lengths[rect[r]]:] for r in members]
        if ragged:
            idx, sl = members, [rect[r] for r in members]
            ids, qlens, lastr = self._pack(rows, [len(x) for x in rows])
            adv = [len(x) for x in rows]
        else:  # padded rectangle: every slot of the batch, non-drafting ones as padding
            idx, sl = list(range(len(rect))), rect
            feed = {r: x for r, x in zip(members, rows, strict=True)}
            allrows = [feed.get(r, [0]) for r in idx]
            ids, qlens, lastr = self._pack(allrows, [len(x) for x in allrows])
            adv = [len(feed[r]) if r in feed else 0 for r in idx]
        idx_t = torch.tensor(idx, device=dev)
        for j in range(kmax):
            logits = self.drafter.forward(ids, sl, qlens, self.dcache, advance=adv, last_rows=lastr)  # [R_j, V]
            if self.cfg.temperature > 0:
                p = torch.softmax(logits.float() / self.cfg.temperature, dim=-1)
                nxt = torch.multinomial(p, 1, generator=self.gen).squeeze(-1)
            else:
                p, nxt = None, argmax_tokens(logits)
            keep = [m for m, r in enumerate(idx) if ks[r] > j]
            if len(keep) != len(idx):
                kt = torch.tensor(keep, device=dev)
                draft[idx_t[kt], j] = nxt[kt]
                if p is not None:
                    qprobs[idx_t[kt], j] = p[kt]
            else:
                draft[idx_t, j] = nxt
                if p is not None:
                    qprobs[idx_t, j] = p
            if j + 1 == kmax:
                break
            # Next round: requests still drafting feed the token just drafted (it stays on the device).
            if ragged:
                nxt_keep = [m for m, r in enumerate(idx) if ks[r] > j + 1]
                kt = torch.tensor(nxt_keep, device=dev)
                ids = nxt[kt]
                idx = [idx[m] for m in nxt_keep]
                idx_t = torch.tensor(idx, device=dev)
                sl = [rect[r] for r in idx]
                qlens, lastr, adv = [1] * len(idx), [0] * len(idx), [1] * len(idx)
            else:
                ids = nxt
                qlens, lastr = [1] * len(idx), [0] * len(idx)
                adv = [1 if ks[r] > j + 1 else 0 for r in idx]

    def _rejection_accept(self, logits: torch.Tensor, flat_idx: torch.Tensor | None, draft: torch.Tensor,
                          qprobs: torch.Tensor | None, R: int, W: int, ks: list[int]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Batched lossless speculative sampling (decoder/verify.py's rule, one row per request)."""
        V, dev, kmax = self.vocab, self.device, W - 1
        p = torch.softmax(logits.float() / self.cfg.temperature, dim=-1)  # [T, V]
        if flat_idx is not None:
            pp = torch.full((R * W, V), 1.0 / V, device=dev)  # padded rows: any valid distribution
            pp[flat_idx] = p
            p = pp
        p = p.view(R, W, V)
        if kmax == 0:
            return torch.zeros(R, dtype=torch.long, device=dev), torch.multinomial(
                p.view(-1, V), 1, generator=self.gen).view(R, W)
        valid = torch.arange(kmax, device=dev)[None, :] < torch.tensor(ks, device=dev)[:, None]  # [R, kmax]
        d = draft.clamp_min(0)[..., None]
        px, qx = p[:, :kmax].gather(2, d).squeeze(-1), qprobs.gather(2, d).squeeze(-1)  # [R, kmax]
        u = torch.rand(R, kmax, generator=self.gen, device=dev)
        n = ((u * qx < px) & valid).to(torch.int64).cumprod(1).sum(1)  # [R]
        # Residual rows; where q is zero (past a request's draft) the residual is p itself: the bonus row.
        resid = (p[:, :kmax] - qprobs).clamp_min(0)
        mass = resid.sum(-1, keepdim=True)
        resid = torch.where(mass > 0, resid / mass.clamp_min(1e-30), p[:, :kmax])
        cand = torch.cat([resid, p[:, kmax:]], 1)  # [R, W, V]
        fallback = torch.multinomial(cand.view(-1, V), 1, generator=self.gen).view(R, W)
        col = torch.arange(W, device=dev)[None, :]
        ext = torch.cat([draft.clamp_min(0), fallback[:, -1:]], 1)  # [R, W]
        return n, torch.where(col < n[:, None], ext, fallback)


def _n_params(lean: LeanLM) -> int:
    return sum(w.numel() for layer in lean.layers for w in layer.tensors()) + lean.embed.numel()


def batch_generate(cfg: DecodeConfig, target, prompts: list[list[int]], max_batch: int, drafter_model=None,
                   eos_id: int | None = None, heads=None) -> BatchRun:
    """Decode `prompts` (all arrived at once) in batches of up to `max_batch` with cfg's mechanisms (`heads`:
    the target's feature drafters and corpus datastore, decoder.featdraft.FeatureHeads)."""
    engine = BatchEngine(target, cfg, max_batch, drafter_model, eos_id, heads=heads)
    return engine.run([Request(p, 0.0, i) for i, p in enumerate(prompts)])


def poisson_arrivals(n: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds) of n requests in a Poisson stream of `rate_per_s` requests per second."""
    if rate_per_s <= 0:
        raise ValueError(f"poisson arrivals: rate {rate_per_s} must be positive (requests per second)")
    g = torch.Generator().manual_seed(seed)
    gaps = -torch.log1p(-torch.rand(n, generator=g, dtype=torch.float64)) / rate_per_s
    return [0.0] + torch.cumsum(gaps, 0)[:-1].tolist() if n else []

