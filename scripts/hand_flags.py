"""llama.cpp's best single flag set found by hand, measured the way the loop measures its final system.

    python scripts/hand_flags.py --workspace WS [--types ngram-simple,ngram-map-k,...] [--threads 1,2]
                                 [--commit NAME=REV ...] [--out F]

For a llama.cpp workspace (`specpilot init --engine llama.cpp`): one branch per flag set a user would try
from llama.cpp's documentation (`--spec-type T` with the engine's defaults, and `--threads N` alone), each
timed against the loop's AR reference (stock with spec_type none) by the same paired benchmark the loop
uses (`workbench.costing.speedup_over_ar`: harness-timed, hidden prompts, interleaved) and token-forced
against stock. Prints one line per flag set and writes JSON; the best lossless one is "by hand".
`--commit NAME=REV` measures a commit the same way in the same run (e.g. a loop round's base, to set the
loop beside the hand-picked flags under the same load).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from decoder.engines.llamacpp_config import SPEC_TYPES, LlamaCppConfig
from workbench.costing import speedup_over_ar
from workbench.forcing import force
from workbench.loop import AR_BRANCH, Loop, LoopOptions
from workbench.workspace import NAME_OK, Workspace, WorkspaceError


def _branch_at(ws: Workspace, name: str) -> str | None:
    """The commit of branch `name`, None when there is no such branch."""
    try:
        return ws.rev(f"refs/heads/{name}")
    except WorkspaceError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workspace", required=True, type=Path)
    p.add_argument("--types", default="ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache",
                   help="spec types to try with the engine's defaults")
    p.add_argument("--threads", default="2", help="thread counts to try alone (comma-separated; '' for none)")
    p.add_argument("--commit", action="append", default=[], metavar="NAME=REV",
                   help="also measure this commit (a branch NAME is made at REV), e.g. a loop round's base")
    p.add_argument("--out", type=Path, default=None, help="JSON report (default: stdout only)")
    args = p.parse_args(argv)
    try:
        ws = Workspace(args.workspace)
    except WorkspaceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if ws.config.engine != "llama.cpp":
        print(f"error: {args.workspace} is not a llama.cpp workspace (specpilot init --engine llama.cpp)",
              file=sys.stderr)
        return 2
    stock = LlamaCppConfig.from_table(ws.config_at(ws.stock_commit), known_only=True)
    sets: list[tuple[str, dict]] = []
    for t in [t for t in args.types.split(",") if t]:
        if t not in SPEC_TYPES:
            print(f"error: --types {t}: choose from {', '.join(SPEC_TYPES)}", file=sys.stderr)
            return 2
        sets.append((f"hand-{t}", {"spec_type": t}))
    sets += [(f"hand-threads-{n}", {"threads": int(n)}) for n in args.threads.split(",") if n.strip()]
    commits: dict[str, str] = {}
    for item in args.commit:
        name, _, rev = item.partition("=")
        if not name or set(name) - NAME_OK or name.startswith((".", "-")):
            print(f"error: --commit {item}: NAME may hold letters, digits, '-', '_' and '.' (it names a branch)",
                  file=sys.stderr)
            return 2
        try:
            commits[name] = ws.rev(rev)
        except Exception:  # noqa: BLE001 - any git failure is this one bad value
            print(f"error: --commit {item}: not NAME=REV with a commit of {args.workspace}", file=sys.stderr)
            return 2
        # A branch of that name is reused only when this script made it at the same commit before.
        at = _branch_at(ws, name)
        if at is not None and (ws.find_branch(name) is None or at != commits[name]):
            print(f"error: --commit {item}: branch {name!r} already exists in {args.workspace}; pick another NAME",
                  file=sys.stderr)
            return 2
        sets.append((name, {}))
    loop = Loop(ws, LoopOptions(rounds=0, agents=1), progress=lambda m: print(m, file=sys.stderr))
    loop._ensure_refs()
    rows = []
    for name, change in sets:
        if name in commits:
            if ws.find_branch(name) is None:
                ws.create_branch(name, base=commits[name], direction="measured beside the hand-picked flags")
        elif ws.find_branch(name) is None:
            b = ws.create_branch(name, direction=f"by hand: {change}")
            cfg = LlamaCppConfig(**{**stock.as_dict(), **change})
            cfg.save(Path(b.worktree_path) / ws.config.config_file)
            g = ws.worktree_git(name)
            g.add(ws.config.config_file)
            g.commit("-q", "-m", f"by hand: {change}")
        forced = force(ws, name, progress=False)
        row = {"name": name, "change": change, "forcing": forced["status"], "forcing_reason": forced["reason"],
               **({"commit": commits[name]} if name in commits else {})}
        if forced["status"] == "keep":
            m = speedup_over_ar(ws, ws.rev(AR_BRANCH), ws.head(name), name, lambda *a, **k: None)
            row.update({"speedup_over_ar": m["speedup"], "ci95": m["ci95"],
                        "tokens_per_s": m["b_tokens_per_s"], "ar_tokens_per_s": m["a_tokens_per_s"]})
        rows.append(row)
        print(f"{name:24s} {row.get('speedup_over_ar', 0):.3f}x over AR  forcing {row['forcing']}", flush=True)
    ok = [r for r in rows if "speedup_over_ar" in r and "commit" not in r]
    best = max(ok, key=lambda r: r["speedup_over_ar"]) if ok else None
    report = {"workspace": str(ws.path), "stock": stock.as_dict(), "flag_sets": rows,
              "best_by_hand": best["name"] if best else None}
    print(f"best by hand: {best['name']} {best['speedup_over_ar']:.3f}x" if best else "no lossless flag set")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
