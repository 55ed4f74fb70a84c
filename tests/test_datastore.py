"""Mechanism corpus-drafter: the corpus datastore (decoder/datastore.py) and the drafter that reads it."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from decoder.capabilities import CORPUS_FILE, drafter_files_refusal
from decoder.config import ConfigError, DecodeConfig, verify_width
from decoder.datastore import CorpusIndex, DatastoreError
from decoder.drafters import CorpusDrafter
from decoder.featdraft import FeatureDrafterError, FeatureHeads
from decoder.generate import ar_generate, generate
from tests.conftest import needs_demo, tiny_llama


def test_the_longest_indexed_context_picks_its_most_frequent_continuation():
    # "1 2 -> 3" twice and "9 2 -> 4" three times: after (1, 2) the order-2 context wins (3); after (7, 2), unseen
    # as a pair, it backs off to (2,) whose most frequent continuation is 4.
    stream = [1, 2, 3, 0, 1, 2, 3, 0, 9, 2, 4, 0, 9, 2, 4, 0, 9, 2, 4, 0]
    index = CorpusIndex.build(stream, vocab_size=16, nmax=3, min_count=2)
    assert index.next_token([5, 1, 2]) == (3, 2)
    assert index.next_token([7, 2]) == (4, 1)
    assert index.draft([1, 2], 3) == [3, 0, 9]  # 3, then (2, 3) -> 0, then (2, 3, 0) -> 9 ... as the stream goes
    # A continuation seen once is not indexed: (5, 6) -> 8 appears once, and 6 is not indexed at all.
    index = CorpusIndex.build(stream + [5, 6, 8], vocab_size=16, nmax=3, min_count=2)
    assert index.next_token([5, 6]) == (-1, 0)
    assert index.draft([5, 6], 4) == []


def test_save_and_load_round_trip_and_bad_files_are_one_line_errors(tmp_path):
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 50, size=5000)
    index = CorpusIndex.build(stream, vocab_size=50, nmax=4, min_count=2)
    path = tmp_path / CORPUS_FILE
    index.save(path)
    assert [p.name for p in tmp_path.iterdir()] == [CORPUS_FILE]  # no temporary left behind
    again = CorpusIndex.load(path)
    assert (again.keys == index.keys).all() and (again.nexts == index.nexts).all()
    assert (again.nmax, again.min_count, again.vocab_size, again.corpus_tokens) == (4, 2, 50, 5000)
    ctx = [int(t) for t in stream[100:110]]
    assert again.draft(ctx, 6) == index.draft(ctx, 6)
    path.write_bytes(b"not a zip")
    with pytest.raises(DatastoreError) as e:
        CorpusIndex.load(path)
    assert "\n" not in str(e.value) and "specpilot train drafter --kind corpus" in str(e.value)
    with pytest.raises(DatastoreError, match="more than nmax"):
        CorpusIndex.build([1, 2], vocab_size=8, nmax=4)


def test_prompt_lookup_comes_first_and_the_corpus_fills_the_draft():
    index = CorpusIndex.build([1, 2, 3, 4, 5, 0, 7, 4, 5, 0] * 3, vocab_size=8, nmax=3, min_count=2)
    d = CorpusDrafter(index, ngram_max=3, ngram_min=1)
    assert d.ngram_min == 2  # a one-token prompt match loses to the corpus
    d.reset([])
    # (6, 7) recurs in the sequence: its continuation (1, 6, 7) comes from the prompt, the rest from the corpus.
    assert d.lookup([6, 7, 1, 6, 7], 4) == [1, 6, 7, 4]
    d.reset([])
    assert d.lookup([3], 3) == [4, 5, 0]  # no prompt match: the corpus alone


def test_corpus_tree_branches_take_a_shorter_contexts_other_continuation():
    # After (1, 2) the order-2 context says 3; its suffix (2,) says 4 (three 9 2 4 against two 1 2 3): the branch.
    stream = [1, 2, 3, 0, 1, 2, 3, 0, 9, 2, 4, 0, 9, 2, 4, 0, 9, 2, 4, 0]
    index = CorpusIndex.build(stream, vocab_size=16, nmax=3, min_count=2)
    assert index.alternative([5, 1, 2], exclude=3) == 4
    assert index.alternative([5, 1, 2], exclude=4) == 3  # the longest context first
    assert index.alternative([9, 2], exclude=4) == -1  # every indexed suffix agrees with the chain
    assert index.alternative([5, 6], exclude=1) == -1  # nothing indexed at all
    d = CorpusDrafter(index, ngram_max=3, tree_alts=2)
    d.reset([])
    draft = d.propose([5, 1, 2], 3)
    # The chain 3 0 9 (the corpus from (1, 2)); beside node 0 the branch 4 0 (a child of the root, then of 4);
    # beside node 1, (1, 2, 3)'s shorter suffixes all say 0 as the chain does: no branch there.
    assert draft.tokens.tolist() == [3, 0, 9, 4, 0]
    assert draft.tree.parents.tolist() == [-1, 0, 1, -1, 3]
    assert draft.tree.depth.tolist() == [0, 1, 2, 0, 1]
    assert draft.tree.anc[4].tolist() == [False, False, False, True, True]
    assert verify_width(DecodeConfig(method="sd", drafter="corpus", draft_len=3, corpus_tree_alts=2,
                                     lean_forward=True)) >= 1 + draft.size
    # A branch never reaches deeper than k: at k = 1 the branch is the alternative alone.
    d.reset([])
    assert d.propose([5, 1, 2], 1).tokens.tolist() == [3, 4]
    chain = CorpusDrafter(index, ngram_max=3)
    chain.reset([])
    assert chain.propose([5, 1, 2], 3).tree is None


def test_corpus_tree_alts_is_refused_in_one_line_where_it_cannot_run():
    with pytest.raises(ConfigError, match="corpus_tree_alts = 2 is invalid: only the corpus drafter"):
        DecodeConfig(method="sd", drafter="ngram", corpus_tree_alts=2)
    with pytest.raises(ConfigError, match="corpus_tree_alts = 1 is invalid: a tree verifies greedily"):
        DecodeConfig(method="sd", drafter="corpus", corpus_tree_alts=1, temperature=0.7, lean_forward=True)
    with pytest.raises(ConfigError, match="corpus_tree_alts = 9 is invalid"):
        DecodeConfig(method="sd", drafter="corpus", corpus_tree_alts=9, lean_forward=True)


@pytest.fixture(scope="module")
def tiny_and_index():
    """A tiny random target and a datastore of its own greedy continuations (so drafts are often right)."""
    target = tiny_llama(vocab=96, hidden=64, layers=2, seed=3)
    gen = torch.Generator().manual_seed(5)
    stream = []
    for _ in range(24):
        prompt = torch.randint(1, 96, (12,), generator=gen).tolist()
        out = ar_generate(target, prompt, DecodeConfig(method="ar", max_new_tokens=40, stop_at_eos=False,
                                                       dtype="float32")).tokens
        stream += prompt + out + [0]
    heads = FeatureHeads(None, target.config, torch.float32, torch.device("cpu"))
    heads.set_corpus(CorpusIndex.build(stream, vocab_size=96, nmax=4, min_count=1))
    return target, heads


@pytest.mark.parametrize("lean", [False, True])
def test_the_corpus_drafter_is_lossless_and_its_drafts_are_accepted(tiny_and_index, lean):
    target, heads = tiny_and_index
    gen = torch.Generator().manual_seed(9)
    accepted = 0
    for _ in range(6):
        prompt = torch.randint(1, 96, (10,), generator=gen).tolist()
        ref = ar_generate(target, prompt, DecodeConfig(method="ar", max_new_tokens=32, stop_at_eos=False,
                                                       dtype="float32")).tokens
        cfg = DecodeConfig(method="sd", drafter="corpus", draft_len=6, max_new_tokens=32, stop_at_eos=False,
                           dtype="float32", lean_forward=lean)
        g = generate(cfg, target, prompt, heads=heads)
        assert g.tokens == ref
        accepted += g.stats.accepted
    assert accepted > 0


def _tree_prompts(target) -> tuple[list[list[int]], list[list[int]]]:
    """Six random prompts of the corpus tree's tests and the target's 32 greedy tokens after each."""
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(1, 96, (n,), generator=gen).tolist() for n in (10, 14, 9, 21, 12, 8)]
    return prompts, [ar_generate(target, p, DecodeConfig(method="ar", max_new_tokens=32, stop_at_eos=False,
                                                         dtype="float32")).tokens for p in prompts]


def test_the_corpus_tree_is_lossless_single_and_batched_and_its_branches_are_accepted(tiny_and_index):
    from decoder.batch import batch_generate

    target, heads = tiny_and_index
    prompts, refs = _tree_prompts(target)
    cfg = DecodeConfig(method="sd", drafter="corpus", draft_len=6, max_new_tokens=32, stop_at_eos=False,
                       dtype="float32", lean_forward=True, corpus_tree_alts=3)
    branches = 0
    for prompt, ref in zip(prompts, refs, strict=True):
        g = generate(cfg, target, prompt, heads=heads)
        assert g.tokens == ref
        branches += g.stats.alternatives_accepted
    assert branches > 0  # the branches are verified, and some steps' accepted paths end in one
    for ragged in (False, True):
        run = batch_generate(dataclasses.replace(cfg, ragged_verify=ragged), target, prompts, 3, heads=heads)
        assert [r.tokens for r in run.results] == refs
        assert run.stats.alternatives_accepted > 0


def test_load_tree_drafts_the_corpus_chain_above_its_cap_and_the_tree_at_or_below(tiny_and_index):
    """Mechanism load-tree: three copies of one prompt stay in step, so every step has 3 live requests. A cap of
    1 drafts the corpus chain in all of them (the chain config's nodes, no branch accepted); a cap of 3 drafts the
    tree (the uncapped tree's nodes). Lossless either way, and on distinct prompts whose tails run alone."""
    from decoder.batch import batch_generate

    target, heads = tiny_and_index
    prompts, refs = _tree_prompts(target)
    base = DecodeConfig(method="sd", drafter="corpus", draft_len=6, max_new_tokens=32, stop_at_eos=False,
                        dtype="float32", lean_forward=True, ragged_verify=True)
    tree = dataclasses.replace(base, corpus_tree_alts=3)
    same = [prompts[5]] * 3  # one whose tree has branches accepted

    def run(cfg, ps):
        r = batch_generate(cfg, target, ps, 3, heads=heads)
        return [x.tokens for x in r.results], r.stats

    chain_out, chain = run(base, same)
    tree_out, full = run(tree, same)
    assert chain_out == tree_out == [refs[5]] * 3 and full.alternatives_accepted > 0
    capped_out, capped = run(dataclasses.replace(tree, tree_max_live=1), same)
    assert capped_out == chain_out
    assert (capped.drafted, capped.alternatives_accepted) == (chain.drafted, 0)  # drafted: tree nodes
    _, at3 = run(dataclasses.replace(tree, tree_max_live=3), same)
    assert (at3.drafted, at3.alternatives_accepted) == (full.drafted, full.alternatives_accepted)
    assert run(dataclasses.replace(tree, tree_max_live=1), prompts)[0] == refs
    with pytest.raises(ConfigError, match="tree_max_live = 2 is invalid: it switches the corpus or MTP tree"):
        dataclasses.replace(base, tree_max_live=2)


def test_the_batched_engine_drafts_from_the_corpus_token_identically(tiny_and_index):
    from decoder.batch import batch_generate

    target, heads = tiny_and_index
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 96, (n,), generator=gen).tolist() for n in (9, 17, 12, 25, 7)]
    refs = [ar_generate(target, p, DecodeConfig(method="ar", max_new_tokens=24, stop_at_eos=False,
                                                dtype="float32")).tokens for p in prompts]
    for ragged in (False, True):
        cfg = DecodeConfig(method="sd", drafter="corpus", draft_len=5, max_new_tokens=24, stop_at_eos=False,
                           dtype="float32", ragged_verify=ragged)
        run = batch_generate(cfg, target, prompts, 3, heads=heads)
        assert [r.tokens for r in run.results] == refs
        assert run.stats.drafted > 0 and run.stats.accepted > 0
    with pytest.raises(ValueError, match="corpus datastore"):
        batch_generate(cfg, target, prompts, 2)


