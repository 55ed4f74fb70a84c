"""The demo target is a real language model: greedy continuations of held-out code do not degenerate."""

import json

from conftest import needs_demo

from decoder.lab.quality import (
    GATE_DTYPE,
    GATE_THREADS,
    QUALITY_BAR,
    QUALITY_TARGET,
    continuation_quality,
    repeated_ngram_fraction,
)
from decoder.models import DEMO_DIR


def test_repeated_ngram_fraction():
    assert repeated_ngram_fraction([1, 2, 3, 4, 5, 6]) == 0.0
    assert repeated_ngram_fraction([7] * 20) > 0.9
    assert repeated_ngram_fraction([1, 2, 3]) == 0.0


@needs_demo
def test_demo_target_is_not_degenerate():
    """Deterministic: fp32, one thread, the 16 held-out code prompts, 128 greedy tokens each.

    The committed quality.json records the value measured when the target was trained; the gate
    (< 0.5) keeps a margin of at least 10% from it, and the recomputed value must equal it."""
    recorded = json.loads((DEMO_DIR / "quality.json").read_text())
    assert recorded["dtype"] == GATE_DTYPE and recorded["threads"] == GATE_THREADS
    assert recorded["mean_repeated_4gram_fraction"] <= QUALITY_TARGET <= 0.9 * QUALITY_BAR
    q = continuation_quality(DEMO_DIR / "target", DEMO_DIR / "prompts" / "code.jsonl", max_new_tokens=128)
    assert q["mean_repeated_4gram_fraction"] < QUALITY_BAR, q
    assert abs(q["mean_repeated_4gram_fraction"] - recorded["mean_repeated_4gram_fraction"]) < 0.02, q
