"""A candidate controls its worktree's `.git`: no git the workbench runs there may use its configuration.

Each case plants, inside a branch's worktree, a repository of the candidate's own whose config names a
program (fsmonitor, hooks, pager, external diff, a filter driver), points the worktree's `.git` file at
it, and then drives every workbench path that runs git on that worktree. The program writes a marker
file when run; the marker must never appear.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import git
import pytest

from workbench.agents.base import AgentContext, Direction, SmokeResult
from workbench.safegit import SafeGitError, worktree_admin_dir, worktree_git
from workbench.workspace import Workspace, WorkspaceError

TOML = """[deployment]
name = "t"
target = "models/target"

[system]
entry = ["{python}", "-m", "decoder.serve"]
config = "system.toml"
protected = ["specpilot.toml"]
"""

ATTACKS = {
    "fsmonitor": "[core]\n\tfsmonitor = {evil}\n",
    "hooksPath": "[core]\n\thooksPath = {hooks}\n",
    "pager": "[core]\n\tpager = {evil}\n[pager]\n\tstatus = true\n\tdiff = true\n",
    "diff.external": "[diff]\n\texternal = {evil}\n",
    "filter": "[filter \"x\"]\n\tclean = {evil}\n\tsmudge = {evil}\n\trequired = true\n",
}


def _workspace(root: Path) -> Workspace:
    root.mkdir()
    (root / "specpilot.toml").write_text(TOML)
    (root / "system.toml").write_text('[decode]\nmethod = "sd"\n')
    (root / ".gitignore").write_text(".specpilot/\n")
    repo = git.Repo.init(root, initial_branch="main")
    with repo.config_writer() as w:
        w.set_value("user", "name", "T").set_value("user", "email", "t@localhost")
    repo.git.add("-A")
    repo.index.commit("stock")
    repo.create_tag("stock")
    return Workspace(root)


def _plant(wt: Path, attack: str, marker: Path) -> None:
    """The candidate's move: its own repository inside the worktree, with config that runs `evil`."""
    evil = wt / "evil.sh"
    evil.write_text(f"#!/bin/sh\necho pwned >> {marker}\ncat\n")
    evil.chmod(evil.stat().st_mode | stat.S_IEXEC)
    hooks = wt / "hooks"
    hooks.mkdir()
    for h in ("pre-commit", "commit-msg", "post-commit", "post-checkout", "pre-applypatch", "post-merge"):
        (hooks / h).write_text(f"#!/bin/sh\necho pwned >> {marker}\n")
        (hooks / h).chmod(0o755)
    own = git.Repo.init(wt / "own.git", bare=True)
    own.close()
    with (wt / "own.git" / "config").open("a") as f:
        f.write(ATTACKS[attack].format(evil=evil, hooks=hooks))
    (wt / ".gitattributes").write_text("* filter=x diff=x\n")
    (wt / ".git").write_text(f"gitdir: {wt / 'own.git'}\n")
    (wt / "system.toml").write_text('[decode]\nmethod = "ar"\n')  # something to see, diff and commit


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_replaced_dot_git_never_runs_candidate_config(tmp_path: Path, attack: str):
    ws = _workspace(tmp_path / "ws")
    marker = tmp_path / "marker"
    try:
        ws.create_branch("cand")
        wt = ws.worktree_path("cand")
        _plant(wt, attack, marker)
        dirty = ws.uncommitted("cand")  # the forcing guard's first call
        assert "system.toml" in dirty
        ws.changed_paths("cand")
        g = ws.worktree_git("cand")
        g.diff("--no-ext-diff", "HEAD")
        g.add("system.toml")
        g.commit("-q", "-m", "candidate commit through the workbench's git")
        ctx = AgentContext("cand", wt, Direction("drafting", 1.0, "x"), [], [], lambda: SmokeResult(True, ""),
                           lambda *a: None)
        ctx.git().status("--porcelain")
        ws.detached_worktree("cand-copy", ws.rev("cand"))  # a fresh internal worktree of the candidate's commit
        ws.detached_worktree("cand-copy", ws.rev("stock"))  # and re-used (checkout + clean)
    finally:
        ws.close()
    assert not marker.exists(), f"{attack}: a host git ran the candidate's program"


def test_admin_dir_comes_from_the_main_repository(tmp_path: Path):
    ws = _workspace(tmp_path / "ws")
    try:
        ws.create_branch("a")
        wt = ws.worktree_path("a")
        admin = worktree_admin_dir(Path(ws.repo.git_dir), wt)
        assert admin.parent == Path(ws.repo.git_dir) / "worktrees"
        (wt / ".git").write_text(f"gitdir: {tmp_path}\n")  # the candidate's claim does not move it
        assert worktree_admin_dir(Path(ws.repo.git_dir), wt) == admin
        with pytest.raises(SafeGitError, match="not a registered worktree"):
            worktree_git(Path(ws.repo.git_dir), tmp_path)
        with pytest.raises(WorkspaceError, match="branch recover"):
            ws.worktree_git("never-created")
    finally:
        ws.close()


def test_git_environment_from_the_host_does_not_leak_in(tmp_path: Path, monkeypatch):
    ws = _workspace(tmp_path / "ws")
    marker = tmp_path / "marker"
    try:
        ws.create_branch("a")
        monkeypatch.setenv("GIT_DIR", str(tmp_path))
        monkeypatch.setenv("GIT_EDITOR", f"sh -c 'echo x > {marker}'")
        g = ws.worktree_git("a")
        (ws.worktree_path("a") / "system.toml").write_text("x = 1\n")
        assert "system.toml" in g.diff("--name-only")
        assert ws.uncommitted("a") == ["system.toml"]
        g.add("system.toml")
        with pytest.raises(git.GitCommandError):
            g.commit("-q")  # would open the editor for a message: refused, not run
    finally:
        ws.close()
    assert not marker.exists()
    assert os.environ["GIT_DIR"] == str(tmp_path)  # the caller's environment is left as it was
