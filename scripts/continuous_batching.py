"""Continuous against static batching: a stream of requests with Poisson arrivals, batched SD on the demo.

    python scripts/continuous_batching.py [--requests 32] [--rate 4] [--batch-size 8] [--json OUT]

Both modes see the same requests at the same arrival times; every output is checked against its
single-request greedy run (divergences explained only by bf16 near-ties, as in the bench).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decoder.lab.batch_bench import format_stream_table, run_stream_bench  # noqa: E402
from decoder.models import demo_deployment  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--drafter", default="draft-model", choices=("draft-model", "ngram"))
    p.add_argument("--mechanisms", default="ragged_verify,load_aware_draft",
                   help="other batching mechanisms on in both modes (comma-separated; '' for none)")
    p.add_argument("--prompts", default="code,prose", help="prompt sets, cycled to fill the stream")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the report here")
    args = p.parse_args(argv)
    known = ("ragged_verify", "load_aware_draft")
    mech = {m: False for m in known}
    for m in filter(None, (x.strip() for x in args.mechanisms.split(","))):
        if m not in known:
            p.error(f"--mechanisms: unknown {m}; choose from {', '.join(known)}")
        mech[m] = True
    d = demo_deployment()
    report = run_stream_bench(d.target, d.drafter, args.prompts.split(","), args.max_new_tokens, args.batch_size,
                              args.requests, args.rate, prompt_dir=d.prompt_dir, drafter=args.drafter,
                              mechanisms=mech, seed=args.seed)
    print(format_stream_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
