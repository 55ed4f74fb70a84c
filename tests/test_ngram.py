from decoder.drafters import NgramDrafter


def test_prefers_longest_and_latest_match():
    d = NgramDrafter(ngram_max=3, ngram_min=1)
    d.reset([])
    seq = [1, 2, 3, 4, 9, 2, 3, 5, 7, 7, 2, 3]
    # suffix (2, 3): latest earlier occurrence ends at index 7 -> continuation 5, 7, 7
    assert d.lookup(seq, 3) == [5, 7, 7]
    # suffix (1, 2, 3) would win over (2, 3) when present (a new sequence: reset the index)
    d.reset([])
    assert d.lookup([1, 2, 3, 8, 1, 2, 3, 6, 2, 3, 1, 2, 3], 2) == [6, 2]


def test_incremental_index_matches_fresh_lookup():
    seq = [5, 6, 7, 8, 5, 6, 9, 9, 5, 6, 7, 1, 2, 5, 6]
    inc = NgramDrafter(4, 1)
    inc.reset([])
    for L in range(1, len(seq) + 1):
        fresh = NgramDrafter(4, 1)
        fresh.reset([])
        assert inc.lookup(seq[:L], 4) == fresh.lookup(seq[:L], 4), L


def test_no_match_gives_empty_draft():
    d = NgramDrafter(3, 2)
    d.reset([])
    assert d.lookup([1, 2, 3, 4], 4) == []


def test_repeating_span_uses_earliest_occurrence_for_a_full_draft():
    d = NgramDrafter(2, 1)
    d.reset([])
    assert d.lookup([4, 4, 4, 4, 4], 3) == [4, 4, 4]
