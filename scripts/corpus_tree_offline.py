"""Offline tau of the corpus drafter's chain and of its corpus-tree shapes on the demo's bench prompts.

Lossless greedy SD commits exactly the target's greedy output, so a drafter's tau on a prompt can be read
off that output without running the target again: at each committed position the drafter proposes (a chain
or a tree), the step accepts the longest proposed path that agrees with the output, plus one token. This
prints tau per (draft_len, corpus_tree_alts) on the prompts' first `--new` greedy tokens (computed once with
the HF target, fp32 argmax of bf16 logits as the bench's reference). Usage:

    .venv/bin/python scripts/corpus_tree_offline.py --prompts prose [--new 128] [--ks 6,8] [--alts 0,1,2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from decoder.capabilities import CORPUS_FILE  # noqa: E402
from decoder.datastore import CorpusIndex  # noqa: E402
from decoder.drafters import CorpusDrafter  # noqa: E402
from decoder.lab.bench import bench_deployment, load_prompts  # noqa: E402
from decoder.lab.train_drafter import greedy_continue  # noqa: E402
from decoder.models import load_causal_lm, load_tokenizer  # noqa: E402


def offline_tau(index: CorpusIndex, prompts: list[list[int]], outputs: list[list[int]], k: int, alts: int,
                ngram_max: int = 3) -> float:
    steps = tokens = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        d = CorpusDrafter(index, ngram_max=ngram_max, tree_alts=alts)
        d.reset(prompt)
        seq, p = list(prompt), 0
        while p < len(out):
            draft = d.propose(seq, min(k, len(out) - p))
            toks = draft.tokens.tolist()
            parents = draft.tree.parents.tolist() if draft.tree is not None else list(range(-1, len(toks) - 1))
            ok = [False] * len(toks)  # node i's whole path agrees with the output
            depth = [0] * len(toks)
            best = 0
            for i, (t, par) in enumerate(zip(toks, parents, strict=True)):
                depth[i] = depth[par] + 1 if par >= 0 else 1
                ok[i] = (par < 0 or ok[par]) and p + depth[i] - 1 < len(out) and out[p + depth[i] - 1] == t
                if ok[i]:
                    best = max(best, depth[i])
            adv = min(best + 1, len(out) - p)
            seq += out[p : p + adv]
            p += adv
            steps += 1
        tokens += len(out)
    return tokens / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="prose", choices=("code", "prose"))
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--ks", default="6,8")
    ap.add_argument("--alts", default="0,1,2,3,4")
    ap.add_argument("--ngram-max", type=int, default=4, help="prompt lookup's longest n-gram (the bench's default)")
    args = ap.parse_args()
    target_dir, _, prompt_dir = bench_deployment("demo")
    path = target_dir / "drafters" / CORPUS_FILE
    if not path.is_file():
        print(f"no corpus datastore at {path}; run `make corpus-drafter` first", file=sys.stderr)
        return 2
    index = CorpusIndex.load(path)
    tok = load_tokenizer(target_dir, "target")
    _, prompts = load_prompts(args.prompts, prompt_dir)
    encoded = [tok(p.text, add_special_tokens=False)["input_ids"] for p in prompts]
    target = load_causal_lm(target_dir, "target").eval()
    with torch.inference_mode():
        outputs = [greedy_continue(target, torch.tensor([ids]), args.new)[0].tolist() for ids in encoded]
    for k in (int(x) for x in args.ks.split(",")):
        for alts in (int(x) for x in args.alts.split(",")):
            tau = offline_tau(index, encoded, outputs, k, alts, args.ngram_max)
            print(f"{args.prompts} draft_len {k} corpus_tree_alts {alts}: tau {tau:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
