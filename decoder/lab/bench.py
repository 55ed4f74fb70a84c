"""`specpilot bench`: our AR and SD against Hugging Face generate, on the same prompts, in one process.

Every method's output is compared with Hugging Face greedy (the stock reference). A divergence is
*explained* when stock's top-2 logit margin at the first divergent position is below twice the
deployment's numerical noise floor (the largest logit difference between one-token and multi-token
forwards over the same contexts): bf16 rounding can flip such a near-tie, nothing else can.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from decoder.capabilities import drafter_files_refusal, refusal
from decoder.config import DecodeConfig, verify_width
from decoder.contract import first_divergence, near_tie
from decoder.generate import generate
from decoder.lab.peers import LLAMA_AR, PeerGroup, check_against_ar, is_peer, peer_entry
from decoder.lab.peers import runner as peer_runner
from decoder.models import (
    ModelLoadError,
    check_model_dir,
    check_same_tokenizer,
    demo_deployment,
    hybrid_demo_deployment,
    load_causal_lm,
    load_tokenizer,
    smollm2_deployment,
)
from decoder.presets import BLOCK_DRAFT_LEN, DCUT_MAX_LEN, MTP_DRAFT_LEN, PRESETS, preset_config
from decoder.runners import HFRunner, recurrent_layers
from decoder.stats import DecodeStats, MethodEntry
from decoder.w12 import apply_w12

OUR_METHODS = ("ar", "sd-draft-model", "sd-ngram")
# Mechanism lean_forward: the same methods on decoder/lean.py's forward. Their speedup_vs_ar is taken
# against ar-lean, so the gain from speculation is never mixed with the gain from the faster forward.
LEAN_METHODS = ("ar-lean", "sd-draft-model-lean", "sd-ngram-lean")
# Mechanism weight_format = "w12": the target's linear layers in the lossless 12-bit format (on a copy;
# the HF reference keeps bf16). Reference path on CPU (slower: it unpacks every forward), Triton on CUDA.
# Not in the default set; ask with --methods. Speedups against ar-w12, like the lean methods.
W12_METHODS = ("ar-w12", "sd-draft-model-w12", "sd-ngram-w12")
# Mechanism transposed-matmul: the lean methods multiplying by transposed weights at up to 3 rows. Not in the
# default set (a CPU float32 lever; ask with --methods); speedups against ar-lean-t, like the lean methods.
T_METHODS = ("ar-lean-t", "sd-draft-model-lean-t", "sd-ngram-lean-t")
# Mechanism onednn-matmul: the lean methods and the MTP ones with the lean forward's matmuls on oneDNN's packed
# weights (CPU). Not in the default set (ask with --methods); speedups against ar-lean-dnn, so ar-lean-dnn beside
# ar-lean is the forward's own gain and the others' ratio is speculation's alone.
DNN_METHODS = ("ar-lean-dnn", "sd-draft-model-lean-dnn", "sd-draft-model-vocab-dnn", "sd-ngram-lean-dnn", "sd-tree-dnn",
               "sd-two-level-dnn", "sd-dcut-dnn", "sd-mtp-dnn", "sd-mtp-vocab-dnn", "sd-mtp-tree-dnn")
# Mechanisms tree-verify, two-level-verify and d-cut (decoder/tree.py, decoder/dcut.py), all on the lean
# forward with the draft model: compare them with sd-draft-model-lean; their speedup_vs_ar is against ar-lean.
TREE_METHODS = ("sd-tree", "sd-two-level", "sd-dcut")
# Tree and two-level verification on the HF path, for targets with recurrent layers (one batch row per branch,
# decoder/runners.py); the draft model grows the tree on its lean forward. Against `ar`.
HF_TREE_METHODS = ("sd-tree-hf", "sd-two-level-hf")
# Mechanisms block-drafter, mtp-heads and domain-routing (decoder/featdraft.py): drafters that read the
# target's hidden states, on the lean forward; their speedup_vs_ar is against ar-lean. They need the
# target's trained feature drafters (TARGET/drafters or --drafters); the default set skips them without.
FEATURE_METHODS = ("sd-block", "sd-mtp", "sd-mtp-vocab", "sd-routed")
HF_METHODS = ("hf-greedy", "hf-assisted-draft-model", "hf-prompt-lookup")
# Mechanism corpus-drafter (decoder/datastore.py): prompt lookup backed by the target's corpus datastore
# (TARGET/drafters/corpus.npz from `specpilot train drafter --kind corpus`). Not in the default set (ask with
# --methods); against ar-lean, drafting as long as the n-gram methods (--ngram-draft-len).
CORPUS_METHODS = ("sd-corpus-lean", "sd-corpus-lean-dnn", "sd-corpus-lean-fused", "sd-corpus-tree-fused",
                  "sd-corpus-lean-bf16w", "sd-corpus-tree-bf16w", "sd-corpus-lean-layer", "sd-corpus-tree-layer")
# Mechanism fused-mlp on top of onednn-matmul: a prefill's MLP as two oneDNN matmuls with SiLU and the product fused.
# Not in the default set; speedups against ar-lean-fused, so ar-lean-fused beside ar-lean is the forward's own gain.
FUSED_METHODS = ("ar-lean-fused", "sd-corpus-lean-fused", "sd-corpus-tree-fused")
# Mechanism bf16w-matmul (kernels/cpu_bf16w.c): the weights held as bfloat16 and multiplied by the CPU kernel; float32
# deployments of bf16 checkpoints on AVX-512 CPUs. Not in the default set; speedups against ar-lean-bf16w.
BF16W_METHODS = ("ar-lean-bf16w", "sd-corpus-lean-bf16w", "sd-corpus-tree-bf16w")
# Mechanism bf16w-fused-layer on top of it: each layer's work around attention as two kernel calls at a step's few
# rows. Not in the default set; speedups against ar-lean-layer. sd-ngram-lean-layer and sd-mtp-layer (the MTP heads)
# need no corpus datastore.
LAYER_METHODS = ("ar-lean-layer", "sd-corpus-lean-layer", "sd-corpus-tree-layer", "sd-ngram-lean-layer",
                 "sd-mtp-layer")
ALL_METHODS = OUR_METHODS + LEAN_METHODS + TREE_METHODS + HF_TREE_METHODS + FEATURE_METHODS + HF_METHODS
KNOWN_METHODS = tuple(dict.fromkeys(  # sd-corpus-lean-fused is a corpus method and a fused one: listed once
    ALL_METHODS + W12_METHODS + T_METHODS + DNN_METHODS + CORPUS_METHODS + FUSED_METHODS + BF16W_METHODS
    + LAYER_METHODS))
DRAFT_MODEL_METHODS = ("sd-draft-model", "sd-draft-model-lean", "sd-draft-model-w12", "sd-draft-model-lean-t",
                       "sd-draft-model-lean-dnn", "sd-draft-model-vocab-dnn", "sd-tree-dnn", "sd-two-level-dnn",
                       "sd-dcut-dnn",
                       "hf-assisted-draft-model",
                       *TREE_METHODS, *HF_TREE_METHODS)
VARIANT_BASELINE = {"lean": "ar-lean", "w12": "ar-w12", "t": "ar-lean-t", "dnn": "ar-lean-dnn",
                    "fused": "ar-lean-fused", "bf16w": "ar-lean-bf16w", "layer": "ar-lean-layer"}


RANKED_METHODS = ("sd-draft-model-vocab-dnn",)  # need the target's token ranking, not its feature drafters


def is_lookup(name: str) -> bool:
    """A method whose drafter looks tokens up (n-gram, corpus): it drafts --ngram-draft-len tokens."""
    return name.startswith(("sd-ngram", "sd-corpus"))


def tree_base(name: str) -> str | None:
    """The verification method `name` runs (sd-tree-dnn -> sd-tree, sd-tree-hf -> sd-tree), None for others."""
    base = name.removesuffix("-dnn").removesuffix("-hf")
    return base if base in TREE_METHODS else None


def feature_base(name: str) -> str | None:
    """The feature method `name` runs (sd-mtp-vocab-dnn -> sd-mtp-vocab), None for any other method; the MTP comb
    tree (sd-mtp-tree-dnn) is the pruned heads' method with alternatives (`FeatureSettings.overrides`)."""
    base = name.removesuffix("-dnn").removesuffix("-layer")
    return base if base in FEATURE_METHODS else "sd-mtp-vocab" if base == "sd-mtp-tree" else None


