"""Acceptance rules on tensors: greedy prefix matching and lossless rejection sampling."""

import torch

from decoder.verify import argmax_tokens, greedy_accept, rejection_accept

# chi-square critical values at p = 0.001 (fixed seeds make the tests deterministic; the bound
# guards against a rule that is wrong by more than sampling noise).
CHI2_001 = {3: 16.27, 7: 24.32, 15: 37.70}


def _logits_for(argmaxes: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def test_greedy_accepts_longest_matching_prefix_and_bonus():
    logits = _logits_for([3, 4, 5, 6])
    out = greedy_accept(logits, torch.tensor([3, 4, 9])).tolist()
    n = out[0]
    assert n == 2 and out[1 : n + 2] == [3, 4, 5]


def test_greedy_all_accepted_gives_bonus():
    out = greedy_accept(_logits_for([1, 2, 7]), torch.tensor([1, 2])).tolist()
    assert out[0] == 2 and out[1:4] == [1, 2, 7]


def test_greedy_empty_draft_is_ar_step():
    out = greedy_accept(_logits_for([8]), torch.empty(0, dtype=torch.long)).tolist()
    assert out == [0, 8]


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    exp = probs * counts.sum()
    mask = exp > 0
    return float((((counts - exp) ** 2)[mask] / exp[mask]).sum())


def _exact_first_token_dist(p_logits, q, temperature):
    return torch.softmax(p_logits[0] / temperature, -1)


def test_rejection_sampling_preserves_target_distribution():
    """Position 0 and position 1 outputs follow the target distribution, for a drafter that disagrees."""
    g = torch.Generator().manual_seed(1234)
    vocab, temperature, trials = 8, 0.8, 20000
    p_logits = torch.randn(3, vocab, generator=g) * 1.5  # target logits at 3 positions (k = 2)
    q = torch.softmax(torch.randn(2, vocab, generator=g) * 1.5, -1)  # drafter distributions
    p = torch.softmax(p_logits / temperature, -1)
    first = torch.zeros(vocab)
    second_given = {}  # draft token 0 (accepted) -> counts at position 1
    gen = torch.Generator().manual_seed(7)
    for _ in range(trials):
        draft = torch.stack([torch.multinomial(q[i], 1, generator=gen)[0] for i in range(2)])
        out = rejection_accept(p_logits, draft, q, temperature, gen).tolist()
        n, toks = out[0], out[1:]
        first[toks[0]] += 1
        if n >= 1:
            second_given.setdefault(toks[0], torch.zeros(vocab))[toks[1]] += 1
    assert _chi2(first, p[0]) < CHI2_001[vocab - 1]
    # Given the first token was kept, the second token must follow p at position 1 (here p_1 does
    # not depend on the first token because the logits are fixed): checked on the largest group.
    tok, counts = max(second_given.items(), key=lambda kv: kv[1].sum())
    assert counts.sum() > 1000
    assert _chi2(counts, p[1]) < CHI2_001[vocab - 1]


def test_rejection_sampling_with_one_hot_drafter():
    g = torch.Generator().manual_seed(5)
    vocab = 4
    p_logits = torch.randn(2, vocab, generator=g)
    draft = torch.tensor([2])
    q = torch.nn.functional.one_hot(draft, vocab).float()
    counts = torch.zeros(vocab)
    for _ in range(8000):
        out = rejection_accept(p_logits, draft, q, 1.0, g).tolist()
        counts[out[1]] += 1
    assert _chi2(counts, torch.softmax(p_logits[0], -1)) < CHI2_001[3]


def test_a_biased_rule_fails_the_same_check():
    """The statistical check has teeth: always keeping the draft is not target-distributed."""
    g = torch.Generator().manual_seed(1234)
    vocab = 8
    p_logits = torch.randn(2, vocab, generator=g) * 1.5
    q = torch.softmax(torch.randn(1, vocab, generator=g) * 1.5, -1)
    counts = torch.zeros(vocab)
    for _ in range(20000):
        counts[torch.multinomial(q[0], 1, generator=g)[0]] += 1  # "accept everything"
    assert _chi2(counts, torch.softmax(p_logits[0] / 0.8, -1)) > CHI2_001[7]


def test_greedy_bf16_exact_ties_take_the_first_index():
    """bf16 logits with exact ties at the maximum (near, far apart, at both ends of a 6144 vocabulary):
    greedy_accept's argmax runs through float32 on the CPU and still takes the first tied index."""
    vocab = 6144
    ties = [[5, 6], [3, 4000], [0, vocab - 1], [17, 18, 19, 6000], [6143 - 8, 6143]]
    logits = torch.randn(len(ties), vocab).clamp(-3, 3).to(torch.bfloat16)
    for row, idx in enumerate(ties):
        logits[row, idx] = 4.0  # exact in bf16, above every other entry
    first = [min(idx) for idx in ties]
    draft = torch.tensor(first[:-1])
    out = greedy_accept(logits, draft).tolist()
    assert out == [len(ties) - 1, *first]
    assert out[1:] == logits.argmax(-1).tolist() == argmax_tokens(logits).tolist()  # the bf16 reference path


def test_argmax_tokens_matches_bf16_argmax_on_coarse_logits():
    """Many ties everywhere (logits rounded to a few bf16 values): same indices as the bf16 argmax."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows, vocab in ((17, 6144), (1, 6144), (40, 6144), (3, 7), (5, 97), (9, 49152)):
            logits = (torch.randn(rows, vocab, generator=g) * 2).round().clamp(-4, 4).to(dtype)
            logits[(logits == 0) & (torch.rand(rows, vocab, generator=g) < 0.5)] = -0.0  # -0 == +0: a tie too
            assert argmax_tokens(logits).tolist() == logits.argmax(-1).tolist(), (dtype, rows, vocab)
            assert argmax_tokens(logits).dtype == torch.int64
            assert argmax_tokens(logits[0]).tolist() == logits[0].argmax().tolist()  # one row, no batch dim
