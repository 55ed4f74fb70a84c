"""The SmolLM2 draft model (issues #19, #24): the recipe's pieces on tiny models, its GGUF for llama.cpp, and
(slow) the committed drafter in llama.cpp against our PyTorch drafter and as llama-server's draft model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from decoder.contract import data_dir
from decoder.engines import smollm2
from decoder.engines.llamacpp_build import engines_root, is_built
from decoder.lab.projected_drafter import ProjectedDrafter, SmolDrafterSpec, _permute, write_hf_dir
from decoder.lab.smollm2_drafter import _batch, chain_tau, load_drafter, save_drafter, target_embedding

ROOT = Path(__file__).resolve().parent.parent
USER_MODELS = data_dir() / "models"  # read before conftest gives each test a private data dir
ENGINES = engines_root()  # the user's engine cache, likewise; the slow tests only read it
TINY = SmolDrafterSpec(hidden_size=64, num_layers=1, intermediate_size=64, num_heads=2, num_kv_heads=1)


def test_chain_tau_is_one_plus_the_capped_run_of_agreements_from_each_position():
    a = [np.array([True, True, False, True])]
    # from position 0: 2 agree (cap 2) -> 3; 1: one -> 2; 2: none -> 1; 3: one (then the answer ends) -> 2
    assert chain_tau(a, 2) == pytest.approx(8 / 4)
    assert chain_tau(a, 1) == pytest.approx((2 + 2 + 1 + 2) / 4)
    assert chain_tau([np.zeros(5, bool)], 4) == 1.0


def test_batch_targets_are_the_answer_tokens_shifted_and_padding_is_ignored():
    seqs = [(np.array([5, 6, 7, 8, 9]), 2), (np.array([1, 2, 3]), 1)]
    ids, tgt = _batch(seqs, [0, 1])
    assert ids.tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]]
    # row 0: the prompt is 5 6; the answer 7 8 9 is predicted at positions 1, 2, 3
    assert tgt.tolist() == [[-100, 7, 8, 9, -100], [2, 3, -100, -100, -100]]


def test_permute_matches_llama_cpp_converters_rope_order():
    w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)  # 2 heads of 4 rows: rows (0 1 | 2 3) -> (0 2 1 3)
    got = _permute(w, 2)
    assert got[:, 0].tolist() == [0, 6, 3, 9, 12, 18, 15, 21]


def _tiny_target(path: Path, vocab: int = 128, dim: int = 96) -> torch.Tensor:
    import gguf

    rng = np.random.default_rng(0)
    emb = rng.standard_normal((vocab, dim)).astype(np.float32)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_tensor("token_embd.weight", emb)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return torch.from_numpy(emb)


def test_the_drafter_gguf_is_the_projected_embedding_and_layers_with_the_targets_tokenizer(tmp_path):
    gguf = pytest.importorskip("gguf", reason="the [smollm2] extra is not installed (pip install -e '.[smollm2]')")
    target = tmp_path / "models" / "smollm2" / smollm2.GGUF_NAME
    target.parent.mkdir(parents=True)
    emb = _tiny_target(target)
    assert torch.equal(target_embedding(target), emb)
    torch.manual_seed(0)
    model = ProjectedDrafter(TINY, emb)
    model.init_projection()
    asset = tmp_path / "asset"
    save_drafter(model, TINY, asset, {"x": 1})
    assert (asset / "recipe.json").is_file() and not list(asset.glob(".*.tmp"))
    out = smollm2.smollm2_drafter_gguf(tmp_path / "models", asset)
    assert out.name == smollm2.DRAFTER_GGUF and not list(out.parent.glob("*.part"))
    r = gguf.GGUFReader(str(out))
    assert r.get_field("tokenizer.ggml.tokens").contents() == [f"t{i}" for i in range(128)]
    assert r.get_field("llama.embedding_length").contents() == 64
    assert r.get_field("llama.attention.head_count_kv").contents() == 1
    tensors = {t.name: t for t in r.tensors}
    assert "output.weight" not in tensors  # tied: llama.cpp reads the LM head from token_embd
    got = gguf.quants.dequantize(tensors["token_embd.weight"].data, tensors["token_embd.weight"].tensor_type)
    loaded = load_drafter(asset, emb)  # the committed (bf16) weights
    want = loaded.weight().detach().numpy()
    assert got.shape == want.shape and np.abs(got - want).max() <= np.abs(want).max() / 100  # Q8_0
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "Q8_0"
    assert tensors["output_norm.weight"].tensor_type.name == "F32"
    # written once; a retrained drafter rewrites it
    stamp = out.stat().st_mtime_ns
    assert smollm2.smollm2_drafter_gguf(tmp_path / "models", asset).stat().st_mtime_ns == stamp
    with torch.no_grad():
        model.proj.mul_(2)
    save_drafter(model, TINY, asset, {"x": 2})
    smollm2.smollm2_drafter_gguf(tmp_path / "models", asset)
    r2 = gguf.GGUFReader(str(out))
    t2 = next(t for t in r2.tensors if t.name == "token_embd.weight")
    assert not np.allclose(gguf.quants.dequantize(t2.data, t2.tensor_type), got)


def test_no_drafter_committed_is_one_line(tmp_path):
    with pytest.raises(smollm2.ModelFetchError, match=r"^no SmolLM2 drafter at .*specpilot train smollm2-drafter"):
        smollm2.smollm2_drafter_gguf(tmp_path, tmp_path / "none")
    assert not smollm2.has_drafter(tmp_path / "none")


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "train smollm2-drafter: --steps 0 must be positive"),
    (["--num-layers", "9"], "train smollm2-drafter: --num-layers 9: use 1 to 8"),
    (["--engine-server", "/nonexistent/llama-server"], "train smollm2-drafter: --engine-server "
     "/nonexistent/llama-server: not an executable file; give a llama-server binary (or leave it out for make "
     "llama-cpp's)"),
])
def test_train_smollm2_drafter_bad_values_are_one_line(args, message):
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "train", "smollm2-drafter", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == f"error: {message}", r.stderr


# -- the committed drafter on the real model ---------------------------------------------------------------------


@pytest.fixture
def real(monkeypatch):
    monkeypatch.setenv("SPECPILOT_ENGINES_DIR", str(ENGINES))
    if not smollm2.has_drafter():
        pytest.skip("no SmolLM2 drafter committed (specpilot train smollm2-drafter)")
    if not is_built():
        pytest.skip("llama.cpp is not built (make llama-cpp)")
    try:
        target = smollm2.smollm2_gguf(USER_MODELS)
        return target, smollm2.smollm2_drafter_gguf(USER_MODELS), smollm2.smollm2_hf_dir(USER_MODELS)
    except smollm2.ModelFetchError as e:
        pytest.skip(f"SmolLM2 cannot be fetched or converted: {e}")


@pytest.mark.slow
def test_llama_cpp_runs_the_drafter_gguf_as_our_pytorch_drafter_does(real):
    """The GGUF's layout (rope order, tied head, norms) is right: llama.cpp's greedy tokens with the drafter as
    the model equal the PyTorch drafter's on a chat prompt (Q8_0 against bf16: compared until a near tie)."""
    from transformers import AutoTokenizer

    from decoder.engines.llamacpp import LlamaServer, ServerSettings

    target, drafter_gguf, hf = real
    tok = AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
    text = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that sums a list."}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    model = load_drafter(embedding=target_embedding(target))
    seq, margins = list(ids), []
    with torch.no_grad():
        for _ in range(24):
            logits = model(torch.tensor([seq]))[0, -1]
            top = torch.topk(logits, 2)
            margins.append(float(top.values[0] - top.values[1]))
            seq.append(int(top.indices[0]))
    ours = seq[len(ids):]
    with LlamaServer(drafter_gguf, settings=ServerSettings(extra=("--no-repack",)), name="drafter-as-model") as srv:
        theirs = srv.generate(ids, 24).tokens
    n = next((i for i, m in enumerate(margins) if m < 0.05), len(margins))  # up to the first near tie
    assert n >= 4 and theirs[:n] == ours[:n], (ours, theirs, margins)


