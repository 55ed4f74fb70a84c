"""The system's entry point under the workbench harness: a JSON-lines decode server.

    python -m decoder.serve --target DIR [--drafter DIR] [--config system.toml]

It loads the models, writes one line `{"ready": true}` and then answers requests read from stdin,
one JSON object per line:

    request:  {"id": 7, "prompt_ids": [..], "max_new_tokens": 64}
    answer:   {"id": 7, "tokens": [..]}        or   {"id": 7, "error": "one line"}
    optional: "config": {DecodeConfig keys} overrides the config for this request (a tuner's sweep;
              dtype and device stay as loaded); "profile": true adds "stats" (phase seconds, target
              forwards, drafted and accepted tokens) as the system reports them about itself
    batched:  {"id": 8, "batch": [[..], [..]], "max_new_tokens": 64}  all requests arrive at once and
              are decoded together by the batched engine (decoder/batch.py), as a server under that load does
    answer:   {"id": 8, "outputs": [[..], [..]]}  (new tokens per request, in order)
    request:  {"op": "quit"}                   (or end of input) ends the server

Answers go to the original stdout; anything the system prints goes to stderr instead, so a stray
print cannot corrupt the protocol. The harness times each request from outside this process, so
nothing this process reports about its own speed is trusted; only its tokens are.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO

from decoder.config import ConfigError, DecodeConfig

MAX_BATCH = 256  # requests in one batched request


def answer(out: TextIO, obj: dict) -> None:
    """One answer line on the protocol channel."""
    out.write(json.dumps(obj, separators=(",", ":")) + "\n")
    out.flush()


def protocol_channel() -> TextIO:
    """The protocol's own copy of stdout; stdout itself then goes to stderr, so print() and library chatter
    cannot corrupt the answers."""
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return proto


def read_requests(lines: Iterable[str], out: TextIO) -> Iterator[dict]:
    """Each request line as a dict, until {"op": "quit"} or the end of input; a line that is not a JSON object
    is answered here with a one-line error and skipped."""
    for line in lines:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise ValueError("a request is a JSON object")
        except ValueError as e:
            answer(out, {"id": None, "error": f"bad request: {e}".splitlines()[0][:300]})
            continue
        if req.get("op") == "quit":
            return
        yield req


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m decoder.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, type=Path, help="local Hugging Face directory of the target")
    p.add_argument("--drafter", type=Path, default=None, help="local directory of the draft model (sd only)")
    p.add_argument("--config", type=Path, default=None, help="DecodeConfig TOML (the editable mechanism config)")
    p.add_argument("--drafters", type=Path, default=None,
                   help="the target's feature drafters and router (drafter = block, mtp, routed; loaded on first "
                        "use); default: TARGET/drafters")
    args = p.parse_args(argv)

    proto = protocol_channel()

    try:
        cfg = DecodeConfig.load(args.config) if args.config else DecodeConfig()
    except (OSError, ConfigError) as e:
        print(f"serve: bad config {args.config}: {e}", file=sys.stderr)
        return 2

    if args.drafter is None and cfg.method == "sd" and cfg.drafter == "draft-model":
        print("serve: config uses the draft-model drafter but no --drafter was given", file=sys.stderr)
        return 2
    from decoder.generate import generate
    from decoder.models import ModelLoadError, load_causal_lm

    try:
        target = load_causal_lm(args.target, "target", cfg.dtype, cfg.device)
        drafter = None
        if args.drafter is not None:  # loaded even if unused now: a per-request config may switch it on
            drafter = load_causal_lm(args.drafter, "drafter", cfg.dtype, cfg.device)
    except ModelLoadError as e:
        print(f"serve: {e}", file=sys.stderr)
        return 2
    from decoder.featdraft import FeatureHeads, drafters_dir
    from decoder.models import torch_dtype

    heads = FeatureHeads(args.drafters or drafters_dir(args.target), target.config, torch_dtype(cfg.dtype),
                         next(target.parameters()).device)
    positions = getattr(target.config, "max_position_embeddings", None)
    from decoder.batch import BatchEngine, BatchLM, Request

    lean_of: dict[int, BatchLM] = {}

    def batched(model) -> BatchLM:  # built on first use and kept: fusing the projections copies every weight
        if id(model) not in lean_of:
            lean_of[id(model)] = BatchLM(model)
        return lean_of[id(model)]

    answer(proto, {"ready": True, "config": cfg.as_dict()})

    for req in read_requests(sys.stdin, proto):
        rid = req.get("id")
        try:
            batch = req.get("batch")
            if batch is not None:
                if not isinstance(batch, list) or not batch or len(batch) > MAX_BATCH:
                    raise ValueError(f"batch must be a list of 1 to {MAX_BATCH} prompts")
                prompts = [[int(t) for t in ids] for ids in batch]
            else:
                prompts = [[int(t) for t in req["prompt_ids"]]]
            prompt = max(prompts, key=len)
            n = int(req["max_new_tokens"])
            over = dict(req.get("config") or {})
            for fixed in ("dtype", "device", "max_new_tokens"):  # as loaded / as requested
                over.pop(fixed, None)
            rcfg = dataclasses.replace(cfg, **over, max_new_tokens=n)
            if positions and len(prompt) + n > positions:
                raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({n}) exceed the target's "
                                 f"{positions} positions (max_position_embeddings); ask for fewer tokens")
        except (ValueError, KeyError, TypeError) as e:
            answer(proto, {"id": rid, "error": f"bad request: {e}".splitlines()[0][:300]})
            continue
        try:
            if rcfg.method == "sd" and rcfg.drafter == "draft-model" and drafter is None:
                raise ConfigError("the draft-model drafter needs --drafter at start-up")
            if batch is not None:
                run = BatchEngine(batched(target), rcfg, len(prompts), batched(drafter) if drafter else None,
                                  heads=heads).run([Request(ids, 0.0, i) for i, ids in enumerate(prompts)])
                ans = {"id": rid, "outputs": [r.tokens for r in run.results]}
                stats = run.stats
            else:
                gen = generate(rcfg, target, prompt, drafter, heads=heads)
                ans, stats = {"id": rid, "tokens": gen.tokens}, gen.stats
            if req.get("profile"):
                ans["stats"] = stats.as_dict()  # the DecodeStats record, as the loop counted it
            answer(proto, ans)
        except Exception as e:  # noqa: BLE001 - report the failure to the harness, keep serving
            answer(proto, {"id": rid, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
