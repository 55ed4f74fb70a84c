"""The cost model's stated accuracy: prediction_error against given measured step times (deterministic,
tiny config-only models, no torch), its JSON shape, the text table, and the CLI paths to it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from costmodel.accuracy import (
    STEP_KINDS,
    STEP_POINTS,
    AccuracyError,
    StepPoint,
    StepSweep,
    abs_rel_error,
    prediction_error,
)
from costmodel.cli import add_parser
from costmodel.deployment import CostDeployment
from costmodel.fit import fit_profile, predict_ms
from costmodel.gaps import check_accounting, modelled_gaps
from costmodel.hardware import HardwareProfile, save_profile
from costmodel.model_profile import from_config, load_model_profile
from costmodel.report import build_report, format_table
from costmodel.step import Drafter, forward_time

TOY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100}
TOY_DRAFTER = {**TOY, "num_hidden_layers": 1, "hidden_size": 32, "head_dim": 8, "intermediate_size": 64}
CONTEXT = 10


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECPILOT_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def toy_hw() -> HardwareProfile:
    return HardwareProfile("cpu-local", 1.0, 1e-3, None, 0.0, fixed_overhead_ms=0.5, per_layer_overhead_ms=0.25)


def toy_deployment(hw: HardwareProfile | None = None) -> CostDeployment:
    target, drafter = from_config(dict(TOY), "toy"), from_config(dict(TOY_DRAFTER), "toy-drafter")
    return CostDeployment("toy", hw or toy_hw(), target, Drafter("model", drafter), draft_len=4, context=CONTEXT)


def sweep_for(dep: CostDeployment, scale: dict[str, float] | None = None, context: int = CONTEXT) -> StepSweep:
    """Measured = predicted x scale[kind] (default 1.25): every error is known in advance."""
    scale = scale or {}
    measured = {}
    for p in STEP_POINTS:
        model = dep.drafter.model if p.kind == "draft" else dep.target
        measured[p] = forward_time(dep.hardware, model, p.q, p.batch, context, "bf16").total_ms * scale.get(p.kind,
                                                                                                            1.25)
    return StepSweep("toy", dep.target.fingerprint, context, "bf16", measured, drafter="toy-drafter",
                     drafter_fingerprint=dep.drafter.model.fingerprint, threads=1)


def test_abs_rel_error_by_hand():
    assert abs_rel_error(12.0, 10.0) == pytest.approx(0.2)
    assert abs_rel_error(8.0, 10.0) == pytest.approx(0.2)
    with pytest.raises(AccuracyError, match="positive"):
        abs_rel_error(1.0, 0.0)


def test_step_points_cover_the_issue_grid():
    kinds = {k: [(p.q, p.batch) for p in STEP_POINTS if p.kind == k] for k in STEP_KINDS}
    assert kinds["ar"] == [(1, 1)] and kinds["draft"] == [(1, 1)]
    assert kinds["verify"] == [(q, 1) for q in (1, 2, 4, 8, 16)]
    assert sorted(kinds["batched"]) == sorted((q, b) for q in (1, 4) for b in (1, 2, 4, 8, 16))
    assert StepPoint("draft", 1).role == "drafter" and StepPoint("batched", 4, 8).role == "target"


def test_prediction_error_shape_and_values():
    dep = toy_deployment()
    # measured = predicted / 0.8 for the target (error 0.2), predicted / 2 for the drafter (error 1.0)
    pe = prediction_error(dep.hardware, dep.target, dep.drafter.model,
                          sweep_for(dep, {"ar": 1.25, "verify": 1.25, "batched": 1.25, "draft": 0.5}))
    assert set(STEP_KINDS) <= set(pe)
    assert {"max_abs_rel_error", "max_abs_rel_error_held_out", "goal_abs_rel_error", "fit_on", "measurement",
            "rule", "notes"} <= set(pe)
    assert len(pe["verify"]["points"]) == 5 and len(pe["batched"]["points"]) == 10
    for kind in ("ar", "verify", "batched"):
        for p in pe[kind]["points"]:
            assert set(p) == {"q", "batch", "predicted_ms", "measured_ms", "abs_rel_error", "held_out"}
            assert p["abs_rel_error"] == pytest.approx(0.2, abs=1e-3)
            assert p["held_out"]  # a profile fitted on nothing: every point is held out
        assert pe[kind]["max_abs_rel_error"] == pytest.approx(0.2, abs=1e-3)
    d = pe["draft"]["points"][0]
    assert d["predicted_ms"] == pytest.approx(forward_time(dep.hardware, dep.drafter.model, 1, 1, CONTEXT).total_ms,
                                              abs=1e-4)
    assert d["abs_rel_error"] == pytest.approx(1.0, abs=1e-3)
    assert pe["max_abs_rel_error"] == pe["draft"]["max_abs_rel_error"] == pe["max_abs_rel_error_held_out"]
    assert pe["fit_on"] is None and pe["measurement"]["context"] == CONTEXT and "points" not in pe["measurement"]
    json.dumps(pe)


def test_fitted_points_are_not_held_out():
    hw = toy_hw()
    hw.measured["validation"] = {"fingerprint": from_config(dict(TOY), "toy").fingerprint, "q": [1, 4, 16],
                                 "batch": 1, "context": CONTEXT, "format": "bf16", "measured_ms": [1.0, 1.0, 1.0],
                                 "model": "toy"}
    dep = toy_deployment(hw)
    pe = prediction_error(hw, dep.target, dep.drafter.model, sweep_for(dep, {"verify": 2.0}))
    held = {p["q"]: p["held_out"] for p in pe["verify"]["points"]}
    assert held == {1: False, 2: True, 4: False, 8: True, 16: False}
    assert not pe["ar"]["points"][0]["held_out"]  # the same shape as a fitted sample
    batched = {(p["q"], p["batch"]): p["held_out"] for p in pe["batched"]["points"]}
    assert batched[(1, 1)] is False and batched[(4, 1)] is False and all(v for k, v in batched.items() if k[1] > 1)
    assert pe["verify"]["max_abs_rel_error"] == pytest.approx(0.5, abs=1e-3)  # measured 2x: |1 - 2| / 2
    assert pe["max_abs_rel_error_held_out"] == pytest.approx(0.5, abs=1e-3)  # verify q = 2, 8 are held out
    assert pe["fit_on"]["groups"] == [{"kind": "verify", "q": [1, 4, 16], "batch": [1]}]
    # A KV rate fitted on batched B = 2, 8 makes those shapes in-sample too.
    hw.measured["validation"]["kv_fit"] = {"kind": "batched", "samples": [
        {"q": q, "batch": b, "measured_ms": 1.0} for q in (1, 4) for b in (2, 8)]}
    pe = prediction_error(hw, dep.target, dep.drafter.model, sweep_for(dep))
    batched = {(p["q"], p["batch"]): p["held_out"] for p in pe["batched"]["points"]}
    assert [k for k, v in batched.items() if v] == [(q, b) for q in (1, 4) for b in (4, 16)]
    assert pe["fit_on"]["groups"][1] == {"kind": "batched", "q": [1, 4], "batch": [2, 8]}
    # The same shapes at another context were not fitted.
    other = prediction_error(hw, dep.target, dep.drafter.model, sweep_for(dep, context=CONTEXT + 1))
    assert all(p["held_out"] for k in STEP_KINDS for p in other[k]["points"])


def test_sweep_roundtrip_and_drafter_mismatch():
    dep = toy_deployment()
    sweep = sweep_for(dep)
    again = StepSweep.from_dict(json.loads(json.dumps(sweep.as_dict())))
    assert again.measured_ms.keys() == sweep.measured_ms.keys()
    assert all(again.measured_ms[p] == pytest.approx(m, abs=1e-4) for p, m in sweep.measured_ms.items())
    # Another drafter's sweep scores the target's kinds and says why the draft kind is missing.
    other = StepSweep.from_dict({**sweep.as_dict(), "drafter_fingerprint": "someone-else"})
    pe = prediction_error(dep.hardware, dep.target, dep.drafter.model, other)
    assert pe["draft"] is None and pe["ar"] is not None
    assert any("not this deployment's" in n for n in pe["notes"])
    with pytest.raises(AccuracyError, match="lacks"):
        StepSweep.from_dict({"target": "x"})
    with pytest.raises(AccuracyError, match="kind"):
        StepSweep.from_dict({**sweep.as_dict(), "points": [{"kind": "prefill", "q": 1, "batch": 1,
                                                            "measured_ms": 1.0}]})


def test_report_and_table_carry_the_prediction_error():
    dep = toy_deployment()
    rep = build_report(dep, tau=2.0, steps=sweep_for(dep))
    assert rep["prediction_error"]["verify"]["max_abs_rel_error"] == pytest.approx(0.2, abs=1e-3)
    text = format_table(rep)
    assert "prediction error" in text and "batched" in text and "held-out max" in text
    assert build_report(dep, tau=2.0)["prediction_error"] is None
    other = StepSweep.from_dict({**sweep_for(dep).as_dict(), "target_fingerprint": "someone-else"})
    with pytest.raises(ValueError, match="measured on toy"):
        build_report(dep, tau=2.0, steps=other)


# -- the KV rate: its own term, fitted on batched forwards ----------------------------------------


def test_kv_rate_is_a_term_of_its_own():
    m = load_model_profile("llama-3.1-8b")
    shared = HardwareProfile("x", 1000.0, 10.0, None, 0.0, fixed_overhead_ms=1.0)
    alone = HardwareProfile("x", 1000.0, 10.0, None, 0.0, fixed_overhead_ms=1.0, kv_bandwidth_GBps=250.0)
    a, b = forward_time(shared, m, 4, 16, 1024), forward_time(alone, m, 4, 16, 1024)
    assert a.compute_ms > a.memory_ms  # compute-bound: the shared roofline hides the KV under compute
    assert a.total_ms == pytest.approx(1.0 + a.compute_ms)
    assert b.kv_ms == pytest.approx(a.kv_ms * 4)  # a quarter of the bandwidth
    assert b.total_ms == pytest.approx(1.0 + max(b.weights_ms, b.compute_ms) + b.kv_ms + b.state_ms)
    assert b.roofline_ms == pytest.approx(b.memory_ms + b.compute_beyond_memory_ms)
    dep = CostDeployment("x", alone, m, Drafter("model", load_model_profile("llama-3.1-8b", 1)), 3, 8, 1024)
    check_accounting(modelled_gaps(alone, m, dep.drafter, 3, 2.5, 8, 1024))  # the parts still add up


def test_fit_recovers_the_kv_rate_from_batched_samples():
    m = load_model_profile("llama-3.1-8b")
    base = HardwareProfile("base", 1000.0, 100.0, None, 0.0)
    truth = HardwareProfile("truth", 1000.0, 100.0, None, 0.0, fixed_overhead_ms=3.0, kv_bandwidth_GBps=125.0)
    verify = [(q, 1, 1024, 0.0) for q in (1, 2, 4, 8, 16)]
    batched = [(q, b, 1024, 0.0) for q in (1, 4) for b in (2, 8)]
    verify, batched = ([(q, b, c, t) for (q, b, c, _), t in zip(s, predict_ms(truth, m, s), strict=True)]
                       for s in (verify, batched))
    # These samples are all memory-bound, so the peak is not fitted (nothing here could tell it).
    fit = fit_profile(base, m, verify, fit_peak=False, bandwidth_range=(0.5, 2.0), kv_samples=batched)
    assert fit.profile.kv_bandwidth_GBps == pytest.approx(125.0, rel=0.15)
    assert fit.median_abs_rel_error < 0.02 and len(fit.predicted_ms) == 9
    held = [(q, b, 1024, 0.0) for q in (1, 4) for b in (4, 16)]
    for p, t in zip(predict_ms(fit.profile, m, held), predict_ms(truth, m, held), strict=True):
        assert p == pytest.approx(t, rel=0.05)
    plain = fit_profile(base, m, verify, bandwidth_range=(0.5, 2.0), peak_range=(0.5, 1.5))
    assert plain.profile.kv_bandwidth_GBps is None and plain.kv_bandwidth_scale is None


# -- CLI: a stored profile's sweep, and one-line errors --------------------------------------------


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specpilot")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def _toy_dir(tmp_path: Path) -> Path:
    d = tmp_path / "toy"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TOY))
    return d


def test_cli_reads_the_profiles_step_sweep(tmp_path, capsys):
    model = _toy_dir(tmp_path)
    dep = toy_deployment()
    hw = toy_hw()
    hw.measured["steps"] = sweep_for(dep).as_dict()
    save_profile(hw)
    argv = ["costmodel", "--hardware", "cpu-local", "--target-config", str(model), "--context", str(CONTEXT)]
    assert run_cli([*argv, "--json"]) == 0
    pe = json.loads(capsys.readouterr().out)["prediction_error"]
    assert pe["measurement"]["source"] == "hardware profile cpu-local"
    assert pe["verify"]["max_abs_rel_error"] == pytest.approx(0.2, abs=1e-3)
    assert pe["draft"] is None  # no draft model in this deployment: the drafter's point is not scored
    assert run_cli(argv) == 0
    assert "prediction error" in capsys.readouterr().out


def test_cli_without_a_sweep_says_why(tmp_path, capsys):
    save_profile(toy_hw())
    argv = ["costmodel", "--hardware", "cpu-local", "--target-config", str(_toy_dir(tmp_path)), "--json"]
    assert run_cli(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["prediction_error"] is None
    assert any("no prediction_error" in n and "profile hardware" in n for n in rep["notes"])


def test_cli_bad_sweep_and_bad_values_are_one_line(tmp_path, capsys):
    hw = toy_hw()
    hw.measured["steps"] = {"target": "x"}
    save_profile(hw)
    model = str(_toy_dir(tmp_path))
    assert run_cli(["costmodel", "--hardware", "cpu-local", "--target-config", model]) == 2
    with pytest.raises(SystemExit) as e:
        run_cli(["costmodel", "--deployment", "demo", "--steps-seconds", "0"])
    assert e.value.code == 2
    assert run_cli(["profile", "hardware", "--no-model", "--drafter", model]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("error: hardware profile cpu-local: step sweep lacks")
    assert "--steps-seconds" in err[-2] and "must be positive" in err[-2]
    assert err[-1] == "error: --drafter needs the target it drafts for: drop --no-model, or pass --model DIR"


@pytest.mark.slow
def test_profile_step_sweep_on_a_tiny_model(tmp_path):
    """The profile's step sweep holds the fit's verify samples, and the report scores it (slow: real forwards)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from decoder.lab.hardware import measure_cpu_local

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny")
    hw = measure_cpu_local(tmp_path / "tiny", seconds_budget=2.0, context=32, steps=True, drafter_dir=tmp_path / "tiny")
    sweep = StepSweep.from_dict(hw.measured["steps"])
    assert set(sweep.measured_ms) == set(STEP_POINTS) and sweep.context == 32
    val = hw.measured["validation"]
    assert val["measured_ms"] == [round(sweep.measured_ms[StepPoint("verify", q)], 4) for q in val["q"]]
    target = from_config(json.loads((tmp_path / "tiny" / "config.json").read_text()), "tiny")
    pe = prediction_error(hw, target, target, sweep)
    assert not any(p["held_out"] for p in pe["verify"]["points"])  # the fit's own samples
    assert [(p["q"], p["batch"]) for p in pe["batched"]["points"] if p["held_out"]] == \
        [(q, b) for q in (1, 4) for b in (4, 16)]  # B = 2, 8 fitted the KV rate
    assert hw.kv_bandwidth_GBps > 0 and set(sweep.extra["probe_ms"]) == {"1_layer", "4_layers"}
    assert hw.measured["tiny_forward_ms"] == sweep.extra["probe_ms"]
    assert pe["draft"]["points"][0]["measured_ms"] > 0
