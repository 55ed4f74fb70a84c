"""The demo recipe: a byte-level BPE tokenizer, a Llama target and a small Llama draft model.

Everything is seeded and resumable: each stage writes its result atomically and skips itself when the
result is already there; LM training checkpoints (weights, optimizer, step) every few minutes, and
the data order is a pure function of (seed, step), so a resumed run sees the same batches.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from decoder.lab.corpus import Document, all_documents, split_of, write_prompt_sets, write_timing_sets

EOS = "<|endoftext|>"
UL_STEPS, UL_LR, UL_WEIGHT = 400, 3e-4, 2.0


@dataclass
class LMSpec:
    """Architecture and optimisation for one LM of the demo set."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    steps: int
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    seed: int = 0
    prose_upweight: int = 3  # the prose domain is ~4% of the text; repeat it so the model learns it
    distill_from: str | None = None  # a target dir: train on its soft labels (KL) instead of data only
    distill_ce_weight: float = 0.1
    checkpoint_every: int = 50
    init_from: str | None = None  # a previous stage's name: start from its final weights
    include_tests: bool = False  # also train on the standard library's test suites
    # Token-level unlikelihood (Welleck et al., 2019): this weight times -log(1 - p(c)) summed over the
    # tokens c already in the context (the true next token excepted); discourages greedy loops.
    unlikelihood: float = 0.0
    # "llama", or "qwen3_next": a hybrid of gated DeltaNet (recurrent linear attention) and gated full
    # attention layers, alternating (full attention every `full_attention_interval` layers), dense MLPs.
    arch: str = "llama"
    full_attention_interval: int = 2


@dataclass
class DemoRecipe:
    """A target trained on the library's modules and docs, and a drafter distilled from it.

    The target takes three stages: 2000 steps (val loss 3.61, greedy repetition 0.50 fp32), a second
    cosine cycle of 1500 steps (3.318, but repetition still 0.49), and 400 steps of unlikelihood at
    weight 2.0 (3.377, repetition 0.36; weight 1.0 left it at 0.52). Tried and dropped: continuing
    for 800 steps on modules + the library's test suites lowered validation loss but raised the
    repetition to 0.58 (test code is repetitive). `include_tests` stays available for such stages.
    """

    vocab_size: int = 6144
    seed: int = 0
    target: LMSpec = field(
        default_factory=lambda: LMSpec(
            name="target", hidden_size=384, num_hidden_layers=6, intermediate_size=1024,
            num_attention_heads=6, num_key_value_heads=2, steps=2000,
        )
    )
    # Stages after the first, each from the previous one's released (bf16) weights with a fresh optimizer
    # and its own data order; the last one is the released target (see quality.json for what they did).
    target_stages: list[LMSpec] = field(
        default_factory=lambda: [
            LMSpec(name="target-continue", hidden_size=384, num_hidden_layers=6, intermediate_size=1024,
                   num_attention_heads=6, num_key_value_heads=2, steps=1500, lr=1e-3, warmup_steps=50, seed=1,
                   init_from="target"),
            LMSpec(name="target-ul", hidden_size=384, num_hidden_layers=6, intermediate_size=1024,
                   num_attention_heads=6, num_key_value_heads=2, steps=UL_STEPS, lr=UL_LR, warmup_steps=20, seed=2,
                   init_from="target-continue", unlikelihood=UL_WEIGHT),
        ]
    )
    drafter: LMSpec = field(
        default_factory=lambda: LMSpec(
            name="drafter", hidden_size=192, num_hidden_layers=1, intermediate_size=512,
            num_attention_heads=3, num_key_value_heads=1, steps=1000, lr=3e-3, distill_from="target",
        )
    )



def tick(elapsed: float, t_last: float) -> tuple[float, float]:
    """Training wall time so far and the new mark: (elapsed + now - t_last, now)."""
    now = time.time()
    return elapsed + now - t_last, now


