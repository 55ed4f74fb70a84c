"""Shared pieces of the `specpilot` command line: one-line errors, exit status, argument types."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

EXIT_USAGE = 2


def quiet_transformers() -> None:
    """Our own progress bars and tables say what happens; transformers' load bars and generate notices
    (about flags we pass on purpose) would bury them. transformers is imported here, not at the top: the
    headless and help paths of the CLIs start without it."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def fail(msg: str) -> int:
    """Print `error: msg` on stderr and return the usage exit status."""
    print(f"error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _flag_value(text: str, kind: type, what: str, ok: Callable[[float], bool], bound: str) -> int | float:
    """`text` as `kind` (else "'text' is not {what}") passing `ok` (else "{text} must be {bound}")."""
    try:
        v = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not ok(v):
        raise argparse.ArgumentTypeError(f"{v if kind is int else text} must be {bound}")
    return v


def positive_int(text: str) -> int:
    return _flag_value(text, int, "an integer", lambda v: v >= 1, "at least 1")


def positive_float(text: str) -> float:
    """A finite number above 0 (`nan` and `inf` parse as floats; neither bounds anything)."""
    return _flag_value(text, float, "a number", lambda v: math.isfinite(v) and v > 0, "a finite number above 0")


def check_out_file(flag: str, out: str) -> str | None:
    """Why `out` cannot take an output file (checked before the work that fills it), or None."""
    path = Path(out).absolute()
    if path.is_dir():
        return f"{flag} {out}: is a folder; pass a file path inside it"
    if not path.parent.is_dir():
        return f"{flag} {out}: folder {path.parent} does not exist; create it or pick another path"
    if not os.access(path.parent, os.W_OK):
        return f"{flag} {out}: folder {path.parent} is not writable; pick another path"
    return None


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it: a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line (`error: PROG: message (see PROG --help)`), exit status 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def run_group(command: str, add_parser: Callable, argv: list[str] | None) -> int:
    """Run one command group (`specpilot COMMAND ARGS`) on its own, as `python -m workbench.X ARGS`."""
    parser = OneLineParser(prog="specpilot")
    add_parser(parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser))
    args = parser.parse_args([command, *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
