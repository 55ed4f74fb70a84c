"""MethodEntry (decoder/stats.py): the typed record of one `specpilot bench --json` method entry, round trip,
tolerance of malformed fields, and the bench's JSON keys unchanged by it (a public contract)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_runs import run_many
from conftest import tiny_llama, write_jsonl

from decoder.lab.peers import peer_entry
from decoder.models import DEMO_DIR
from decoder.stats import PHASES, DecodeStats, MethodEntry

# The keys every bench entry had before the record existed (the contract: add fields, never rename or drop).
CORE = ["name", "tokens_per_s", "speedup_vs_ar", "ar_baseline", "speedup_vs_hf_greedy", "tau", "identical_to_hf_greedy",
        "mismatched_prompts", "unexplained_mismatches", "new_tokens", "seconds", "target_forwards",
        "target_forwards_per_token", "divergences"]
OURS = CORE + ["target_tokens_per_token", "drafter_forwards_per_token", "acceptance_rate", "accept_hist",
               "phase_ms_per_token", "draft_ms_per_step", "draft_len"]
BENCH_KEYS = {"ar": OURS, "sd-draft-model": OURS, "sd-tree": OURS + ["mechanism_config"], "hf-greedy": CORE}
PHASE_MS = {"prefill": 0.5, "draft": 2.0, "verify": 5.0, "accept": 0.3, "other": 0.2}
SD = {"name": "sd-draft-model", "tokens_per_s": 120.5, "speedup_vs_ar": 1.8, "ar_baseline": "ar",
      "speedup_vs_hf_greedy": 2.1, "tau": 2.5, "identical_to_hf_greedy": False, "mismatched_prompts": 1,
      "unexplained_mismatches": 0, "new_tokens": 100, "seconds": 0.83, "target_forwards": 45,
      "target_forwards_per_token": 0.45, "divergences": [{"prompt": "a", "position": 3, "margin": 0.001,
                                                          "explained": True}],
      "target_tokens_per_token": 2.2, "drafter_forwards_per_token": 1.1, "acceptance_rate": 0.7,
      "accept_hist": {"0": 3, "3": 9}, "phase_ms_per_token": PHASE_MS, "draft_ms_per_step": 1.5, "draft_len": 3,
      "mechanism_config": {"verify": "tree"}}
AR = {**{k: SD[k] for k in OURS}, "name": "ar", "accept_hist": {},  # AR: the counters a chain of 0 drafts leaves
      "acceptance_rate": None, "draft_ms_per_step": None, "draft_len": None}
HF = {k: SD[k] for k in CORE} | {"name": "hf-greedy"}


@pytest.mark.parametrize("entry", [SD, AR, HF], ids=["sd", "ar-nulls", "hf"])
def test_round_trip_keeps_every_field_and_its_value(entry):
    e = MethodEntry.from_dict(json.loads(json.dumps(entry)))
    assert e.as_dict() == entry and list(e.as_dict()) == list(entry)
    assert MethodEntry.from_dict(e.as_dict()) == e


def test_typed_fields_read_the_contract():
    e = MethodEntry.from_dict(SD)
    assert (e.tau, e.draft_len, e.target_forwards, e.speedup_vs_ar, e.acceptance_rate) == (2.5, 3, 45, 1.8, 0.7)
    assert e.phase_ms_per_token == PHASE_MS and e.accept_hist == {"0": 3, "3": 9}
    assert e.extra == {"mechanism_config": {"verify": "tree"}}
    assert e.ms_per_token == pytest.approx(1000 / 120.5)
    assert MethodEntry(phase_ms_per_token=PHASE_MS).ms_per_token == pytest.approx(8.0)  # no rate: the phases


@pytest.mark.parametrize("bad", [None, 3, "x", [SD], {"name": ["a"]}, {**SD, "tau": "fast", "draft_len": 2.5,
                                 "tokens_per_s": -1, "target_forwards": True, "divergences": "none",
                                 "accept_hist": {"1": "many", "2": 4}, "phase_ms_per_token": {"draft": "x", "verify": 5,
                                 "bogus": float("nan")}, "identical_to_hf_greedy": "yes", "ar_baseline": 1,
                                 "speedup_vs_ar": float("nan"), "acceptance_rate": None}])
def test_malformed_fields_read_as_defaults(bad):
    e = MethodEntry.from_dict(bad)  # a candidate's report: never an exception
    e.as_dict()
    if isinstance(bad, dict) and "tau" in bad:
        assert (e.tau, e.draft_len, e.tokens_per_s, e.target_forwards, e.divergences, e.identical_to_hf_greedy,
                e.ar_baseline, e.speedup_vs_ar) == (None, None, 0.0, None, None, None, None, None)
        assert e.accept_hist == {"2": 4} and e.phase_ms_per_token == {"verify": 5.0}
    elif not isinstance(bad, dict):
        assert e == MethodEntry()
    else:
        assert e.name == "method"


def test_profile_entry_shape_keeps_its_old_keys():
    """workbench/measure.py's profile of a running system: the keys it wrote before the record, still there."""
    e = MethodEntry(name="base", tokens_per_s=50.0, tau=1.5, phase_ms_per_token=dict.fromkeys(PHASES, 1.0),
                    draft_len=3, target_forwards=20, new_tokens=30, acceptance_rate=0.5, seconds=0.6)
    old = ["name", "tokens_per_s", "tau", "draft_len", "target_forwards", "new_tokens", "acceptance_rate",
           "phase_ms_per_token", "seconds"]
    d = e.as_dict()
    assert set(old) <= set(d) and MethodEntry.from_dict(d) == e


def test_llama_cpp_entries_keep_their_keys():
    base = MethodEntry.from_dict(HF | {"name": "llama.cpp-ar", "ratio_vs_llama_cpp_ar": 1.0})
    want = CORE + ["ratio_vs_llama_cpp_ar", "engine", "server_flags", "vs_hf_greedy", "acceptance_rate", "drafted",
                   "accepted", "checked_against", "identical_to_reference"]
    ar = peer_entry(base, DecodeStats(), None, ["-t", "2"])
    assert sorted(ar) == sorted(want) and ar["acceptance_rate"] is None and ar["tau"] is None
    check = {"reference": "llama.cpp-ar", "identical_to_reference": True, "mismatched_prompts": 0,
             "unexplained_mismatches": 0, "divergences": []}
    sd = peer_entry(base, DecodeStats(drafted=10, accepted=7), check, [])
    assert sorted(sd) == sorted(want) and sd["acceptance_rate"] == 0.7 and sd["vs_hf_greedy"]["mismatched_prompts"] == 1
    assert MethodEntry.from_dict(sd).as_dict() == sd


def _save(model, path: Path) -> Path:
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / "target" / f, path / f)
    return path


def test_bench_json_keys_unchanged(tmp_path):
    """`specpilot bench --json` on tiny random models: every method entry has exactly the keys it had, in order."""
    target = _save(tiny_llama(vocab=6144, hidden=32, layers=1), tmp_path / "target")
    drafter = _save(tiny_llama(vocab=6144, hidden=32, layers=1, seed=1), tmp_path / "drafter")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "text": "def add(a, b):\n    return"}])
    out = tmp_path / "report.json"
    run = run_many("workbench.cli", {"bench": [
        "bench", "--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts), "--max-new-tokens",
        "4", "--quiet", "--dtype", "float32", "--json", "--out", str(out), "--methods", ",".join(BENCH_KEYS)]})["bench"]
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {m["name"]: list(m) for m in report["methods"]} == BENCH_KEYS
    for m in report["methods"]:
        assert MethodEntry.from_dict(m).as_dict() == m
