"""`specpilot-tui`: the Textual workbench, or with `--auto` the same loop headless.

    specpilot-tui [--workspace PATH] [--executor local|ray] [--ray-address ADDR]
    specpilot-tui --auto --workspace PATH [--rounds N] [--agents K] [--agent tuner|llm]
                  [--budget-minutes M] [--json] [--executor local|ray] [--ray-address ADDR]

Headless, progress goes to stderr and a JSON summary to stdout (with --json; else a short table).
The headless path never imports Textual.

Exit status (--auto):
    0  every round ran
    2  usage error (one line on stderr)
    3  the time budget ended first (the summary covers what ran; run again to go on)
    4  interrupted (SIGINT/SIGTERM); the interrupted round resumes on the next run
    5  internal failure (one line on stderr; the workspace stays recoverable)
    6  the executor could not start (Ray not installed, the cluster unreachable or without the
       evaluation resource; one line on stderr)

The interactive app takes --executor and --ray-address too (its launches, re-evaluations and loop rounds
evaluate there; the Overview shows the running evaluations per node) and exits 2 or 6 the same way.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from workbench.agents.llm import LLMConfigError
from workbench.cli_util import OneLineParser, fail, positive_float, positive_int, quiet_transformers
from workbench.executor import ExecutorError, ExecutorSettings, make_evaluator
from workbench.loop import Loop, LoopOptions, llm_config
from workbench.workspace import DTYPE_AUTO, Workspace, WorkspaceError, default_demo_path, init_demo, resolve_dtype

EXIT_OK, EXIT_USAGE, EXIT_BUDGET, EXIT_INTERRUPTED, EXIT_FAILED, EXIT_EXECUTOR = 0, 2, 3, 4, 5, 6
T = TypeVar("T")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="specpilot-tui", description="SpecPilot workbench (Textual), or headless with --auto.")
    p.add_argument("--workspace", help="workspace folder (default: the demo workspace, created on first run)")
    p.add_argument("--auto", action="store_true", help="run the loop headless: progress on stderr, summary on stdout")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--agents", type=positive_int, default=2, help="agents per round (in parallel)")
    p.add_argument("--agent", choices=("tuner", "llm"), default="tuner")
    p.add_argument("--budget-minutes", type=positive_float, default=30.0,
                   help="wall-clock budget of the whole run, in minutes (a finite number above 0; default 30)")
    p.add_argument("--no-global-memory", action="store_true",
                   help="neither read nor write the global memory (a cold start)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--executor", choices=("local", "ray"),
                   help="where candidates are evaluated: here (local, the default) or on a Ray cluster "
                        "(pip install -e .[ray]); default: [executor] kind in specpilot.toml, else local")
    p.add_argument("--ray-address", help="the Ray cluster: host:port of its head, auto (RAY_ADDRESS or one "
                                         "started on this machine; the default) or local (a one-node cluster here)")
    return p


def _progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _table(s: dict) -> str:
    def x(v) -> str:
        return f"{v:.2f}x" if v is not None else "-"

    lines = [f"{s['deployment']}: stock {x(s['stock_speedup'])} over AR -> final {x(s['final_speedup'])} "
             f"({x(s['improvement'])} stock) in {s['minutes']:.1f} min [{s['status']}]"]
    points = s.get("points") or {}
    if len(points) > 1:  # a load profile: each batch size over the same engine's AR at that load
        for bs, pt in points.items():
            lines.append(f"  B = {bs}: stock {x(pt['stock_speedup'])} -> final {x(pt['final_speedup'])} "
                         f"({x(pt['improvement'])} stock) over {'AR' if bs == '1' else 'batched AR'}")
    for r in s["rounds"]:
        lines.append(f"round {r['index']}: best {r['best_speedup_over_ar'] or 0:.2f}x over AR")
        for a in r["attempts"]:
            sp = f"{a['speedup']:.3f}x" if a.get("speedup") else "-"
            lines.append(f"  {a['branch']:32s} {a['status']:8s} {sp:>7s}  {a['reason']}")
    for m in s["accepted_mechanisms"]:
        lines.append(f"accepted: {m['name']} ({m['family']})")
    return "\n".join(lines)


def run_auto(args: argparse.Namespace) -> int:

    if not (math.isfinite(args.budget_minutes) and args.budget_minutes > 0):  # run_auto is also called directly
        return fail(f"--budget-minutes {args.budget_minutes:g}: use a finite number of minutes above 0")
    try:
        path = Path(args.workspace) if args.workspace else default_demo_path()
        if not args.workspace and not (path / "specpilot.toml").exists():
            dtype, note = resolve_dtype(DTYPE_AUTO)  # the CPU decides: float32 without native bfloat16
            _progress(f"creating the demo workspace at {path} ({dtype})")
            if note:
                _progress(note)
            init_demo(path, dtype=dtype)
        ws = Workspace(path)
    except WorkspaceError as e:
        return fail(str(e))


    quiet_transformers()  # our progress lines say what happens; no weight-loading bars in between
    opts = LoopOptions(rounds=args.rounds, agents=args.agents, agent=args.agent, budget_minutes=args.budget_minutes,
                       use_global_memory=not args.no_global_memory, auto_accept=True)
    if opts.agent == "llm":  # fail now, in one line, rather than inside every agent

        try:
            llm_config(ws)
        except LLMConfigError as e:
            ws.close()
            return fail(str(e))
    try:
        settings = ExecutorSettings.resolve(getattr(args, "executor", None), getattr(args, "ray_address", None),
                                            ws.config.executor, f"{ws.path / 'specpilot.toml'}: [executor]")
    except ExecutorError as e:
        ws.close()
        return fail(str(e))
    if settings.kind == "local" and settings.address:
        ws.close()
        return fail(f"--ray-address {settings.address}: only with --executor ray (or [executor] kind = \"ray\")")
    try:
        evaluator = make_evaluator(settings, _progress)
    except ExecutorError as e:
        ws.close()
        print(f"error: {e}", file=sys.stderr)
        return EXIT_EXECUTOR
    try:
        code, summary = run_headless(ws, lambda: Loop(ws, opts, progress=_progress, evaluator=evaluator).run(),
                                     "loop")
    finally:
        evaluator.shutdown()
    if summary is None:
        return code
    print(json.dumps(summary) if args.json else _table(summary))
    return EXIT_BUDGET if summary["status"] == "budget" else EXIT_OK


def run_headless(ws, body: Callable[[], T], what: str) -> tuple[int, T | None]:
    """Run `body` under the headless exit contract, then close the workspace: (EXIT_OK, its result), or
    the exit status with one line on stderr (interrupted: resumable; a workspace error; anything else)."""

    def interrupted(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupted)  # SIGTERM ends it like Ctrl-C: resumable
    try:
        return EXIT_OK, body()
    except KeyboardInterrupt as e:
        _progress(f"interrupted ({str(e) or 'SIGINT'}); run the same command again to resume the round")
        return EXIT_INTERRUPTED, None
    except WorkspaceError as e:
        return fail(str(e)), None
    except Exception as e:  # noqa: BLE001 - one line, not a traceback; the store keeps the details
        print(f"error: {what} failed: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        return EXIT_FAILED, None
    finally:
        ws.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.auto:
        return run_auto(args)
    from workbench.tui.app import main as tui_main  # Textual only here

    return tui_main([*(["--workspace", args.workspace] if args.workspace else []),
                     *(["--executor", args.executor] if args.executor else []),
                     *(["--ray-address", args.ray_address] if args.ray_address else [])])


if __name__ == "__main__":
    sys.exit(main())
