"""`specpilot memory list|show|search|accept|reject`: the mechanisms in a memory, for scripts and review.

Wire into the main parser with `add_parser(subparsers)`; each subcommand sets `func(args) -> int`.
Runs on its own too: `python -m workbench.memory_cli list --db PATH` is `specpilot memory list --db PATH`.

The database is `--db PATH`, else `./.specpilot/memory.db` when the current directory is a workspace,
else the global memory (`$SPECPILOT_DATA_DIR/memory.db`). Errors a user can meet (no such id, no
database) print one line `error: ...` on stderr and return 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from store import Memory, StoreError, global_memory_path, to_dict, workspace_memory_path
from store.migrations import GAP_FAMILIES, MECHANISM_STATUSES
from workbench.cli_util import fail, positive_int, run_group

if TYPE_CHECKING:
    from store import Mechanism, Memory



def default_db_path() -> Path:
    """This directory's workspace memory if there is one, else the global memory."""

    local = workspace_memory_path(Path.cwd())
    return local if local.exists() else global_memory_path()


def _open(args: argparse.Namespace) -> Memory:

    # Reading commands must not leave an empty database behind a mistyped path: never create here.
    return Memory(_db_path(args), create=False)


def _db_path(args: argparse.Namespace) -> Path:

    if getattr(args, "workspace", None):
        return workspace_memory_path(Path(args.workspace))
    return Path(args.db) if args.db else default_db_path()


def publish_verdict(m: Mechanism, source: Path) -> bool:
    """Carry an accepted or rejected mechanism from a workspace memory into the global memory, where
    other deployments find it (transfer). Returns whether anything was copied."""

    glob = global_memory_path()
    if m.status == "candidate" or source.resolve() == glob.resolve():
        return False
    glob.parent.mkdir(parents=True, exist_ok=True)
    with Memory(glob) as g:
        g.import_mechanism(m)
    return True


def _best_speedup(m: Mechanism) -> float | None:
    speedups = [e["speedup"] for e in m.evidence if isinstance(e.get("speedup"), int | float)]
    return max(speedups) if speedups else None


def _table(mechanisms: list[Mechanism]) -> str:
    if not mechanisms:
        return "(no mechanisms)"
    rows = [("id", "status", "family", "best", "name", "summary")]
    for m in mechanisms:
        best = _best_speedup(m)
        summary = m.summary if len(m.summary) <= 60 else m.summary[:59] + "…"
        rows.append((str(m.id), m.status, m.gap_family, f"{best:.2f}x" if best is not None else "-", m.name, summary))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True)) + "  " + r[5] for r in rows)


def _detail(m: Mechanism) -> str:
    status = m.status + (f" ({m.reviewer_note})" if m.reviewer_note else "")
    lines = [f"mechanism {m.id}: {m.name}", f"  status:   {status}", f"  family:   {m.gap_family}",
             f"  uid:      {m.uid}", f"  created:  {m.created_at}", f"  updated:  {m.updated_at}",
             f"  summary:  {m.summary}"]
    if m.notes:
        lines += ["  notes:"] + [f"    {line}" for line in m.notes.splitlines()]
    lines.append("  evidence:" if m.evidence else "  evidence: none")
    for e in m.evidence:
        speedup = e.get("speedup")
        forcing = e.get("forcing") or {}
        rate = forcing.get("match_rate") if isinstance(forcing, dict) else None
        lines.append(f"    {e['deployment']}: speedup {speedup if speedup is not None else '-'}"
                     + (f", forcing match rate {rate}" if rate is not None else ""))
    lines.append(f"  patch:    {len(m.patch.splitlines())} lines" if m.patch else "  patch:    none")
    return "\n".join(lines)


def _emit(args: argparse.Namespace, payload: object, text: str) -> None:
    print(json.dumps(payload, ensure_ascii=False) if args.json else text)


