"""llama.cpp's n-gram lookup caches made from a deployment's own answers (decoder/engines/lookup_cache.py).

The format and drafting-rule tests need nothing built. The engine test runs the real `llama-server` built by
`make llama-cpp` on the demo's f32 GGUF: it loads the files we write (llama.cpp aborts on a malformed one),
drafts from them, and its output stays the AR server's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decoder.config import ConfigError
from decoder.engines import llamacpp_build as build
from decoder.engines import lookup_cache as lc
from decoder.engines.llamacpp import LlamaServer, ServerSettings, SpecSettings
from decoder.engines.llamacpp_config import LlamaCppConfig
from decoder.mechanisms import LLAMA_CPP_REGISTRY
from decoder.models import DEMO_DIR

ENGINES = build.engines_root()  # the user's engine cache, read before conftest gives each test a private data dir


@pytest.fixture(autouse=True)
def _real_engines(monkeypatch):
    monkeypatch.setenv("SPECPILOT_ENGINES_DIR", str(ENGINES))


needs_llamacpp = pytest.mark.skipif(not (build.is_built() and build.gguf_path("target", "f32").is_file()),
                                    reason="llama.cpp is not built (run `make llama-cpp`)")


def test_files_round_trip_in_llama_cpps_layout(tmp_path):
    cache = lc.count([[5, 6, 7, 5, 6, 8], [5, 6, 7]], 1, 4)
    n = lc.write(cache, tmp_path / "c.bin")
    assert lc.read(tmp_path / "c.bin") == cache
    # one record: 4 int32 tokens (-1 pads), an int32 count of continuations, then (token, count) pairs
    assert n == sum(4 * (lc.NGRAM_MAX + 1) + 8 * len(p) for p in cache.values())
    assert cache[(5, 6, -1, -1)] == {7: 2, 8: 1}
    (tmp_path / "bad.bin").write_bytes((tmp_path / "c.bin").read_bytes()[:-3])
    with pytest.raises(lc.LookupCacheError, match="bad continuation count|truncated"):
        lc.read(tmp_path / "bad.bin")


def test_pruning_drops_exactly_what_the_strict_thresholds_never_draft():
    cache = lc.count([[1, 2, 3]] * 2 + [[1, 2, 4]], 1, 4)
    kept = lc.prune_dynamic(cache)
    assert (1, 2, -1, -1) in kept  # 3 samples >= 3, top share 2/3 >= 66%
    assert (2, -1, -1, -1) not in kept  # 3 samples < 4 for a 1-gram
    ctx: lc.Cache = {}
    for hist in ([1, 2], [9, 1, 2], [2], [7, 2]):
        assert lc.draft(hist, ctx, cache, {}) == lc.draft(hist, ctx, kept, {})


def test_the_drafting_rule_follows_the_corpus_and_stops_where_it_is_unsure():
    corpus = [[10, 11, 12, 13, 14, 15]] * 3
    dyn, static = lc.prune_dynamic(lc.count(corpus, 1, 4)), lc.count(corpus, 2, 2)
    assert lc.draft([99, 10, 11], {}, dyn, static) == [12, 13, 14, 15]
    assert lc.draft([99, 98], {}, dyn, static) == []
    assert lc.draft([99, 10, 11], {}, dyn, static, n_draft=2) == [12, 13]
    tokens, steps, drafted = lc.replay_tau([99], [10, 11, 12, 13, 14, 15], dyn, static)
    assert (tokens, steps, drafted) == (5, 2, 4)  # a 1-gram seen 3 times drafts nothing (4 needed)


def test_sequences_commit_small_and_materialise_once(tmp_path):
    seqs = [[1, 2, 3, 4], [5, 6, 7, 8, 9]]
    info = lc.save_sequences(seqs, tmp_path / "a.npz", {"source": "test"})
    assert info["tokens"] == 9 and lc.load_sequences(tmp_path / "a.npz") == (seqs, {"source": "test"})
    dest = lc.materialise(tmp_path / "a.npz", tmp_path / "out" / "cache")
    first = (dest / "dynamic.bin").stat().st_mtime_ns
    assert lc.materialise(tmp_path / "a.npz", dest) == dest and (dest / "dynamic.bin").stat().st_mtime_ns == first
    assert json.loads((dest / "build.json").read_text())["tokens"] == 9


def test_the_config_passes_the_files_only_for_ngram_cache_with_corpus():
    cfg = LlamaCppConfig(spec_type="ngram-cache", lookup_cache="corpus")
    flags = cfg.spec_flags(None, Path("/d/lc"))
    assert flags == ["--spec-type", "ngram-cache", "--lookup-cache-dynamic", "/d/lc/dynamic.bin",
                     "--lookup-cache-static", "/d/lc/static.bin"] and cfg.verify_width() == 9
    with pytest.raises(ConfigError, match="lookup_cache = 'corpus' needs the deployment's n-gram caches"):
        cfg.spec_flags(None, None)
    assert LlamaCppConfig(spec_type="ngram-mod", lookup_cache="corpus").spec_flags(None, None) == \
        ["--spec-type", "ngram-mod"]
    with pytest.raises(ConfigError, match="lookup_cache = 'wiki': choose one of off, corpus"):
        LlamaCppConfig(lookup_cache="wiki")
    mech = LLAMA_CPP_REGISTRY["llama-ngram-corpus"]
    assert tuple(mech.keys["lookup_cache"]) == ("corpus",) and tuple(mech.keys["spec_type"]) == ("ngram-cache",)


@needs_llamacpp
def test_llama_server_drafts_from_our_files_and_keeps_ar_output(tmp_path):
    rows = [json.loads(line) for line in (DEMO_DIR / "prompts" / "code.jsonl").read_text().splitlines()][:3]
    one = ServerSettings(threads=1)
    target = build.gguf_path("target", "f32")
    with LlamaServer(target, settings=one) as ar:
        prompts = [ar.tokenize(r["text"])[-48:] for r in rows]
        outs = [ar.generate(p, 40).tokens for p in prompts]
    # the corpus: the target's own answers with their prompts' last tokens, as the deployment's data stage makes
    info = lc.build([p[-4:] + o for p, o in zip(prompts, outs, strict=True)] * 2, tmp_path)
    assert info["dynamic_ngrams"] > 0
    flags = ("--lookup-cache-dynamic", str(tmp_path / "dynamic.bin"),
             "--lookup-cache-static", str(tmp_path / "static.bin"))
    with LlamaServer(target, spec=SpecSettings("ngram-cache", extra=flags), settings=one, log_dir=tmp_path) as sd:
        done = [sd.generate(p, 40) for p in prompts]
    accepted = sum(d.accepted for d in done)
    assert accepted >= 0.5 * sum(len(o) for o in outs), [(d.drafted, d.accepted) for d in done]
    for d, o in zip(done, outs, strict=True):
        assert d.tokens[:16] == o[:16]
