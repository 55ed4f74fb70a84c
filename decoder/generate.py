"""AR decoding and chain speculative decoding over Hugging Face causal LMs with a KV cache.

The target's cache always holds every committed token but the last; a step feeds that last token
plus the draft, so one forward scores k+1 positions. Rollback is `cache.crop(n)`: exact, because a
causal cache entry depends only on the tokens before it.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from dataclasses import dataclass, field

import torch

from decoder.capabilities import Unsupported, check  # noqa: F401 (Unsupported re-exported)
from decoder.config import FEATURE_DRAFTERS, DecodeConfig, scheduled_draft_len
from decoder.dcut import DCutDrafter
from decoder.drafters import CorpusDrafter, DraftModelDrafter, NgramDrafter
from decoder.lean import LeanLM, StaticLeanLM
from decoder.profiler import DecodeStats, PhaseTimer
from decoder.proposer import Draft, Proposer, Verdict
from decoder.runners import LAZY_REFEED, HFRunner, as_runner, crop_cache, rollback  # noqa: F401 (re-exported)
from decoder.tree import TreeDrafter, TwoLevelDrafter, tree_accept, tree_attention_mask, tree_positions
from decoder.verify import argmax_tokens, greedy_accept, rejection_accept, sample_from_logits


@dataclass
class Generation:
    tokens: list[int]  # new tokens only
    stats: DecodeStats = field(default_factory=DecodeStats)


def _finish(new: list[int], cfg: DecodeConfig, eos_id: int | None) -> tuple[list[int], bool]:
    """Cut at max_new_tokens and after the first EOS; report whether generation is over."""
    done = len(new) >= cfg.max_new_tokens
    if cfg.stop_at_eos and eos_id is not None and eos_id in new:
        new = new[: new.index(eos_id) + 1]
        done = True
    return new[: cfg.max_new_tokens], done


def _select(logits: torch.Tensor, cfg: DecodeConfig, generator: torch.Generator | None) -> torch.Tensor:
    if cfg.temperature > 0:
        return sample_from_logits(logits, cfg.temperature, generator)
    return argmax_tokens(logits)


def _eos_id(model) -> int | None:
    eos = model.config.eos_token_id
    return eos[0] if isinstance(eos, list) else eos


@torch.inference_mode()
def ar_generate(target, prompt: list[int], cfg: DecodeConfig, profile_sync: bool = False) -> Generation:
    """Plain autoregressive decoding: one target forward per token (the stock baseline)."""
    target = as_runner(target)
    device = target.device
    gen = torch.Generator(device=device).manual_seed(cfg.seed) if cfg.temperature > 0 else None
    stats = DecodeStats()
    timer = PhaseTimer(stats, device, profile_sync)
    t0 = time.perf_counter()
    cache = target.new_cache()
    eos = _eos_id(target)
    inp = torch.tensor(prompt, device=device)
    out: list[torch.Tensor] = []
    done_check_every = 8 if (cfg.stop_at_eos and eos is not None) else cfg.max_new_tokens
    for i in range(cfg.max_new_tokens):
        logits = target.forward(inp, cache, last_only=True)  # [1, V]
        nxt = _select(logits, cfg, gen)  # [1]
        out.append(nxt)
        stats.target_forwards += 1
        stats.target_tokens += inp.shape[0]
        inp = nxt
        timer.mark("prefill" if i == 0 else "verify")
        # EOS is checked every few tokens, not every token: one host sync per 8 steps.
        if (i + 1) % done_check_every == 0 and eos in torch.cat(out[-done_check_every:]).tolist():
            break
    new, _ = _finish(torch.cat(out).tolist(), cfg, eos)
    timer.mark("other")
    stats.new_tokens = len(new)
    stats.wall_s = time.perf_counter() - t0
    return Generation(new, stats)


def make_proposer(cfg: DecodeConfig, drafter_model=None, device: torch.device | str = "cpu",
                  generator: torch.Generator | None = None, heads=None, target=None) -> Proposer:
    """The proposer cfg names: draft model (chain, D-cut, tree, two-level), n-gram lookup (alone or backed by
    the corpus datastore of `heads`), or a feature drafter (block, MTP) reading `target`'s hidden states
    through `heads` (decoder.featdraft.FeatureHeads)."""
    if cfg.drafter in FEATURE_DRAFTERS:
        if heads is None:
            raise ValueError(f"drafter = {cfg.drafter!r} needs the target's feature drafters (FeatureHeads); "
                             f"serve loads them from <target>/drafters")
        mtp = cfg.drafter == "mtp"
        return heads.state(cfg.drafter, target, cfg.draft_vocab if mtp else 0, cfg.mtp_tree_alts if mtp else 0)
    if cfg.drafter == "ngram":
        return NgramDrafter(cfg.ngram_max, cfg.ngram_min, device)
    if cfg.drafter == "corpus":
        if heads is None:
            raise ValueError("drafter = 'corpus' needs the target's corpus datastore (FeatureHeads); serve loads it "
                             "from <target>/drafters")
        return CorpusDrafter(heads.corpus(), cfg.ngram_max, cfg.ngram_min, device, cfg.corpus_tree_alts)
    if drafter_model is None:
        raise ValueError("drafter = 'draft-model' needs a draft model; pass --drafter DIR or use drafter = 'ngram'")
    if cfg.verify == "tree":
        return TreeDrafter.from_config(drafter_model, cfg)
    if cfg.verify == "two-level":
        return TwoLevelDrafter(drafter_model, cfg.two_level_alts)
    if cfg.dcut:
        return DCutDrafter(drafter_model, cfg.dcut_threshold, cfg.temperature, generator)
    return DraftModelDrafter(drafter_model, cfg.temperature, generator)


make_drafter = make_proposer  # the name callers used before every drafter became a proposer


@torch.inference_mode()
def speculative_generate(target, proposer: Proposer, prompt: list[int], cfg: DecodeConfig,
                         generator: torch.Generator | None = None, profile_sync: bool = False) -> Generation:
    """Speculative decoding, the one loop: draft, verify every draft node in one target forward, accept,
    roll back.

    The proposer's draft is a chain (verified causally, rolled back by a cache crop) or a tree (verified
    under a tree mask, the accepted path compacted in the cache). Greedy (temperature 0) commits exactly
    the target's argmax sequence; temperature > 0 uses lossless rejection sampling with the proposer's
    probabilities (one-hot for a deterministic proposer), seeded by `generator` (or cfg.seed).
    """
    target = as_runner(target)
    device = target.device
    if cfg.temperature > 0 and generator is None:
        generator = torch.Generator(device=device).manual_seed(cfg.seed)
        if isinstance(proposer, DraftModelDrafter):
            proposer.generator = generator
    vocab = target.config.vocab_size
    stats = DecodeStats()
    timer = PhaseTimer(stats, device, profile_sync)
    t0 = time.perf_counter()
    eos = _eos_id(target)
    cache = target.new_cache()
    capture = proposer.capture
    hook = {"capture": capture} if capture else {}
    forwards0, alts0 = proposer.forwards, proposer.alternatives_accepted
    depth = proposer.depth or cfg.draft_len

    # Prefill: the prompt's KV and the first new token.
    out = target.forward(torch.tensor(prompt, device=device), cache, last_only=True, **hook)  # [1, V]
    logits, hidden = out if capture else (out, None)
    tokens = list(prompt)
    tokens.append(int(_select(logits, cfg, generator).item()))
    stats.target_forwards += 1
    stats.target_tokens += len(prompt)
    proposer.reset(prompt, hidden)
    timer.mark("prefill")

    new, done = _finish(tokens[len(prompt):], cfg, eos)
    while not done:
        remaining = cfg.max_new_tokens - (len(tokens) - len(prompt))
        k = min(depth, remaining - 1) if remaining > 1 else 0
        draft = proposer.propose(tokens, k) if k > 0 else Draft(torch.empty(0, dtype=torch.long, device=device))
        tree = draft.tree
        k = draft.size
        timer.mark("draft")

        # The committed tokens the cache has not seen: the last one, or more after a lazy rollback of a
        # recurrent cache (decoder/runners.py), fed in the same forward as the draft.
        start = cache.get_seq_length()
        pending = len(tokens) - start
        inp = torch.cat([torch.tensor(tokens[start:], device=device), draft.tokens])  # [pending + N]
        if tree is None:
            out = target.forward(inp, cache, **hook)  # [1 + k, V]
        else:
            out = target.forward(inp, cache, positions=tree_positions(tree.depth, start),
                                 attn_mask=tree_attention_mask(tree.anc, start), **hook)
        logits, hidden = out if capture else (out, None)
        if pending > 1:  # rows of the tokens committed earlier: only the last one's prediction is new
            if capture or tree is not None:
                raise ValueError("a lazy rollback leaves several tokens to feed; trees and feature drafters "
                                 "need the cache at the last committed token (lean caches crop exactly)")
            logits = logits[pending - 1 :]
        stats.target_forwards += 1
        branches = getattr(cache, "branches", None)  # a recurrent target's tree: one row per branch
        stats.target_tokens += len(branches) * (cache.get_seq_length() - start) if branches else inp.shape[0]
        timer.mark("verify")

        if tree is not None:
            if cfg.temperature > 0:
                raise ValueError("tree drafts verify greedily only; set temperature = 0 or verify = 'chain'")
            n, committed, path, fed = tree_accept(logits, tree)
            cache.compact(start, torch.tensor([0] + [p + 1 for p in path], device=device))
            rows = hidden[[0] + [p + 1 for p in path]] if capture else None
        else:
            if cfg.temperature > 0:
                probs = draft.probs
                if probs is None:  # deterministic proposer: q is one-hot
                    probs = torch.nn.functional.one_hot(draft.tokens, vocab).float()
                result = rejection_accept(logits, draft.tokens, probs, cfg.temperature, generator)
            else:
                result = greedy_accept(logits, draft.tokens)
            result = result.tolist()  # the step's one device-to-host copy
            n = result[0]
            committed = result[1 : n + 2]
            path, fed = list(range(n)), []
            rows = hidden[: n + 1] if capture else None
        tokens.extend(committed)
        # Keep the step's input token and the n accepted drafts: all committed but the last (a tree's path was
        # compacted into place above; a recurrent cache restores and re-feeds, at once after a tree step so the
        # next tree starts at its root).
        refed = rollback(target, cache, len(tokens) - 1, tokens, lazy=LAZY_REFEED if tree is None else 0)
        if refed:  # a recurrent target fed the accepted tokens again: target work like any forward
            stats.target_forwards += 1
            stats.target_tokens += refed
        proposer.accepted(tokens, Verdict(n, path, fed, rows))
        if k > 0:
            stats.draft_steps += 1
            stats.drafted += k
            stats.accepted += n
            stats.accept_hist[n] += 1
        done = len(tokens) - len(prompt) >= cfg.max_new_tokens or (cfg.stop_at_eos and eos in committed)
        timer.mark("accept")

    new, _ = _finish(tokens[len(prompt):], cfg, eos)
    stats.new_tokens = len(new)
    stats.drafter_forwards = proposer.forwards - forwards0
    stats.alternatives_accepted = proposer.alternatives_accepted - alts0
    stats.wall_s = time.perf_counter() - t0
    return Generation(new, stats)


_LEAN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # HF model -> {(cuda_graphs, t_rows, backend): runner}


def generate(cfg: DecodeConfig, target, prompt: list[int], drafter_model=None, profile_sync: bool = False,
             heads=None) -> Generation:
    """Dispatch on cfg.method: the AR baseline or speculative decoding with cfg.drafter.

    `heads` (decoder.featdraft.FeatureHeads) holds the target's block drafter, MTP heads and router,
    needed for drafter = block, mtp or routed.
    """
    k_load = scheduled_draft_len(cfg, 1) if cfg.method == "sd" else None
    if k_load is not None:  # the load schedule at one request: its draft length, or (0) plain AR
        cfg = dataclasses.replace(cfg, draft_len=k_load) if k_load else dataclasses.replace(
            cfg, method="ar", load_aware_draft=False)
    drafter_cfg = drafter_model.config if drafter_model is not None and cfg.drafter == "draft-model" else None
    check(cfg, target.config, drafter_cfg)  # one line before any work when this model cannot run cfg
    if cfg.method == "sd" and cfg.drafter == "routed":
        if heads is None:
            raise ValueError("drafter = 'routed' needs the target's router (FeatureHeads); serve loads it from "
                             "<target>/drafters")
        t0 = time.perf_counter()
        domain = heads.router().route(prompt)
        chosen = cfg.route_code if domain == "code" else cfg.route_prose
        route_s = time.perf_counter() - t0
        g = generate(dataclasses.replace(cfg, drafter=chosen), target, prompt, drafter_model, profile_sync, heads)
        g.stats.routes[f"{domain}:{chosen}"] += 1
        g.stats.route_s += route_s
        g.stats.wall_s += route_s
        return g
    if cfg.weight_format == "w12" and not getattr(target, "_specpilot_w12", False):
        from decoder.w12 import apply_w12

        apply_w12(target)  # in place: the caller's target now holds 12-bit weights
        target._specpilot_w12 = True
    def lean(m, head_ids: torch.Tensor | None = None):
        # Built once per model and kept: fusing the projections copies every weight.
        per_model = _LEAN.setdefault(m, {})
        key = (cfg.cuda_graphs, cfg.matmul_t_rows, cfg.matmul_backend, cfg.fused_mlp_rows, cfg.fused_layer,
               cfg.bf16w_rows, None if head_ids is None else head_ids.shape[0])
        if key not in per_model:
            runner = LeanLM(m)
            if head_ids is not None:  # first: the matmul mechanisms below then copy the pruned head once
                runner.set_head_vocab(head_ids)
            runner.set_transposed_rows(cfg.matmul_t_rows)
            runner.set_matmul_backend(cfg.matmul_backend)
            runner.set_fused_mlp_rows(cfg.fused_mlp_rows)
            runner.set_bf16w_rows(cfg.bf16w_rows)
            runner.set_fused_layer(cfg.fused_layer)
            per_model[key] = StaticLeanLM(runner) if cfg.cuda_graphs else runner
        return per_model[key]

    head_ids = None  # mechanism draft-vocab on the draft model: its head scores the target's frequent tokens only
    if cfg.method == "sd" and cfg.drafter == "draft-model" and cfg.draft_vocab and drafter_model is not None:
        if heads is None:
            raise ValueError("draft_vocab with the draft model needs the target's token ranking (TARGET/drafters/"
                             "vocab_rank.json from `specpilot train drafter --kind vocab`); set draft_vocab = 0")
        head_ids = heads.vocab_ids(cfg.draft_vocab)
    if cfg.lean_forward:
        target = lean(target)
        drafter_model = lean(drafter_model, head_ids) if drafter_model is not None else None
    elif cfg.method == "sd" and cfg.verify != "chain" and drafter_model is not None:
        drafter_model = lean(drafter_model, head_ids)  # the tree grows on the drafter's lean forward; target HF
    if cfg.method == "ar":
        return ar_generate(target, prompt, cfg, profile_sync)
    device = as_runner(target).device
    proposer = make_proposer(cfg, drafter_model, device, heads=heads, target=target)
    return speculative_generate(target, proposer, prompt, cfg, profile_sync=profile_sync)
