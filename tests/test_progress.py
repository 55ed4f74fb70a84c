"""Live progress files: what the TUI's "now" column and stale states are read from (no model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from workbench.progress import clock, current_branch, describe, read_progress, step, tracking


def test_steps_inside_tracking_reach_the_file_and_it_goes_when_the_work_ends(tmp_path):
    step("outside", 1, 2)  # no branch: nothing written
    assert read_progress(tmp_path) == {}
    with tracking(tmp_path, "b1"):
        assert current_branch() == "b1"
        step("forcing", 0, 10)
        step("forcing", 10, 10, "2 mismatches")  # the last of a phase is never throttled away
        rec = read_progress(tmp_path)["b1"]
        assert (rec["phase"], rec["done"], rec["total"], rec["detail"]) == ("forcing", 10, 10, "2 mismatches")
        assert rec["alive"] and rec["pid"] == os.getpid() and rec["elapsed_s"] >= 0
    assert current_branch() is None
    assert read_progress(tmp_path) == {}


def test_a_kept_file_carries_its_start_into_the_next_step_of_the_same_work(tmp_path):
    with tracking(tmp_path, "b2", keep=True):
        step("tuner agent")
    first = json.loads((tmp_path / "progress" / "b2.json").read_text())["started"]
    with tracking(tmp_path, "b2"):
        step("bench", 1, 8)
        assert read_progress(tmp_path)["b2"]["started"] == first


def test_threads_report_for_their_own_branch(tmp_path):
    seen = {}

    def work(name: str) -> None:
        with tracking(tmp_path, name, keep=True):
            step("agent", detail=name)
            seen[name] = current_branch()

    ts = [threading.Thread(target=work, args=(f"t{i}",)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert seen == {"t0": "t0", "t1": "t1", "t2": "t2"}
    assert {k: v["detail"] for k, v in read_progress(tmp_path).items()} == {"t0": "t0", "t1": "t1", "t2": "t2"}


def test_a_file_left_by_a_dead_process_reads_as_not_alive(tmp_path):
    code = (f"import sys; sys.path.insert(0, {os.getcwd()!r})\n"
            "from workbench.progress import tracking, step\n"
            "import os\n"
            f"with tracking(__import__('pathlib').Path({str(tmp_path)!r}), 'gone', keep=True):\n"
            "    step('bench', 3, 8)\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    rec = read_progress(tmp_path)["gone"]
    assert rec["alive"] is False and rec["done"] == 3


def test_describe_gives_phase_count_elapsed_eta_and_detail():
    rec = {"phase": "forcing", "done": 12, "total": 24, "elapsed_s": 41.0, "eta_s": 30.4, "detail": "0 mismatches"}
    assert describe(rec) == "forcing 12/24 · 0:41 · ETA 0:30 · 0 mismatches"
    assert describe({"phase": "smoke", "done": None, "total": None, "elapsed_s": 3725, "eta_s": None}) == \
        "smoke · 1:02:05"
    assert clock(None) == "" and clock(59.6) == "1:00"
