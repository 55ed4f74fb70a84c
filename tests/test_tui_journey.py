"""The engineer's journey through `specpilot-tui`, driven in tmux as a person would (slow: a real tuner run).

Start the app on a fresh demo workspace at 120x40, launch a tuner agent on drafting, watch its progress
change, accept the mechanism with a note, export, quit: the process exits 0 and the exported series
`git am`-applies to a fresh clone of stock. The panes are captured (also at 80x24) and, with
SPECPILOT_JOURNEY_OUT=DIR, written there with the first-paint time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import git
import pytest

from tests.conftest import needs_demo
from workbench.workspace import init_demo

pytestmark = [needs_demo, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]


class Tmux:
    def __init__(self, name: str, command: str, cwd: Path, size: tuple[int, int]) -> None:
        self.name = name
        self.started = time.perf_counter() + 0.5  # the app itself starts after the sleep below
        # The app starts once the window has its size (a fresh tmux server may start it at 80x24 first).
        subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", str(size[0]), "-y", str(size[1]), "-c",
                        str(cwd), f"sleep 0.5; {command}"], check=True)
        self.resize(*size)

    def pane(self) -> str:
        r = subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name], capture_output=True, text=True)
        return r.stdout

    def keys(self, *keys: str) -> None:
        for k in keys:
            subprocess.run(["tmux", "send-keys", "-t", self.name, k], check=True)
            time.sleep(0.15)

    def type(self, text: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, "-l", text], check=True)

    def resize(self, w: int, h: int) -> None:
        subprocess.run(["tmux", "resize-window", "-t", self.name, "-x", str(w), "-y", str(h)], check=True)

    def wait(self, cond, timeout: float, what: str) -> str:
        t0 = time.monotonic()
        while True:
            text = self.pane()
            if cond(text):
                return text
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"timed out waiting for {what}; the pane:\n{text}")
            time.sleep(0.2)

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def test_launch_watch_accept_export_quit_in_tmux(tmp_path):
    ws = init_demo(tmp_path / "ws", forcing_max_new_tokens=16, prompt_limit=4, hidden=1,
                   limits={"request_s": 60, "start_s": 120}, bench={"noise_pairs": 1})
    ws.close()
    out = Path(os.environ["SPECPILOT_JOURNEY_OUT"]) if os.environ.get("SPECPILOT_JOURNEY_OUT") else None
    panes: dict[str, str] = {}
    exit_file = tmp_path / "exit"
    cmd = (f"{sys.executable} -m workbench.tui_entry --workspace {ws.path}; echo $? > {exit_file}; sleep 60")
    tm = Tmux(f"journey-{os.getpid()}", cmd, tmp_path, (120, 40))
    try:
        tm.wait(lambda t: "Overview" in t and "Branches" in t, 30, "the first paint")
        first_paint = time.perf_counter() - tm.started
        tm.wait(lambda t: "Gap breakdown" in t, 30, "the workspace to open")
        panes["overview-120x40-start"] = tm.pane()
        tm.keys("2", "l")
        dialog = tm.wait(lambda t: "Launch an agent on a direction" in t and "drafting" in t, 30, "the dialog")
        rows = [ln for ln in dialog.splitlines() if "ms/token" in ln or "not profiled" in ln]
        downs = next(i for i, ln in enumerate(rows) if "drafting" in ln)
        tm.keys(*["Down"] * downs, "Enter")
        seen: list[str] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 900:
            text = tm.pane()
            row = next((ln for ln in text.splitlines() if "tui-tuner-drafting-1" in ln), "")
            if row and (not seen or seen[-1] != row):
                seen.append(row)
                if len(seen) == 4:
                    panes["branches-120x40-progress"] = text
            if " kept " in row or "discarded" in row or "crashed" in row or "rejected" in row:
                break
            time.sleep(0.5)
        assert " kept " in row, f"the tuner's branch ended as: {row}\n{text}"
        assert len({r.split('·')[0] for r in seen if '·' in r}) >= 3, seen  # phases changed while watched
        panes["branches-120x40-kept"] = tm.pane()
        tm.resize(80, 24)
        time.sleep(2.0)  # the app redraws at the new size
        panes["branches-80x24-kept"] = tm.pane()
        tm.keys("1")
        time.sleep(1.5)
        panes["overview-80x24"] = tm.pane()
        tm.resize(120, 40)
        tm.keys("4")
        tm.wait(lambda t: "candidate" in t, 20, "the mechanism in the Memory tab")
        tm.keys("a")  # the table has the focus, its first row the mechanism
        tm.wait(lambda t: "reviewer's note" in t, 10, "the note dialog")
        tm.type("lossless on the forcing prompts, kept by the cascade")
        tm.keys("Enter")
        tm.wait(lambda t: "accepted" in t, 20, "the verdict")
        tm.keys("e")
        tm.wait(lambda t: "Export accepted mechanisms" in t, 10, "the export dialog")
        tm.keys("Enter")
        tm.wait(lambda t: "exported 1 patch" in t, 30, "the export")
        panes["memory-120x40-exported"] = tm.pane()
        tm.keys("q")
        t_quit = time.perf_counter()
        while not exit_file.exists() and time.perf_counter() - t_quit < 20:
            time.sleep(0.05)
        quit_s = time.perf_counter() - t_quit
        assert exit_file.read_text().strip() == "0"
    finally:
        tm.close()
    patches = sorted((tmp_path / "demo-patches").glob("*.patch"))
    assert patches
    clone = tmp_path / "clone"
    repo = git.Repo.clone_from(str(ws.path), clone)
    repo.git.checkout("stock")
    with repo.config_writer() as w:
        w.set_value("user", "name", "T").set_value("user", "email", "t@localhost")
    repo.git.am(*map(str, patches))
    assert repo.git.diff("stock", "HEAD", "--", "system.toml")  # the mechanism, applied on stock
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in panes.items():
            (out / f"{name}.txt").write_text(text)
        (out / "timings.txt").write_text(f"first paint (process start to tabs drawn): {first_paint:.2f} s\n"
                                         f"quit (q to process exit): {quit_s:.2f} s\n"
                                         f"progress rows seen: {len(seen)}\n" + "\n".join(seen) + "\n")
