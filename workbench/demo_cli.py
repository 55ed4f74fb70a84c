"""`specpilot demo`: the product's main job in one command, on the embedded demo deployment.

Creates the demo workspace (once), runs one round of the loop headless with the built-in tuner, exports
what it kept as a `git am` series and prints the result in a few lines:

    stock -> final speedup over AR with 95% intervals,
    the kept mechanism and its forcing verdict (positions checked, real mismatches),
    where the patch is, and the command that opens the workspace in `specpilot-tui`.

Running it again on the same workspace resumes an interrupted round, or prints the finished one.
Exit status: 0 done, 2 usage, 3 budget ended first, 4 interrupted (resumable), 5 internal failure.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from workbench.cli_util import fail, positive_int, quiet_transformers
from workbench.export import export
from workbench.loop import Loop, LoopOptions
from workbench.tui_entry import EXIT_BUDGET, EXIT_OK, _progress, run_headless
from workbench.workspace import DTYPE_AUTO, Workspace, WorkspaceError, bf16_hint, init_demo, resolve_dtype

DEFAULT_WORKSPACE = "build/demo-workspace"
PATCH_DIR = "patches"  # under the workspace's .specpilot/ state: never committed, never seen by agents


def _x(v: float | None, ci: list[float] | None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def _forcing_line(ws, branch: str) -> str:
    """The latest forcing verdict of `branch` from the store: positions checked, real mismatches, near ties."""
    b = ws.find_branch(branch)
    reports = ws.memory.list_forcing_reports(b.id) if b is not None else []
    if not reports:
        return "forcing: no report"
    r = reports[-1]
    real, near = r.details.get("unexplained", "?"), r.details.get("near_ties", 0)
    return (f"forcing: {r.positions_checked} positions checked, {real} real mismatches"
            + (f" ({near} near ties within the noise floor)" if near else ""))


def summary_lines(ws, summary: dict, patches: list[Path]) -> list[str]:
    """The few lines `specpilot demo` ends with (also used by its tests)."""
    lines = [f"{summary['deployment']}: stock {_x(summary['stock_speedup'], summary['stock_ci95'])} over AR -> "
             f"final {_x(summary['final_speedup'], summary['final_ci95'])} "
             f"({summary['improvement']:.2f}x stock) in {summary['minutes']:.1f} min"
             if summary.get("improvement") else
             f"{summary['deployment']}: stock {_x(summary['stock_speedup'], summary['stock_ci95'])} over AR; "
             f"no final measurement ({summary['status']})"]
    kept = [a for r in summary["rounds"] for a in r["attempts"] if a["status"] == "keep"]
    merged = {b for r in summary["rounds"] for b in (r.get("integration") or {}).get("merged", [])}
    for a in kept:
        tag = "kept and merged" if a["branch"] in merged else "kept"
        lines.append(f"{tag}: {a['mechanism'] or a['branch']} ({a['direction']}), "
                     f"{a['speedup']:.2f}x over its base; {_forcing_line(ws, a['branch'])}")
    if not kept:
        lines.append("kept: nothing this round beat the base beyond the noise; "
                     f"more rounds: specpilot-tui --auto --workspace {shlex.quote(str(ws.path))} --rounds 3")
    if patches:
        lines.append(f"patch: {patches[0].parent}/ ({len(patches)} file(s); `git am` applies them to stock)")
    lines.append(f"open it: specpilot-tui --workspace {shlex.quote(str(ws.path))}")
    return lines


def _cmd_demo(args: argparse.Namespace) -> int:

    if not args.budget_minutes > 0 or args.budget_minutes == float("inf"):
        return fail(f"--budget-minutes {args.budget_minutes:g}: must be a positive number of minutes")
    try:  # before any folder is made
        dtype, note = resolve_dtype(args.dtype)
    except WorkspaceError as e:
        return fail(str(e))
    path = Path(args.workspace).absolute()
    if not (path / "specpilot.toml").exists():  # say what is wrong with the folder before any work starts
        up = path
        while not up.exists():
            up = up.parent
        if not up.is_dir():
            return fail(f"demo workspace {path}: {up} is a file; pick a folder for the workspace")
        if not os.access(up, os.W_OK):
            return fail(f"demo workspace {path}: {up} is not writable; pick a folder you can write")
    try:
        created = not (path / "specpilot.toml").exists()
        if created:
            _progress(f"creating the demo workspace at {path} ({dtype})")
            init_demo(path, dtype=dtype)
        ws = Workspace(path)
    except (WorkspaceError, OSError) as e:
        return fail(f"demo workspace {path}: {e}".splitlines()[0])
    if args.dtype not in (None, DTYPE_AUTO) and args.dtype != ws.config.dtype:
        return fail(f"--dtype {args.dtype}: the demo workspace {path} was made in {ws.config.dtype}; --dtype applies "
                    f"when it is created: give a new --workspace")
    hint = (note if created else None) or bf16_hint(ws.config.dtype)
    if hint:
        _progress(hint)

    quiet_transformers()
    opts = LoopOptions(rounds=args.rounds, agents=1, agent="tuner", budget_minutes=args.budget_minutes,
                       use_global_memory=False, auto_accept=True)

    def body() -> tuple[dict, list[Path]]:
        summary = Loop(ws, opts, progress=_progress).run()
        out = ws.state / PATCH_DIR
        for old in out.glob("*.patch") if out.exists() else ():
            old.unlink()
        accepted = ws.memory.list_mechanisms(status="accepted")
        patches = export(ws, accepted, out) if accepted else []
        print("\n".join(summary_lines(ws, summary, patches)))
        return summary, patches

    code, result = run_headless(ws, body, "demo")
    if result is None:
        return code
    return EXIT_BUDGET if result[0]["status"] == "budget" else EXIT_OK


def add_parser(sub) -> None:
    d = sub.add_parser("demo", help="the main job on the embedded demo: one tuner round, its result and patch")
    d.add_argument("--workspace", default=DEFAULT_WORKSPACE,
                   help=f"demo workspace folder (default: {DEFAULT_WORKSPACE}; created on first use)")
    d.add_argument("--rounds", type=positive_int, default=1, help="loop rounds (default 1)")
    d.add_argument("--budget-minutes", type=float, default=15.0, help="time budget (default 15)")
    d.add_argument("--dtype", metavar="auto|bfloat16|float32",
                   help="when the workspace is created: the weights' dtype (default auto: bfloat16 on a CPU with "
                        "native bfloat16, else float32, which decodes faster there)")
    d.set_defaults(func=_cmd_demo)