def resume_checkpoint(ckpt: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, label: str, total_steps: int,
                      recipe: dict | None = None) -> tuple[int, float, list]:
    """Load a training checkpoint into model and optimizer: (step, elapsed seconds, log). With `recipe`, a
    checkpoint written by another recipe is refused (its weights would not be this recipe's)."""
    state = torch.load(ckpt, weights_only=False)
    if recipe is not None and state.get("spec") != recipe:
        raise SystemExit(f"error: checkpoint {ckpt} was written by a different recipe; delete it or use "
                         f"another --work-dir")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    print(f"[{label}] resuming at step {state['step']}/{total_steps}", file=sys.stderr)
    return state["step"], state["elapsed"], state["log"]


def save_checkpoint(ckpt: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, elapsed: float,
                    log: list, recipe: dict | None = None) -> None:
    """Write a training checkpoint atomically (a kill mid-write leaves the previous one)."""
    tmp = ckpt.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed, "log": log,
                **({"spec": recipe} if recipe is not None else {})}, tmp)
    os.replace(tmp, ckpt)

def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(docs: list[Document], vocab_size: int, out_dir: Path) -> None:
    """Byte-level BPE on the training split only, saved as a transformers fast tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    train_docs = [d.text for d in docs if split_of(d.id, d.domain) == "train"]
    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(train_docs, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                            show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token=EOS, eos_token=EOS,
                                  unk_token=EOS, pad_token=EOS)
    tok.model_max_length = 2048
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out_dir)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def tokenize_corpus(docs: list[Document], tokenizer_dir: Path, cache_dir: Path, prose_upweight: int
                    ) -> dict[str, np.ndarray]:
    """Token streams for 'train' and 'val' (documents joined by EOS), cached as .npy."""
    paths = {s: cache_dir / f"{s}.npy" for s in ("train", "val")}
    if all(p.exists() for p in paths.values()):
        return {s: np.load(p) for s, p in paths.items()}
    tok = load_tokenizer(tokenizer_dir)
    eos = tok.convert_tokens_to_ids(EOS)
    streams: dict[str, list[int]] = {"train": [], "val": []}
    for d in tqdm(docs, desc="tokenize", file=sys.stderr, leave=False):
        split = split_of(d.id, d.domain)
        if split == "heldout":
            continue
        ids = tok(d.text, add_special_tokens=False)["input_ids"] + [eos]
        reps = prose_upweight if (d.domain == "prose" and split == "train") else 1
        for _ in range(reps):
            streams[split].extend(ids)
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for s, ids in streams.items():
        arr = np.asarray(ids, dtype=np.uint16)
        np.save(paths[s], arr)
        out[s] = arr
    return out


# ---------------------------------------------------------------- LM training


def _model_config(spec: LMSpec, vocab_size: int, eos_id: int):
    """The transformers config of `spec`'s architecture."""
    if spec.arch == "qwen3_next":
        from transformers import Qwen3NextConfig

        head_dim = spec.hidden_size // spec.num_attention_heads
        return Qwen3NextConfig(
            vocab_size=vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads, head_dim=head_dim, max_position_embeddings=2048,
            rope_theta=10000.0, tie_word_embeddings=True, full_attention_interval=spec.full_attention_interval,
            mlp_only_layers=list(range(spec.num_hidden_layers)), num_experts=0,  # dense MLP in every layer
            linear_num_key_heads=spec.num_key_value_heads, linear_num_value_heads=spec.num_attention_heads,
            linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
            bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        )
    if spec.arch != "llama":
        raise ValueError(f"LMSpec.arch {spec.arch!r}: use 'llama' or 'qwen3_next'")
    return _llama_config(spec, vocab_size, eos_id)


def _llama_config(spec: LMSpec, vocab_size: int, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=2048, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
    )


