"""`specpilot train drafter`: self-distilled feature drafters (block, mtp) and the domain router.

Recipe (each stage resumable; every result written atomically and skipped when present):
1. **Greedy data.** Windows of the training corpus (the target's own tokenizer; code and prose, prose
   up-weighted as for the demo target) are continued by the target itself, greedily, in batches:
   the drafter learns to predict what the target will say, not what the corpus said. Shards of
   sequences are written one by one, so a killed run keeps the finished shards.
2. **Features.** One teacher-forced target forward per shard captures the residual stream after
   the drafter's target layers (hooks on the Hugging Face layers: the same tensors the lean forward's
   `capture` returns at decode time), stored as bf16 memory maps.
3. **Training.** AdamW with warm-up and cosine decay, bf16 autocast on the CPU; the target's
   embedding and LM head are frozen and shared. The batch at step s is a pure function of (seed, s)
   and a checkpoint (weights, optimiser, step, log) is written every few steps, so a resumed run
   ends with exactly the weights of an uninterrupted one.
   - block: blocks of `block_size` slots at random anchors inside the continuation; each block sees
     only the context before its anchor; loss = CE per slot, slot j weighted exp(-(j-1)/decay).
   - mtp: at random continuation positions p, head j predicts token p+1+j from h_p and token p+1.
4. **Evaluation** on held-out sequences from the validation split: per-slot top-1 accuracy and the
   expected tokens per step of chain verification (1 + mean accepted prefix), written to recipe.json.

The router (`--kind router`) is a logistic regression on bag-of-token prompts of the training split
(code vs prose), evaluated on the validation split and on the held-out prompt sets.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from decoder.capabilities import CORPUS_FILE, native_bf16_cpu
from decoder.contract import data_dir
from decoder.datastore import CorpusIndex
from decoder.engines import lookup_cache
from decoder.featdraft import (
    VOCAB_RANK_FILE,
    BlockDrafter,
    BlockDrafterConfig,
    DomainRouter,
    MTPConfig,
    MTPHeads,
    drafters_dir,
    save_feature_drafter,
)
from decoder.lab.corpus import all_documents, code_documents, make_prompt, prose_documents, split_of
from decoder.lab.train import (
    _atomic_write_text,
    _lr_at,
    optimizer_step,
    resume_checkpoint,
    save_checkpoint,
    tick,
)


@dataclass
class DrafterSpec:
    """Everything that determines a trained feature drafter (written beside its weights)."""

    kind: str = "block"  # block | mtp
    seed: int = 0
    # data
    train_sequences: int = 4096
    val_sequences: int = 128
    prefix_len: int = 256
    gen_len: int = 128
    shard_size: int = 128
    prose_upweight: int = 3
    # model
    target_layers: tuple[int, ...] | None = None  # None: three layers spread over the target, ending at the last
    num_layers: int = 1
    intermediate: int = 1024
    block_size: int = 8
    inject_prev: bool = True  # block: add the previous position's context state to every slot
    slot_inputs: bool = True  # block: per-offset slot embeddings plus the anchor token's embedding in every slot
    num_heads_mtp: int = 4
    # optimisation
    steps: int = 2500
    batch_size: int = 16
    anchors_per_seq: int = 16  # block: blocks per sequence per step; mtp: positions per sequence per step
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    slot_decay: float = 6.0  # block: CE weight of slot j is exp(-(j-1)/slot_decay)
    checkpoint_every: int = 50
    # data from a chat deployment's own answers (JSONL rows: "prompt" text, "tokens" answer ids) instead of
    # corpus continuations: the prompt's last `prefix_len` tokens, the answer's first `gen_len`
    answers: str | None = None


def default_layers(n_layers: int) -> tuple[int, ...]:
    if n_layers <= 2:
        return tuple(range(n_layers))
    return (1, n_layers // 2 + (n_layers % 2), n_layers - 1) if n_layers >= 4 else (0, 1, n_layers - 1)


def _atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, arr)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------ data


def corpus_streams(target_dir: Path, cache_dir: Path, prose_upweight: int) -> dict[str, np.ndarray]:
    """The corpus's train / val token streams under the target's tokenizer (cached)."""
    from decoder.lab.train import tokenize_corpus

    return tokenize_corpus(all_documents(), target_dir, cache_dir, prose_upweight)


@torch.inference_mode()
def greedy_continue(target, prefixes: torch.Tensor, gen_len: int) -> torch.Tensor:
    """Greedy continuations [B, gen_len] of equal-length prefixes [B, P] (batched, KV cache)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    out = target(input_ids=prefixes, past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1)
    gen = [nxt]
    for _ in range(gen_len - 1):
        out = target(input_ids=nxt[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1)
        gen.append(nxt)
    return torch.stack(gen, dim=1)


@torch.inference_mode()
def capture_features(target, seqs: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """The residual stream after each of `layers` for every position: [B, T, len(layers) * D]."""
    got: dict[int, torch.Tensor] = {}
    hooks = []
    for li in layers:
        def hook(_m, _inp, out, li=li):
            got[li] = out[0] if isinstance(out, tuple) else out
        hooks.append(target.model.layers[li].register_forward_hook(hook))
    try:
        target.model(input_ids=seqs, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([got[li] for li in layers], dim=-1)


def build_data(target, target_dir: Path, work: Path, spec: DrafterSpec, layers: tuple[int, ...]) -> dict:
    """Stage 1-2: greedy sequences and their features, shard by shard (resumable). Returns memmaps."""
    streams = corpus_streams(target_dir, work / "tokens", spec.prose_upweight)
    t_len = spec.prefix_len + spec.gen_len
    lay = "-".join(map(str, layers))
    ddir = work / f"data-p{spec.prefix_len}-g{spec.gen_len}-s{spec.seed}-l{lay}"
    ddir.mkdir(parents=True, exist_ok=True)
    out: dict[str, list] = {"train": [], "val": []}
    plan = [("train", i) for i in range(math.ceil(spec.train_sequences / spec.shard_size))] + \
           [("val", i) for i in range(math.ceil(spec.val_sequences / spec.shard_size))]
    todo = [p for p in plan if not (ddir / f"{p[0]}-{p[1]:03d}.feat.npy").exists()]
    bar = tqdm(total=len(plan), initial=len(plan) - len(todo), desc="greedy data + features (shards)",
               file=sys.stderr, dynamic_ncols=True)
    for split, i in plan:
        seq_path, feat_path = ddir / f"{split}-{i:03d}.seq.npy", ddir / f"{split}-{i:03d}.feat.npy"
        if not feat_path.exists():
            total = spec.train_sequences if split == "train" else spec.val_sequences
            n = min(spec.shard_size, total - i * spec.shard_size)
            data = streams[split]
            rng = np.random.default_rng([spec.seed, 7 if split == "train" else 8, i])
            starts = rng.integers(0, len(data) - spec.prefix_len - 1, size=n)
            prefixes = torch.from_numpy(np.stack([data[s : s + spec.prefix_len] for s in starts]).astype(np.int64))
            if not seq_path.exists():
                gens = [greedy_continue(target, prefixes[j : j + 32], spec.gen_len) for j in range(0, n, 32)]
                seqs = torch.cat([prefixes, torch.cat(gens)], dim=1)
                _atomic_save_npy(seq_path, seqs.numpy().astype(np.int32))
            seqs = torch.from_numpy(np.load(seq_path).astype(np.int64))
            feats = torch.cat([capture_features(target, seqs[j : j + 16], layers) for j in range(0, n, 16)])
            _atomic_save_npy(feat_path, feats.to(torch.bfloat16).view(torch.int16).numpy())
            bar.update(1)
        out[split].append((np.load(seq_path), np.load(feat_path, mmap_mode="r")))
    bar.close()
    res = {}
    for split, shards in out.items():
        seqs = np.concatenate([s for s, _ in shards])
        res[split] = (seqs, [f for _, f in shards], [len(s) for s, _ in shards], np.full(len(seqs), t_len))
    assert res["train"][0].shape[1] == t_len
    return res


def read_answers(path: Path) -> list[dict]:
    """Rows of an answers file (JSONL: "prompt" text, "tokens" answer ids), e.g. `specpilot train smollm2-drafter
    --only data`'s answers.jsonl. ValueError (one line, naming the line) on a row that is not one."""
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise ValueError(f"--answers {path}: line {n} is not JSON") from None
        if not (isinstance(row, dict) and isinstance(row.get("prompt"), str) and isinstance(row.get("tokens"), list)
                and all(isinstance(t, int) and not isinstance(t, bool) for t in row["tokens"])):
            raise ValueError(f"--answers {path}: line {n} needs \"prompt\" (text) and \"tokens\" (answer ids)")
        rows.append(row)
    return rows


def answer_split(rows: list[dict], seed: int, held: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out) rows of an answers file: the first `held` of a seeded shuffle are held out."""
    order = np.random.default_rng([seed, 9]).permutation(len(rows))
    return [rows[i] for i in order[held:]], [rows[i] for i in order[:held]]


def build_answer_data(target, target_dir: Path, work: Path, spec: DrafterSpec, layers: tuple[int, ...]) -> dict:
    """Stage 1-2 from a chat deployment's own answers (`spec.answers`): each row is its prompt (chat template
    rendered, tokenised as the harness does) and the target's greedy answer; the features come from one
    teacher-forced forward over the whole row, so every position sees its real context. Rows are stored
    right-aligned on the prompt: the prompt's last `prefix_len` tokens end at `prefix_len`, the answer's first
    `gen_len` tokens follow, and each row's real length bounds the positions drawn from it. Shards as in
    `build_data` (resumable); the first `val_sequences` rows of a seeded shuffle are held out."""
    from transformers import AutoTokenizer

    rows = read_answers(Path(spec.answers))
    tok = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    need = (spec.num_heads_mtp if spec.kind == "mtp" else spec.block_size) + 2
    rows = [r for r in rows if len(r["tokens"]) >= need]
    if len(rows) <= spec.val_sequences:
        raise ValueError(f"--answers {spec.answers}: {len(rows)} answers of at least {need} tokens; need more than "
                         f"the {spec.val_sequences} held out")
    train, val = answer_split(rows, spec.seed, spec.val_sequences)
    splits = {"train": train[: spec.train_sequences], "val": val}
    t_len, p_len = spec.prefix_len + spec.gen_len, spec.prefix_len
    lay = "-".join(map(str, layers))
    digest = hashlib.sha256(Path(spec.answers).read_bytes()).hexdigest()[:12]
    ddir = work / f"answers-{digest}-p{p_len}-g{spec.gen_len}-s{spec.seed}-l{lay}"
    ddir.mkdir(parents=True, exist_ok=True)
    out: dict[str, tuple] = {}
    for split, srows in splits.items():
        seqs_all, feats_all, sizes, lens_all = [], [], [], []
        n_shards = math.ceil(len(srows) / spec.shard_size)
        for i in tqdm(range(n_shards), desc=f"answer features ({split} shards)", file=sys.stderr, dynamic_ncols=True):
            seq_path, feat_path = ddir / f"{split}-{i:03d}.seq.npy", ddir / f"{split}-{i:03d}.feat.npy"
            len_path = ddir / f"{split}-{i:03d}.len.npy"
            if not feat_path.exists():
                chunk = srows[i * spec.shard_size: (i + 1) * spec.shard_size]
                seqs = np.zeros((len(chunk), t_len), dtype=np.int32)
                feats = np.zeros((len(chunk), t_len, len(layers) * target.config.hidden_size), dtype=np.int16)
                lens = np.zeros(len(chunk), dtype=np.int64)
                for j, r in enumerate(chunk):
                    prompt = tok(r["prompt"], add_special_tokens=False)["input_ids"]
                    answer = list(r["tokens"])[: spec.gen_len]
                    full = torch.tensor([prompt + answer], dtype=torch.long)
                    f = capture_features(target, full, layers)[0].to(torch.bfloat16).view(torch.int16).numpy()
                    cut = max(0, len(prompt) - p_len)  # drop the prompt's head: it stays in the features' context
                    at = p_len - (len(prompt) - cut)
                    seqs[j, at: at + full.shape[1] - cut] = full[0, cut:].numpy()
                    feats[j, at: at + full.shape[1] - cut] = f[cut:]
                    lens[j] = p_len + len(answer)
                _atomic_save_npy(seq_path, seqs)
                _atomic_save_npy(len_path, lens)
                _atomic_save_npy(feat_path, feats)
            seqs_all.append(np.load(seq_path))
            lens_all.append(np.load(len_path))
            feats_all.append(np.load(feat_path, mmap_mode="r"))
            sizes.append(len(seqs_all[-1]))
        out[split] = (np.concatenate(seqs_all), feats_all, sizes, np.concatenate(lens_all))
    return out


class _Feats:
    """Row access over the feature shards (memory-mapped, bf16 stored as int16)."""

    def __init__(self, shards: list[np.ndarray], sizes: list[int]) -> None:
        self.shards, self.offsets = shards, np.cumsum([0, *sizes])

    def rows(self, idx: np.ndarray) -> torch.Tensor:
        out = []
        for i in idx:
            s = int(np.searchsorted(self.offsets, i, side="right") - 1)
            out.append(np.asarray(self.shards[s][i - self.offsets[s]]))
        return torch.from_numpy(np.stack(out)).view(torch.bfloat16)


# ------------------------------------------------------------------------------------- training


def _positions(spec: DrafterSpec, rng: np.random.Generator, lens: np.ndarray) -> torch.Tensor:
    """block: anchors in [prefix, L-1-k]; mtp: positions p in [prefix-1, L-2-heads], L each row's real length
    (T for corpus data). [B, N] long."""
    lens = np.asarray(lens, dtype=np.int64)[:, None]
    if spec.kind == "block":
        lo, hi = spec.prefix_len, lens - 1 - spec.block_size
    else:
        lo, hi = spec.prefix_len - 1, lens - 2 - spec.num_heads_mtp
    if not np.ptp(hi):  # equal lengths (corpus data): the scalar draw, as the committed recipes were trained
        hi = int(hi[0, 0])
    return torch.from_numpy(rng.integers(lo, hi + 1, size=(len(lens), spec.anchors_per_seq)).astype(np.int64))


def _block_targets(tokens: torch.Tensor, anchors: torch.Tensor, k: int) -> torch.Tensor:
    idx = anchors[:, :, None] + torch.arange(1, k + 1)
    return tokens.gather(1, idx.view(tokens.shape[0], -1)).view(*anchors.shape, k)  # [B, N, k]


def _mtp_inputs(feats: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor, d: int, n_heads: int, embed):
    b, n = pos.shape
    h = feats[..., -d:].gather(1, pos[:, :, None].expand(b, n, d))  # final hidden at p
    e = F.embedding(tokens.gather(1, pos + 1), embed)  # token p+1 (the target's own next token)
    idx = pos[:, :, None] + 1 + torch.arange(1, n_heads + 1)
    y = tokens.gather(1, idx.view(b, -1)).view(b, n, n_heads)  # tokens p+1+j
    return h, e, y


def _batch_logits(model, spec, seqs: np.ndarray, lens: np.ndarray, feats_of, idx: np.ndarray,
                  rng: np.random.Generator, embed, lm_head, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and targets of the windows `idx` (anchors drawn from `rng`), under bf16 autocast."""
    tokens = torch.from_numpy(seqs[idx].astype(np.int64))
    feats = feats_of.rows(idx)
    pos = _positions(spec, rng, lens[idx])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _logits(model, spec, feats, tokens, pos, embed, lm_head, d)


def _logits(model, spec: DrafterSpec, feats, tokens, pos, embed, lm_head, d: int):
    """(logits [B, N, k, V], targets [B, N, k]) for a batch."""
    if spec.kind == "block":
        return (model.forward_train(feats, tokens, pos, embed, lm_head),
                _block_targets(tokens, pos, spec.block_size))
    h, e, y = _mtp_inputs(feats, tokens, pos, d, spec.num_heads_mtp, embed)
    return F.linear(model.hidden(h, e), lm_head), y


@torch.no_grad()
def evaluate(model, spec: DrafterSpec, val, embed, lm_head, d: int) -> dict:
    """Per-slot top-1 accuracy and chain tau on held-out sequences (fixed positions, seed-independent)."""
    seqs, shards, sizes, lens = val
    feats_of = _Feats(shards, sizes)
    rng = np.random.default_rng([12345])
    model.eval()
    hits = []
    for i in range(0, len(seqs), 16):
        idx = np.arange(i, min(len(seqs), i + 16))
        logits, y = _batch_logits(model, spec, seqs, lens, feats_of, idx, rng, embed, lm_head, d)
        hits.append((logits.argmax(-1) == y).reshape(-1, y.shape[-1]))
    model.train()
    h = torch.cat(hits).float()  # [blocks, k]
    prefix = h.cumprod(dim=1)  # slot j accepted iff all slots <= j right
    k = h.shape[1]
    return {
        "slot_accuracy": [round(v, 4) for v in h.mean(0).tolist()],
        "tau_chain_at_k": {str(j): round(1 + prefix[:, :j].sum(1).mean().item(), 4) for j in range(1, k + 1)},
        "blocks": int(h.shape[0]),
    }


def train_feature_drafter(target_dir: Path, out_dir: Path | None, work: Path, spec: DrafterSpec,
                          progress: bool = True, stop_after: int | None = None) -> dict | None:
    """Train (or resume) one feature drafter; write config.json, model.safetensors and recipe.json.

    `stop_after` ends the run after that many steps with a checkpoint and no output, as a kill would
    (for resume tests); the next call resumes there."""
    from decoder.models import load_causal_lm

    target_dir = Path(target_dir)
    out_dir = Path(out_dir) if out_dir else drafters_dir(target_dir) / spec.kind
    if spec.kind not in ("block", "mtp"):
        raise ValueError(f"--kind {spec.kind}: choose block, mtp or router")
    target = load_causal_lm(target_dir, "target", "bfloat16", "cpu")
    tc = target.config
    layers = tuple(spec.target_layers) if spec.target_layers else default_layers(tc.num_hidden_layers)
    if max(layers) >= tc.num_hidden_layers:
        raise ValueError(f"--target-layers {layers}: the target has {tc.num_hidden_layers} layers "
                         f"(0..{tc.num_hidden_layers - 1})")
    d = tc.hidden_size
    work.mkdir(parents=True, exist_ok=True)
    t_data = time.time()
    data = (build_answer_data if spec.answers else build_data)(target, target_dir, work, spec, layers)
    data_s = time.time() - t_data
    embed = target.model.embed_tokens.weight.detach()
    lm_head = target.lm_head.weight.detach()

    torch.manual_seed(spec.seed)
    if spec.kind == "block":
        cfg = BlockDrafterConfig(target_hidden=d, target_layers=list(layers), vocab_size=tc.vocab_size,
                                 num_layers=spec.num_layers, num_heads=tc.num_attention_heads,
                                 num_kv_heads=tc.num_key_value_heads, intermediate=spec.intermediate,
                                 block_size=spec.block_size, inject_prev=spec.inject_prev, slot_inputs=spec.slot_inputs,
                                 rope_theta=float(getattr(tc, "rope_theta", 1e4) or 1e4),
                                 rms_eps=tc.rms_norm_eps)
        model = BlockDrafter(cfg)
    else:
        cfg = MTPConfig(target_hidden=d, target_layers=[layers[-1]], vocab_size=tc.vocab_size,
                        num_heads=spec.num_heads_mtp, rms_eps=tc.rms_norm_eps)
        model = MTPHeads(cfg, target.model.norm.weight)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=spec.weight_decay)
    ckpt = work / f"{spec.kind}-s{spec.seed}.ckpt.pt"
    step, elapsed, log = 0, 0.0, []
    if ckpt.exists():
        step, elapsed, log = resume_checkpoint(ckpt, model, opt, spec.kind, spec.steps, asdict(spec))

    def save_ckpt() -> None:
        save_checkpoint(ckpt, model, opt, step, elapsed, log, asdict(spec))

    seqs, shards, sizes, lens = data["train"]
    feats_of = _Feats(shards, sizes)
    slot_w = None
    if spec.kind == "block":
        slot_w = torch.exp(-torch.arange(spec.block_size, dtype=torch.float32) / spec.slot_decay)
        slot_w = slot_w / slot_w.mean()
    n_params = sum(p.numel() for p in model.parameters())
    model.train()
    bar = tqdm(total=spec.steps, initial=step, desc=f"train {spec.kind} ({n_params / 1e6:.2f}M)", file=sys.stderr,
               dynamic_ncols=True, disable=not progress)
    t_last = time.time()
    while step < spec.steps:
        for g in opt.param_groups:
            g["lr"] = _lr_at(spec, step)  # the demo recipe's schedule (same fields)
        rng = np.random.default_rng([spec.seed, step, 1])
        idx = np.sort(rng.choice(len(seqs), size=spec.batch_size, replace=False))
        logits, y = _batch_logits(model, spec, seqs, lens, feats_of, idx, rng, embed, lm_head, d)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
        ce = ce.view(-1, y.shape[-1])
        loss = (ce * slot_w).mean() if slot_w is not None else ce.mean()
        optimizer_step(model, opt, loss)
        step += 1
        elapsed, t_last = tick(elapsed, t_last)
        if step % 10 == 0:
            log.append({"step": step, "loss": round(loss.item(), 4),
                        "acc1": round((logits[..., 0, :].argmax(-1) == y[..., 0]).float().mean().item(), 4)})
        bar.set_postfix(loss=f"{loss.item():.3f}")
        bar.update(1)
        if step % spec.checkpoint_every == 0 or step == spec.steps or step == stop_after:
            save_ckpt()
        if step == stop_after:
            bar.close()
            return None
    bar.close()

    metrics = evaluate(model, spec, data["val"], embed, lm_head, d)
    save_feature_drafter(model, out_dir)
    recipe = {
        "spec": asdict(spec),
        "target": str(target_dir),
        "target_layers": list(layers),
        "parameters": n_params,
        "data_seconds": round(data_s, 1),
        "train_seconds": round(elapsed, 1),
        "threads": torch.get_num_threads(),
        "val": metrics,
        "train_log_tail": log[-10:],
        "torch": torch.__version__,
    }
    _atomic_write_text(out_dir / "recipe.json", json.dumps(recipe, indent=2))
    print(f"[{spec.kind}] done: {n_params / 1e6:.2f}M params, val slot accuracy {metrics['slot_accuracy']}, "
          f"chain tau at k: {metrics['tau_chain_at_k']}", file=sys.stderr)
    return recipe


# ------------------------------------------------------------------------------------------ router


def _router_rows(docs, tok, chars: int) -> tuple[list[list[int]], list[int]]:

    rows, labels = [], []
    for d in docs:
        text = make_prompt(d.text, target_chars=chars) if d.domain == "code" else d.text[:chars]
        rows.append(tok(text, add_special_tokens=False)["input_ids"])
        labels.append(1 if d.domain == "prose" else 0)
    return rows, labels


def _bag(rows: list[list[int]], vocab: int) -> torch.Tensor:
    x = torch.zeros(len(rows), vocab)
    for i, r in enumerate(rows):
        if r:
            x[i].index_add_(0, torch.tensor(r), torch.full((len(r),), 1.0 / len(r)))
    return x


def train_router(target_dir: Path, out_path: Path | None = None, seed: int = 0, prompt_chars: int = 1000,
                 steps: int = 300) -> dict:
    """Fit the code/prose router on the training split; report its accuracy on val and the prompt sets."""
    from decoder.models import DEMO_DIR, load_tokenizer

    target_dir = Path(target_dir)
    out_path = Path(out_path) if out_path else drafters_dir(target_dir) / "router.json"
    tok = load_tokenizer(target_dir)
    vocab = len(tok)
    docs = all_documents()
    by = {s: [d for d in docs if split_of(d.id, d.domain) == s] for s in ("train", "val")}
    xs, ys = {}, {}
    for s, ds in by.items():
        rows, labels = _router_rows(ds, tok, prompt_chars)
        xs[s], ys[s] = _bag(rows, vocab), torch.tensor(labels, dtype=torch.float32)
    torch.manual_seed(seed)
    w = torch.zeros(vocab, requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    pos_weight = (ys["train"] == 0).sum() / (ys["train"] == 1).sum().clamp_min(1)  # classes balanced
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        z = xs["train"] @ w + b
        loss = F.binary_cross_entropy_with_logits(z, ys["train"], pos_weight=pos_weight) + 1e-4 * w.pow(2).sum()
        loss.backward()
        return loss

    t0 = time.time()
    opt.step(closure)
    fit_s = time.time() - t0
    router = DomainRouter(w.detach().tolist(), float(b.item()))

    def acc(x, y) -> float:
        return round(((x @ w.detach() + b.detach() >= 0).float() == y).float().mean().item(), 4)

    prompt_acc = {}
    prompt_dir = DEMO_DIR / "prompts"
    for dom in ("code", "prose"):
        path = prompt_dir / f"{dom}.jsonl"
        if path.exists():
            texts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
            routes = [router.route(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
            prompt_acc[dom] = round(sum(r == dom for r in routes) / len(routes), 4)
    probe = tok(texts[0], add_special_tokens=False)["input_ids"] if prompt_acc else list(range(300))
    t1 = time.perf_counter()
    for _ in range(200):
        router.route(probe)
    route_us = (time.perf_counter() - t1) / 200 * 1e6
    router.recipe = {"seed": seed, "prompt_chars": prompt_chars, "lbfgs_iters": steps, "vocab": vocab,
                     "train_docs": len(ys["train"]), "val_docs": len(ys["val"]), "fit_seconds": round(fit_s, 2),
                     "train_accuracy": acc(xs["train"], ys["train"]), "val_accuracy": acc(xs["val"], ys["val"]),
                     "prompt_set_accuracy": prompt_acc, "route_microseconds": round(route_us, 1)}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    router.save(out_path)
    print(f"[router] val accuracy {router.recipe['val_accuracy']}, prompt sets {prompt_acc}, "
          f"{route_us:.0f} us per route", file=sys.stderr)
    return router.recipe


# ------------------------------------------------------------------------------------------ vocab rank


def train_vocab_rank(target_dir: Path, out_path: Path | None = None, prose_upweight: int = 3,
                     answers: Path | None = None, seed: int = 0) -> dict:
    """The token frequency ranking a pruned drafter head reads (`draft_vocab`): every token id of the target's
    vocabulary, most frequent first (ties by id), and the share of held-out tokens that the top 512 ... 8192
    cover. Counted over the training split of the corpus, or with `answers` (a chat deployment's own answers,
    as `train drafter --answers`) over its answer tokens, held out the way the MTP heads' validation is
    (`answer_split`: the first `val_sequences` of a seeded shuffle; here over every row, there after too-short
    answers are dropped).
    Written to `<target>/drafters/vocab_rank.json`."""
    from decoder.models import model_config

    target_dir = Path(target_dir)
    out_path = Path(out_path) if out_path else drafters_dir(target_dir) / VOCAB_RANK_FILE
    vocab = int(model_config(target_dir, "target")["vocab_size"])
    if answers is not None:
        rows = read_answers(Path(answers))
        held = DrafterSpec().val_sequences
        if len(rows) <= held:
            raise ValueError(f"--answers {answers}: {len(rows)} answers; need more than the {held} held out")
        train, val = answer_split(rows, seed, held)
        streams = {k: np.asarray([t for r in part for t in r["tokens"]], dtype=np.int64)
                   for k, part in (("train", train), ("val", val))}
        source = f"answer token counts of {Path(answers).resolve()} ({len(train)} rows; {held} held out)"
    else:
        streams = corpus_streams(target_dir, data_dir() / "drafters" / f"vocab-{target_dir.name}", prose_upweight)
        source = "corpus train split token counts (decoder/lab/corpus.py)"
    if streams["train"].size and (streams["train"].min() < 0 or streams["train"].max() >= vocab):
        raise ValueError(f"token ids outside the target's vocabulary of {vocab}: the answers are not this target's")
    counts = np.bincount(streams["train"].astype(np.int64), minlength=vocab)[:vocab]
    order = sorted(range(vocab), key=lambda t: (-int(counts[t]), t))
    val = np.bincount(streams["val"].astype(np.int64), minlength=vocab)[:vocab]
    cover = {str(n): round(float(val[order[:n]].sum() / max(1, val.sum())), 4)
             for n in (512, 1024, 2048, 4096, 8192) if n <= vocab}
    out = {"ids": order, "source": source, "train_tokens": int(streams["train"].size), "val_coverage": cover}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out) + "\n")
    os.replace(tmp, out_path)
    print(f"[vocab] {out_path}: {vocab} tokens ranked over {out['train_tokens']} training tokens; held-out "
          f"coverage of the top N: {cover}", file=sys.stderr)
    return {"path": str(out_path), "val_coverage": cover, "train_tokens": out["train_tokens"]}


# ---------------------------------------------------------------- corpus datastore


def domain_streams(target_dir: Path, cache_dir: Path) -> dict[str, np.ndarray]:
    """The corpus's training split per domain (code, prose) under the target's tokenizer (cached)."""
    from decoder.lab.train import tokenize_corpus

    return {domain: tokenize_corpus(docs, target_dir, cache_dir / domain, 1)["train"]
            for domain, docs in (("code", code_documents()), ("prose", prose_documents()))}


def train_corpus_index(target_dir: Path, out_path: Path | None = None, answers: Path | None = None,
                       self_sequences: int = 8192, self_weight: int = 3, nmax: int = 6, min_count: int = 2,
                       seed: int = 0, work: Path | None = None) -> dict:
    """The corpus datastore of drafter = "corpus" (decoder/datastore.py), written to `<target>/drafters/corpus.npz`.

    Its text: the corpus's training split under the target's tokenizer, and what the target itself writes,
    counted `self_weight` times (a greedy target continues the way it continued before, more than the way the
    corpus does): per domain (code, prose: prose is 4% of the corpus's tokens, so its own text matters most
    there) `self_sequences` greedy continuations (128 tokens) of training-split prefixes (128 tokens), made in
    shards under `work` (resumable); or with `answers` (a chat deployment's own answers, as `train drafter
    --answers`) those answers' tokens. Held-out documents never reach it."""
    from decoder.models import load_causal_lm, model_config

    target_dir = Path(target_dir)
    out_path = Path(out_path) if out_path else drafters_dir(target_dir) / CORPUS_FILE
    work = Path(work) if work else data_dir() / "drafters" / f"corpus-{target_dir.name}"
    vocab = int(model_config(target_dir, "target")["vocab_size"])
    eos = model_config(target_dir, "target").get("eos_token_id")
    eos = int(eos[0] if isinstance(eos, list) else eos or 0)
    t0 = time.perf_counter()
    domains = {d: a.astype(np.int64) for d, a in domain_streams(target_dir, work / "tokens").items()}
    corpus = np.concatenate(list(domains.values()))
    own: list[np.ndarray] = []
    if answers is not None:
        own = [np.asarray(list(r["tokens"]) + [eos], dtype=np.int64) for r in read_answers(Path(answers))]
        source = f"answers {Path(answers).resolve()}"
    elif self_sequences > 0:
        # Greedy text in the CPU's fastest exact-enough dtype: bf16 where it is native (AMX, AVX512-BF16),
        # float32 elsewhere (2.2x faster than converted bf16 here). Either writes the target's own text; a near
        # tie decided the other way only changes what the drafter proposes, never what the target commits.
        gen_dtype = "float32" if native_bf16_cpu() is False else "bfloat16"
        target = None  # loaded for the first missing shard: a rerun over finished shards never loads it
        shard, prefix_len, gen_len = 256, 128, 128
        n_shards = math.ceil(self_sequences / shard)
        plan = [(d, i) for d in domains for i in range(n_shards)]
        for d, i in tqdm(plan, desc="greedy continuations (shards)", file=sys.stderr, dynamic_ncols=True):
            path = work / f"self-{d}-p{prefix_len}-g{gen_len}-s{seed}-{i:03d}.npy"
            if not path.exists():
                if target is None:
                    target = load_causal_lm(target_dir, "target", dtype=gen_dtype)
                n = min(shard, self_sequences - i * shard)
                rng = np.random.default_rng([seed, 11, i, 0 if d == "code" else 1])
                starts = rng.integers(0, len(domains[d]) - prefix_len - 1, size=n)
                prefixes = torch.from_numpy(np.stack([domains[d][s : s + prefix_len] for s in starts]))
                gens = torch.cat([greedy_continue(target, prefixes[j : j + 64], gen_len) for j in range(0, n, 64)])
                _atomic_save_npy(path, torch.cat([prefixes, gens], dim=1).numpy().astype(np.int32))
            seqs = np.load(path).astype(np.int64)[:, prefix_len - nmax :]  # the continuation and its context
            own.extend(np.concatenate([s, [eos]]) for s in seqs)
        source = (f"{self_sequences} greedy continuations of the target per domain ({', '.join(domains)}; "
                  f"new shards in {gen_dtype})")
    else:
        source = "none"
    stream = np.concatenate([corpus] + [np.concatenate(own)] * self_weight if own else [corpus])
    if stream.min() < 0 or stream.max() >= vocab:
        raise ValueError(f"token ids outside the target's vocabulary of {vocab}: the answers are not this target's")
    index = CorpusIndex.build(stream, vocab, nmax=nmax, min_count=min_count)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    index.save(out_path)
    own_tokens = int(sum(len(s) for s in own))
    out = {"path": str(out_path), "contexts": len(index), "corpus_tokens": int(len(corpus)), "own_tokens": own_tokens,
           "own_source": source, "self_weight": self_weight, "nmax": nmax, "min_count": min_count,
           "seconds": round(time.perf_counter() - t0, 1), "bytes": out_path.stat().st_size}
    print(f"[corpus] {out_path}: {len(index)} contexts of 1..{nmax} tokens over {len(corpus)} corpus tokens and "
          f"{own_tokens} of the target's own ({source}) x{self_weight}", file=sys.stderr)
    return out


PROMPT_TAIL = lookup_cache.NGRAM_MAX  # prompt tokens kept before each answer: the n-grams that open an answer


def train_lookup_corpus(target_dir: Path, answers: Path, out_path: Path) -> dict:
    """The corpus of llama.cpp's n-gram lookup caches (mechanism `llama-ngram-corpus`): each answer of a chat
    deployment (`answers`, as `train drafter --answers`) after its prompt's last PROMPT_TAIL tokens under the
    target's tokenizer, committed as token ids (`lookup_cache.save_sequences`); the caches themselves are built
    from it on first use (`lookup_cache.materialise`). Also returns the caches' sizes."""
    from decoder.models import load_tokenizer, model_config

    t0 = time.perf_counter()
    rows = read_answers(Path(answers))
    if not rows:
        raise ValueError(f"--answers {answers}: no rows")
    vocab = int(model_config(Path(target_dir), "target")["vocab_size"])
    tok = load_tokenizer(Path(target_dir), "target")
    seqs = [tok(r["prompt"], add_special_tokens=False)["input_ids"][-PROMPT_TAIL:] + list(r["tokens"]) for r in rows]
    if any(t < 0 or t >= vocab for q in seqs for t in q):
        raise ValueError(f"--answers {answers}: token ids outside the target's vocabulary of {vocab}: the answers "
                         f"are not this target's")
    digest = hashlib.sha256(Path(answers).read_bytes()).hexdigest()[:16]
    info = lookup_cache.save_sequences(seqs, Path(out_path), {"answers": Path(answers).name, "answers_sha256": digest,
                                                              "prompt_tail": PROMPT_TAIL, "rows": len(rows)})
    with tempfile.TemporaryDirectory() as tmp:
        caches = lookup_cache.build(seqs, Path(tmp))
    return {"path": str(out_path), **info, **{k: v for k, v in caches.items() if k not in ("sequences", "tokens")},
            "seconds": round(time.perf_counter() - t0, 1)}