def test_a_missing_or_foreign_datastore_is_refused_in_one_line(tmp_path, tiny_and_index):
    target, _ = tiny_and_index
    cfg = DecodeConfig(method="sd", drafter="corpus")
    why = drafter_files_refusal(cfg, tmp_path, "T")
    assert why == (f"no corpus datastore at {tmp_path / CORPUS_FILE}; make it with `specpilot train drafter --kind "
                   f"corpus --target T`")
    routed = DecodeConfig(method="sd", drafter="routed", route_code="corpus", lean_forward=True)
    (tmp_path / "router.json").write_text("{}")
    assert "no corpus datastore" in drafter_files_refusal(routed, tmp_path, "T")
    CorpusIndex.build([1, 2, 3] * 5, vocab_size=8, nmax=2).save(tmp_path / CORPUS_FILE)
    assert drafter_files_refusal(cfg, tmp_path, "T") is None
    heads = FeatureHeads(tmp_path, target.config, torch.float32, torch.device("cpu"))
    with pytest.raises(FeatureDrafterError, match="vocabulary of 8 tokens, the target's has 96"):
        heads.corpus()


@needs_demo
@pytest.mark.slow  # tokenizes the whole corpus and indexes >100k contexts: ~55 s on 2 cores
def test_train_drafter_kind_corpus_writes_the_index(tmp_path, capsys):
    from workbench.cli import main

    out = tmp_path / "d" / CORPUS_FILE
    work = tmp_path / "w"
    argv = ["train", "drafter", "--kind", "corpus", "--train-sequences", "8", "--out", str(out),
            "--work-dir", str(work)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["path"] == str(out) and report["contexts"] > 100_000
    assert report["own_tokens"] == 2 * 8 * (128 + 6 + 1)  # 8 continuations per domain, their context, an EOS
    index = CorpusIndex.load(out)
    assert index.vocab_size == 6144 and index.nmax == 6
    assert sorted(p.name for p in out.parent.iterdir()) == [CORPUS_FILE]
    # The target's continuations are made once (shards under --work-dir) and reused.
    assert sorted(p.name[:10] for p in work.glob("self-*.npy")) == ["self-code-", "self-prose"]
    answers = tmp_path / "answers.jsonl"
    answers.write_text(json.dumps({"prompt": "x", "tokens": [5, 6, 7, 8]}) + "\n")
    assert main([*argv[:4], "--answers", str(answers), "--out", str(out), "--work-dir", str(work)]) == 0
    assert json.loads(capsys.readouterr().out)["own_tokens"] == 5


def test_train_drafter_kind_corpus_fails_in_one_line_before_any_work(tmp_path, capsys):
    from workbench.cli import main

    out, work = tmp_path / "d" / CORPUS_FILE, tmp_path / "w"
    argv = ["train", "drafter", "--kind", "corpus"]
    (tmp_path / "file").write_text("a file where a folder should be")
    for bad, msg in ((["--train-sequences", "-1"], "--train-sequences -1 must be 0 or more"),
                     (["--out", str(tmp_path / "file" / CORPUS_FILE)], "cannot write")):
        code = main([*argv[:4], "--train-sequences", "0", "--work-dir", str(work), "--out", str(out), *bad])
        err = capsys.readouterr().err
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not (work.exists() and any(work.rglob("*.np*")))  # nothing half-written