def _baseline(name: str) -> str:
    if is_peer(name):
        return LLAMA_AR
    if name in TREE_METHODS + FEATURE_METHODS:
        return "ar-lean"
    return VARIANT_BASELINE.get(name.rsplit("-", 1)[-1], "ar")


_DEFAULT = DecodeConfig()


@dataclass(frozen=True)
class TreeSettings:
    """Flags of sd-tree, sd-two-level and sd-dcut (defaults: DecodeConfig's, the best measured on the demo)."""

    tree_shape: str = _DEFAULT.tree_shape
    tree_topk: int = _DEFAULT.tree_topk
    tree_depth: int = _DEFAULT.tree_depth
    tree_budget: int = _DEFAULT.tree_budget
    two_level_alts: int = _DEFAULT.two_level_alts
    two_level_draft_len: int = _DEFAULT.draft_len
    dcut_threshold: float = _DEFAULT.dcut_threshold
    dcut_max_len: int = DCUT_MAX_LEN

    def overrides(self, name: str) -> dict:
        """The DecodeConfig keys these flags set for method `name`."""
        name = tree_base(name) or name  # the HF-path and oneDNN variants take the same flags
        if name == "sd-tree":
            return {"tree_shape": self.tree_shape, "tree_topk": self.tree_topk, "tree_depth": self.tree_depth,
                    "tree_budget": self.tree_budget}
        if name == "sd-two-level":
            return {"two_level_alts": self.two_level_alts, "draft_len": self.two_level_draft_len}
        if name == "sd-dcut":
            return {"dcut_threshold": self.dcut_threshold, "draft_len": self.dcut_max_len}
        return {}


