"""The proposer contract of the one speculative-decoding loop (`decoder.generate.speculative_generate`).

A proposer drafts; the loop verifies, accepts and rolls back. Every drafter — draft model, n-gram
lookup, D-cut, tree and two-level, block and MTP feature drafters — is a proposer:

- `reset(prompt, hidden)` before the first step; `hidden` holds the target's captured features of the
  prompt (only for a proposer with `capture`, else None);
- `propose(tokens, k) -> Draft`: up to k tokens after the committed sequence `tokens` (as a chain,
  or as a tree of nodes whose parents precede them; a chain is a tree of width one);
- `propose_many(proposers, tokens, ks)` (a classmethod): the batched engine's drafting for many requests at
  once, each draft as `propose` gives it; a class that can batch its forward overrides it;
- `accepted(tokens, verdict)` after verification: `tokens` is the committed sequence after the step,
  `verdict` says which draft nodes the target accepted, so the proposer can roll its state back.

A proposer that reads the target's hidden states sets `capture` to the target layers it needs: the
verify forward returns them (one hook, no second forward) and `verdict.hidden` holds the rows of the
last committed token and the accepted nodes. `depth` caps the draft length per step (None: cfg.draft_len).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Draft:
    """What a proposer hands the loop for one verify step."""

    tokens: torch.Tensor  # [N] draft tokens on the device (chain order, or tree nodes parents-first)
    probs: torch.Tensor | None = None  # [N, V] the drafter's distributions (chain, sampled); None = deterministic
    tree: object | None = None  # decoder.tree.DraftTree when the draft is a tree; None = a chain

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


@dataclass
class Verdict:
    """What verification accepted: n draft nodes, in depth order."""

    n: int
    path: list[int]  # accepted node indices (a chain: 0..n-1)
    fed: list[int]  # tree drafts: drafter cache slots of the accepted nodes the drafter fed
    hidden: torch.Tensor | None = None  # [n + 1, F] captured target features (last committed token, then path)


class Proposer:
    """Interface of a drafter in the one loop (see the module docstring)."""

    name = "proposer"
    capture: tuple[int, ...] | None = None  # target layers whose hidden states the proposer reads
    depth: int | None = None  # most draft tokens per step (None: cfg.draft_len)
    forwards: int = 0  # drafter forwards so far (the loop reports the difference)
    alternatives_accepted: int = 0  # two-level: steps whose accepted path ended in an alternative

    def reset(self, prompt: list[int], hidden: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    def propose(self, tokens: list[int], k: int) -> Draft:
        raise NotImplementedError

    @classmethod
    def propose_many(cls, proposers: list[Proposer], tokens: list[list[int]], ks: list[int]) -> list[Draft]:
        """`propose` for several requests of the batched engine, all proposers of this class: one draft
        each, as `propose` would give it. A class that can draft for many requests in one batched forward
        overrides this (MTP heads); the default asks each in turn."""
        return [pr.propose(t, k) for pr, t, k in zip(proposers, tokens, ks, strict=True)]

    def trees(self, on: bool) -> None:
        """Mechanism load-tree: chains from now on (`on` = False), or the configured trees again. A proposer
        whose drafts are never trees, or whose tree cannot fall back to a chain, ignores it."""

    def accepted(self, tokens: list[int], verdict: Verdict) -> None:
        """Roll the proposer's state forward to the committed sequence `tokens`."""
