"""Shared fixtures: the committed demo models (trained by `specpilot train demo`) and tiny random models."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from decoder.engines import llamacpp_build
from decoder.models import DEMO_DIR, load_causal_lm, load_tokenizer

# One intra-op thread: CI's two cores are often shared with other work, and OpenMP threads that spin-wait
# for a busy core make a loaded run many times slower; subprocesses (the harness) use one thread too.
torch.set_num_threads(1)


# `make test` runs each file whole on one of two workers (--dist loadfile), and xdist hands out the files with the
# most tests first: files with few but long tests (the harness, the loop, the sampled generation) came last, and
# one worker ran them alone while the other idled. Longest first instead: these files, heaviest first (as
# measured here), then every other file in collection order. Only the order of files changes, never the order
# of the tests inside one (test_tui's flows build on each other).
HEAVIEST_FILES = ("test_forcing.py", "test_tui.py", "test_loop.py", "test_featdraft.py", "test_batch.py",
                  "test_generate.py", "test_init_target.py", "test_tree.py", "test_w12.py", "test_load.py",
                  "test_archs.py", "test_presets.py", "test_verify.py", "test_lossless.py", "test_quality.py",
                  "test_bad_inputs.py", "test_cli.py", "test_lean_archs.py", "test_llm_agent.py")


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "dist", "no") == "loadfile":  # the controller: schedule in the workers' order
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: its collection order is what the controller schedules
        rank = {name: i for i, name in enumerate(HEAVIEST_FILES)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


def demo_available() -> bool:
    return all((DEMO_DIR / role / "model.safetensors").exists() for role in ("target", "drafter"))


needs_demo = pytest.mark.skipif(not demo_available(), reason="demo models not trained (specpilot train demo)")


@pytest.fixture(scope="session")
def demo_tokenizer():
    return load_tokenizer(DEMO_DIR / "target")


@pytest.fixture(scope="session")
def demo_prompts(demo_tokenizer) -> list[list[int]]:
    rows = [json.loads(line) for line in (DEMO_DIR / "prompts" / "code.jsonl").read_text().splitlines()]
    prose = [json.loads(line) for line in (DEMO_DIR / "prompts" / "prose.jsonl").read_text().splitlines()]
    texts = [rows[0]["text"], rows[1]["text"], prose[0]["text"]]
    # Keep contexts short so the fp32 sweeps stay quick on two cores.
    return [demo_tokenizer(t, add_special_tokens=False)["input_ids"][-160:] for t in texts]


@pytest.fixture(scope="session")
def demo_fp32():
    return (load_causal_lm(DEMO_DIR / "target", "target", "float32"),
            load_causal_lm(DEMO_DIR / "drafter", "drafter", "float32"))


@pytest.fixture(scope="session")
def demo_bf16():
    return (load_causal_lm(DEMO_DIR / "target", "target", "bfloat16"),
            load_causal_lm(DEMO_DIR / "drafter", "drafter", "bfloat16"))


def tiny_llama(vocab: int = 16, hidden: int = 32, layers: int = 2, seed: int = 0):
    """A random-init Llama small enough for thousands of sampled generations."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper than the default init so distributions are not near-uniform
        model.lm_head.weight.mul_(40)
    return model


@pytest.fixture(scope="session")
def tiny_fp32():
    """A tiny random target and a drafter that agrees with it most of the time (its own weights, perturbed):
    lossless sweeps run on these in the fast tier, since token identity with AR holds for any model. The
    demo models stay for the few end-to-end tests and the slow tier."""
    import copy

    target = tiny_llama(vocab=96, hidden=64, layers=2, seed=3)
    drafter = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.2 * p.std() * torch.randn(p.shape, generator=gen))
    return target, drafter


@pytest.fixture(scope="session")
def tiny_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(1, 96, (n,), generator=gen).tolist() for n in (24, 40, 9)]


def fake_system(body: str, setup: str = "") -> str:
    """The source of a stand-in system speaking the serve protocol (a ready line, then one JSON answer per
    request until `quit`): `setup` runs first, `body` once per request with `req` bound; json, os and sys are
    imported. For the harness's and the sandbox's tests, where the system's behaviour is the point."""
    return ("import json, os, sys\n" + textwrap.dedent(setup) + 'print(json.dumps({"ready": True}), flush=True)\n'
            'for line in sys.stdin:\n    req = json.loads(line)\n    if req.get("op") == "quit":\n        break\n'
            + textwrap.indent(textwrap.dedent(body), "    "))


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session", autouse=True)
def _session_data_dir(tmp_path_factory):
    """Fixtures built once per file or session (workspaces, their stock references) write outside the user's real
    data directory too: they are set up before any test's own `_private_data_dir`."""
    path = tmp_path_factory.mktemp("specpilot-data-session")
    users_engines = os.environ.get("SPECPILOT_ENGINES_DIR")
    with pytest.MonkeyPatch.context() as mp:
        # A built llama.cpp stays where those fixtures found it before (the user's engine cache, only read);
        # each test's own data dir resolves engines as it always did (`_private_data_dir`).
        mp.setenv("SPECPILOT_ENGINES_DIR", str(llamacpp_build.engines_root()))
        mp.setenv("SPECPILOT_DATA_DIR", str(path))
        yield path, users_engines


@pytest.fixture(autouse=True)
def _private_data_dir(monkeypatch, tmp_path_factory, _session_data_dir):
    """No test writes to the user's real data directory (global memory, hardware profiles, workspaces).

    This machine's measured profiles (`hardware/cpu-local.json`, `cpu-local-float32.json`: one per dtype, saved
    only when measured quietly) carry from one test's data directory to the next on the same worker, as they
    carry from one run to the next for a user: a loop test then reads one instead of measuring the machine
    again (9-18 s each)."""
    session_dir, users_engines = _session_data_dir
    data = tmp_path_factory.mktemp("specpilot-data")
    saved = session_dir / "hardware"
    if saved.is_dir():
        shutil.copytree(saved, data / "hardware")
    monkeypatch.setenv("SPECPILOT_DATA_DIR", str(data))
    if users_engines is None:
        monkeypatch.delenv("SPECPILOT_ENGINES_DIR")
    yield
    for measured in (data / "hardware").glob("cpu-local*.json"):
        if not (saved / measured.name).is_file():
            saved.mkdir(exist_ok=True)
            shutil.copyfile(measured, saved / measured.name)
