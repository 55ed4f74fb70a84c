"""The demo target is a real language model: greedy continuations of held-out code do not degenerate."""

from conftest import needs_demo

from decoder.models import DEMO_DIR
from decoder.quality import continuation_quality, repeated_ngram_fraction


def test_repeated_ngram_fraction():
    assert repeated_ngram_fraction([1, 2, 3, 4, 5, 6]) == 0.0
    assert repeated_ngram_fraction([7] * 20) > 0.9
    assert repeated_ngram_fraction([1, 2, 3]) == 0.0


@needs_demo
def test_demo_target_is_not_degenerate():
    q = continuation_quality(DEMO_DIR / "target", DEMO_DIR / "prompts" / "code.jsonl", max_new_tokens=128)
    assert q["mean_repeated_4gram_fraction"] < 0.5, q
