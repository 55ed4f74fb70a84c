"""Tune sd-tree / sd-two-level / sd-dcut settings on the demo against chain SD and AR (lean forward, bf16).

Usage: python scripts/sweep_tree.py {code|prose} N_PROMPTS tree,two,dcut
Methods are interleaved per prompt and timed in process CPU time on one thread, so the ranking holds on a
machine shared with other jobs (wall-clock speedups come from `specpilot bench`). Prints one line per
setting: tok/s of CPU time, speedup over ar-lean, tau; and MISMATCH lines where an output differs from
ar-lean's (bf16 near-ties; the bench explains them by logit margin).
"""

import json
import sys
import time

import torch

from decoder.config import DecodeConfig
from decoder.dcut import DCutDrafter
from decoder.drafters import DraftModelDrafter
from decoder.generate import ar_generate, speculative_generate
from decoder.lean import LeanLM
from decoder.models import DEMO_DIR, load_causal_lm, load_tokenizer
from decoder.tree import tree_generate, two_level_generate

TREES = [(4, 3, 12), (4, 3, 16), (6, 3, 18), (4, 4, 16)]  # dynamic (top-k, depth, budget)
STATIC = ["2,1,1", "2,2,1"]
TWO_LEVEL = [(a, k) for a in (1, 2, 3) for k in (3, 4)]  # (alternatives, chain length)
DCUT = [(t, m) for t in (0.02, 0.05, 0.1, 0.2) for m in (4, 6)]  # (threshold, max draft)


def main() -> None:
    torch.set_num_threads(1)
    prompts_name, limit, which = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
    t = LeanLM(load_causal_lm(DEMO_DIR / "target", "target", "bfloat16"))
    d = LeanLM(load_causal_lm(DEMO_DIR / "drafter", "drafter", "bfloat16"))
    tok = load_tokenizer(DEMO_DIR / "target")
    rows = [json.loads(x) for x in (DEMO_DIR / "prompts" / f"{prompts_name}.jsonl").read_text().splitlines()]
    prompts = [tok(r["text"], add_special_tokens=False)["input_ids"] for r in rows[:limit]]
    base = dict(max_new_tokens=128, lean_forward=True)
    runs = {"ar-lean": lambda p: ar_generate(t, p, DecodeConfig(method="ar", **base)),
            "chain k=3": lambda p: speculative_generate(t, DraftModelDrafter(d), p, DecodeConfig(**base))}
    if "tree" in which:
        for k, depth, budget in TREES:
            c = DecodeConfig(verify="tree", tree_topk=k, tree_depth=depth, tree_budget=budget, **base)
            runs[f"tree dyn k{k} d{depth} b{budget}"] = lambda p, c=c: tree_generate(t, d, p, c)
        for shape in STATIC:
            c = DecodeConfig(verify="tree", tree_shape=shape, **base)
            runs[f"tree static {shape}"] = lambda p, c=c: tree_generate(t, d, p, c)
    if "two" in which:
        for a, k in TWO_LEVEL:
            c = DecodeConfig(verify="two-level", two_level_alts=a, draft_len=k, **base)
            runs[f"two-level a{a} k{k}"] = lambda p, c=c: two_level_generate(t, d, p, c)
    if "dcut" in which:
        for th, m in DCUT:
            c = DecodeConfig(dcut=True, dcut_threshold=th, draft_len=m, **base)
            runs[f"dcut t{th} max{m}"] = lambda p, c=c: speculative_generate(t, DCutDrafter(d, c.dcut_threshold), p, c)
    for f in runs.values():
        f(prompts[0][-64:])
    sec, toks, fwd, ref = dict.fromkeys(runs, 0.0), dict.fromkeys(runs, 0), dict.fromkeys(runs, 0), {}
    for i, p in enumerate(prompts):
        for name, f in runs.items():
            t0 = time.process_time()
            g = f(p)
            sec[name] += time.process_time() - t0
            toks[name] += len(g.tokens)
            fwd[name] += g.stats.target_forwards
            if name == "ar-lean":
                ref[i] = g.tokens
            elif g.tokens != ref[i]:
                print("MISMATCH", name, i, flush=True)
    ar = toks["ar-lean"] / sec["ar-lean"]
    for name in runs:
        tps = toks[name] / sec[name]
        print(f"{name:26s} {tps:7.1f} tok/s  {tps / ar:5.3f}x  tau {toks[name] / fwd[name]:.2f}", flush=True)


if __name__ == "__main__":
    main()
