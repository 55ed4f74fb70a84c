"""Bad input gets one clear line on stderr and exit status 2 (each case the real `specpilot` main, captured as a
process of its own: all in one child interpreter, `cli_runs.run_many`)."""

import json
import shutil
import subprocess

import pytest
from cli_runs import run_many
from conftest import demo_available, needs_demo, write_jsonl

from decoder.models import DEMO_DIR

HELP = {"help": ["--help"], "bench-help": ["bench", "--help"], "train-help": ["train", "--help"]}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def runs(tmp) -> dict[str, subprocess.CompletedProcess]:
    """Every case's inputs, then every case run (the demo-model cases where the demo models exist)."""
    cases = {
        "max-new-tokens-zero": ["bench", "--max-new-tokens", "0"],
        "missing-model-dir": ["bench", "--target", str(tmp / "nope"), "--prompts", "code"],
        "unknown-method": ["bench", "--methods", "ar,warp-drive", "--max-new-tokens", "4"],
        **HELP,
    }
    if demo_available():
        bad = write_jsonl(tmp / "bad.jsonl", [{"id": "a", "text": "def f():\n"}, "{not json"])
        bad2 = write_jsonl(tmp / "bad2.jsonl", [{"id": "a", "body": "x"}])
        other = tmp / "other-drafter"
        shutil.copytree(DEMO_DIR / "drafter", other)
        tj = json.loads((other / "tokenizer.json").read_text())
        vocab = tj["model"]["vocab"]
        a, b = "def", "class"
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (other / "tokenizer.json").write_text(json.dumps(tj))
        cases |= {
            "malformed-json": ["bench", "--prompts", str(bad)],
            "malformed-row": ["bench", "--prompts", str(bad2)],
            "different-tokenizers": ["bench", "--target", str(DEMO_DIR / "target"), "--drafter", str(other),
                                     "--prompts", "code"],
            "auto-dtype": ["bench", "--prompts", "code", "--methods", "ar", "--limit", "1", "--max-new-tokens", "4",
                           "--quiet", "--json"],
        }
    return run_many("workbench.cli", cases)


def _one_error_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_max_new_tokens_zero(runs):
    _one_error_line(runs["max-new-tokens-zero"], "--max-new-tokens", "0")


def test_missing_model_dir(runs, tmp):
    missing = tmp / "nope"
    _one_error_line(runs["missing-model-dir"], str(missing), "does not exist")


@needs_demo
def test_malformed_prompt_file(runs):
    _one_error_line(runs["malformed-json"], "bad.jsonl:2", "not valid JSON")
    _one_error_line(runs["malformed-row"], "bad2.jsonl:1", '"text"')


@needs_demo
def test_different_tokenizers(runs):
    _one_error_line(runs["different-tokenizers"], "different tokenizers")


@needs_demo
def test_bench_dtype_defaults_to_the_cpus_choice(runs):
    """No --dtype: float32 on a CPU without native bfloat16, else bfloat16; the report says which."""
    from workbench.workspace import auto_dtype

    r = runs["auto-dtype"]
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["dtype"] == auto_dtype()


def test_unknown_method(runs):
    _one_error_line(runs["unknown-method"], "warp-drive")


@pytest.mark.parametrize("case", list(HELP))
def test_help(runs, case):
    proc = runs[case]
    assert proc.returncode == 0 and "usage" in proc.stdout
