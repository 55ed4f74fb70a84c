"""Degeneracy check for the demo target: repeated 4-grams in greedy continuations.

The gate is a deterministic quantity: fp32 weights and activations, one intra-op thread (so no
reduction order depends on the machine's thread schedule), the held-out code prompts, 128 greedy
tokens each. bf16 is measured and recorded beside it, since the demo runs in bf16, but its value
can move with the machine's numerics (reduction order in bf16 matmuls), so it is reported, not gated.
"""

from __future__ import annotations

from pathlib import Path

import torch

from decoder.config import DecodeConfig
from decoder.generate import ar_generate
from decoder.lab.bench import load_prompts, repeated_ngram_fraction  # noqa: F401 (re-exported)
from decoder.models import load_causal_lm, load_tokenizer

QUALITY_BAR = 0.5  # the gate: mean repeated-4-gram fraction below this
QUALITY_TARGET = 0.45  # what the committed demo target must reach, so the gate keeps a 10% margin
GATE_DTYPE = "float32"
GATE_THREADS = 1


def continuation_quality(target_dir: Path, prompts_file: Path, max_new_tokens: int = 128,
                         dtype: str = GATE_DTYPE, threads: int = GATE_THREADS) -> dict:
    """Mean repeated-4-gram fraction of greedy continuations over a prompt set (held-out code for the demo),
    computed with `threads` intra-op threads (restored afterwards)."""
    tok = load_tokenizer(target_dir)
    target = load_causal_lm(target_dir, "target", dtype)
    _, prompts = load_prompts(str(prompts_file), None)
    cfg = DecodeConfig(method="ar", max_new_tokens=max_new_tokens, dtype=dtype, stop_at_eos=False)
    fractions = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for p in prompts:
            out = ar_generate(target, tok(p.text, add_special_tokens=False)["input_ids"], cfg).tokens
            fractions.append(repeated_ngram_fraction(out))
    finally:
        torch.set_num_threads(before)
    return {
        "prompts": str(prompts_file),
        "max_new_tokens": max_new_tokens,
        "dtype": dtype,
        "threads": threads,
        "mean_repeated_4gram_fraction": round(sum(fractions) / len(fractions), 4),
        "max_repeated_4gram_fraction": round(max(fractions), 4),
        "per_prompt": [round(f, 4) for f in fractions],
    }


def demo_quality(target_dir: Path, prompts_file: Path) -> dict:
    """The gate (fp32, one thread) and the bf16 figure beside it, as written to the demo's quality.json."""
    gate = continuation_quality(target_dir, prompts_file)
    bf16 = continuation_quality(target_dir, prompts_file, dtype="bfloat16")
    return {**gate, "bar": QUALITY_BAR, "target": QUALITY_TARGET,
            "bfloat16": {k: bf16[k] for k in ("mean_repeated_4gram_fraction", "max_repeated_4gram_fraction",
                                                "per_prompt", "threads")}}
