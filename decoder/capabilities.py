"""What a decoding configuration can run on a model, decided from the configs alone (no weights).

Every decoding path either runs an architecture correctly or refuses it in one line before any work:
`refusal(cfg, target_config, drafter_config)` names why `cfg` cannot run (None when it can). The bench
picks the methods that can run and lists the skipped ones with these reasons; `generate` raises
`Unsupported` with the same line.

- The HF path runs every causal LM transformers loads. Speculative decoding on it needs a rollback: attention
  caches crop; recurrent layers (Mamba/Mamba2, GatedDeltaNet, short convolutions) restore the state saved
  before the step and re-feed the accepted tokens (decoder/runners.py: RollbackCache).
- The lean forward (and what is built on it: feature drafters, tree and two-level verification, D-cut,
  cuda graphs, the batched engine) covers the architectures `decoder.lean.lean_unsupported_reason` accepts.
- Tree verification feeds a tree of drafts in one forward under a tree mask on the lean forward; a target
  with recurrent layers (HF path) verifies it as one batch row per root-to-leaf branch, each with its own
  copy of the recurrent state (decoder/runners.py). The draft model grows the tree on its lean forward.
"""

from __future__ import annotations

from pathlib import Path

from decoder.archs import activation_name, lean_unsupported_reason, recurrent_layers
from decoder.config import DecodeConfig

VOCAB_RANK_FILE = "vocab_rank.json"  # token ids by corpus frequency (`specpilot train drafter --kind vocab`)
ROUTER_FILE = "router.json"  # the domain router of drafter = "routed"
CORPUS_FILE = "corpus.npz"  # the corpus datastore of drafter = "corpus" (`specpilot train drafter --kind corpus`)


def drafters_dir(target_dir: Path | str) -> Path:
    """Where `specpilot train drafter` puts a target's feature drafters and router by default."""
    return Path(target_dir) / "drafters"


class Unsupported(ValueError):
    """A decoding configuration cannot run on this model; the message is one line naming why and the fix."""


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def refusal(cfg: DecodeConfig, target_config, drafter_config=None, dtype: str | None = None) -> str | None:
    """Why `cfg` cannot decode with this target (and drafter), in one line; None when it can."""
    target = _text(target_config)
    recurrent = recurrent_layers(target)
    uses_drafter_model = cfg.method == "sd" and cfg.drafter == "draft-model"
    if cfg.lean_forward:
        why = lean_unsupported_reason(target)
        if why:
            return f"target: {why}"
        if uses_drafter_model and drafter_config is not None:
            why = lean_unsupported_reason(_text(drafter_config))
            if why:
                return f"drafter: {why}"
    if cfg.fused_mlp_rows and activation_name(target) not in ("silu", "swish"):
        return (f"target: fused_mlp_rows fuses a SiLU MLP; this model's activation is {activation_name(target)!r}: "
                f"use 0")
    if cfg.method == "sd" and cfg.verify in ("tree", "two-level"):
        if not cfg.lean_forward and not recurrent:
            return (f"{cfg.verify} verification on the HF path runs only on targets with recurrent layers (one "
                    f"batch row per branch); set lean_forward = true")
        if not cfg.lean_forward and drafter_config is not None:
            why = lean_unsupported_reason(_text(drafter_config))
            if why:
                return f"{cfg.verify} verification grows its tree on the drafter's lean forward: drafter: {why}"
    if cfg.matmul_backend == "onednn" and dtype == "bfloat16" and cfg.device == "cpu":
        why = onednn_bf16_refusal()
        if why:
            return why
    if cfg.matmul_backend == "bf16w" and cfg.lean_forward:
        why = bf16w_refusal(dtype or cfg.dtype)
        if why:
            return why
    if cfg.fused_layer and (dtype or cfg.dtype) not in ("float32", "bfloat16"):
        return (f"fused_layer runs float32 or bfloat16 layers; the model is loaded as {dtype or cfg.dtype}: use "
                f"dtype = \"float32\" or \"bfloat16\", or fused_layer = false")
    if cfg.fused_layer:
        for role, conf in (("target", target), ("drafter", _text(drafter_config) if drafter_config else None)):
            why = fused_layer_refusal(conf) if conf is not None and (role == "target" or uses_drafter_model) else None
            if why:
                return f"{role}: {why}"
    if cfg.weight_format == "w12" and dtype not in (None, "bfloat16"):
        return f"w12 weights pack bf16 weights; the model is loaded as {dtype} (use --dtype bfloat16)"
    if uses_drafter_model and drafter_config is not None:
        tv, dv = getattr(target, "vocab_size", None), getattr(_text(drafter_config), "vocab_size", None)
        if tv is not None and dv is not None and dv != tv:
            return (f"the drafter's vocabulary ({dv} tokens) differs from the target's ({tv}); a drafter must "
                    f"share the target's tokenizer")
    return None