@dataclass(frozen=True)
class FeatureSettings:
    """Flags of sd-block, sd-mtp and sd-routed (defaults: the best measured on the demo, README)."""

    block_draft_len: int = BLOCK_DRAFT_LEN
    mtp_draft_len: int = MTP_DRAFT_LEN
    mtp_draft_vocab: int = PRESETS["sd-mtp-vocab"]["draft_vocab"]
    mtp_tree_alts: int = PRESETS["sd-mtp-tree-dnn"]["mtp_tree_alts"]
    corpus_tree_alts: int = PRESETS["sd-corpus-tree-fused"]["corpus_tree_alts"]
    route_code: str = _DEFAULT.route_code  # measured best on both demo domains (README)
    route_prose: str = _DEFAULT.route_prose
    drafters: str | None = None  # directory of the target's feature drafters (default TARGET/drafters)

    def overrides(self, name: str) -> dict:
        if name != "sd-corpus-tree-layer":  # the oneDNN and fused-layer variants take the same flags
            name = name.removesuffix("-dnn").removesuffix("-layer")
        if name == "sd-block":
            return {"draft_len": self.block_draft_len}
        if name == "sd-mtp":
            return {"draft_len": self.mtp_draft_len}
        if name == "sd-mtp-vocab":
            return {"draft_len": self.mtp_draft_len, "draft_vocab": self.mtp_draft_vocab}
        if name == "sd-mtp-tree":
            return {"draft_len": self.mtp_draft_len, "draft_vocab": self.mtp_draft_vocab,
                    "mtp_tree_alts": self.mtp_tree_alts}
        if name in ("sd-corpus-tree-fused", "sd-corpus-tree-bf16w", "sd-corpus-tree-layer"):
            return {"corpus_tree_alts": self.corpus_tree_alts}
        if name == "sd-routed":  # one draft length for whichever drafter a request is routed to
            return {"draft_len": self.mtp_draft_len if "mtp" in (self.route_code, self.route_prose)
                    else self.block_draft_len, "route_code": self.route_code, "route_prose": self.route_prose}
        return {}


REFERENCE = "hf-greedy"


class BenchError(ValueError):
    """Bad bench input; the message names the value and the fix."""


def check_known(flag: str, values: tuple[str, ...], known: tuple[str, ...]) -> None:
    """A BenchError naming every value of `flag` that is not in `known`, and the choices."""
    bad = [v for v in values if v not in known]
    if bad:
        raise BenchError(f"{flag}: unknown {', '.join(bad)}; choose from {', '.join(known)}")


@dataclass
class Prompt:
    id: str
    text: str


def load_prompts(spec: str, prompt_dir: Path | None) -> tuple[str, list[Prompt]]:
    """`code` / `prose` (the deployment's held-out sets) or a JSONL file of {"id", "text"} rows."""
    if spec in ("code", "prose"):
        if prompt_dir is None:
            raise BenchError(f"--prompts {spec}: this deployment has no built-in prompt sets; pass a .jsonl file")
        path = prompt_dir / f"{spec}.jsonl"
    else:
        path = Path(spec)
        if not path.is_file():
            raise BenchError(f"--prompts {spec}: no such file; use code, prose or a path to a .jsonl file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BenchError(f"--prompts {path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                         f"save the file as UTF-8") from None
    except OSError as e:
        raise BenchError(f"--prompts {path}: cannot read it ({e.strerror}); pass a readable .jsonl file") from None
    prompts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be "
                             f'{{"id": ..., "text": ...}}') from e
        if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"].strip():
            raise BenchError(f"{path}:{lineno}: each line must be an object with a non-empty string "
                             f'"text" (and an "id")')
        prompts.append(Prompt(str(row.get("id", f"{path.stem}-{lineno}")), row["text"]))
    if not prompts:
        raise BenchError(f"{path}: no prompts found; each line must be {{\"id\": ..., \"text\": ...}}")
    return (spec if spec in ("code", "prose") else str(path)), prompts


@dataclass
class MethodResult:
    name: str
    outputs: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    stats: DecodeStats = field(default_factory=DecodeStats)

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


