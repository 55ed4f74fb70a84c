"""`specpilot train smollm2-drafter`: a draft model for SmolLM2-135M-Instruct, distilled from its own answers.

llama.cpp's `draft-simple` needs a draft model sharing the target's vocabulary, and SmolLM2-135M is the
smallest of its family. This recipe makes one (each stage resumable; every result written atomically):

1. **Instructions** (self-instruct): the target itself, sampled (temperature 1, top-k 50, top-p 0.95, seeded per row)
   after its chat template's user header and a steering opening ("Write a Python function that", "Explain",
   ...), writes user instructions; deduplicated, and none equal to an instruction of the held-out bench sets.
2. **Answers**: the deployment's own engine (llama-server on the Q4_1 GGUF, greedy, the bench's answer length)
   answers each instruction rendered with the chat template; rows are appended as they finish, so a killed
   run keeps what it has. The drafter learns what the target says, token for token.
3. **Training**: a small Llama (`hidden_size`, `num_layers`) whose tied embedding is the target's own
   embedding projected to `hidden_size` (E @ P; E frozen, P initialised from E's top right singular
   vectors): logits live in the target's embedding space and the committed weights are only P and the
   layers (~1 M parameters); the full drafter is materialised from the target's GGUF on first use.
   Cross-entropy on the answer tokens, AdamW, warm-up + cosine, bf16 autocast; checkpoints every few
   steps and batches that are a pure function of (seed, step), so a resumed run ends where an
   uninterrupted one would.
4. **Evaluation** on held-out answers and on the bench's own prompts: top-1 agreement and the expected
   tokens per chain-verification step (tau) at draft length 1-4; written to recipe.json beside the weights.

`decoder.engines.smollm2.smollm2_drafter_gguf()` writes the drafter as a GGUF (Q8_0) with the target's
tokenizer metadata copied byte for byte, so llama.cpp accepts it as a draft model of the target.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from decoder.engines.llamacpp import LlamaServer, ServerSettings
from decoder.engines.smollm2 import (
    DRAFTER_ASSET,
    DRAFTER_WEIGHTS,
    INSTRUCTIONS,
    smollm2_gguf,
    smollm2_hf_dir,
)
from decoder.lab.projected_drafter import ProjectedDrafter, SmolDrafterSpec, load_weights
from decoder.lab.projected_drafter import save_drafter as _save
from decoder.lab.projected_drafter import target_embedding as _embedding
from decoder.lab.train import _atomic_write_text, _lr_at, optimizer_step, resume_checkpoint, save_checkpoint, tick

CODE_OPENINGS = (
    "Write a Python function that", "Write a Python function to", "Write a Python class that",
    "Write a Python script that", "How do I", "Write a JavaScript function that", "Write a function in C that",
    "Write a SQL query that", "Explain what this Python code does:", "Implement", "Write a program that",
    "What is the difference between", "Write a Python function called",
)
PROSE_OPENINGS = (
    "Write a short paragraph", "Give three tips for", "Explain", "Write a short email", "Summarise",
    "What are the main differences between", "Write a haiku about", "Describe", "List four ways to",
    "What causes", "Give advice to", "Write a short story", "What is", "Why do", "How does", "Write a poem about",
)


def _progress(msg: str) -> None:
    print(f"smollm2-drafter: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- stages 1-2: data from the target itself

def _user_header(tok) -> str:
    """The chat template up to where the user's text starts (default system turn included)."""
    mark = "\x00USER\x00"
    text = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False, add_generation_prompt=False)
    return text[: text.index(mark)]


def _chat_prompt(tok, instruction: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": instruction}], tokenize=False,
                                   add_generation_prompt=True)


def _held_out() -> set[str]:
    out = set()
    for f in sorted(INSTRUCTIONS.glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                out.add(_norm(json.loads(line)["text"]))
    return out


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _read_rows(path: Path) -> list[dict]:
    """The complete rows of a JSONL file appended to by a run that may have been killed mid-line."""
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _complete(port: int, body: dict, timeout: float = 600.0) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"llama-server answered {resp.status}: {data[:200]!r}")
        return json.loads(data)
    finally:
        conn.close()


