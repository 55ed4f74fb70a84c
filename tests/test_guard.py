"""The evaluated tree is exactly the branch's committed sources (the guard before any stage runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_safegit import _workspace


def _commit(ws, name: str, files: dict[str, bytes | str], force_add: bool = False) -> None:
    ws.create_branch(name)
    wt = ws.worktree_path(name)
    for rel, data in files.items():
        f = wt / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data) if isinstance(data, bytes) else f.write_text(data)
    g = ws.worktree_git(name)
    g.add("-f" if force_add else "-A", *files)
    g.commit("-q", "-m", f"candidate {name}")


@pytest.fixture
def ws(tmp_path: Path):
    w = _workspace(tmp_path / "ws")
    for rel, text in {"decoder/serve.py": "print('serve')\n", "decoder/generate.py": "x = 1\n",
                      ".gitignore": ".specpilot/\n__pycache__/\n*.pyc\nbuild/\n"}.items():
        (w.path / rel).parent.mkdir(parents=True, exist_ok=True)
        (w.path / rel).write_text(text)
    w.repo.git.add("-A")
    w.repo.git.commit("-q", "-m", "stock sources")
    w.repo.git.tag("-f", "stock")
    w.config.protected = ["specpilot.toml", "decoder/serve.py", ".gitignore"]
    yield w
    w.close()


@pytest.mark.parametrize("files", [
    {"decoder/serve/__init__.py": "print('not stock serve')\n"},  # a package shadows the protected module
    {"decoder/serve.cpython-311-x86_64-linux-gnu.so": b"\x7fELF"},  # an extension module shadows it
    {"decoder/__pycache__/serve.cpython-311.pyc": b"\x00" * 16},  # unchecked-hash bytecode shadows it
])
def test_shadows_of_a_protected_module_are_rejected(ws, files):
    _commit(ws, "shadow", files, force_add=True)
    why = ws.guard("shadow")
    assert why and why.startswith("touches protected path"), why


@pytest.mark.parametrize("files", [
    {"decoder/__pycache__/generate.cpython-311.pyc": b"\x00" * 16},
    {"decoder/fast.so": b"\x7fELF"},
    {"build/cache.py": "x = 2\n"},
])
def test_bytecode_binaries_and_ignored_paths_are_rejected(ws, files):
    _commit(ws, "bin", files, force_add=True)
    why = ws.guard("bin")
    assert why and why.startswith("commits bytecode, binaries or ignored paths"), why


def test_untracked_is_rejected_and_ignored_leftovers_are_deleted(ws):
    _commit(ws, "ok", {"decoder/generate.py": "x = 2\n"})
    wt = ws.worktree_path("ok")
    (wt / "decoder" / "__pycache__").mkdir()
    left = wt / "decoder" / "__pycache__" / "generate.cpython-311.pyc"
    left.write_bytes(b"\x00" * 16)  # written by an earlier run: ignored, so invisible to `git status`
    assert ws.guard("ok") is None
    assert not left.exists()
    (wt / "extra.py").write_text("y = 1\n")
    why = ws.guard("ok")
    assert why and why.startswith("uncommitted changes") and "extra.py" in why