class _ForwardCounter:
    """Counts target forwards during Hugging Face generate (ours count themselves)."""

    def __init__(self, model) -> None:
        self.n = 0
        self._h = model.register_forward_hook(self._hook)

    def _hook(self, *_args) -> None:
        self.n += 1

    def close(self) -> None:
        self._h.remove()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Bench:
    """Holds the models and runs each method on a prompt: our methods are presets (decoder/presets.py) run
    through `decoder.generate.generate`, the HF methods are Hugging Face generate."""

    def __init__(self, target, drafter, eos_id: int, cfg: DecodeConfig, ngram_draft_len: int,
                 hf_prompt_lookup_tokens: int = 10, tree: TreeSettings | None = None,
                 feature: FeatureSettings | None = None, heads=None) -> None:
        self.feature = feature or FeatureSettings()
        self.tree = tree or TreeSettings()
        self.heads = heads
        self.target = target
        self.drafter = drafter
        self.eos_id = eos_id
        self.cfg = cfg
        self.ngram_draft_len = ngram_draft_len
        self.hf_prompt_lookup_tokens = hf_prompt_lookup_tokens
        self.device = next(target.parameters()).device
        self.w12_footprint: dict | None = None
        self._w12_target = None

    def config(self, name: str) -> DecodeConfig:
        """The DecodeConfig method `name` runs: its preset over the bench's config, with the flags' values."""
        flags = {**self.tree.overrides(name), **self.feature.overrides(name)}
        if is_lookup(name):
            flags["draft_len"] = self.ngram_draft_len
        return preset_config(name, self.cfg, **flags)

    def methods(self, names: tuple[str, ...]) -> dict[str, Callable[[list[int]], tuple[list[int], DecodeStats]]]:
        if any(n in W12_METHODS for n in names) and self._w12_target is None:
            # On a copy: the HF reference keeps bf16. Marked so generate does not convert it again.
            self._w12_target = copy.deepcopy(self.target)
            self.w12_footprint = apply_w12(self._w12_target, backend="auto")
            self._w12_target._specpilot_w12 = True
        table = {n: self._ours(n) for n in names if n in PRESETS}
        table.update({
            "hf-greedy": lambda p: self._hf(p, {}),
            "hf-assisted-draft-model": lambda p: self._hf(p, {"assistant_model": self.drafter}),
            "hf-prompt-lookup": lambda p: self._hf(p, {"prompt_lookup_num_tokens": self.hf_prompt_lookup_tokens}),
        })
        return {n: table[n] for n in names}

    def _ours(self, name: str) -> Callable[[list[int]], tuple[list[int], DecodeStats]]:
        cfg = self.config(name)
        target = self._w12_target if cfg.weight_format == "w12" else self.target

        def run(prompt: list[int]) -> tuple[list[int], DecodeStats]:
            g = generate(cfg, target, prompt, self.drafter, heads=self.heads)
            return g.tokens, g.stats

        return run

    @torch.inference_mode()
    def _hf(self, prompt: list[int], extra: dict) -> tuple[list[int], DecodeStats]:
        ids = torch.tensor([prompt], device=self.device)
        counter = _ForwardCounter(self.target)
        try:
            out = self.target.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.cfg.max_new_tokens,
                do_sample=False, pad_token_id=self.eos_id, eos_token_id=self.eos_id, **extra,
            )
        finally:
            counter.close()
        new = out[0, len(prompt):].tolist()
        if self.eos_id in new:
            new = new[: new.index(self.eos_id) + 1]
        stats = DecodeStats(new_tokens=len(new), target_forwards=counter.n)
        return new, stats


@torch.inference_mode()
def noise_floor(target, sequences: list[tuple[list[int], list[int]]], chunk_sizes: tuple[int, ...]) -> float:
    """Largest |logit| difference between one-token forwards and multi-token forwards (a full
    teacher-forced forward, and chunked forwards of each verify width) over the same contexts.

    Through the stock runner (decoder/runners.py), so every cache kind the decode loop uses (sliding
    windows, recurrent layers) is measured the way it decodes; chunks follow each other without rollback."""
    runner = HFRunner(target)
    device = runner.device
    worst = 0.0
    for prompt, cont in sequences:
        if len(cont) < 2 or len(prompt) < 2:
            continue
        seq = prompt + cont
        n = len(cont)
        # One token at a time, as AR decoding computes them: logits predicting cont[0..n-1].
        cache = runner.new_cache()
        one = [runner.forward(torch.tensor(prompt, device=device), cache, last_only=True)[-1]]
        for i in range(n - 1):
            one.append(runner.forward(torch.tensor([cont[i]], device=device), cache)[-1])
        one_t = torch.stack(one).float()  # [n, V]
        full = target(input_ids=torch.tensor([seq[: len(prompt) + n - 1]], device=device)).logits[0]
        worst = max(worst, (full[len(prompt) - 1 :].float() - one_t).abs().max().item())
        for c in chunk_sizes:
            cache = runner.new_cache()
            runner.forward(torch.tensor(prompt[:-1], device=device), cache, last_only=True)
            rows, pos = [], len(prompt) - 1
            while pos < len(prompt) + n - 1:
                width = min(c, len(prompt) + n - 1 - pos)
                rows.append(runner.forward(torch.tensor(seq[pos : pos + width], device=device), cache))
                pos += width
            chunked = torch.cat(rows).float()[:n]
            worst = max(worst, (chunked - one_t).abs().max().item())
    return worst


WEAK_CHECK_FRACTION = 0.05  # above this share of near-tie positions the table warns that the check is weak


@torch.inference_mode()
def near_tie_fraction(target, sequences: list[tuple[list[int], list[int]]], floor: float) -> float:
    """The share of continuation positions whose top-2 margin (one teacher-forced forward) is a near tie at
    this noise floor: where a diverging method would be excused."""
    ties = total = 0
    device = next(target.parameters()).device
    for prompt, cont in sequences:
        if not cont:
            continue
        seq = torch.tensor([prompt + cont[:-1]], device=device)
        logits = target(input_ids=seq).logits[0, len(prompt) - 1 :].float()  # predicting cont
        top = torch.topk(logits, 2, dim=-1).values
        margins = (top[:, 0] - top[:, 1]).tolist()
        ties += sum(near_tie(m, floor) for m in margins)
        total += len(margins)
    return ties / total if total else 0.0