def _serve_rows(port: int, todo: list[dict], make_body: Callable[[dict], dict],
                keep: Callable[[dict, dict], dict | None], out: Path, parallel: int, label: str) -> None:
    """POST every row of `todo` (in `parallel` requests at once); append what `keep` returns to `out`."""
    done, t0 = 0, time.time()
    with open(out, "a", encoding="utf-8") as fh, ThreadPoolExecutor(parallel) as pool:
        for row, res in zip(todo, pool.map(lambda r: _complete(port, make_body(r)), todo), strict=True):
            kept = keep(row, res)
            if kept is not None:
                fh.write(json.dumps(kept) + "\n")
                fh.flush()
            done += 1
            if done % 100 == 0 or done == len(todo):
                _progress(f"{label}: {done}/{len(todo)} ({done / max(1e-9, time.time() - t0):.1f}/s)")


def _server(spec: SmolDrafterSpec, binary: Path | None = None) -> LlamaServer:
    ctx = spec.server_parallel * 320  # a slot holds an instruction prompt and its answer (<= 300 tokens)
    return LlamaServer(smollm2_gguf(), settings=ServerSettings(
        threads=spec.threads, ctx_size=ctx, extra=("--parallel", str(spec.server_parallel), "--no-repack")),
        name="smollm2-data", server=binary)


def make_instructions(spec: SmolDrafterSpec, work: Path, tok, port: int) -> list[str]:
    """Stage 1: `spec.instructions` distinct user instructions written by the target (resumable)."""
    out = work / "instructions.jsonl"
    header, held = _user_header(tok), _held_out()
    rng = random.Random(spec.seed)
    n_code = int(round(spec.instructions * spec.code_share))
    # Oversample: some samples are dropped as duplicates or as too short/long.
    plan = [{"i": i, "opening": rng.choice(CODE_OPENINGS if i % 10 < spec.code_share * 10 else PROSE_OPENINGS),
             "domain": "code" if i % 10 < spec.code_share * 10 else "prose"}
            for i in range(int(spec.instructions * 1.6))]
    seen = {r["i"] for r in _read_rows(out)}
    todo = [p for p in plan if p["i"] not in seen]

    def keep(row: dict, res: dict) -> dict | None:
        text = (row["opening"] + res.get("content", "")).strip()
        if not 4 <= len(text.split()) <= 40:
            return {"i": row["i"], "text": None}
        return {"i": row["i"], "domain": row["domain"], "text": text}

    if todo and len([r for r in _read_rows(out) if r.get("text")]) < spec.instructions:
        _serve_rows(port, todo, lambda r: {
            "prompt": header + r["opening"], "n_predict": 40, "temperature": 1.0, "top_p": 0.95, "top_k": 50,
            "seed": spec.seed * 1_000_003 + r["i"], "stop": ["<|im_end|>", "\n"]}, keep, out,
            spec.server_parallel, "instructions")
    rows = sorted((r for r in _read_rows(out) if r.get("text")), key=lambda r: r["i"])
    picked, norms = {"code": [], "prose": []}, set()
    for r in rows:
        n = _norm(r["text"])
        if n in norms or n in held:
            continue
        norms.add(n)
        picked[r["domain"]].append(r["text"])
    code = picked["code"][:n_code]
    prose = picked["prose"][: spec.instructions - len(code)]
    return code + prose