def _batch(data: np.ndarray, spec: LMSpec, step: int, rng_tag: int = 0) -> torch.Tensor:
    # A pure function of (seed, step): resuming replays exactly the batches an uninterrupted run sees.
    rng = np.random.default_rng([spec.seed, step, rng_tag])
    starts = rng.integers(0, len(data) - spec.seq_len - 1, size=spec.batch_size)
    rows = np.stack([data[s : s + spec.seq_len + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows)


def _lr_at(spec: LMSpec, step: int) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * cos)


def optimizer_step(model, opt, loss: torch.Tensor) -> None:
    """One AdamW step of the recipes: backward, clip the gradient norm at 1, step."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def unlikelihood_loss(logits: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean over positions of -sum_c log(1 - p(c)), c over the tokens seen so far other than the target.

    logits [B, T, V] predict y [B, T] from the inputs x[:, :t+1]."""
    seen = torch.zeros(logits.shape, dtype=torch.uint8)
    seen.scatter_(2, x.unsqueeze(-1), 1)
    seen = torch.cummax(seen, dim=1).values  # [B, T, V]: token v occurred in x[:, :t+1]
    seen.scatter_(2, y.unsqueeze(-1), 0)
    p = torch.softmax(logits, dim=-1)
    penalty = -torch.log((1 - p).clamp_min(1e-5)) * seen
    return penalty.sum(-1).mean()


@torch.no_grad()
def evaluate_loss(model, data: np.ndarray, seq_len: int = 512, max_windows: int = 64) -> float:
    """Mean next-token cross-entropy over non-overlapping validation windows."""
    model.eval()
    n = min(max_windows, (len(data) - 1) // seq_len)
    losses = []
    for i in range(0, n, 8):
        rows = [data[j * seq_len : j * seq_len + seq_len + 1] for j in range(i, min(n, i + 8))]
        x = torch.from_numpy(np.stack(rows).astype(np.int64))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits.float()
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).item())
    model.train()
    return float(np.mean(losses))


