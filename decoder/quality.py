"""Degeneracy check for the demo target: repeated 4-grams in greedy continuations."""

from __future__ import annotations

from pathlib import Path

from decoder.config import DecodeConfig
from decoder.generate import ar_generate


def repeated_ngram_fraction(tokens: list[int], n: int = 4) -> float:
    """Fraction of the continuation's n-grams that already occurred earlier in it (0 = no repeats)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def continuation_quality(target_dir: Path, prompts_file: Path, max_new_tokens: int = 128,
                         dtype: str = "bfloat16") -> dict:
    """Mean repeated-4-gram fraction of greedy continuations over a prompt set (held-out code for the demo)."""
    from decoder.bench import load_prompts
    from decoder.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(target_dir)
    target = load_causal_lm(target_dir, "target", dtype)
    _, prompts = load_prompts(str(prompts_file), None)
    cfg = DecodeConfig(method="ar", max_new_tokens=max_new_tokens, dtype=dtype, stop_at_eos=False)
    fractions = []
    for p in prompts:
        out = ar_generate(target, tok(p.text, add_special_tokens=False)["input_ids"], cfg).tokens
        fractions.append(repeated_ngram_fraction(out))
    return {
        "prompts": str(prompts_file),
        "max_new_tokens": max_new_tokens,
        "mean_repeated_4gram_fraction": round(sum(fractions) / len(fractions), 4),
        "max_repeated_4gram_fraction": round(max(fractions), 4),
        "per_prompt": [round(f, 4) for f in fractions],
    }
