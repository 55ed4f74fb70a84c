"""Cost-model surfaces: hardware profile storage, the report's JSON contract, the PNG, the CLI,
the GPU check's arithmetic, and that the arithmetic never imports torch."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from costmodel.cli import add_parser
from costmodel.deployment import CostDeployment
from costmodel.fit import fit_profile, predict_ms
from costmodel.hardware import DATASHEETS, HardwareError, HardwareProfile, get_profile, load_profile, save_profile
from costmodel.model_profile import from_config, load_model_profile
from costmodel.report import build_report, format_table, plot_gaps
from costmodel.step import Drafter

ROOT = Path(__file__).resolve().parents[1]
TOY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100}
ENTRY = {"name": "sd-draft-model", "tokens_per_s": 120.0, "tau": 2.5, "draft_len": 4, "speedup_vs_ar": 1.8,
         "phase_ms_per_token": {"prefill": 0.5, "draft": 2.0, "verify": 5.0, "accept": 0.3, "other": 0.2}}


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECPILOT_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def toy_deployment(hw: HardwareProfile | None = None, batch: int = 1) -> CostDeployment:
    m = from_config(dict(TOY), "toy")
    hw = hw or HardwareProfile("toy", 1.0, 1e9, None, 0.0, fixed_overhead_ms=0.5)
    return CostDeployment("toy", hw, m, Drafter("model", m), draft_len=4, batch=batch, context=10)


# -- hardware profiles ---------------------------------------------------------------------------


def test_datasheets_are_dense_and_sourced():
    assert set(DATASHEETS) == {"h100-sxm", "h200", "b200", "a100-80gb", "l40s", "rtx-4090"}
    for hw in DATASHEETS.values():
        assert hw.source and hw.mem_bandwidth_GBps > 0 and hw.bf16_tflops > 0
    assert DATASHEETS["h200"].mem_bandwidth_GBps == 4800 and DATASHEETS["h200"].bf16_tflops == pytest.approx(989.4)
    assert DATASHEETS["a100-80gb"].fp8_tflops is None
    assert DATASHEETS["a100-80gb"].peak_tflops("fp8") == 312.0  # no fp8 units: bf16 rate


def test_profile_roundtrip_and_lookup(data_dir):
    hw = HardwareProfile("cpu-local", 12.5, 0.2, None, 0.0, fixed_overhead_ms=3.0, measured={"threads": 2})
    path = save_profile(hw)
    assert path == data_dir / "hardware" / "cpu-local.json"
    assert load_profile(path) == hw
    assert get_profile("cpu-local") == hw
    assert get_profile("h200").mem_bandwidth_GBps == 4800
    explicit = save_profile(hw, data_dir / "elsewhere.json")
    assert load_profile(explicit).fixed_overhead_ms == 3.0


def test_profile_errors_name_the_fix(data_dir):
    with pytest.raises(HardwareError, match="profile hardware"):
        get_profile("cpu-local")
    with pytest.raises(HardwareError, match="h300: unknown"):
        get_profile("h300")
    bad = data_dir / "bad.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("[1]")
    with pytest.raises(HardwareError, match="JSON object"):
        load_profile(bad)


def test_fit_recovers_overhead_and_bandwidth():
    m = load_model_profile("llama-3.1-8b")
    truth = HardwareProfile("truth", 4800 * 0.8, 989.4 * 0.7, None, 50.0, fixed_overhead_ms=4.0)
    samples = [(q, b, 1024, 0.0) for b in (1, 4, 16) for q in (1, 2, 4, 8, 16, 32, 64)]
    samples = [(q, b, c, t) for (q, b, c, _), t in zip(samples, predict_ms(truth, m, samples), strict=True)]
    fit = fit_profile(DATASHEETS["h200"], m, samples, bandwidth_range=(0.25, 1.2), peak_range=(0.25, 1.2))
    assert fit.median_abs_rel_error < 0.01
    assert fit.overhead_ms == pytest.approx(4.0, rel=0.05)
    assert fit.profile.achieved_bandwidth_GBps == pytest.approx(3840, rel=0.05)


# -- report --------------------------------------------------------------------------------------


def test_projection_report_contract():
    rep = build_report(toy_deployment(batch=4), tau=3.0)
    assert rep["ceiling_speedup"] > 1
    assert rep["ceiling_batch"] == 4
    assert "measured_speedup" not in rep and rep["projected_speedup"] > 0
    values = [g["ms_per_token"] for g in rep["gaps"]]
    assert values == sorted(values, reverse=True)
    assert all({"family", "ms_per_token"} <= set(g) for g in rep["gaps"])
    counted = sum(g["ms_per_token"] for g in rep["gaps"] if not g["could_save"])
    assert counted == pytest.approx(rep["gap_accounting"]["total_ms_per_token"], abs=1e-5)
    json.dumps(rep)  # serialisable
    assert "ceiling" in format_table(rep)


def test_measured_report_flags_implausible_speedups():
    rep = build_report(toy_deployment(), bench_entry=ENTRY, ar_ms_per_token=20.0)
    assert rep["measured_speedup"] == 1.8 and rep["plausible"]["ok"]
    assert rep["ms_per_token"] == pytest.approx(1000 / 120, abs=1e-5)
    cheat = build_report(toy_deployment(), bench_entry={**ENTRY, "speedup_vs_ar": 500.0}, ar_ms_per_token=20.0)
    assert not cheat["plausible"]["ok"] and "exceeds" in cheat["plausible"]["reason"]
    assert "IMPLAUSIBLE" in format_table(cheat)


def test_validation_appears_only_for_the_measured_target():
    dep = toy_deployment()
    qs, ctx = [1, 2, 4], 10
    measured = predict_ms(dep.hardware, dep.target, [(q, 1, ctx, 0.0) for q in qs])
    dep.hardware.measured["validation"] = {"fingerprint": dep.target.fingerprint, "q": qs, "context": ctx,
                                           "batch": 1, "format": "bf16", "measured_ms": [m * 1.1 for m in measured]}
    val = build_report(dep, tau=2.0)["validation"]
    assert val["q"] == qs and val["median_abs_rel_error"] == pytest.approx(1 / 11, abs=1e-3)
    dep.hardware.measured["validation"]["fingerprint"] = "someone-else"
    assert "validation" not in build_report(dep, tau=2.0)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rep = build_report(toy_deployment(), bench_entry=ENTRY, ar_ms_per_token=20.0)
    out = plot_gaps(rep, tmp_path / "gaps.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"\.png"):
        plot_gaps(rep, tmp_path / "gaps.jpg")


# -- CLI -----------------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specpilot")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_projection_json(capsys):
    rc = run_cli(["costmodel", "--hardware", "h200", "--target-config", "qwen3-8b", "--tau", "3", "--batch", "16",
                  "--json"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["deployment"]["batch"] == 16 and rep["ceiling_speedup"] > 1
    assert rep["gaps"][0]["ms_per_token"] >= rep["gaps"][-1]["ms_per_token"]


def test_cli_with_a_bench_report(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"num_prompts": 2, "dtype": "bfloat16", "methods": [
        {"name": "ar", "tokens_per_s": 50.0, "tau": 1.0, "speedup_vs_ar": 1.0, "draft_len": None,
         "phase_ms_per_token": {"prefill": 1, "draft": 0, "verify": 18, "accept": 0, "other": 1}}, ENTRY]}))
    plot = tmp_path / "g.png"
    argv = ["costmodel", "--hardware", "h200", "--target-config", "qwen3-8b", "--drafter-config", "qwen3-8b",
            "--drafter-layers", "1", "--bench", str(bench), "--json"]
    if importlib.util.find_spec("matplotlib"):
        argv += ["--plot", str(plot)]
    assert run_cli(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["measured_speedup"] == 1.8 and rep["method"] == "sd-draft-model"
    assert rep["ceilings"][0]["ar_ms_per_token"] == pytest.approx(20.0)  # the bench's AR anchors B = 1


def test_cli_errors_are_one_line(capsys, tmp_path):
    assert run_cli(["costmodel", "--hardware", "h300", "--target-config", "qwen3-8b"]) == 2
    assert run_cli(["costmodel", "--target-config", "qwen3-8b"]) == 2
    assert run_cli(["costmodel", "--hardware", "h200", "--target-config", "qwen3-8b", "--tau", "9"]) == 2
    assert run_cli(["costmodel", "--hardware", "h200", "--target-config", "qwen3-8b", "--bench",
                    str(tmp_path / "missing.json")]) == 2
    assert run_cli(["profile", "gpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and all(line.startswith("error: ") for line in err)
    assert "h300" in err[0] and "--tau 9" in err[2] and "missing.json" in err[3]


# -- GPU check script and import hygiene ---------------------------------------------------------


def test_gpu_check_script_arithmetic():
    spec = importlib.util.spec_from_file_location("gpu_check_costmodel", ROOT / "scripts" / "gpu_check_costmodel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.datasheet_for("NVIDIA H200").name == "h200"
    m = load_model_profile("llama-3.1-8b")
    truth = HardwareProfile("truth", 4000.0, 800.0, None, 50.0, fixed_overhead_ms=6.0)
    cells = [(q, b, 1024, 0.0) for b in mod.BATCHES for q in mod.QS]
    samples = [(q, b, c, t) for (q, b, c, _), t in zip(cells, predict_ms(truth, m, cells), strict=True)]
    summary = mod.summarize(DATASHEETS["h200"], m, samples)
    assert summary["median_abs_rel_error"]["fitted_held_out_batch_gt_1"] < 0.02
    assert summary["median_abs_rel_error"]["datasheet_all"] > 0.1  # the datasheet misses the 6 ms overhead
    assert "held-out" in mod.format_summary(summary)


def test_arithmetic_never_imports_torch():
    code = ("import sys, costmodel, costmodel.report, costmodel.cli, costmodel.deployment, costmodel.fit; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# -- measurements (slow: they time real forwards; `make test-slow`) ------------------------------


@pytest.mark.slow
def test_measure_cpu_local_on_a_tiny_model(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from decoder.lab.hardware import measure_cpu_local

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny")
    hw = measure_cpu_local(tmp_path / "tiny", seconds_budget=3.0, context=32)
    val = hw.measured["validation"]
    assert hw.mem_bandwidth_GBps > 0 and hw.achieved_bf16_tflops > 0
    assert val["q"] == [1, 2, 4, 8, 16] and len(val["measured_ms"]) == 5
    assert val["fingerprint"] == load_model_profile(tmp_path / "tiny").fingerprint
    assert load_profile(save_profile(hw)).measured["validation"] == val


@pytest.mark.slow
def test_gpu_check_smoke_runs_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_costmodel.py"), "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "gpu_check_costmodel.json").read_text())
    assert len(summary["cells"]) == 21
    assert load_profile(tmp_path / "h200-fitted.json").name == "h200-fitted"


@pytest.mark.slow
def test_a_repeated_profile_keeps_the_quietest_run_with_its_evidence(tmp_path):
    from costmodel.hardware import profile_spread
    from decoder.lab.hardware import measure_cpu_local_repeated

    hw = measure_cpu_local_repeated(None, seconds_budget=3.0, repeats=3, threads=1)
    runs = hw.measured["repeats"]
    assert len(runs) == 3 and hw.measured["measured_at"] and hw.measured["load_avg"] >= 0
    times = [r["forward_ms"] for r in runs]
    assert hw.measured["tiny_forward_ms"]["4_layers"] == pytest.approx(min(times), abs=1e-3)
    assert profile_spread(hw) == pytest.approx((max(times) - min(times)) / min(times), abs=1e-3)


def test_the_loop_s_profile_of_this_machine_is_kept_per_dtype(tmp_path):
    """A float32 workspace reads the profile measured with float32 forwards (`cpu-local-float32.json`), a bfloat16
    one `cpu-local.json`: neither is fitted to the other's forwards. (Stored profiles stand in for two quiet
    measurements here; the measuring itself is the slow test below.)"""
    from dataclasses import replace

    from costmodel.hardware import LOCAL, local_profile_path
    from workbench.costing import hardware_profile
    from workbench.workspace import init_demo

    for dtype, bw in (("bfloat16", 11.0), ("float32", 22.0)):
        save_profile(replace(DATASHEETS["h100-sxm"], name=LOCAL, mem_bandwidth_GBps=bw,
                             measured={"dtype": dtype, "spread": 0.01}), local_profile_path(dtype))
    said: list[str] = []
    for dtype, bw in (("bfloat16", 11.0), ("float32", 22.0)):
        ws = init_demo(tmp_path / dtype, prompt_limit=2, hidden=1, dtype=dtype)
        hw = hardware_profile(ws, said.append)
        ws.close()
        assert hw.name == LOCAL and hw.mem_bandwidth_GBps == bw and hw.measured["dtype"] == dtype
    assert not said  # nothing measured: each dtype had its own quiet profile
    assert local_profile_path("bfloat16").name == "cpu-local.json"


def test_profile_hardware_in_float32_keeps_the_bfloat16_profile(data_dir, capsys):
    """`specpilot profile hardware --dtype float32` under the default name writes cpu-local-float32.json (where the
    loop keeps a float32 workspace's profile), never over cpu-local.json; --name and --out still decide."""
    bf16 = HardwareProfile("cpu-local", 12.5, 0.2, None, 0.0, measured={"dtype": "bfloat16"})
    save_profile(bf16)
    parser = argparse.ArgumentParser(prog="specpilot")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["profile", "hardware", "--no-model", "--seconds", "0.3", "--dtype", "float32"])
    assert args.func(args) == 0
    hw = data_dir / "hardware"
    assert capsys.readouterr().out.strip().endswith(f"saved {hw / 'cpu-local-float32.json'}")
    assert load_profile(hw / "cpu-local.json") == bf16
    assert load_profile(hw / "cpu-local-float32.json").name == "cpu-local"
    args = parser.parse_args(["profile", "hardware", "--no-model", "--seconds", "0.3", "--dtype", "float32",
                              "--name", "box"])
    assert args.func(args) == 0 and (hw / "box.json").is_file()


@pytest.mark.slow
def test_a_float32_workspace_measures_its_own_profile_beside_a_bfloat16_one(tmp_path):
    from dataclasses import replace

    from costmodel.hardware import LOCAL, local_profile_path
    from workbench.costing import hardware_profile
    from workbench.workspace import init_demo

    bf16 = replace(DATASHEETS["h100-sxm"], name=LOCAL, measured={"dtype": "bfloat16", "spread": 0.01})
    save_profile(bf16, local_profile_path("bfloat16"))
    local_profile_path("float32").unlink(missing_ok=True)
    said: list[str] = []
    ws = init_demo(tmp_path / "f32", prompt_limit=2, hidden=1, dtype="float32")
    hw = hardware_profile(ws, said.append)
    ws.close()
    assert hw.measured["dtype"] == "float32" and said and "float32" in said[0]
    assert load_profile(local_profile_path("bfloat16")).mem_bandwidth_GBps == bf16.mem_bandwidth_GBps
