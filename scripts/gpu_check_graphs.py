"""GPU check for the host-overhead mechanisms (issue #11): lean forward and CUDA graphs on the demo.

Runs on one CUDA device in bf16 in about a minute: AR and draft-model SD with the HF path, the lean
forward, and the lean forward with CUDA graphs (StaticLeanLM), the block drafter and MTP heads on the lean
and graph steps, on the demo's code prompts. Prints tokens/s per method and whether each method's tokens
equal HF-path AR's, and writes $OUT/gpu_check_graphs.json when OUT is set.

    python scripts/gpu_check_graphs.py [--prompts 8] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from decoder.config import DecodeConfig
from decoder.drafters import DraftModelDrafter
from decoder.featdraft import FeatureHeads, drafters_dir
from decoder.generate import ar_generate, speculative_generate
from decoder.lean import LeanLM, StaticLeanLM
from decoder.models import DEMO_DIR, load_causal_lm, load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    tok = load_tokenizer(DEMO_DIR / "target")
    target = load_causal_lm(DEMO_DIR / "target", "target", "bfloat16", args.device)
    drafter = load_causal_lm(DEMO_DIR / "drafter", "drafter", "bfloat16", args.device)
    rows = [json.loads(x) for x in (DEMO_DIR / "prompts" / "code.jsonl").read_text().splitlines()][: args.prompts]
    prompts = [tok(r["text"], add_special_tokens=False)["input_ids"] for r in rows]
    cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, device=args.device, stop_at_eos=False)
    ar_cfg = DecodeConfig(**{**cfg.as_dict(), "method": "ar"})
    # Runners are built once: StaticLeanLM captures its graphs on its first new_cache().
    lean_t, lean_d = LeanLM(target), LeanLM(drafter)
    graph_t, graph_d = StaticLeanLM(LeanLM(target)), StaticLeanLM(LeanLM(drafter))
    methods = {
        "ar": lambda p: ar_generate(target, p, ar_cfg),
        "ar-lean": lambda p: ar_generate(lean_t, p, ar_cfg),
        "ar-lean-graphs": lambda p: ar_generate(graph_t, p, ar_cfg),
        "sd-draft-model": lambda p: speculative_generate(target, DraftModelDrafter(drafter), p, cfg),
        "sd-draft-model-lean": lambda p: speculative_generate(lean_t, DraftModelDrafter(lean_d), p, cfg),
        "sd-draft-model-lean-graphs": lambda p: speculative_generate(graph_t, DraftModelDrafter(graph_d), p, cfg),
    }
    heads_dir = drafters_dir(DEMO_DIR / "target")
    heads = FeatureHeads(heads_dir, target.config, torch.bfloat16, torch.device(args.device))
    for kind in ("block", "mtp"):  # feature drafters read the graph's captured hidden states
        if (heads_dir / kind / "config.json").exists():
            methods[f"sd-{kind}-lean"] = lambda p, k=kind: speculative_generate(lean_t, heads.state(k, lean_t), p, cfg)
            methods[f"sd-{kind}-lean-graphs"] = lambda p, k=kind: speculative_generate(graph_t, heads.state(k, graph_t),
                                                                                       p, cfg)
    outputs, report = {}, {}
    for name, run in methods.items():
        run(prompts[0][-32:])  # warm-up (and graph capture)
        torch.cuda.synchronize()
        t0, tokens, outs = time.perf_counter(), 0, []
        for p in prompts:
            g = run(p)
            outs.append(g.tokens)
            tokens += len(g.tokens)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        outputs[name] = outs
        same = sum(o == r for o, r in zip(outs, outputs["ar"], strict=True))
        report[name] = {"tokens_per_s": round(tokens / dt, 1), "prompts_identical_to_ar": same}
        print(f"{name:28s} {tokens / dt:9.1f} tok/s   identical to ar on {same}/{len(prompts)} prompts")
    for name in report:
        base_name = "ar-lean-graphs" if "graphs" in name else "ar-lean" if "lean" in name else "ar"
        report[name]["speedup_vs_own_ar"] = round(report[name]["tokens_per_s"] / report[base_name]["tokens_per_s"], 3)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check_graphs.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
