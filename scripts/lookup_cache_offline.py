"""Offline: what llama.cpp's ngram-cache drafting would accept on recorded greedy answers, with the n-gram caches
made from a deployment's own answers (mechanism `llama-ngram-corpus`) and without them (the request's own text).

    python scripts/lookup_cache_offline.py --corpus WORK/answers.jsonl --eval WORK/bench-answers.jsonl
        [--target smollm2] [--limit N] [--json OUT]

tau = answer tokens per verify step under greedy verification, replayed with llama.cpp's drafting rule
(decoder/engines/lookup_cache.py's `draft`); width = 1 + drafted tokens per step (what one verify forward holds).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from decoder.engines import lookup_cache as lc
from decoder.lab.smollm2_drafter import _domain_of
from decoder.lab.train_drafter import PROMPT_TAIL, read_answers
from decoder.models import load_tokenizer, smollm2_deployment


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, required=True, help="answers the caches are made from (JSONL)")
    p.add_argument("--eval", type=Path, required=True, help="answers to replay (JSONL, e.g. bench-answers.jsonl)")
    p.add_argument("--target", default="smollm2", help="the target's tokenizer directory, or smollm2")
    p.add_argument("--limit", type=int, default=0, help="use the first N corpus rows (0: all)")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    target = smollm2_deployment().target if args.target == "smollm2" else Path(args.target)
    tok = load_tokenizer(target, "target")
    t0 = time.perf_counter()
    rows = read_answers(args.corpus)[: args.limit or None]
    seqs = [tok(r["prompt"], add_special_tokens=False)["input_ids"][-PROMPT_TAIL:] + list(r["tokens"]) for r in rows]
    with tempfile.TemporaryDirectory() as tmp:
        info = lc.build(seqs, Path(tmp))
        dynamic, static = lc.read(Path(tmp) / "dynamic.bin"), lc.read(Path(tmp) / "static.bin")
    print(f"caches from {len(rows)} answers: {info} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    evals = read_answers(args.eval)
    out: dict = {"corpus_rows": len(rows), "caches": info}
    for name, (dyn, st) in (("context only", ({}, {})), ("corpus", (dynamic, static))):
        for domain in ("code", "prose"):
            n = steps = drafted = 0
            for r in evals:
                if _domain_of(r.get("text", "")) != domain or len(r["tokens"]) < 2:
                    continue
                prompt = tok(r["prompt"], add_special_tokens=False)["input_ids"]
                a, b, c = lc.replay_tau(prompt, r["tokens"], dyn, st)
                n, steps, drafted = n + a, steps + b, drafted + c
            row = {"tau": round(n / max(steps, 1), 3), "width": round(1 + drafted / max(steps, 1), 2),
                   "accept_rate": round((n - steps) / max(drafted, 1), 3), "tokens": n}
            out[f"{name}/{domain}"] = row
            print(f"{name:13s} {domain:5s} tau {row['tau']:.3f}  width {row['width']:.2f}  "
                  f"accepted/drafted {row['accept_rate']:.3f}  ({n} tokens)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
