"""llama.cpp as an engine (issue #19): the cached build, the demo GGUFs, the server adapter, bench --peers.

Tests that need the engine run against the real built `llama-server` and are skipped, with one line saying
so, only when `make llama-cpp` has not been run (the cache is per user, outside the clone)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import needs_demo
from tokenizers import Tokenizer

from decoder.contract import near_tie
from decoder.engines import EngineError, EngineNotBuilt
from decoder.engines import llamacpp_build as build
from decoder.engines.llamacpp import LlamaServer, ServerSettings, SpecSettings, server_spec_types
from decoder.models import DEMO_DIR
from workbench.cli import main

ROOT = Path(__file__).resolve().parent.parent


# The engine cache as the user has it, read before conftest gives each test a private data dir; the tests
# only read it, through SPECPILOT_ENGINES_DIR.
ENGINES = build.engines_root()


def _engine_ready() -> bool:
    return build.is_built() and all(build.gguf_path(m, t).is_file() for m in build.DEMO_MODELS
                                    for t in build.GGUF_TYPES)


@pytest.fixture(autouse=True)
def _real_engines(monkeypatch):
    monkeypatch.setenv("SPECPILOT_ENGINES_DIR", str(ENGINES))


needs_llamacpp = pytest.mark.skipif(not _engine_ready(),
                                    reason="llama.cpp is not built (run `make llama-cpp`)")
ONE_THREAD = ServerSettings(threads=1)  # tests do not time; the 2 cores are shared


def _prompts(name: str) -> list[dict]:
    return [json.loads(line) for line in (DEMO_DIR / "prompts" / f"{name}.jsonl").read_text().splitlines()]


# -- the build module, without building ---------------------------------------------------------------------


def test_cache_is_version_keyed_under_the_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("SPECPILOT_ENGINES_DIR")
    assert build.engine_dir() == tmp_path / "engines" / f"llama.cpp-{build.LLAMA_CPP_PYTHON_VERSION}"
    assert build.binary("llama-server").parent == build.engine_dir() / "bin"
    assert not build.is_built()


def _fake_binaries(root: Path) -> None:
    (root / "bin").mkdir(parents=True)
    for name in build.BINARIES:
        p = root / "bin" / name
        p.write_text("#!/bin/sh\n")
        p.chmod(p.stat().st_mode | stat.S_IXUSR)


def test_second_build_is_a_no_op(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECPILOT_ENGINES_DIR", str(tmp_path))
    _fake_binaries(build.engine_dir())
    assert build.main(["build"]) == 0
    assert "already built" in capsys.readouterr().err
    assert not (build.engine_dir() / "build.log").exists()  # nothing ran


def test_failed_build_is_one_line_naming_step_and_log(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECPILOT_ENGINES_DIR", str(tmp_path))
    src = build.source_dir()
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("this is not cmake(\n")
    assert build.main(["build"]) == build.EXIT_FAILED
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: cmake configure failed") and str(build.engine_dir() / "build.log") in err[-1]
    assert not (build.engine_dir() / "bin").exists()  # nothing half-written where a reader looks


def test_missing_build_is_one_line_exit_2(tmp_path):
    env = dict(os.environ, SPECPILOT_ENGINES_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "bench", "--peers", "llama.cpp"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "make llama-cpp" in r.stderr and "Traceback" not in r.stderr


def test_unknown_peer_is_a_usage_error():
    assert main(["bench", "--peers", "vllm"]) == 2


# -- the real engine -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ar_server():
    with LlamaServer(build.gguf_path("target", "f32"), settings=ONE_THREAD) as server:
        yield server


@needs_llamacpp
@needs_demo
@pytest.mark.parametrize("prompt_set", ["code", "prose"])
def test_llamacpp_tokenizes_every_bench_prompt_as_we_do(ar_server, demo_tokenizer, prompt_set):
    for row in _prompts(prompt_set):
        ours = demo_tokenizer(row["text"], add_special_tokens=False)["input_ids"]
        assert ar_server.tokenize(row["text"]) == ours, row["id"]


@needs_llamacpp
def test_gguf_says_gpt2_pre_tokenizer():
    out = subprocess.run([str(build.binary("llama-tokenize")), "-m", str(build.gguf_path("target", "bf16")), "-p",
                          "def f(x):\n    return x", "--ids", "--log-disable"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-500:]
    ids = json.loads(out.stdout.strip().splitlines()[-1])
    tok = json.loads((DEMO_DIR / "target" / "tokenizer.json").read_text())
    assert tok["pre_tokenizer"]["type"] == "ByteLevel"
    assert ids == Tokenizer.from_file(str(DEMO_DIR / "target" / "tokenizer.json")).encode(
        "def f(x):\n    return x", add_special_tokens=False).ids


@needs_llamacpp
@needs_demo
def test_greedy_matches_hf_fp32_and_margins_are_logit_margins(ar_server, demo_fp32, demo_prompts):
    target, _ = demo_fp32
    for prompt in demo_prompts[:2]:
        prompt = prompt[-64:]
        done = ar_server.generate(prompt, 16)
        assert done.seconds > 0 and 1 <= len(done.tokens) <= 16
        with torch.inference_mode():
            ref = target.generate(input_ids=torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                  pad_token_id=0, eos_token_id=0)[0, len(prompt):].tolist()
            scores = ar_server.score(prompt, ref[:4])
            for i, s in enumerate(scores):
                logits = target(input_ids=torch.tensor([prompt + ref[:i]])).logits[0, -1].float()
                top = torch.topk(logits, 2).values
                # ggml's f32 matmuls sum in another order per CPU's SIMD width: 2.0e-3 apart seen on one CI CPU
                assert s.margin == pytest.approx((top[0] - top[1]).item(), abs=1e-2)
                if i < len(ref):
                    assert s.token == ref[i] or near_tie(s.margin, 1e-3)
        pos = next((i for i, (a, b) in enumerate(zip(done.tokens, ref, strict=False)) if a != b), None)
        assert pos is None or near_tie(scores[0].margin if pos == 0 else ar_server.score(prompt + ref[:pos])[0].margin,
                                       1e-3), (done.tokens, ref)


@needs_llamacpp
def test_spec_types_come_from_the_binary_and_draft_model_runs():
    types = server_spec_types()
    assert "draft-simple" in types and "ngram-simple" in types and "none" in types
    prompt = list(range(5, 60))
    spec = SpecSettings("draft-simple", build.gguf_path("drafter", "f32"), n_max=3)
    with LlamaServer(build.gguf_path("target", "f32"), settings=ONE_THREAD) as ar, \
            LlamaServer(build.gguf_path("target", "f32"), spec=spec, settings=ONE_THREAD) as sd:
        a, s = ar.generate(prompt, 24), sd.generate(prompt, 24)
        assert s.drafted > 0 and 0 <= s.accepted <= s.drafted
        assert a.tokens[:8] == s.tokens[:8]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@needs_llamacpp
def test_stop_kills_the_server_also_on_exceptions():
    server = LlamaServer(build.gguf_path("target", "bf16"), settings=ONE_THREAD)
    with pytest.raises(RuntimeError), server:
        pid = server.pid
        assert _alive(pid)
        raise RuntimeError("boom")
    assert not _alive(pid)
    server.stop()  # twice is fine
    with pytest.raises(EngineError, match="not started"):
        server.generate([1, 2, 3], 4)


@needs_llamacpp
def test_a_killed_parent_leaves_no_server(tmp_path):
    code = ("import sys, time; from decoder.engines.llamacpp import LlamaServer, ServerSettings;"
            "from decoder.engines.llamacpp_build import gguf_path;"
            "s = LlamaServer(gguf_path('target', 'bf16'), settings=ServerSettings(threads=1), log_dir=sys.argv[1]);"
            "s.start(); print(s.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ))
    try:
        pid = int(parent.stdout.readline())
        assert _alive(pid)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


@needs_llamacpp
def test_a_server_dead_of_sigill_names_no_repack(tmp_path):
    # On this VM the repacked Q4 kernels execute AMX instructions that trap: llama-server dies of SIGILL at its
    # first request. The real server is killed with that signal here; the error must say what to do.
    with LlamaServer(build.gguf_path("target", "bf16"), settings=ONE_THREAD, log_dir=tmp_path) as server:
        os.killpg(server.pid, signal.SIGILL)
        server._proc.wait(10)
        with pytest.raises(EngineError) as e:
            server.generate([1, 2, 3], 4)
    msg = str(e.value)
    assert "\n" not in msg and "SIGILL" in msg and "--no-repack" in msg


@needs_llamacpp
def test_a_server_that_cannot_start_is_one_line_with_its_log(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(EngineError) as e:
        LlamaServer(bad, settings=ONE_THREAD, log_dir=tmp_path).start()
    msg = str(e.value)
    assert "\n" not in msg and f"log: {tmp_path}" in msg
    with pytest.raises(EngineError, match="make llama-cpp"):
        LlamaServer(tmp_path / "missing.gguf").start()


def test_engine_not_built_names_make_target(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_ENGINES_DIR", str(tmp_path))
    with pytest.raises(EngineNotBuilt, match="make llama-cpp"):
        LlamaServer(tmp_path / "x.gguf").start()


# -- bench --peers ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_llamacpp
@needs_demo
def test_bench_with_llamacpp_peers(tmp_path):
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "bench", "--deployment", "demo", "--prompts", "code",
                        "--limit", "2", "--max-new-tokens", "24", "--methods", "ar-lean,sd-draft-model-lean",
                        "--peers", "llama.cpp", "--peer-spec-types", "draft-simple,ngram-simple,draft-mtp",
                        "--json", "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    names = [m["name"] for m in report["methods"]]
    assert names[-3:] == ["llama.cpp-ar", "llama.cpp-draft-simple", "llama.cpp-ngram-simple"]
    assert {"hf-greedy", "ar-lean", "sd-draft-model-lean"} <= set(names)
    for m in report["methods"]:
        assert m["ratio_vs_llama_cpp_ar"] > 0 and m["unexplained_mismatches"] == 0, m
    ar = report["methods"][names.index("llama.cpp-ar")]
    assert ar["ratio_vs_llama_cpp_ar"] == 1.0 and "vs_hf_greedy" in ar
    assert report["methods"][names.index("llama.cpp-draft-simple")]["checked_against"] == "llama.cpp-ar"
    assert [s["name"] for s in report["skipped"]] == ["llama.cpp-draft-mtp"]
    assert report["peers"]["threads"] == report["torch_threads"]
