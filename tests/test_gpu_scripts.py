"""scripts/gpu_check_all.sh off a GPU machine: valid bash, and with no NVIDIA GPU one line on stderr and exit 3
before any set-up (no venv, no output file)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check_all.sh"


def test_gpu_check_all_is_valid_bash():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: the script would run the checks")
def test_gpu_check_all_without_a_gpu_is_one_line_and_exit_3(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(SCRIPT), str(out / "gpu_checks.json")], capture_output=True, text=True,
                       timeout=60, env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)})
    assert r.returncode == 3, (r.returncode, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "no NVIDIA GPU" in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == "" and list(tmp_path.iterdir()) == []  # no venv, no work folder, no output