def _run(args: argparse.Namespace, body) -> int:

    try:
        mem = _open(args)
    except StoreError as e:
        return fail(str(e))
    try:
        return body(mem)
    except (StoreError, ValueError) as e:  # NotFound is a StoreError
        return fail(str(e))
    finally:
        mem.close()


def _cmd_list(args: argparse.Namespace) -> int:

    def body(mem: Memory) -> int:
        ms = mem.list_mechanisms(status=args.status, gap_family=args.family)
        _emit(args, [to_dict(m) for m in ms], _table(ms))
        return 0

    return _run(args, body)


def _cmd_show(args: argparse.Namespace) -> int:

    def body(mem: Memory) -> int:
        m = mem.get_mechanism(args.id)
        text = _detail(m) + (f"\n\n{m.patch}" if args.patch and m.patch else "")
        _emit(args, to_dict(m), text)
        return 0

    return _run(args, body)


def _cmd_search(args: argparse.Namespace) -> int:

    def body(mem: Memory) -> int:
        ms = mem.search_mechanisms(args.query, status=args.status, limit=args.limit)
        _emit(args, [to_dict(m) for m in ms], _table(ms))
        return 0

    return _run(args, body)


def _set_status(args: argparse.Namespace, status: str) -> int:

    if not args.note.strip():
        return fail(f"{status} needs a reviewer note: --note TEXT saying why")

    def body(mem: Memory) -> int:
        m = mem.set_mechanism_status(args.id, status, args.note.strip())
        shared = publish_verdict(m, _db_path(args))
        _emit(args, to_dict(m), f"mechanism {m.id} ({m.name}) is now {m.status}: {m.reviewer_note}"
                                + (" (copied to the global memory)" if shared else ""))
        return 0

    return _run(args, body)


def _cmd_accept(args: argparse.Namespace) -> int:
    return _set_status(args, "accepted")


def _cmd_reject(args: argparse.Namespace) -> int:
    return _set_status(args, "rejected")


def _mechanism_id(text: str) -> int:
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a mechanism id (an integer from 1; see "
                                         f"`memory list`)") from None


def add_parser(subparsers) -> None:
    """Add the `memory` command and its subcommands to an argparse subparsers object."""

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", help="memory database (default: ./.specpilot/memory.db if present, else the global "
                                     "memory in $SPECPILOT_DATA_DIR or ~/.local/share/specpilot)")
    common.add_argument("--workspace", help="use this workspace's memory (PATH/.specpilot/memory.db)")
    common.add_argument("--json", action="store_true", help="print JSON on stdout")

    m = subparsers.add_parser("memory", help="mechanisms kept in memory: list, show, search, accept, reject")
    sub = m.add_subparsers(dest="memory_command", required=True, metavar="{list,show,search,accept,reject}")

    p = sub.add_parser("list", parents=[common], help="mechanisms, oldest first")
    p.add_argument("--status", choices=MECHANISM_STATUSES)
    p.add_argument("--family", choices=GAP_FAMILIES, help="gap family")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("show", parents=[common], help="one mechanism with its evidence")
    p.add_argument("id", type=_mechanism_id)
    p.add_argument("--patch", action="store_true", help="also print the patch")
    p.set_defaults(func=_cmd_show)

    p = sub.add_parser("search", parents=[common], help="full-text search on name, summary and notes")
    p.add_argument("query")
    p.add_argument("--status", choices=MECHANISM_STATUSES)
    p.add_argument("--limit", type=int, default=50)
    p.set_defaults(func=_cmd_search)

    for name, func, verb in (("accept", _cmd_accept, "accept"), ("reject", _cmd_reject, "reject")):
        p = sub.add_parser(name, parents=[common], help=f"{verb} a mechanism, with the reviewer's note")
        p.add_argument("id", type=_mechanism_id)
        p.add_argument("--note", required=True, help="why (kept with the mechanism and in the ledger)")
        p.set_defaults(func=func)


def main(argv: list[str] | None = None) -> int:
    """Run `specpilot memory ARGS` on its own (ARGS start with the subcommand)."""
    return run_group("memory", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
