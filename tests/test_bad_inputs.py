"""Bring-your-own-model inputs that used to crash, hang or write the wrong file (#23): each ends in one line
on stderr naming the value and the fix, with the documented exit status, before any work and with no output
file left behind. Every case runs the real command's `main` outside the test process, on tiny random models
in a temporary folder: the `specpilot` runs all in one child interpreter (`cli_runs.run_many`: each run's
stdout and stderr captured at the file descriptors, as a process of its own), the others each in a
subprocess of their own (another environment, or a protocol on stdin)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runs import run_many
from conftest import tiny_llama, write_jsonl

from costmodel.cli import PROFILE_NAME
from decoder.config import ConfigError, DecodeConfig
from decoder.models import DEMO_DIR
from workbench.cli_util import EXIT_USAGE
from workbench.workspace import init_demo
from workbench.workspace_cli import EXIT_CRASH

VOCAB = 6144  # the demo tokenizer's: the tiny models borrow it (committed with the package)


def _run(*argv: str, module: str = "workbench.cli", stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, *argv], input=stdin, capture_output=True, text=True,
                          timeout=180, env=env)


def _one_line(proc: subprocess.CompletedProcess, code: int, *needles: str, prefix: str = "error: ") -> str:
    """The whole of stderr is one line starting with `prefix` and holding every needle; the exit status is `code`."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert lines[0].startswith(prefix), lines[0]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _save(model, path: Path) -> Path:
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / "target" / f, path / f)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny target on the demo tokenizer, one with a truncated weights file, and a drafter whose output
    layer is narrower than the target's (same tokenizer)."""
    root = tmp_path_factory.mktemp("models")
    target = _save(tiny_llama(vocab=VOCAB, hidden=32, layers=1), root / "target")
    corrupt = root / "corrupt"
    shutil.copytree(target, corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    narrow = _save(tiny_llama(vocab=VOCAB - 144, hidden=32, layers=1, seed=1), root / "narrow-drafter")
    prompts = write_jsonl(root / "prompts.jsonl", [{"id": "a", "text": "def add(a, b):\n    return"}])
    return {"target": target, "corrupt": corrupt, "narrow": narrow, "prompts": prompts}


def _bench(models: dict, out: Path, *argv: str) -> list[str]:
    """`specpilot bench` on the tiny prompts, writing --out `out` (which no failure may leave behind)."""
    return ["bench", "--prompts", str(models["prompts"]), "--max-new-tokens", "4", "--quiet", "--dtype", "float32",
            "--out", str(out), *argv]


@pytest.fixture(scope="module")
def cli(models, tmp_path_factory) -> dict:
    """Every `specpilot` case's inputs in a folder of its own, and its run (all in one child interpreter)."""
    root = tmp_path_factory.mktemp("cli")
    d = {n: root / n for n in ("corrupt", "latin1", "narrow", "out", "tokens", "no-target", "force")}
    for f in d.values():
        f.mkdir()
    bad = d["latin1"] / "latin1.jsonl"
    bad.write_bytes('{"id": "a", "text": "caf\xe9"}\n'.encode("latin-1"))
    ws = init_demo(d["force"] / "ws", forcing_max_new_tokens=4, prompt_limit=3, hidden=1,
                   limits={"start_s": 60, "request_s": 10})
    ws.create_branch("cand")
    ws.close()
    toml = d["force"] / "ws" / "specpilot.toml"
    entry = json.dumps([sys.executable, "-c", "raise SystemExit(7)"])
    toml.write_text("\n".join(f"entry = {entry}" if ln.startswith("entry = ") else ln
                              for ln in toml.read_text().splitlines()) + "\n")
    target = str(models["target"])
    runs = {
        "corrupt": _bench(models, d["corrupt"] / "report.json", "--target", str(models["corrupt"]), "--methods", "ar"),
        "latin1": ["bench", "--target", target, "--prompts", str(bad), "--methods", "ar", "--out",
                   str(d["latin1"] / "report.json")],
        "narrow": _bench(models, d["narrow"] / "report.json", "--target", target, "--drafter", str(models["narrow"]),
                         "--methods", "sd-draft-model"),
        "out-missing": _bench(models, d["out"] / "no-such-folder" / "report.json", "--target", target, "--methods",
                              "ar"),
        "out-folder": _bench(models, d["out"], "--target", target, "--methods", "ar"),
        "tokens-huge": _bench(models, d["tokens"] / "report.json", "--target", target, "--methods", "ar",
                              "--max-new-tokens", "1000000000"),
        "tokens-1000": _bench(models, d["tokens"] / "report.json", "--target", target, "--methods", "ar",
                              "--max-new-tokens", "1000"),
        "no-target": _bench(models, d["no-target"] / "report.json", "--drafter", target, "--methods", "ar"),
        "force": ["force", "--workspace", str(d["force"] / "ws"), "--branch", "cand", "--quiet"],
    }
    return {"dirs": d, "bad": bad, "runs": run_many("workbench.cli", runs)}


def test_corrupt_weights_are_one_line(models, cli):
    line = _one_line(cli["runs"]["corrupt"], EXIT_USAGE, str(models["corrupt"]), "failed to load", "SafetensorError",
                     "re-download")
    assert "\n" not in line and not (cli["dirs"]["corrupt"] / "report.json").exists()


def test_a_prompt_file_that_is_not_utf8(cli):
    _one_line(cli["runs"]["latin1"], EXIT_USAGE, str(cli["bad"]), "not UTF-8", "0xe9", "save the file as UTF-8")
    assert not (cli["dirs"]["latin1"] / "report.json").exists()


def test_a_drafter_with_another_vocabulary_is_refused_before_decoding(cli):
    _one_line(cli["runs"]["narrow"], EXIT_USAGE, str(VOCAB - 144), str(VOCAB), "drafter")
    assert not (cli["dirs"]["narrow"] / "report.json").exists()


def test_out_is_checked_before_the_bench_runs(cli):
    missing = cli["dirs"]["out"] / "no-such-folder" / "report.json"
    proc = cli["runs"]["out-missing"]
    _one_line(proc, EXIT_USAGE, str(missing.parent), "does not exist")
    assert proc.stdout == "" and not missing.parent.exists()
    _one_line(cli["runs"]["out-folder"], EXIT_USAGE, "is a folder")


def test_max_new_tokens_is_bounded(cli):
    out = cli["dirs"]["tokens"] / "report.json"
    _one_line(cli["runs"]["tokens-huge"], EXIT_USAGE, "--max-new-tokens 1000000000", "at most 65536")
    # The tiny target holds 256 positions (config.json max_position_embeddings), the prompt some of them.
    line = _one_line(cli["runs"]["tokens-1000"], EXIT_USAGE, "--max-new-tokens 1000", "256 positions", "use at most")
    assert not out.exists(), line


def test_profile_name_cannot_leave_the_data_dir(tmp_path, monkeypatch):
    data = tmp_path / "a" / "b" / "data"
    monkeypatch.setenv("SPECPILOT_DATA_DIR", str(data))
    proc = _run("profile", "hardware", "--no-model", "--seconds", "0.5", "--name", "../../x")
    _one_line(proc, EXIT_USAGE, "--name '../../x'", "--out FILE")
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    assert not any(PROFILE_NAME.fullmatch(n) for n in ("/tmp/x", ".hidden", "..", "a/b", "a\\b", ""))
    assert all(PROFILE_NAME.fullmatch(n) for n in ("cpu-local", "h100-sxm", "my_box.2"))


def test_budget_minutes_must_be_finite_and_positive(tmp_path):
    for value in ("nan", "inf", "0"):
        proc = _run("--auto", "--workspace", str(tmp_path / "ws"), "--budget-minutes", value,
                    module="workbench.tui_entry")
        _one_line(proc, EXIT_USAGE, f"--budget-minutes: {value}", "finite number above 0")
    assert not (tmp_path / "ws").exists()


def test_serve_refuses_a_nan_temperature(models, tmp_path):
    cfg = tmp_path / "system.toml"
    cfg.write_text('[decode]\nmethod = "ar"\ntemperature = nan\n')
    proc = _run("--target", str(models["target"]), "--config", str(cfg), module="decoder.serve",
                stdin='{"op": "quit"}\n')
    _one_line(proc, 2, "temperature = nan", "finite", prefix="serve: bad config")
    assert proc.stdout == ""  # refused before the models load: no ready line
    for key, value in (("temperature", math.inf), ("temperature", -1.0), ("dcut_threshold", math.nan),
                       ("top_p", math.nan)):
        with pytest.raises(ConfigError, match=key):
            DecodeConfig(**{key: value})


def test_drafter_without_target_is_an_error(models, cli):
    _one_line(cli["runs"]["no-target"], EXIT_USAGE, f"--drafter {models['target']}", "needs --target")
    assert not (cli["dirs"]["no-target"] / "report.json").exists()


def test_force_on_a_crashing_stock_exits_with_the_crash_status(cli):
    _one_line(cli["runs"]["force"], EXIT_CRASH, "stock crashed", "status 7", "specpilot.toml")
    assert EXIT_CRASH == 3  # README: force exits 0 lossless, 1 mismatch, 3 crash/rejected