def fused_layer_refusal(config) -> str | None:
    """Why mechanism bf16w-fused-layer cannot run a model of this config (one line), or None: its two kernel calls
    are a Llama-style layer (RMSNorm, SiLU MLP, full RoPE), as `LeanLM.fused_layer_refusal` finds on the loaded
    model."""
    mt = getattr(config, "model_type", "")
    kind = (f"a {mt} model (its own norms)" if mt in ("gemma", "gemma2", "qwen3")
            else f"activation {activation_name(config)!r}" if activation_name(config) not in ("silu", "swish")
            else "a partial rotary" if (getattr(config, "partial_rotary_factor", None) or 1.0) < 1.0 else None)
    return (f"fused_layer runs Llama-style layers (RMSNorm, SiLU MLP, full RoPE); this is {kind}: use fused_layer = "
            f"false") if kind else None


def bf16w_refusal(dtype: str) -> str | None:
    """Why the bf16w kernel cannot run this deployment here, in one line; None when it can (a weight bf16 cannot
    hold exactly is found only when the weights are packed: LeanUnsupported then)."""
    from kernels.cpu_bf16w import unavailable  # a seam: the command lines start without torch (it imports torch)

    if dtype not in ("float32", "bfloat16"):
        return (f'matmul_backend = "bf16w" multiplies float32 or bfloat16 activations; the model is loaded as '
                f'{dtype}: use dtype = "float32" or "bfloat16", or matmul_backend = "torch"')
    why = unavailable()
    return f'matmul_backend = "bf16w": {why}; use matmul_backend = "torch"' if why else None


def onednn_bf16_refusal() -> str | None:
    """Why oneDNN cannot pack bfloat16 weights on this CPU, in one line; None when it can. torch's own test
    (AVX512-BW/VL/DQ or AVX-NE-CONVERT on x86): without it `mkldnn._reorder_linear_weight` raises mid-run."""
    import torch  # a seam: the command lines start without torch; only a oneDNN bfloat16 config asks

    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return ('matmul_backend = "onednn" on bfloat16 weights needs a CPU with AVX512-BW/VL/DQ or AVX-NE-CONVERT, '
            'which this one lacks; use matmul_backend = "torch" or dtype = "float32"')


def native_bf16_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool | None:
    """Whether this CPU computes bfloat16 natively (AMX-BF16 or AVX512-BF16 on x86, BF16 on Arm), read from
    /proc/cpuinfo's flags; None where that file cannot tell. Without it torch converts every bf16 matmul and
    float32 decodes faster (the demo: AR 125.8 against 68.8 tok/s on an AVX-512 Xeon without AMX)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    flags = {f for line in text.splitlines() if line.split(":")[0].strip() in ("flags", "Features")
             for f in line.split(":", 1)[1].split()}
    return bool(flags & {"amx_bf16", "avx512_bf16", "bf16"}) if flags else None


def drafter_files_refusal(cfg: DecodeConfig, drafters: Path, target_dir: Path | str = "TARGET") -> str | None:
    """What `cfg` needs from the target's drafters directory (`TARGET/drafters`: feature drafters, router,
    token ranking) and does not find there, in one line with the command that makes it; None when all is there
    or `cfg` needs none of it. Read from the files alone: the tuner refuses such a config before running it."""
    if cfg.method != "sd":
        return None
    kinds = {cfg.drafter} if cfg.drafter in ("mtp", "block", "corpus") else set()
    if cfg.drafter == "routed":
        if not (drafters / ROUTER_FILE).is_file():
            return (f"no router at {drafters}; train it with `specpilot train drafter --kind router "
                    f"--target {target_dir}`")
        kinds = {r for r in (cfg.route_code, cfg.route_prose) if r in ("mtp", "block", "corpus")}
    for kind in sorted(kinds):
        if kind == "corpus":
            if not (drafters / CORPUS_FILE).is_file():
                return (f"no corpus datastore at {drafters / CORPUS_FILE}; make it with `specpilot train drafter "
                        f"--kind corpus --target {target_dir}`")
        elif not (drafters / kind / "config.json").is_file():
            what = "mtp heads" if kind == "mtp" else "block drafter"
            return (f"no {what} at {drafters}; train it with `specpilot train drafter --kind {kind} "
                    f"--target {target_dir}`")
    if cfg.draft_vocab and not (drafters / VOCAB_RANK_FILE).is_file():
        return (f"draft_vocab = {cfg.draft_vocab} needs the target's token ranking at {drafters / VOCAB_RANK_FILE}; "
                f"make it with `specpilot train drafter --kind vocab --target {target_dir}`")
    return None


def check(cfg: DecodeConfig, target_config, drafter_config=None, dtype: str | None = None) -> None:
    """Raise Unsupported when `refusal` names a reason."""
    why = refusal(cfg, target_config, drafter_config, dtype)
    if why:
        raise Unsupported(why)