@torch.inference_mode()
def top2_margin(target, context: list[int]) -> float:
    """Stock's top-2 logit margin for the token after `context` (one teacher-forced forward)."""
    device = next(target.parameters()).device
    logits = target(input_ids=torch.tensor([context], device=device), logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return (top[0] - top[1]).item()


def repeated_ngram_fraction(tokens: list[int], n: int = 4) -> float:
    """Fraction of the continuation's n-grams that already occurred earlier in it (0 = no repeats)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def select_methods(methods: tuple[str, ...], skip_unsupported: bool, target_dir: Path, drafter_dir: Path | None,
                   cfg: DecodeConfig, ngram_draft_len: int, tree: TreeSettings, feature: FeatureSettings,
                   ) -> tuple[tuple[str, ...], list[dict]]:
    """The methods that can run on this deployment, and the skipped ones with their reasons, from the model
    configs alone (no weights). A method named explicitly (not `skip_unsupported`) that cannot run is a
    BenchError naming it and the reason."""
    from transformers import AutoConfig

    def config_of(path: Path, role: str):
        try:
            return AutoConfig.from_pretrained(str(check_model_dir(path, role)), local_files_only=True)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelLoadError(f"{role} config at {path} cannot be read: {first}") from e

    target_cfg = config_of(target_dir, "target")
    drafter_cfg = config_of(drafter_dir, "drafter") if drafter_dir else None
    heads_root = Path(feature.drafters) if feature.drafters else Path(target_dir) / "drafters"
    keep, skipped = [], []
    for name in methods:
        why = None
        if name in DRAFT_MODEL_METHODS and drafter_dir is None:
            why = "needs a draft model (--drafter DIR)"
        elif name in ("hf-assisted-draft-model", "hf-prompt-lookup") and recurrent_layers(target_cfg):
            why = (f"transformers' assisted generation does not support stateful models "
                   f"({', '.join(recurrent_layers(target_cfg))} layers); SpecPilot's own methods roll them back")
        elif name in PRESETS:
            flags = {**tree.overrides(name), **feature.overrides(name)}
            if is_lookup(name):
                flags["draft_len"] = ngram_draft_len
            method_cfg = preset_config(name, cfg, **flags)
            # What the method needs from the drafters directory first (the tuner's refusal), then the models.
            why = (drafter_files_refusal(method_cfg, heads_root, target_dir)
                   or refusal(method_cfg, target_cfg, drafter_cfg, cfg.dtype))
        if why is None:
            keep.append(name)
        elif skip_unsupported and name != REFERENCE:
            skipped.append({"name": name, "reason": why})
        else:
            raise BenchError(f"--methods {name}: {why}")
    return tuple(keep), skipped


def load_bench_inputs(target_dir: Path, drafter_dir: Path | None, needs_drafter: bool, prompts_spec: str,
                      prompt_dir: Path | None, limit: int | None, dtype: str, device: str) -> tuple:
    """(prompt set name, prompts, tokenizer, target, drafter or None): what both benches load first."""
    prompts_name, prompts = load_prompts(prompts_spec, prompt_dir)
    if limit:
        prompts = prompts[:limit]
    if needs_drafter:
        check_same_tokenizer(target_dir, drafter_dir)
    tok = load_tokenizer(target_dir, "target")
    target = load_causal_lm(target_dir, "target", dtype, device)
    drafter = load_causal_lm(drafter_dir, "drafter", dtype, device) if needs_drafter else None
    return prompts_name, prompts, tok, target, drafter


def run_bench(
    target_dir: Path, drafter_dir: Path | None, prompts_spec: str, max_new_tokens: int,
    deployment: str = "custom", prompt_dir: Path | None = None, methods: tuple[str, ...] = ALL_METHODS,
    draft_len: int = 3, ngram_draft_len: int = 8, ngram_max: int = 4, ngram_min: int = 1,
    dtype: str = "bfloat16", device: str = "cpu",
    limit: int | None = None, noise_prompts: int = 4, progress: bool = True, tree: TreeSettings | None = None,
    feature: FeatureSettings | None = None, skip_unsupported: bool = False, peers: PeerGroup | None = None,
) -> dict:
    """Run every method on every prompt; return the JSON report (see the issue's contract).

    A method that cannot run on this target (decoder/capabilities.py: architecture, missing drafter) is a
    one-line BenchError before any work, or, with `skip_unsupported` (the default method set), left out and
    listed in the report's "skipped" with its reason.

    `peers`: running llama.cpp servers (decoder/lab/peers.py, started and stopped by the caller) whose methods
    join the same interleaved run; every method then also gets `ratio_vs_llama_cpp_ar`."""
    if max_new_tokens < 1:
        raise BenchError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    check_known("--methods", methods, KNOWN_METHODS)
    if REFERENCE not in methods:
        methods = (REFERENCE, *methods)  # the reference every output is checked against
    feature = feature or FeatureSettings()
    tree = tree or TreeSettings()
    cfg = DecodeConfig(method="sd", drafter="draft-model", draft_len=draft_len, max_new_tokens=max_new_tokens,
                       ngram_max=ngram_max, ngram_min=ngram_min, dtype=dtype, device=device)
    methods, skipped = select_methods(methods, skip_unsupported, target_dir, drafter_dir, cfg, ngram_draft_len,
                                      tree, feature)
    needs_drafter = any(m in DRAFT_MODEL_METHODS for m in methods) or (
        "sd-routed" in methods and "draft-model" in (feature.route_code, feature.route_prose))
    if needs_drafter and drafter_dir is None:
        raise BenchError(f"{', '.join(DRAFT_MODEL_METHODS)} need --drafter DIR (or drop them with --methods)")
    prompts_name, prompts, tok, target, drafter = load_bench_inputs(
        target_dir, drafter_dir, needs_drafter, prompts_spec, prompt_dir, limit, dtype, device)
    eos = tok.eos_token_id if tok.eos_token_id is not None else target.config.eos_token_id
    heads = None
    if any(feature_base(m) or m in RANKED_METHODS or m in CORPUS_METHODS for m in methods):
        from decoder.featdraft import FeatureDrafterError, FeatureHeads, drafters_dir

        root = Path(feature.drafters) if feature.drafters else drafters_dir(target_dir)
        heads = FeatureHeads(root, target.config, target.dtype, target.device)
        try:  # load now: a missing drafter is a usage error, not a crash mid-bench
            wanted = {feature_base(m).removeprefix("sd-").removesuffix("-vocab") for m in methods
                      if feature_base(m) in ("sd-block", "sd-mtp", "sd-mtp-vocab")}
            if "sd-routed" in methods:
                wanted |= {r for r in (feature.route_code, feature.route_prose) if r in ("block", "mtp")}
                heads.router()
            for kind in sorted(wanted):
                heads.model(kind)
            if any(m in CORPUS_METHODS for m in methods):
                heads.corpus()
        except FeatureDrafterError as e:
            needing = [m for m in methods if feature_base(m) or m in RANKED_METHODS or m in CORPUS_METHODS]
            raise BenchError(f"{e} (or drop {', '.join(needing)} with --methods)") from e
    bench = Bench(target, drafter, eos, cfg, ngram_draft_len, tree=tree, feature=feature, heads=heads)
    runners = bench.methods(methods)
    if peers is not None:
        runners.update({name: peer_runner(server, max_new_tokens) for name, server in peers.servers.items()})
        skipped = skipped + peers.skipped
    encoded = [tok(p.text, add_special_tokens=False)["input_ids"] for p in prompts]
    dev = torch.device(device)

    # Warm-up: first forwards pay one-time costs (allocator, kernels, HF's generation set-up). On a text no
    # timed prompt holds (the first prompt's last 64 tokens reversed): a method that remembers across requests
    # (llama.cpp's ngram-mod keeps its n-gram table) learns nothing of a timed prompt from it.
    warm = encoded[0][-64:][::-1]
    for fn in runners.values():
        fn(warm)

    results = {name: MethodResult(name) for name in runners}
    bar = tqdm(total=len(prompts) * len(runners), desc="bench", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    # Interleave methods per prompt so machine-load drift hits every method alike.
    for ids in encoded:
        for name, fn in runners.items():
            _sync(dev)
            t0 = time.perf_counter()
            out, stats = fn(ids)
            _sync(dev)
            res = results[name]
            res.seconds += time.perf_counter() - t0
            res.outputs.append(out)
            res.stats.merge(stats)
            bar.update(1)
    bar.close()

    reference = results[REFERENCE].outputs
    # The noise floor is measured at every verify width a method used (and at chain SD's widths).
    k_widths = {draft_len + 1, ngram_draft_len + 1} | {verify_width(bench.config(m)) for m in methods if m in PRESETS}
    k_widths = tuple(sorted(w for w in k_widths if w > 1))
    pairs = [(ids, ref[:64]) for ids, ref in zip(encoded[:noise_prompts], reference[:noise_prompts], strict=True)]
    floor = noise_floor(target, pairs, k_widths)
    tie_fraction = near_tie_fraction(target, pairs, floor)
    hf = results[REFERENCE]
    peer_ar = results.get(LLAMA_AR)
    report_methods = []
    for name, res in results.items():
        mismatched, unexplained, divergences = 0, 0, []
        for pid, ids, out, ref in zip((p.id for p in prompts), encoded, res.outputs, reference, strict=True):
            pos = first_divergence(out, ref)
            if pos is None:
                continue
            mismatched += 1
            margin = top2_margin(target, ids + ref[:pos]) if pos < len(ref) else float("inf")
            explained = near_tie(margin, floor)
            unexplained += not explained
            divergences.append({"prompt": pid, "position": pos, "margin": round(margin, 5), "explained": explained})
        tps = res.tokens / res.seconds if res.seconds else 0.0
        baseline = _baseline(name)
        ar = results.get(baseline)
        entry = MethodEntry(
            name=name, tokens_per_s=round(tps, 2),
            speedup_vs_ar=round(tps / (ar.tokens / ar.seconds), 4) if ar else None,
            ar_baseline=baseline if ar else None,
            speedup_vs_hf_greedy=round(tps / (hf.tokens / hf.seconds), 4),
            tau=round(res.stats.tau, 4),
            identical_to_hf_greedy=mismatched == 0, mismatched_prompts=mismatched,
            unexplained_mismatches=unexplained,
            # Extra fields (the contract above is stable; these are additions).
            new_tokens=res.tokens, seconds=round(res.seconds, 4), target_forwards=res.stats.target_forwards,
            target_forwards_per_token=round(res.stats.target_forwards / max(1, res.tokens), 4),
            divergences=divergences,
        )
        if peer_ar is not None:
            entry.ratio_vs_llama_cpp_ar = round(tps / (peer_ar.tokens / peer_ar.seconds), 4)
        if is_peer(name):
            check = None if name == LLAMA_AR else check_against_ar(
                peers.ar, encoded, [p.id for p in prompts], res.outputs, peer_ar.outputs, floor)
            own = peers.is_other_ar(name)
            report_methods.append(peer_entry(entry, res.stats, None if own else check,
                                             peers.servers[name].spec.flags(), check if own else None))
            continue
        if name in OUR_METHODS + LEAN_METHODS + W12_METHODS + T_METHODS + DNN_METHODS + FUSED_METHODS + TREE_METHODS \
                + HF_TREE_METHODS + FEATURE_METHODS + CORPUS_METHODS + BF16W_METHODS:
            # Target work: positions scored per new token (prompt included), and drafter forwards per token.
            entry.target_tokens_per_token = round(res.stats.target_tokens / max(1, res.tokens), 4)
            entry.drafter_forwards_per_token = round(res.stats.drafter_forwards / max(1, res.tokens), 4)
            entry.acceptance_rate = round(res.stats.acceptance_rate, 4) if res.stats.drafted else None
            entry.accept_hist = {str(k): v for k, v in sorted(res.stats.accept_hist.items())}
            entry.phase_ms_per_token = {k: round(1000 * v / max(1, res.tokens), 4)
                                        for k, v in res.stats.phase_s.items()}
            # Drafting time per verify step (the drafter's calls, and for feature drafters their context update).
            entry.draft_ms_per_step = (round(1000 * res.stats.phase_s.get("draft", 0.0) / res.stats.draft_steps, 4)
                                       if res.stats.draft_steps else None)
            if feature_base(name):
                entry.draft_len = (feature.block_draft_len if name == "sd-block" else
                                   feature.mtp_draft_len if feature_base(name) in ("sd-mtp", "sd-mtp-vocab") else None)
                if name == "sd-routed":
                    entry.extra["routes"] = dict(sorted(res.stats.routes.items()))
                    entry.extra["route_us_per_request"] = round(1e6 * res.stats.route_s / max(1, len(res.outputs)),
                                                                2)
                    entry.extra["mechanism_config"] = {"drafter": "routed", "route_code": feature.route_code,
                                                       "route_prose": feature.route_prose}
                report_methods.append(entry.as_dict())
                continue
            entry.draft_len = (draft_len if name.startswith("sd-draft-model") else
                               ngram_draft_len if is_lookup(name) else
                               bench.config(name).draft_len
                               if tree_base(name) in ("sd-two-level", "sd-dcut") else None)
            if tree_base(name):
                c = bench.config(name)
                base = tree_base(name)
                entry.extra["mechanism_config"] = (
                    {"verify": "tree", "tree_shape": c.tree_shape, "tree_topk": c.tree_topk,
                     "tree_depth": c.tree_depth, "tree_budget": c.tree_budget} if base == "sd-tree" else
                    {"verify": "two-level", "two_level_alts": c.two_level_alts, "draft_len": c.draft_len}
                    if base == "sd-two-level" else
                    {"dcut": True, "dcut_threshold": c.dcut_threshold, "draft_len": c.draft_len})
        report_methods.append(entry.as_dict())
    order = {m: i for i, m in enumerate(KNOWN_METHODS + tuple(n for n in runners if is_peer(n)))}
    report_methods.sort(key=lambda m: order[m["name"]])
    return {
        "deployment": deployment,
        "prompts": prompts_name,
        "max_new_tokens": max_new_tokens,
        "noise_floor": round(floor, 6),
        # Positions of the greedy reference whose top-2 margin is under the near-tie threshold: the share of
        # divergences the lossless check would excuse. Large (bf16 MoE routing flips) means a weak check.
        "near_tie_fraction": round(tie_fraction, 4),
        # How much the greedy reference repeats itself: n-gram and prompt-lookup drafting feed on repeats,
        # so their speedups are read beside this figure.
        "reference_repeated_4gram_fraction": round(
            sum(repeated_ngram_fraction(r) for r in reference) / max(1, len(reference)), 4),
        "methods": report_methods,
        "skipped": skipped,
        "num_prompts": len(prompts),
        "dtype": dtype,
        "device": device,
        "target": str(target_dir),
        "drafter": str(drafter_dir) if drafter_dir else None,
        "config": {"draft_len": draft_len, "ngram_draft_len": ngram_draft_len, "ngram_max": ngram_max,
                   "ngram_min": ngram_min, "hf_prompt_lookup_num_tokens": bench.hf_prompt_lookup_tokens,
                   **({"tree": asdict(tree)} if any(tree_base(m) for m in methods) else {}),
                   **({"feature": asdict(feature)} if any(feature_base(m) for m in methods) else {})},
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        **({"peers": peers.info()} if peers is not None else {}),
        **({"w12": bench.w12_footprint} if bench.w12_footprint else {}),
    }


def format_table(report: dict) -> str:
    head = (f"deployment {report['deployment']} · prompts {report['prompts']} ({report['num_prompts']}) · "
            f"{report['max_new_tokens']} new tokens · {report['dtype']} on {report['device']} · "
            f"noise floor {report['noise_floor']:.4f}")
    if report.get("reference_repeated_4gram_fraction") is not None:
        head += (f"\ngreedy output repeats {report['reference_repeated_4gram_fraction']:.0%} of its 4-grams "
                 f"(n-gram and prompt-lookup drafting gain from repeats)")
    peers = report.get("peers")
    cols = ("method", "tok/s", "vs AR", "vs HF", *(("vs llama.cpp AR",) if peers else ()), "tau", "fwd/tok", "accept",
            "identical", "diverged", "unexplained")
    methods = [MethodEntry.from_dict(m) for m in report["methods"]]

    def times(v: float | None, fmt: str = ".2f", unit: str = "x") -> str:
        return f"{v:{fmt}}{unit}" if v is not None else "-"

    rows = []
    for m in methods:
        rows.append((
            m.name, f"{m.tokens_per_s:.1f}", times(m.speedup_vs_ar), times(m.speedup_vs_hf_greedy),
            *((times(m.ratio_vs_llama_cpp_ar),) if peers else ()),
            times(m.tau, unit=""), times(m.target_forwards_per_token, ".3f", ""), times(m.acceptance_rate, ".0%", ""),
            "yes" if m.extra.get("identical_to_reference", m.identical_to_hf_greedy) else "no",
            str(m.mismatched_prompts), str(m.unexplained_mismatches),
        ))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = [head, "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    for variant, base in VARIANT_BASELINE.items():
        if any(m.ar_baseline == base for m in methods):
            extra = "".join(f", {m.name}" for m in methods
                            if variant == "lean" and m.name in TREE_METHODS + FEATURE_METHODS)
            lines.append(f"vs AR of *-{variant}{extra} methods is against {base} (speculation's gain alone)")
    tree = report.get("config", {}).get("tree")
    if tree:
        lines.append("sd-tree: shape {tree_shape}, top-k {tree_topk}, depth {tree_depth}, budget {tree_budget}; "
                     "sd-two-level: k {two_level_draft_len}, alternatives {two_level_alts}; "
                     "sd-dcut: threshold {dcut_threshold}, max k {dcut_max_len}".format(**tree))
    feat = report.get("config", {}).get("feature")
    if feat:
        routed = next((m.extra for m in methods if m.name == "sd-routed"), None)
        lines.append("sd-block: k {block_draft_len}; sd-mtp: k {mtp_draft_len}; ".format(**feat) +
                     (f"sd-mtp-vocab: {feat['mtp_draft_vocab']} tokens; " if "mtp_draft_vocab" in feat else "") +
                     "sd-routed: code -> {route_code}, prose -> {route_prose}".format(**feat) +
                     (f"; routed {routed['routes']} at {routed['route_us_per_request']:.0f} us per request"
                      if routed else ""))
    if peers:
        lines.append(f"llama.cpp rows: vs AR is against {peers['reference']}, and identical/diverged/unexplained "
                     f"check each against {peers['reference']}'s output (its own top-2 margins); "
                     f"{peers['threads']} threads for llama.cpp, {report.get('torch_threads')} for torch; "
                     f"{peers['timing']}")
        for name in peers.get("other_ar_gguf") or {}:
            other = next((m.extra for m in methods if m.name == name), None)
            if other is not None:
                v = other["vs_llama_cpp_ar"]
                lines.append(f"{name}: llama.cpp AR on {Path(peers['other_ar_gguf'][name]).name} (its own reference; "
                             f"against {peers['reference']} {v['mismatched_prompts']} of {report['num_prompts']} "
                             f"prompts diverge, {v['unexplained_mismatches']} beyond the near-tie threshold)")
        ar = next((m.extra for m in methods if m.name == peers["reference"]), None)
        if ar is not None:
            v = ar["vs_hf_greedy"]
            lines.append(f"{peers['reference']} against hf-greedy (two engines' arithmetic, for information): "
                         f"{v['mismatched_prompts']} of {report['num_prompts']} prompts diverge, "
                         f"{v['unexplained_mismatches']} beyond the near-tie threshold")
    for sk in report.get("skipped") or []:
        lines.append(f"skipped {sk['name']}: {sk['reason']}")
    if (report.get("near_tie_fraction") or 0.0) > WEAK_CHECK_FRACTION:
        lines.append(f"WEAK LOSSLESS CHECK: the noise floor {report['noise_floor']:.3g} makes "
                     f"{report['near_tie_fraction']:.0%} of the reference's positions near ties that a divergence "
                     f"may hide behind; rerun with --dtype float32")
    lossless = all(m.unexplained_mismatches == 0 for m in methods)
    lines.append("all methods lossless (no unexplained mismatch)" if lossless
                 else "LOSSLESS CHECK FAILED: see unexplained mismatches above")
    return "\n".join(lines)


def bench_deployment(name: str) -> tuple[Path, Path | None, Path | None]:
    deployments = {"demo": demo_deployment, "hybrid-demo": hybrid_demo_deployment, "smollm2": smollm2_deployment}
    if name not in deployments:
        raise BenchError(f"--deployment {name}: unknown; use {', '.join(deployments)}, or --target DIR "
                         f"[--drafter DIR]")
    d = deployments[name]()
    if not (d.target / "config.json").exists():
        train = "specpilot train hybrid-demo" if name == "hybrid-demo" else "specpilot train demo"
        raise ModelLoadError(f"the {name} models are missing under {d.target.parent}; run `{train}`")
    return d.target, d.drafter, d.prompt_dir
