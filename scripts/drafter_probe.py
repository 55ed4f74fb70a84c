"""Where llama.cpp's draft-simple with the SmolLM2 drafter spends its time: tokens/s, drafted and accepted
tokens and tokens per step for llama.cpp AR, the drafter alone, and draft-simple at several draft lengths and
p_min, on code prompts 10-15 (64 tokens, one request at a time, each server warmed on an untimed text).

    python scripts/drafter_probe.py [--threads 1] [--server PATH] [--settings 1:0,3:0.5]

`--server`: another build's llama-server (e.g. one with a kernel patch, `workbench.engine_source.engine_tool`);
`--settings`: the draft-simple (n_max:p_min) pairs to run.

A probe, not the loop's paired benchmark: one pass, no forcing (tests/test_smollm2_drafter.py checks that
draft-simple's output is AR's).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from decoder.engines import smollm2
from decoder.engines.llamacpp import LlamaServer, ServerSettings, SpecSettings

SETTINGS = ((1, 0.0), (2, 0.0), (3, 0.0), (3, 0.5), (4, 0.3))  # (draft n_max, p_min)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--server", type=Path, default=None, help="the llama-server binary (default: make llama-cpp's)")
    p.add_argument("--settings", default=",".join(f"{n}:{m}" for n, m in SETTINGS),
                   help="draft-simple n_max:p_min pairs, comma-separated")
    args = p.parse_args(argv)
    try:
        settings_list = [(int(a), float(b)) for a, b in (x.split(":") for x in args.settings.split(",") if x)]
    except ValueError:
        print(f"error: --settings {args.settings}: write n_max:p_min pairs, e.g. 1:0,3:0.5", file=sys.stderr)
        return 2
    if args.server is not None and not args.server.is_file():
        print(f"error: --server {args.server}: no such file; give a llama-server binary", file=sys.stderr)
        return 2
    tok = AutoTokenizer.from_pretrained(str(smollm2.smollm2_hf_dir()))
    rows = [json.loads(line) for line in (smollm2.INSTRUCTIONS / "code.jsonl").read_text().splitlines()][10:16]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": r["text"]}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for r in rows]
    drafter, target = smollm2.smollm2_drafter_gguf(), smollm2.smollm2_gguf()
    settings = ServerSettings(threads=args.threads, extra=("--no-repack",))

    def run(name: str, model, spec: SpecSettings) -> None:
        with LlamaServer(model, spec, settings, name=name, server=args.server) as s:
            s.generate(prompts[0][::-1][:40], 16)  # warm-up on a text no timed prompt holds
            seconds = n = drafted = accepted = 0
            for ids in prompts:
                c = s.generate(ids, 64)
                seconds, n = seconds + c.seconds, n + len(c.tokens)
                drafted, accepted = drafted + c.drafted, accepted + c.accepted
        print(f"{name:28s} {n / seconds:6.1f} tok/s  drafted {drafted} accepted {accepted} "
              f"({accepted / max(1, drafted):.0%})  tok/step {n / max(1, n - accepted):.2f}", flush=True)

    run("ar", target, SpecSettings())
    run("drafter-as-model", drafter, SpecSettings())
    for n_max, p_min in settings_list:
        run(f"ds n{n_max} p{p_min}", target,
            SpecSettings("draft-simple", drafter, n_max, extra=("--spec-draft-p-min", str(p_min))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
