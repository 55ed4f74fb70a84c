"""The machine's timing gate (workbench/gate.py): untimed work side by side, never beside timed work.

Real file locks, real threads and processes, a real system process speaking the protocol; every check is
on an order of events (which block entered first, whether one is still blocked while a lock is held),
never on a speed."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.test_sandbox import ECHO
from workbench.gate import PAUSED, holding, measurement_lock, untimed
from workbench.harness import SystemProcess
from workbench.progress import read_progress, step, tracking

HOLD = r'''
import sys, time
from pathlib import Path
from workbench.gate import measurement_lock
with measurement_lock():
    Path(sys.argv[1]).write_text("held")
    while not Path(sys.argv[2]).exists():
        time.sleep(0.02)
'''


def _wait_for(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.02)


def test_untimed_work_runs_side_by_side():
    inside = threading.Barrier(2, timeout=30)  # both blocks must be inside at once, or this breaks

    def work() -> None:
        with untimed():
            assert holding() == "untimed"
            inside.wait()

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert not inside.broken


def test_timed_work_waits_for_the_request_in_flight_and_new_untimed_work_waits_for_it():
    order: list[str] = []
    release_first = threading.Event()
    first_in = threading.Event()

    def first() -> None:
        with untimed():
            first_in.set()
            release_first.wait(30)
            order.append("first untimed ends")

    def timed() -> None:
        with measurement_lock():
            order.append("timed")
            assert holding() == "timed"
            with untimed():  # its own systems' requests pass straight through
                pass
            time.sleep(0.2)
            order.append("timed ends")

    def later() -> None:
        with untimed():
            order.append("later untimed")

    a = threading.Thread(target=first)
    a.start()
    assert first_in.wait(30)
    b = threading.Thread(target=timed)
    b.start()
    time.sleep(0.3)  # the timed thread now waits for the first request (and holds the turnstile)
    c = threading.Thread(target=later)
    c.start()
    time.sleep(0.3)
    assert order == []  # nothing got past: the request in flight holds the timed run, which holds the later one
    release_first.set()
    for t in (a, b, c):
        t.join(30)
    assert order == ["first untimed ends", "timed", "timed ends", "later untimed"]


def test_a_request_pauses_while_another_process_times_and_its_clock_excludes_the_pause(tmp_path: Path):
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / "echo.py").write_text(ECHO)
    state = tmp_path / "state"
    held, go = tmp_path / "held", tmp_path / "go"
    with SystemProcess(wt, [sys.executable, "-I", str(wt / "echo.py")]) as sp:
        holder = subprocess.Popen([sys.executable, "-c", HOLD, str(held), str(go)], env=os.environ.copy(),
                                  cwd=Path(__file__).resolve().parents[1])
        try:
            _wait_for(held.exists)
            got: dict = {}

            def ask() -> None:
                with tracking(state, "cand"):
                    step("forcing", 3, 10, "prompt p3")
                    t0 = time.monotonic()
                    got["r"] = sp.generate([1, 2], 3)
                    got["waited"] = time.monotonic() - t0

            t = threading.Thread(target=ask)
            t.start()
            _wait_for(lambda: (read_progress(state).get("cand") or {}).get("detail") == PAUSED)
            rec = read_progress(state)["cand"]
            assert (rec["phase"], rec["done"], rec["total"]) == ("forcing", 3, 10)  # the phase's counts kept
            time.sleep(1.0)
            assert t.is_alive() and "r" not in got  # still paused while the other process times
            go.write_text("done")
            t.join(60)
            assert holder.wait(30) == 0
        finally:
            go.write_text("done")
            holder.wait(30)
    assert got["r"].tokens == [1, 2, 3]
    assert got["waited"] >= 1.0 and got["r"].seconds < got["waited"]  # the pause is not the request's time


def test_the_lock_files_live_in_the_data_directory():
    with measurement_lock():
        pass
    d = Path(os.environ["SPECPILOT_DATA_DIR"])
    assert (d / "measure.lock").exists() and (d / "measure.turnstile").exists()
