"""Chain drafters: a small draft model with its own KV cache, and n-gram prompt lookup.

Both are proposers of the one loop (decoder/proposer.py): they see the committed token sequence,
propose up to k tokens as a chain, and are told after verification how many the target accepted so
they can roll their state back.
"""

from __future__ import annotations

import torch

from decoder.config import CORPUS_BRANCH_LEN
from decoder.datastore import CorpusIndex
from decoder.proposer import Draft, Proposer, Verdict
from decoder.runners import LAZY_REFEED, as_runner, rollback
from decoder.tree import parents_tree
from decoder.verify import argmax_tokens


class Drafter(Proposer):
    """A chain proposer: `draft(tokens, k)` -> (tokens [<=k] on the device, probs [<=k, V] or None when
    greedy), `commit(tokens, n_accepted)` after the step."""

    name = "drafter"

    def reset(self, prompt: list[int], hidden: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    def draft(self, tokens: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def commit(self, tokens: list[int], n_accepted: int) -> None:
        """`tokens` is the committed sequence after the step; n_accepted drafts of the last draft survived."""

    def propose(self, tokens: list[int], k: int) -> Draft:
        draft, probs = self.draft(tokens, k)
        return Draft(draft, probs)

    def accepted(self, tokens: list[int], verdict: Verdict) -> None:
        self.commit(tokens, verdict.n)


class DraftModelDrafter(Drafter):
    """A smaller causal LM sharing the target's tokenizer, drafting k tokens autoregressively."""

    name = "draft-model"

    def __init__(self, model, temperature: float = 0.0, generator: torch.Generator | None = None) -> None:
        self.model = as_runner(model)  # a Hugging Face model (stock) or a LeanLM
        self.device = self.model.device
        self.temperature = temperature
        self.generator = generator
        self.cache = None
        self.cache_len = 0  # tokens of the committed sequence whose KV the cache holds
        self._last_k = 0
        self._fed = 0  # drafts of the last draft the cache saw (k - 1: the last one is never fed)
        self.forwards = 0

    def reset(self, prompt: list[int], hidden: torch.Tensor | None = None) -> None:
        self.cache = self.model.new_cache()
        self.cache_len = 0

    @torch.inference_mode()
    def draft(self, tokens: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Feed what the cache has not seen (the prompt on the first step, then 1-2 tokens), then
        # one token per forward. Drafted tokens stay on the device: no host sync inside the loop.
        inp = torch.tensor(tokens[self.cache_len:], device=self.device)
        drafted, probs = [], []
        for _ in range(k):
            logits = self.model.forward(inp, self.cache, last_only=True)  # [1, V]
            if self.temperature > 0:
                p = torch.softmax(logits.float() / self.temperature, dim=-1)
                nxt = torch.multinomial(p, 1, generator=self.generator).view(1)  # [1]
                probs.append(p)
            else:
                nxt = argmax_tokens(logits)  # [1]
            drafted.append(nxt)
            inp = nxt
        # The cache now holds tokens + drafted[:-1]; the last draft was never fed.
        self.cache_len = len(tokens) + k - 1
        self._last_k = k
        self._fed = k - 1
        self.forwards += k
        draft = torch.cat(drafted)  # [k]
        return draft, (torch.cat(probs, dim=0) if probs else None)

    def commit(self, tokens: list[int], n_accepted: int) -> None:
        # Valid prefix: the committed sequence before the step plus the accepted drafts the cache saw.
        before = len(tokens) - n_accepted - 1
        keep = before + min(n_accepted, self._fed)
        if keep <= self.cache_len:  # == : every fed draft survived, a commit point for a recurrent cache
            self.forwards += rollback(self.model, self.cache, keep, tokens, lazy=LAZY_REFEED) > 0
            self.cache_len = self.cache.get_seq_length()  # keep, or less: the next draft feeds the rest


class NgramDrafter(Drafter):
    """Prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens
    (n from ngram_max down to ngram_min) and propose the tokens that followed it.

    The index maps each n-gram to its latest end position and is updated incrementally with the
    tokens committed each step, so a lookup costs a few dict probes, not a scan of the history.
    """

    name = "ngram"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1, device: torch.device | str = "cpu",
                 vocab_size: int | None = None) -> None:
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> latest end position
        self.first: dict[tuple[int, ...], int] = {}  # n-gram -> earliest end position
        self.indexed = 0  # n-grams ending before this position are indexed

    def reset(self, prompt: list[int], hidden: torch.Tensor | None = None) -> None:
        self.index = {}
        self.first = {}
        self.indexed = 0

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        L = len(tokens)
        # Index n-grams ending at each new position `end` < L (their continuation starts at `end`).
        # The n-gram ending at L is the query itself, so it joins the index on the next call.
        for end in range(max(self.indexed, 1), L):
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                gram = tuple(tokens[end - n : end])
                self.index[gram] = end
                self.first.setdefault(gram, end)
        self.indexed = max(self.indexed, L)
        for n in range(min(self.ngram_max, L), self.ngram_min - 1, -1):
            gram = tuple(tokens[L - n :])
            end = self.index.get(gram)
            if end is not None:
                # The latest occurrence predicts best, but in a repeating span it sits inside the last
                # period and has fewer than k tokens after it; then the earliest one gives a full draft.
                if L - end < k:
                    end = self.first[gram]
                return tokens[end : end + k]
        return []

    def draft(self, tokens: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        proposal = self.lookup(tokens, k)
        draft = torch.tensor(proposal, dtype=torch.long, device=self.device)
        return draft, None

    def one_hot_probs(self, draft: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """A deterministic drafter's q: one-hot rows, which makes rejection sampling exact for it."""
        return torch.nn.functional.one_hot(draft, vocab_size).float()


class CorpusDrafter(NgramDrafter):
    """Prompt lookup first, then a corpus datastore (mechanism `corpus-drafter`): the sequence's own
    earlier text when its last `ngram_min`.. tokens recur there, else (and to fill the draft to k) the
    corpus index's most frequent continuation. Both are lookups, so a draft costs no forward."""

    name = "corpus"

    def __init__(self, index: CorpusIndex, ngram_max: int = 4, ngram_min: int = 2,
                 device: torch.device | str = "cpu", tree_alts: int = 0) -> None:
        super().__init__(ngram_max, max(ngram_min, 2), device)  # a one-token prompt match loses to the corpus
        self.corpus = index
        self.tree_alts = self._tree_alts = tree_alts
        self._chain = 0  # the last tree draft's chain length: nodes from here on are branch nodes

    def trees(self, on: bool) -> None:
        self.tree_alts = self._tree_alts if on else 0

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        proposal = super().lookup(tokens, k)
        if len(proposal) < k:  # the datastore reads the last nmax tokens only: no copy of the whole sequence
            proposal = proposal + self.corpus.draft(tokens[-self.corpus.nmax :] + proposal, k - len(proposal))
        return proposal

    def propose(self, tokens: list[int], k: int) -> Draft:
        """The chain, and with `tree_alts` (mechanism corpus-tree) a tree: beside chain node j < tree_alts, a branch
        of the datastore's continuation of the same context under a shorter suffix where it differs from the
        chain's token (prompt lookup's token, or the corpus's at the longest context), then the corpus's next
        token after it. A branch never reaches deeper than k, so a step commits at most k + 1 tokens."""
        main = self.lookup(tokens, k)
        if not self.tree_alts or not main:
            return Draft(torch.tensor(main, dtype=torch.long, device=self.device))
        nodes, parents = list(main), list(range(-1, len(main) - 1))
        nmax = self.corpus.nmax
        ctx = tokens[-nmax:]
        for j in range(min(self.tree_alts, len(main))):
            at = (ctx + main[:j])[-nmax:]
            alt = self.corpus.alternative(at, exclude=main[j])
            if alt < 0:
                continue
            parent = j - 1
            for t in [alt] + self.corpus.draft(at + [alt], min(CORPUS_BRANCH_LEN, k - j) - 1):
                nodes.append(t)
                parents.append(parent)
                parent = len(nodes) - 1
        if len(nodes) == len(main):
            return Draft(torch.tensor(main, dtype=torch.long, device=self.device))
        tree = parents_tree(nodes, parents, self.device)
        self._chain = len(main)
        return Draft(tree.tokens, tree=tree)

    def accepted(self, tokens: list[int], verdict: Verdict) -> None:
        if self._chain and verdict.path and verdict.path[-1] >= self._chain:
            self.alternatives_accepted += 1  # the step's accepted path ended in a branch
        self._chain = 0
        super().accepted(tokens, verdict)
