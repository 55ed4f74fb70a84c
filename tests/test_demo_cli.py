"""`specpilot demo` (what `make demo` runs): one tuner round on the demo, its result in a few lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import git
import pytest

from tests.conftest import needs_demo


def _demo(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench.cli", "demo", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("minutes", ["nan", "0", "-3", "inf"])
def test_bad_budget_is_one_line_exit_2(minutes):
    r = _demo("--budget-minutes", minutes, "--workspace", "/nonexistent/x")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    assert "--budget-minutes" in r.stderr


def test_workspace_on_a_file_or_read_only_folder_is_one_line(tmp_path: Path):
    f = tmp_path / "file"
    f.write_text("x")
    r = _demo("--workspace", str(f / "ws"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "demo workspace" in r.stderr, r.stderr
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores permission bits: nothing to check
            pytest.skip("running as a user that can write a read-only folder (root)")
        r = _demo("--workspace", str(ro / "ws"))
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert not (ro / "ws").exists()
    finally:
        ro.chmod(0o700)


@needs_demo
@pytest.mark.slow
def test_demo_runs_a_round_and_prints_result_patch_and_tui_command(tmp_path: Path):
    ws = tmp_path / "demo-ws"
    r = _demo("--workspace", str(ws), timeout=1500)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.strip().splitlines()
    assert out[0].startswith("demo: stock ") and "-> final" in out[0], out
    assert any(ln.startswith("kept") and "0 real mismatches" in ln for ln in out), out
    assert out[-1] == f"open it: specpilot-tui --workspace {ws}", out
    patch_line = next(ln for ln in out if ln.startswith("patch: "))
    patches = sorted(Path(patch_line.split()[1].rstrip("/")).glob("*.patch"))
    assert patches
    clone = tmp_path / "clone"
    git.Repo.clone_from(str(ws), clone, branch="main")
    repo = git.Repo(clone)
    repo.git.checkout("stock")
    with repo.config_writer() as w:
        w.set_value("user", "name", "T").set_value("user", "email", "t@localhost")
    repo.git.am(*map(str, patches))
    # A second run finds the round done and prints the same result without measuring again.
    again = _demo("--workspace", str(ws), timeout=600)
    assert again.returncode == 0 and again.stdout.splitlines()[0] == out[0], again.stderr[-2000:]


def test_native_bf16_is_read_from_the_cpu_flags(tmp_path: Path):
    from decoder.capabilities import native_bf16_cpu

    cases = {"flags\t\t: fpu avx2 avx512f avx512bw amx_bf16 amx_tile\n": True,
             "flags\t\t: fpu avx2 avx512_bf16\n": True,
             "flags\t\t: fpu avx2 avx512f avx512bw avx512vl avx512dq\n": False,
             "Features\t: fp asimd bf16 i8mm\n": True,
             "processor\t: 0\n": None}
    for i, (text, want) in enumerate(cases.items()):
        (tmp_path / f"c{i}").write_text(text)
        assert native_bf16_cpu(tmp_path / f"c{i}") is want, text
    assert native_bf16_cpu(tmp_path / "missing") is None


def test_auto_dtype_is_float32_only_where_the_cpu_lacks_native_bf16(tmp_path: Path):
    from workbench.workspace import WorkspaceError, resolve_dtype

    amx, plain, unknown = tmp_path / "amx", tmp_path / "plain", tmp_path / "unknown"
    amx.write_text("flags\t\t: fpu avx512f amx_bf16 amx_tile\n")
    plain.write_text("flags\t\t: fpu avx512f avx512bw avx512_vnni\n")
    unknown.write_text("processor\t: 0\n")
    for given in (None, "auto"):
        assert resolve_dtype(given, amx) == ("bfloat16", None)
        assert resolve_dtype(given, unknown) == ("bfloat16", None)
        dtype, note = resolve_dtype(given, plain)
        assert dtype == "float32" and note.startswith("note: float32: this CPU has no native bfloat16")
        assert "--dtype bfloat16" in note and "\n" not in note
    assert resolve_dtype("bfloat16", plain) == ("bfloat16", None)  # asked for: kept
    assert resolve_dtype("float32", amx) == ("float32", None)
    with pytest.raises(WorkspaceError, match="--dtype half: choose one of auto, bfloat16, float32"):
        resolve_dtype("half", amx)


@needs_demo
def test_init_demo_dtype_reaches_system_and_stock_and_bad_values_are_one_line(tmp_path: Path):
    """`init demo --dtype float32` makes a float32 system and stock, no --dtype the CPU's choice; a bad dtype,
    --dtype beside --target, and `demo --dtype` on a workspace made in another dtype are one line, exit 2, nothing
    created."""
    from workbench.workspace import Workspace, auto_dtype

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True,
                              timeout=120)

    r = cli("init", "demo", str(tmp_path / "f32"), "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    ws = Workspace(tmp_path / "f32")
    assert ws.config.dtype == "float32" and ws.config_at(ws.stock_commit)["dtype"] == "float32"
    assert "note: this CPU has no native bfloat16" not in r.stderr  # the hint is for bfloat16 only
    # Without --dtype the CPU decides: float32 (with a note saying why) where it has no native bfloat16.
    r = cli("init", "demo", str(tmp_path / "auto"))
    assert r.returncode == 0, r.stderr
    assert Workspace(tmp_path / "auto").config.dtype == auto_dtype()
    assert ("note: float32: this CPU has no native bfloat16" in r.stderr) == (auto_dtype() == "float32"), r.stderr
    for argv, msg in ((("init", "demo", str(tmp_path / "h"), "--dtype", "float16"), "--dtype float16: choose one of"),
                      (("init", "--target", str(tmp_path), str(tmp_path / "t"), "--dtype", "float32"),
                       "--dtype float32 goes with `specpilot init demo"),
                      (("demo", "--workspace", str(tmp_path / "h2"), "--dtype", "half"), "--dtype half: choose one"),
                      (("demo", "--workspace", str(tmp_path / "f32"), "--dtype", "bfloat16", "--budget-minutes", "1"),
                       "was made in float32")):
        r = cli(*argv)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and msg in r.stderr, (argv, r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auto", "f32"]
