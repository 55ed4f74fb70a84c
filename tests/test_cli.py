"""Bad input gets one clear line on stderr and exit status 2 (run as a real subprocess)."""

import json
import shutil
import subprocess
import sys

import pytest
from conftest import needs_demo, write_jsonl

from decoder.models import DEMO_DIR


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True,
                          timeout=300)


def _one_error_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_max_new_tokens_zero():
    _one_error_line(_run("bench", "--max-new-tokens", "0"), "--max-new-tokens", "0")


def test_missing_model_dir(tmp_path):
    missing = tmp_path / "nope"
    _one_error_line(_run("bench", "--target", str(missing), "--prompts", "code"), str(missing), "does not exist")


@needs_demo
def test_malformed_prompt_file(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": "a", "text": "def f():\n"}, "{not json"])
    _one_error_line(_run("bench", "--prompts", str(bad)), "bad.jsonl:2", "not valid JSON")
    bad2 = write_jsonl(tmp_path / "bad2.jsonl", [{"id": "a", "body": "x"}])
    _one_error_line(_run("bench", "--prompts", str(bad2)), "bad2.jsonl:1", '"text"')


@needs_demo
def test_different_tokenizers(tmp_path):
    other = tmp_path / "other-drafter"
    shutil.copytree(DEMO_DIR / "drafter", other)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = "def", "class"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    _one_error_line(_run("bench", "--target", str(DEMO_DIR / "target"), "--drafter", str(other), "--prompts", "code"),
                    "different tokenizers")


def test_unknown_method():
    _one_error_line(_run("bench", "--methods", "ar,warp-drive", "--max-new-tokens", "4"), "warp-drive")


@pytest.mark.parametrize("args", [["--help"], ["bench", "--help"], ["train", "--help"]])
def test_help(args):
    proc = _run(*args)
    assert proc.returncode == 0 and "usage" in proc.stdout
