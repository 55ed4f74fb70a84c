"""Shared pieces of the `specpilot` command line: one-line errors, exit status, argument types."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

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


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be at least 1")
    return v


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
