"""The machine's timing gate: timed work alone on the cores, untimed work paused while it runs.

Two file locks in the data directory, shared by every process on the machine (several agents, several
evaluations of a Ray node, several Ray nodes started on one machine):

    measure.lock        timed work holds it exclusively (`measurement_lock`); untimed work holds it
                        shared for each request it sends and each system it starts (`untimed`)
    measure.turnstile   timed work holds it while it waits for `measure.lock`, so a stream of untimed
                        requests cannot keep a timed run waiting (the writer-preferring readers-writer
                        lock built from two flocks)

So untimed stages of several evaluations (smoke, forcing, stock's reference, starting systems) run
side by side, and when one evaluation starts its paired benchmark the others pause at their next request
boundary (a request in flight finishes first; a paused request is not timed, so its limits do not run
out) until the timed run ends. A thread that holds the exclusive lock passes `untimed` straight through
(its own systems' requests are the timed ones).
"""

from __future__ import annotations

import fcntl
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from store import data_dir
from workbench.progress import note

_local_lock = threading.Lock()  # threads here: flock alone does not order two threads sharing nothing else
_held = threading.local()  # .mode: "timed" in a thread holding the exclusive lock, "untimed" under a shared hold

LOCK_NAME = "measure.lock"
TURNSTILE_NAME = "measure.turnstile"
PAUSED = "paused: another evaluation is being timed on this machine"


def _open(name: str):
    path = data_dir() / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a")


def holding() -> str | None:
    """What this thread holds: "timed", "untimed" or None."""
    return getattr(_held, "mode", None)


@contextmanager
def measurement_lock() -> Iterator[None]:
    """Exclusive use of the machine for timed work: across threads here and processes elsewhere; untimed
    work (`untimed`) waits meanwhile."""
    with _local_lock, _open(TURNSTILE_NAME) as turn, _open(LOCK_NAME) as f:
        fcntl.flock(turn, fcntl.LOCK_EX)  # no new untimed request starts while this one waits
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)
        _held.mode = "timed"
        try:
            yield
        finally:
            _held.mode = None
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def untimed() -> Iterator[None]:
    """Untimed work (one request, one start-up): shared with other untimed work, never beside timed work.
    Reports the pause on the branch's progress while it waits."""
    if holding() is not None:  # timed work's own requests, or a start-up that sends a request
        yield
        return
    with _open(TURNSTILE_NAME) as turn, _open(LOCK_NAME) as f:
        shown = None  # the detail the pause replaced, restored when it ends
        for lock in (turn, f):
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                shown = note(PAUSED) if shown is None else shown
                fcntl.flock(lock, fcntl.LOCK_SH)
            if lock is turn:
                fcntl.flock(turn, fcntl.LOCK_UN)
        if shown is not None:
            note(shown)
        _held.mode = "untimed"
        try:
            yield
        finally:
            _held.mode = None
            fcntl.flock(f, fcntl.LOCK_UN)
