"""Live progress of the work on a branch, readable by any process (the TUI, another terminal).

Work on a branch runs inside `tracking(state_dir, branch)`; anything below it (the agent, forcing, the
paired benchmark) reports with `step(phase, done, total, detail)` and needs no handle passed down: the
branch is this thread's context. Each report lands in `.specpilot/progress/<branch>.json`
(written whole and renamed into place; within a phase at most every `MIN_INTERVAL_S`):

    {"branch", "phase", "done", "total", "detail", "started", "phase_started", "updated", "pid"}

`read_progress` adds `elapsed_s`, `eta_s` (from the phase's rate so far) and `alive` (its process still
runs). The file is removed when the work ends; one left by a dead process reads as stale.
"""

from __future__ import annotations

import contextvars
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

MIN_INTERVAL_S = 0.25


@dataclass
class _Tracker:
    path: Path
    branch: str
    started: float = field(default_factory=time.time)
    phase: str = ""
    phase_started: float = 0.0
    written: float = 0.0
    done: int | None = None
    total: int | None = None
    detail: str = ""
    forward: Callable[[dict], None] | None = None  # also hands each written report to this (e.g. a Ray head)

    def step(self, phase: str, done: int | None, total: int | None, detail: str) -> None:
        now = time.time()
        self.done, self.total, self.detail = done, total, detail
        if phase != self.phase:
            self.phase, self.phase_started = phase, now
        elif now - self.written < MIN_INTERVAL_S and not (done is not None and done == total):
            return
        self.written = now
        rec = {"branch": self.branch, "phase": phase, "done": done, "total": total, "detail": detail,
               "started": self.started, "phase_started": self.phase_started, "updated": now, "pid": os.getpid()}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(rec))
            os.replace(tmp, self.path)
        except OSError:
            pass  # progress is a view: a full disk must not fail the work
        if self.forward is not None:
            try:
                self.forward(rec)
            except Exception:  # noqa: BLE001 - a view: a lost receiver never fails the work
                pass


_current: contextvars.ContextVar[_Tracker | None] = contextvars.ContextVar("specpilot_progress", default=None)


def progress_dir(state_dir: Path) -> Path:
    return state_dir / "progress"


@contextmanager
def tracking(state_dir: Path, branch: str, *, keep: bool = False,
             forward: Callable[[dict], None] | None = None) -> Iterator[None]:
    """Reports from this thread go to `branch` for the block. The file is removed at the end unless
    `keep` (work that continues in another step, e.g. an agent done and waiting for its evaluation).
    `forward(report)` also receives each report written (a Ray node relays its evaluation's to the head)."""
    d = progress_dir(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    outer = _current.get()
    tr = _Tracker(d / f"{branch}.json", branch, forward=forward)
    if outer is not None and outer.branch == branch:
        tr.started = outer.started
    else:
        try:
            tr.started = float(json.loads(tr.path.read_text()).get("started", tr.started))  # the same work, resumed
        except (OSError, ValueError, AttributeError):
            pass
    token = _current.set(tr)
    try:
        yield
    finally:
        _current.reset(token)
        if not keep:
            tr.path.unlink(missing_ok=True)


def current_branch() -> str | None:
    """The branch this thread's work is for (None outside `tracking`)."""
    tr = _current.get()
    return tr.branch if tr is not None else None


def step(phase: str, done: int | None = None, total: int | None = None, detail: str = "") -> None:
    """Report progress of the current branch's work (nothing happens outside `tracking`)."""
    tr = _current.get()
    if tr is not None:
        tr.step(phase, done, total, detail)


def note(detail: str) -> str:
    """Replace the detail of the current branch's phase (its counts kept), e.g. while its work waits;
    returns the detail it replaced ("" outside `tracking`)."""
    tr = _current.get()
    if tr is None:
        return ""
    before = tr.detail
    tr.written = 0.0  # shown at once
    tr.step(tr.phase, tr.done, tr.total, detail)
    return before


def pid_alive(pid: object) -> bool:
    """Whether a process with this pid runs (one of another user counts as running)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_progress(state_dir: Path) -> dict[str, dict]:
    """Every branch's latest progress, with elapsed time, an ETA where the phase counts, and liveness."""
    out: dict[str, dict] = {}
    d = progress_dir(state_dir)
    if not d.is_dir():
        return out
    now = time.time()
    for path in d.glob("*.json"):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(rec, dict) or "branch" not in rec:
            continue
        done, total = rec.get("done"), rec.get("total")
        rec["elapsed_s"] = max(0.0, now - float(rec.get("started", now)))
        rec["eta_s"] = None
        if isinstance(done, int) and isinstance(total, int) and 0 < done < total:
            spent = max(0.0, float(rec.get("updated", now)) - float(rec.get("phase_started", now)))
            rec["eta_s"] = spent / done * (total - done)
        rec["alive"] = pid_alive(rec.get("pid"))
        out[str(rec["branch"])] = rec
    return out


def describe(rec: dict) -> str:
    """One line: `forcing 12/24 · 0:41 · ETA 0:30 · detail`."""
    parts = [str(rec.get("phase", ""))]
    done, total = rec.get("done"), rec.get("total")
    if isinstance(done, int) and isinstance(total, int):
        parts[0] += f" {done}/{total}"
    parts.append(clock(rec.get("elapsed_s")))
    if rec.get("eta_s") is not None:
        parts.append(f"ETA {clock(rec['eta_s'])}")
    if rec.get("detail"):
        parts.append(str(rec["detail"]))
    return " · ".join(p for p in parts if p)


def clock(seconds: float | None) -> str:
    if seconds is None:
        return ""
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