def train_lm(spec: LMSpec, data: dict[str, np.ndarray], tokenizer_dir: Path, work_dir: Path, out_dir: Path,
             teacher_dir: Path | None = None) -> dict:
    """Train one LM with bf16 autocast on the CPU, resumable from `work_dir`; writes `out_dir` at the end."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if (out_dir / "recipe.json").exists():
        return json.loads((out_dir / "recipe.json").read_text())
    tok = load_tokenizer(tokenizer_dir)
    eos = tok.convert_tokens_to_ids(EOS)
    config = _model_config(spec, len(tok), eos)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config) if spec.arch == "llama" else AutoModelForCausalLM.from_config(config)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=spec.weight_decay)
    teacher = None
    if teacher_dir is not None:
        teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.bfloat16).eval()

    work_dir.mkdir(parents=True, exist_ok=True)
    ckpt = work_dir / f"{spec.name}.ckpt.pt"
    step, elapsed, log = 0, 0.0, []
    if not ckpt.exists() and spec.init_from:
        init = work_dir / f"{spec.init_from}.ckpt.pt"
        if not init.exists():
            raise SystemExit(f"error: stage {spec.name} starts from {spec.init_from}, whose checkpoint {init} "
                             f"is missing; run that stage first")
        # Start from the previous stage as released (bf16), so a rerun of the recipe matches its models.
        prev = torch.load(init, weights_only=False)["model"]
        model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in prev.items()})
    if ckpt.exists():
        step, elapsed, log = resume_checkpoint(ckpt, model, opt, spec.name, spec.steps)

    def save_ckpt() -> None:
        save_checkpoint(ckpt, model, opt, step, elapsed, log)

    n_params = sum(p.numel() for p in model.parameters())
    model.train()
    bar = tqdm(total=spec.steps, initial=step, desc=f"train {spec.name} ({n_params / 1e6:.1f}M)",
               file=sys.stderr, dynamic_ncols=True)
    t_last = time.time()
    while step < spec.steps:
        for g in opt.param_groups:
            g["lr"] = _lr_at(spec, step)
        batch = _batch(data["train"], spec, step)
        x, y = batch[:, :-1], batch[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        logits = logits.float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss = ce
        if spec.unlikelihood:
            loss = loss + spec.unlikelihood * unlikelihood_loss(logits, x, y)
        if teacher is not None:
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(input_ids=x).logits.float(), dim=-1)
            logp = F.log_softmax(logits, dim=-1)
            kd = F.kl_div(logp.reshape(-1, logp.shape[-1]), t_logp.reshape(-1, t_logp.shape[-1]),
                          log_target=True, reduction="batchmean")
            loss = kd + spec.distill_ce_weight * ce
        optimizer_step(model, opt, loss)
        step += 1
        elapsed, t_last = tick(elapsed, t_last)
        if step % 10 == 0:
            log.append({"step": step, "loss": round(loss.item(), 4), "ce": round(ce.item(), 4)})
        bar.set_postfix(loss=f"{loss.item():.3f}", ce=f"{ce.item():.3f}")
        bar.update(1)
        if step % spec.checkpoint_every == 0 or step == spec.steps:
            save_ckpt()
    bar.close()

    val_loss = evaluate_loss(model, data["val"], spec.seq_len)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)  # each model dir is self-contained: loadable with its tokenizer
    recipe = {
        "spec": asdict(spec),
        "parameters": n_params,
        "tokens_seen": spec.steps * spec.batch_size * spec.seq_len,
        "train_seconds": round(elapsed, 1),
        "final_val_loss": round(val_loss, 4),
        "final_val_ppl": round(math.exp(val_loss), 2),
        "train_log_tail": log[-20:],
        "torch": torch.__version__,
    }
    _atomic_write_text(out_dir / "recipe.json", json.dumps(recipe, indent=2))
    print(f"[{spec.name}] done: {n_params / 1e6:.2f}M params, val loss {val_loss:.4f}", file=sys.stderr)
    return recipe


def train_demo(out_root: Path, work_dir: Path, recipe: DemoRecipe | None = None,
               only: str | None = None) -> dict:
    """Run the whole demo recipe: prompts, tokenizer, target, drafter. Each finished stage is kept."""
    recipe = recipe or DemoRecipe()
    # Every core unless OMP_NUM_THREADS says otherwise (e.g. 1, to train two things side by side).
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)))
    work_dir.mkdir(parents=True, exist_ok=True)
    out_root.mkdir(parents=True, exist_ok=True)
    docs = all_documents()
    write_prompt_sets(out_root / "prompts")
    write_timing_sets(out_root / "prompts")  # more held-out prompts for the demo's hidden split (timing)
    tok_dir = out_root / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        print("[tokenizer] training byte-level BPE", file=sys.stderr)
        train_tokenizer(docs, recipe.vocab_size, tok_dir)  # the tokenizer never sees the test suites
    corpora: dict[bool, dict[str, np.ndarray]] = {}

    def data_for(spec: LMSpec) -> dict[str, np.ndarray]:
        if spec.include_tests not in corpora:
            d = all_documents(include_tests=spec.include_tests)
            cache = work_dir / ("tokens-with-tests" if spec.include_tests else "tokens")
            corpora[spec.include_tests] = tokenize_corpus(d, tok_dir, cache, spec.prose_upweight)
            print(f"[corpus{' + tests' if spec.include_tests else ''}] train "
                  f"{len(corpora[spec.include_tests]['train']):,} tokens, val "
                  f"{len(corpora[spec.include_tests]['val']):,} tokens", file=sys.stderr)
        return corpora[spec.include_tests]

    results = {}
    if only in (None, "target"):
        # Earlier stages are kept under the work dir; the last one is the released target.
        stages = [recipe.target, *recipe.target_stages]
        for i, spec in enumerate(stages):
            last = i == len(stages) - 1
            results["target"] = train_lm(spec, data_for(spec), tok_dir, work_dir,
                                         out_root / "target" if last else work_dir / f"{spec.name}-out")
    if only in (None, "drafter"):
        teacher = out_root / "target" if recipe.drafter.distill_from == "target" else None
        if teacher is not None and not (teacher / "recipe.json").exists():
            raise SystemExit("error: the drafter distils from the target; train the target first "
                             "(specpilot train demo --only target)")
        results["drafter"] = train_lm(recipe.drafter, data_for(recipe.drafter), tok_dir, work_dir,
                                      out_root / "drafter", teacher)
    if only is None or only == "drafter":
        from decoder.lab.quality import QUALITY_BAR, demo_quality  # quality imports the decoder, which is heavy

        quality = demo_quality(out_root / "target", out_root / "prompts" / "code.jsonl")
        _atomic_write_text(out_root / "quality.json", json.dumps(quality, indent=2))
        print(f"[quality] mean repeated-4-gram fraction over held-out code continuations: "
              f"{quality['mean_repeated_4gram_fraction']:.3f} fp32, "
              f"{quality['bfloat16']['mean_repeated_4gram_fraction']:.3f} bf16 (gate: fp32 < {QUALITY_BAR})",
              file=sys.stderr)
        results["quality"] = quality
    _atomic_write_text(out_root / "recipe.json", json.dumps(
        {"vocab_size": recipe.vocab_size, "seed": recipe.seed, "target": asdict(recipe.target),
         "target_stages": [asdict(x) for x in recipe.target_stages],
         "drafter": asdict(recipe.drafter)}, indent=2))
    return results


@dataclass
class HybridDemoRecipe:
    """The hybrid demo: a Qwen3-Next-style target (gated DeltaNet layers alternating with gated attention,
    dense MLPs) distilled from the demo target on the same corpus and tokenizer, and a one-layer Llama draft
    model distilled from it. Speculative decoding on it rolls the recurrent state back (decoder/runners.py:
    RollbackCache)."""

    target: LMSpec = field(
        default_factory=lambda: LMSpec(
            name="hybrid-target", arch="qwen3_next", hidden_size=192, num_hidden_layers=6, intermediate_size=512,
            num_attention_heads=3, num_key_value_heads=1, steps=700, batch_size=8, seq_len=256, lr=3e-3,
            warmup_steps=50, distill_from="demo-target", distill_ce_weight=0.1,
        )
    )
    # Its own draft model, distilled from it: the demo's draft model (distilled from the demo target) agrees
    # with it on 37% of drafts only (bench, code, k = 3), too few for speculation to pay.
    drafter: LMSpec = field(
        default_factory=lambda: LMSpec(
            name="hybrid-drafter", hidden_size=128, num_hidden_layers=1, intermediate_size=384,
            num_attention_heads=2, num_key_value_heads=1, steps=800, batch_size=8, seq_len=256, lr=3e-3,
            warmup_steps=50, distill_from="target",
        )
    )


def train_hybrid_demo(out_root: Path, work_dir: Path, demo_root: Path, recipe: HybridDemoRecipe | None = None,
                      ) -> dict:
    """Distil the hybrid demo target from the demo target, then its draft model from it (resumable from
    `work_dir`; the demo's tokenizer). Writes out_root/target, out_root/drafter and out_root/recipe.json."""
    recipe = recipe or HybridDemoRecipe()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)))
    teacher = demo_root / "target"
    if not (teacher / "recipe.json").exists():
        raise SystemExit(f"error: the hybrid demo distils from the demo target; {teacher} is missing "
                         f"(specpilot train demo --only target)")
    work_dir.mkdir(parents=True, exist_ok=True)
    tok_dir = demo_root / "tokenizer"
    data = tokenize_corpus(all_documents(), tok_dir, work_dir / "tokens", recipe.target.prose_upweight)
    result = train_lm(recipe.target, data, tok_dir, work_dir, out_root / "target", teacher)
    drafter = train_lm(recipe.drafter, data, tok_dir, work_dir, out_root / "drafter", out_root / "target")
    _atomic_write_text(out_root / "recipe.json", json.dumps(
        {"target": asdict(recipe.target), "teacher": "demo target", "drafter": asdict(recipe.drafter)},
        indent=2))
    return {"target": result, "drafter": drafter}
