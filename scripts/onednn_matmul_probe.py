"""Probe, not a mechanism yet: the lean forward's matmuls through oneDNN with prepacked weights, end to end.

`scripts/lean_matmul_widths.py` shows PyTorch's float32 `F.linear` on this CPU costing more at 2-3 rows than at
4-5, and oneDNN's prepacked linear nearly flat across widths. This swaps `LeanLM.mm` for a oneDNN version (weights
packed once, `torch.utils.mkldnn`) and runs, through the shared decode loop (`decoder.generate.generate`), `ar-lean`
and `sd-mtp-vocab` (--draft-len, --draft-vocab) on the smollm2 deployment's code prompts, interleaved per prompt, the
second pass timed; every output is compared with stock `ar-lean`'s. Needs the SmolLM2 MTP heads and token ranking.

    python scripts/onednn_matmul_probe.py [--prompts 6] [--max-new-tokens 96] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.utils.mkldnn

from decoder.config import DecodeConfig
from decoder.featdraft import FeatureHeads, drafters_dir
from decoder.generate import generate
from decoder.lab.bench import bench_deployment, load_prompts
from decoder.lean import LeanLM
from decoder.models import load_causal_lm, load_tokenizer
from decoder.presets import preset_config


def _onednn_mm(packed: dict):
    def mm(self: LeanLM, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        m = packed.get(id(w))
        if m is None:
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None, dtype=w.dtype)
            lin.weight.data = w
            if b is not None:
                lin.bias.data = b
            m = packed[id(w)] = torch.utils.mkldnn.to_mkldnn(lin)
        return m(x.contiguous().to_mkldnn()).to_dense()
    return mm


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.backends.mkldnn.is_available():
        print("error: this torch build has no oneDNN (torch.backends.mkldnn)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    target_dir, _, pdir = bench_deployment("smollm2")
    _, prompts = load_prompts("code", pdir)
    tok = load_tokenizer(target_dir, "target")
    model = load_causal_lm(target_dir, "target", "float32", "cpu")
    heads = FeatureHeads(drafters_dir(target_dir), model.config, model.dtype, model.device)
    ids = [tok(p.text, add_special_tokens=False)["input_ids"] for p in prompts[: args.prompts]]
    base = DecodeConfig(max_new_tokens=args.max_new_tokens, dtype="float32")
    methods = {"ar-lean": {}, "sd-mtp-vocab": {"draft_len": args.draft_len, "draft_vocab": args.draft_vocab}}
    stock_mm, packed = LeanLM.mm, {}
    res: dict = {}
    try:
        for rep in range(2):  # the first pass warms up (and packs the weights)
            for pi, p in enumerate(ids):
                for backend in ("torch", "onednn"):
                    LeanLM.mm = stock_mm if backend == "torch" else _onednn_mm(packed)
                    for name, over in methods.items():
                        t = time.perf_counter()
                        g = generate(preset_config(name, base, **over), model, p, None, heads=heads)
                        dt = time.perf_counter() - t
                        r = res.setdefault(f"{backend}/{name}", {"seconds": 0.0, "tokens": 0, "outputs": {}})
                        if rep:
                            r["seconds"] += dt
                            r["tokens"] += len(g.tokens)
                        r["outputs"][pi] = g.tokens
    finally:
        LeanLM.mm = stock_mm
    ref = res["torch/ar-lean"]["outputs"]
    report = {"prompts": len(ids), "max_new_tokens": args.max_new_tokens, "threads": args.threads, "rows": {}}
    for key, r in res.items():
        tps = r["tokens"] / r["seconds"]
        same = sum(r["outputs"][i] == ref[i] for i in ref)
        report["rows"][key] = {"tokens_per_s": round(tps, 2), "identical_prompts": same}
        print(f"{key:22s} {tps:6.1f} tok/s  identical to torch/ar-lean on {same}/{len(ref)} prompts")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