@pytest.mark.slow
def test_llama_server_drafts_with_it_and_its_output_is_ar_s(real):
    from transformers import AutoTokenizer

    from decoder.engines.llamacpp import LlamaServer, ServerSettings, SpecSettings

    target, drafter_gguf, hf = real
    tok = AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
    rows = [json.loads(line) for line in (smollm2.INSTRUCTIONS / "code.jsonl").read_text().splitlines()][:2]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": r["text"]}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for r in rows]
    settings = ServerSettings(extra=("--no-repack",))
    with LlamaServer(target, settings=settings) as ar:
        want = [ar.generate(p, 48).tokens for p in prompts]
    spec = SpecSettings("draft-simple", drafter_gguf, 3)
    with LlamaServer(target, spec, settings) as sd:
        got = [sd.generate(p, 48) for p in prompts]
    assert [g.tokens for g in got] == want
    assert sum(g.drafted for g in got) > 0 and sum(g.accepted for g in got) > 0, [g.timings for g in got]


def test_the_drafter_as_a_hugging_face_llama_gives_the_projected_drafters_logits(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    emb = torch.randn(128, 96)
    model = ProjectedDrafter(TINY, emb)
    model.init_projection()
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (tok_dir / "tokenizer.json").write_text("{}")
    write_hf_dir(model, tok_dir, tmp_path / "hf")
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and hf.config.eos_token_id == 2
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, model.eval()(ids), atol=1e-5)


def test_train_smollm2_drafter_into_a_path_that_cannot_be_a_folder_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "train", "smollm2-drafter", "--work-dir",
                        str(tmp_path / "file" / "w")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Not a directory" in r.stderr, r.stderr
    assert "--work-dir" in r.stderr and not (tmp_path / "file" / "w").exists()
