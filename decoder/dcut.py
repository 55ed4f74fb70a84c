"""D-cut (mechanism `d-cut`, gap family drafting): draft while the drafter is confident.

Per request: the draft model drafts up to `draft_len` tokens and stops after the first position i where
the running product of its top-1 probabilities, P_i = p_0 * ... * p_i (an estimate of the chance that
drafts 0..i are all accepted), falls below `dcut_threshold`. Token i itself is kept: its forward is already
paid for, and a drafter forward whose token is thrown away would be pure waste. Confident spans get long
drafts, uncertain ones stop early and save drafter forwards. It changes only how many tokens are drafted,
never which, so verification stays lossless (greedy or sampled).

Under batching, `batch_verify_budget` spends one verify budget (draft tokens across the batch) on the
(request, position) pairs with the highest running products: a pure function the batched loop calls.
"""

from __future__ import annotations

import torch

from decoder.drafters import DraftModelDrafter


class DCutDrafter(DraftModelDrafter):
    """A draft model whose draft stops where the running product of its top-1 probabilities < threshold.

    Deciding to stop needs the product on the host, so this drafter reads one float per drafter forward
    (a drafter forward is its own launch anyway); the target step keeps its one copy.
    """

    name = "draft-model-dcut"

    def __init__(self, model, threshold: float, temperature: float = 0.0,
                 generator: torch.Generator | None = None) -> None:
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"D-cut: threshold {threshold!r} must lie strictly between 0 and 1")
        super().__init__(model, temperature, generator)
        self.threshold = threshold
        self.products: list[float] = []  # running product at each kept draft position, last draft

    @torch.inference_mode()
    def draft(self, tokens: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        inp = torch.tensor(tokens[self.cache_len:], device=self.device)
        drafted, probs, products = [], [], []
        product = 1.0
        for _ in range(k):
            logits = self.model.forward(inp, self.cache, last_only=True)  # [1, V]
            self.forwards += 1
            scaled = logits.float() / self.temperature if self.temperature > 0 else logits.float()
            p = torch.softmax(scaled, dim=-1)  # [1, V]
            top_p, top_i = p.max(dim=-1)
            if self.temperature > 0:
                nxt = torch.multinomial(p, 1, generator=self.generator).view(1)
                probs.append(p)
            else:
                nxt = top_i  # [1]
            drafted.append(nxt)
            product *= float(top_p.item())  # the one host read per drafter forward
            products.append(product)
            if product < self.threshold:
                break  # cut: the product fell below the threshold at this position
            inp = nxt
        # The cache has seen every draft but the last.
        self.cache_len = len(tokens) + len(drafted) - 1
        self._last_k = len(drafted)
        self._fed = len(drafted) - 1
        self.products = products
        return torch.cat(drafted), (torch.cat(probs, dim=0) if probs else None)


def batch_verify_budget(products: torch.Tensor, budget: int, threshold: float = 0.0, min_len: int = 0
                        ) -> torch.Tensor:
    """How many draft tokens of each request to verify when the whole batch may verify `budget` tokens.

    products: [B, k] running products of drafter top-1 probabilities per request and draft position
    (non-increasing along k; pad requests with shorter drafts with 0). Each request first gets
    min(min_len, its draft tokens with product > 0); the rest of the budget goes to the remaining
    (request, position) pairs in order of product, highest first, skipping products below `threshold`.
    Because products only fall along a draft, each request's share is a prefix. Returns lengths [B] (long).
    """
    if products.dim() != 2:
        raise ValueError(f"batch_verify_budget: products must be [B, k], got shape {tuple(products.shape)}")
    if budget < 0 or min_len < 0:
        raise ValueError(f"batch_verify_budget: budget ({budget}) and min_len ({min_len}) must be >= 0")
    b, k = products.shape
    if k == 0 or b == 0:
        return torch.zeros(b, dtype=torch.long, device=products.device)
    if bool((products[:, 1:] > products[:, :-1]).any()):
        raise ValueError("batch_verify_budget: products must be running products (non-increasing along each row)")
    pos = torch.arange(k, device=products.device).expand(b, k)
    available = products > 0
    guaranteed = (pos < min_len) & available  # [B, k]
    rest = max(0, budget - int(guaranteed.sum()))
    eligible = available & ~guaranteed & (products >= threshold)
    score = torch.where(eligible, products, torch.full_like(products, -1.0)).flatten()
    # A stable sort keeps row-major order among ties, so a request's earlier position always wins a tie.
    order = torch.sort(-score, stable=True).indices[:rest]
    take = torch.zeros(b * k, dtype=torch.bool, device=products.device)
    take[order] = True
    take &= score >= 0
    chosen = guaranteed | take.view(b, k)
    return chosen.sum(dim=1)
