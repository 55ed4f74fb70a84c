"""The training recipe: corpus split, resumable seeded training."""

import json

import numpy as np
import torch

from decoder.lab.corpus import code_documents, make_prompt, prose_documents, split_of
from decoder.lab.train import LMSpec, train_lm, train_tokenizer
from decoder.models import DEMO_DIR


def test_split_is_stable_and_prompts_are_held_out():
    code = code_documents()
    assert len(code) > 300
    assert all(split_of(d.id, "code") == split_of(d.id, "code") for d in code[:50])
    ids = {json.loads(x)["id"] for x in (DEMO_DIR / "prompts" / "code.jsonl").read_text().splitlines()}
    ids |= {json.loads(x)["id"] for x in (DEMO_DIR / "prompts" / "prose.jsonl").read_text().splitlines()}
    assert len(ids) >= 24
    domain = {d.id: d.domain for d in code + prose_documents()}
    assert all(split_of(i, domain[i]) == "heldout" for i in ids)


def test_make_prompt_ends_on_line_boundary():
    text = "".join(f"line {i}\n" for i in range(500))
    p = make_prompt(text, target_chars=300)
    assert p.endswith("\n") and len(p) >= 300


def test_training_resumes_to_the_same_weights(tmp_path):
    from decoder.lab.corpus import Document

    docs = [Document(f"d{i}", "code", f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 20) for i in range(200)]
    docs = [d for d in docs if split_of(d.id, "code") == "train"][:60] + [
        d for d in docs if split_of(d.id, "code") == "val"]
    tok_dir = tmp_path / "tok"
    train_tokenizer(docs, 300, tok_dir)
    from decoder.lab.train import tokenize_corpus

    data = tokenize_corpus(docs, tok_dir, tmp_path / "tokens", 1)
    spec = LMSpec(name="tiny", hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2,
                  num_key_value_heads=1, steps=6, batch_size=2, seq_len=32, warmup_steps=2, checkpoint_every=3)

    straight = train_lm(spec, data, tok_dir, tmp_path / "w1", tmp_path / "out1")
    # Interrupted run: stop after 3 steps (a checkpoint), then resume to 6.
    short = LMSpec(**{**spec.__dict__, "steps": 3})
    train_lm(short, data, tok_dir, tmp_path / "w2", tmp_path / "partial")
    resumed = train_lm(spec, data, tok_dir, tmp_path / "w2", tmp_path / "out2")

    from safetensors.torch import load_file

    a = load_file(tmp_path / "out1" / "model.safetensors")
    b = load_file(tmp_path / "out2" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert straight["final_val_loss"] == resumed["final_val_loss"]
    assert a[next(iter(a))].dtype == torch.bfloat16
    assert np.isfinite(straight["final_val_loss"])
