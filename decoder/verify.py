"""Verification: which drafted tokens the target accepts, and the token it adds.

Both rules work on whole drafts as tensors and hand back one small tensor, so a step costs one
device-to-host copy whatever k is.
"""

from __future__ import annotations

import torch

# PyTorch's CPU argmax is a slow reduction: on bf16 logits [9, 6144] it costs ~207 us, on their float32 copy ~110 us,
# while max(dim).indices on that copy costs ~31 us ([40, 6144]: 829 / 348 / 151 us; measured here, one thread, #21).
# max(dim) returns the first index among equal maxima like argmax (its documented tie rule, and tests/test_verify.py
# checks it on tie-heavy logits against argmax); the float32 cast is exact, so order and ties are unchanged.
_REDUCED = (torch.bfloat16, torch.float16)


def argmax_tokens(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)`, the first index among equal maxima; on the CPU as max(-1).indices over float32."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    if logits.dtype in _REDUCED:
        logits = logits.float()
    return logits.max(dim=-1).indices


def greedy_accept(logits: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """Longest prefix of `draft` equal to the target's argmax, plus the target's next token.

    logits: [k+1, V] target logits at the last committed token and each draft token; draft: [k].
    Returns [1 + k + 1] = (n_accepted, target argmax at each of the k+1 positions); the committed
    tokens are argmax[: n + 1] (draft[:n] equals argmax[:n] by construction).
    """
    pred = argmax_tokens(logits)  # [k+1]
    k = draft.shape[0]
    n = (draft == pred[:k]).to(torch.int64).cumprod(0).sum().view(1)
    return torch.cat([n, pred])


def sample_from_logits(logits: torch.Tensor, temperature: float, generator: torch.Generator | None
                       ) -> torch.Tensor:
    """One token per row of logits [R, V] at `temperature` (> 0)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def rejection_accept(logits: torch.Tensor, draft: torch.Tensor, draft_probs: torch.Tensor,
                     temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Draft token i is kept with probability min(1, p_i(x) / q_i(x)); at the first rejection a token
    is drawn from norm(max(0, p_i - q_i)); if all k are kept, the bonus token is drawn from p_k.
    The output is distributed exactly as sampling from the target at `temperature`.

    logits: [k+1, V]; draft: [k]; draft_probs: [k, V] the drafter's distributions (one-hot for a
    deterministic drafter such as n-gram lookup). Returns [1 + k + 1] = (n, tokens) where the
    committed tokens are tokens[: n + 1].
    """
    k = draft.shape[0]
    p = torch.softmax(logits.float() / temperature, dim=-1)  # [k+1, V]
    q = draft_probs.float()  # [k, V]
    idx = torch.arange(k, device=draft.device)
    px, qx = p[idx, draft], q[idx, draft]  # [k]
    u = torch.rand(k, generator=generator, device=draft.device)
    keep = (u * qx < px).to(torch.int64)  # u < p/q without dividing by q = 0
    n = keep.cumprod(0).sum().view(1)
    # Every row's replacement is sampled up front (k+1 small multinomials) so the choice of row n
    # needs no host sync: rows 0..k-1 are residuals, row k is the target itself (the bonus token).
    resid = (p[:k] - q).clamp_min(0)
    mass = resid.sum(-1, keepdim=True)
    resid = torch.where(mass > 0, resid / mass.clamp_min(1e-30), p[:k])  # p == q: rejection impossible
    fallback = torch.multinomial(torch.cat([resid, p[k:]]), 1, generator=generator).squeeze(-1)  # [k+1]
    # Token at position i: the draft where kept, the replacement at the first rejection (or the bonus).
    tokens = torch.where(idx < n, draft, fallback[:k])
    tokens = torch.cat([tokens, fallback[k:]])
    tokens[n] = fallback[n]  # n == k selects the bonus row
    return torch.cat([n, tokens])