def make_answers(spec: SmolDrafterSpec, work: Path, tok, port: int, instructions: list[str]) -> list[dict]:
    """Stage 2: the target's greedy answer (token ids) to each instruction, rendered with its chat template."""
    out = work / "answers.jsonl"
    seen = {r["text"] for r in _read_rows(out)}
    todo = [{"text": t, "prompt": _chat_prompt(tok, t)} for t in instructions if t not in seen]
    if todo:
        _serve_rows(port, todo, lambda r: {"prompt": r["prompt"], "n_predict": spec.answer_tokens, "temperature": 0.0,
                                           "return_tokens": True},
                    lambda row, res: {**row, "tokens": res.get("tokens") or []}, out, spec.server_parallel, "answers")
    by_text = {r["text"]: r for r in _read_rows(out)}
    return [by_text[t] for t in instructions if t in by_text and by_text[t]["tokens"]]


def greedy_answers(tok, port: int, texts: Iterable[str], answer_tokens: int, parallel: int = 4) -> list[dict]:
    """The target's greedy answers to `texts` (no file): the bench prompts' answers for evaluation."""
    rows = [{"text": t, "prompt": _chat_prompt(tok, t)} for t in texts]
    with ThreadPoolExecutor(parallel) as pool:
        res = list(pool.map(lambda r: _complete(port, {"prompt": r["prompt"], "n_predict": answer_tokens,
                                                        "temperature": 0.0, "return_tokens": True}), rows))
    return [{**r, "tokens": x.get("tokens") or []} for r, x in zip(rows, res, strict=True)]


# ---------------------------------------------------------------- the drafter

def _encode(tok, rows: list[dict]) -> list[tuple[np.ndarray, int]]:
    """(prompt + answer token ids, prompt length) per row; the prompt tokenised as the harness does."""
    out = []
    for r in rows:
        p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        out.append((np.asarray(p + list(r["tokens"]), dtype=np.int64), len(p)))
    return out


def _batch(seqs: list[tuple[np.ndarray, int]], idx: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and next-token targets (-100 outside the answers): causal attention makes padding at
    the end invisible to every real position."""
    chosen = [seqs[i] for i in idx]
    n = max(len(s) for s, _ in chosen)
    ids = torch.zeros(len(chosen), n, dtype=torch.long)
    tgt = torch.full((len(chosen), n), -100, dtype=torch.long)
    for b, (s, p) in enumerate(chosen):
        ids[b, : len(s)] = torch.from_numpy(s)
        tgt[b, p - 1: len(s) - 1] = torch.from_numpy(s[p:])
    return ids, tgt


def _agreement(model: ProjectedDrafter, seqs: list[tuple[np.ndarray, int]]) -> list[np.ndarray]:
    """Per sequence, whether the drafter's top-1 equals the target's next answer token (teacher-forced)."""
    out = []
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for i in range(0, len(seqs), 16):
            ids, tgt = _batch(seqs, range(i, min(len(seqs), i + 16)))
            where = tgt != -100
            hit = (model(ids, where).argmax(-1) == tgt[where]).numpy()
            for n in where.sum(1).tolist():
                out.append(hit[:n])
                hit = hit[n:]
    model.train()
    return out


def chain_tau(agree: list[np.ndarray], k: int) -> float:
    """Expected tokens per chain-verification step with draft length k, over every answer position: 1 plus the
    run of consecutive agreements starting there, capped at k (a mismatch ends the draft; drafts that agree
    are the target's tokens, so teacher forcing gives the drafter's own continuation)."""
    total, n = 0.0, 0
    for a in agree:
        for s in range(len(a)):
            run = 0
            while run < k and s + run < len(a) and a[s + run]:
                run += 1
            total += 1 + run
            n += 1
    return total / max(1, n)


def _summary(agree: list[np.ndarray]) -> dict:
    flat = np.concatenate(agree) if agree else np.zeros(0)
    return {"positions": int(flat.size), "top1": round(float(flat.mean()) if flat.size else 0.0, 4),
            **{f"tau_k{k}": round(chain_tau(agree, k), 3) for k in (1, 2, 3, 4)}}


def data_server(binary: Path | None) -> dict:
    """Which llama-server made the data: `make llama-cpp`'s (stock) or another build, named by its file's hash."""
    if binary is None:
        return {"stock": True}
    return {"stock": False, "path": str(binary), "sha256": hashlib.sha256(Path(binary).read_bytes()).hexdigest()}


def train_smollm2_drafter(work: Path, out: Path = DRAFTER_ASSET, spec: SmolDrafterSpec | None = None,
                          server: Path | None = None, data_only: bool = False) -> dict:
    """Run the recipe (resuming whatever `work` holds); write the weights and recipe.json to `out`. `server`: the
    llama-server binary that makes the data (default `make llama-cpp`'s), e.g. a build with a kernel patch that
    decodes the data stage's 16 slots faster; its greedy answers may differ from stock's at near ties only
    (the kernel test and forcing hold a kernel to that). `data_only`: stop after the data, returning where it is
    (the answers also train MTP heads: `specpilot train drafter --kind mtp --answers WORK/answers.jsonl`)."""
    spec = spec or SmolDrafterSpec()
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)))
    tok = AutoTokenizer.from_pretrained(str(smollm2_hf_dir()), local_files_only=True)
    bench_rows_file = work / "bench-answers.jsonl"
    t_data = time.time()
    srv = _server(spec, server)
    marker = work / "answers.done"  # holds the instruction count the answers were made for
    need_data = not (marker.is_file() and marker.read_text() == str(spec.instructions) and bench_rows_file.is_file())
    if need_data:
        srv.start()
    try:
        if need_data:
            instr = make_instructions(spec, work, tok, srv.port)
            _progress(f"{len(instr)} instructions")
            rows = make_answers(spec, work, tok, srv.port, instr)
            _progress(f"{len(rows)} answers")
            held = [json.loads(line)["text"] for f in sorted(INSTRUCTIONS.glob("*.jsonl"))
                    for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
            bench_rows = greedy_answers(tok, srv.port, held, spec.answer_tokens)
            _atomic_write_text(bench_rows_file, "".join(json.dumps(r) + "\n" for r in bench_rows))
            _atomic_write_text(marker, str(spec.instructions))
    finally:
        srv.stop()
    if need_data:  # what making the data took, kept for a resumed run's recipe.json
        _atomic_write_text(work / "data.seconds", f"{time.time() - t_data:.1f}")
    data_seconds = float((work / "data.seconds").read_text()) if (work / "data.seconds").is_file() else 0.0
    rows = [r for r in _read_rows(work / "answers.jsonl") if r["tokens"]]
    if data_only:
        return {"answers": str(work / "answers.jsonl"), "rows": len(rows),
                "answer_tokens": sum(len(r["tokens"]) for r in rows), "data_seconds": round(data_seconds, 1),
                "data_server": data_server(server)}
    bench_rows = _read_rows(bench_rows_file)
    rng = random.Random(spec.seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    val = [rows[i] for i in order[: spec.val_rows]]
    train = [rows[i] for i in order[spec.val_rows:]]
    train_seqs, val_seqs = _encode(tok, train), _encode(tok, val)
    _progress(f"{len(train_seqs)} training answers ({sum(len(s) - p for s, p in train_seqs)} answer tokens), "
              f"{len(val_seqs)} held out")

    model = ProjectedDrafter(spec, target_embedding())
    model.init_projection()
    # Stage 1 from the initial weights; stage 2 a second warm-up + cosine schedule from stage 1's weights.
    key1 = {k: v for k, v in asdict(spec).items() if not k.startswith("stage2_")}
    elapsed, log = _run_stage(model, train_seqs, spec, work / "drafter.ckpt", key1, "stage 1", 0)
    if spec.stage2_steps:
        stage2 = replace(spec, steps=spec.stage2_steps, lr=spec.stage2_lr, warmup_steps=20)
        e2, log2 = _run_stage(model, train_seqs, stage2, work / "drafter-stage2.ckpt", asdict(spec), "stage 2", 1)
        elapsed, log = elapsed + e2, log + log2

    with torch.no_grad():  # evaluate the weights as committed (bf16)
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    evaluation = {"held_out": _summary(_agreement(model, val_seqs))}
    bench = _encode(tok, bench_rows)
    for domain in ("code", "prose"):
        sel = [s for s, r in zip(bench, bench_rows, strict=True) if _domain_of(r["text"]) == domain]
        evaluation[f"bench_{domain}"] = _summary(_agreement(model, sel))
    save_drafter(model, spec, out, {
        "spec": asdict(spec), "parameters": int(sum(p.numel() for p in model.parameters())),
        "train_answers": len(train_seqs), "train_answer_tokens": int(sum(len(s) - p for s, p in train_seqs)),
        "data_seconds": round(data_seconds, 1), "train_seconds": round(elapsed, 1),
        "final_loss": round(float(np.mean([x[1] for x in log[-20:]])), 4), "evaluation": evaluation,
        "data_server": data_server(server)})
    return json.loads((out / "recipe.json").read_text())


def _run_stage(model: ProjectedDrafter, train_seqs: list[tuple[np.ndarray, int]], spec: SmolDrafterSpec,
               ckpt: Path, key: dict, label: str, tag: int) -> tuple[float, list]:
    """One warm-up + cosine schedule of `spec.steps` AdamW steps, resumable from `ckpt` (a checkpoint of another
    recipe is refused); the batch at step s is a pure function of (seed, tag, s). (seconds, loss log)"""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec.lr,
                            weight_decay=spec.weight_decay, betas=(0.9, 0.95))
    step, elapsed, log = (resume_checkpoint(ckpt, model, opt, f"smollm2-drafter {label}", spec.steps, key)
                          if ckpt.is_file() else (0, 0.0, []))
    t_last = time.time()
    while step < spec.steps:
        for g in opt.param_groups:
            g["lr"] = _lr_at(spec, step)
        rng = np.random.default_rng([spec.seed, tag, step] if tag else [spec.seed, step])
        ids, tgt = _batch(train_seqs, rng.choice(len(train_seqs), spec.batch_size, replace=False))
        where = tgt != -100
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids, where)
        loss = F.cross_entropy(logits.float(), tgt[where])
        optimizer_step(model, opt, loss)
        step += 1
        log.append([step, round(float(loss.detach()), 4)])
        if step % spec.checkpoint_every == 0 or step == spec.steps:
            elapsed, t_last = tick(elapsed, t_last)
            save_checkpoint(ckpt, model, opt, step, elapsed, log, key)
            recent = [x[1] for x in log[-spec.checkpoint_every:]]
            _progress(f"{label}: step {step}/{spec.steps} loss {sum(recent) / len(recent):.3f} "
                      f"({elapsed / 60:.1f} min)")
    elapsed, _ = tick(elapsed, t_last)
    return elapsed, log


def _domain_of(instruction: str) -> str:
    for f in sorted(INSTRUCTIONS.glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip() and json.loads(line)["text"] == instruction:
                return f.stem
    return "other"


def save_drafter(model: ProjectedDrafter, spec: SmolDrafterSpec, out: Path, recipe: dict) -> None:
    """The trainable weights and recipe.json into `out` (the committed asset by default)."""
    _save(model, spec, out, recipe, DRAFTER_WEIGHTS)


def target_embedding(gguf_path: Path | None = None) -> torch.Tensor:
    """SmolLM2's token embedding from the deployment's GGUF (or `gguf_path`)."""
    return _embedding(gguf_path or smollm2_gguf())


def load_drafter(asset: Path = DRAFTER_ASSET, embedding: torch.Tensor | None = None) -> ProjectedDrafter:
    """The committed drafter with the target's embedding (from the deployment's GGUF unless given)."""
    return load_weights(asset / DRAFTER_WEIGHTS, embedding if embedding is not None else target_embedding())
