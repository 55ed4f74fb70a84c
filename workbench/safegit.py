"""Git on candidate worktrees without candidate-controlled configuration.

A candidate controls every file in its worktree, the worktree's `.git` file included: pointed at a
repository of its own, that repository's config (`core.fsmonitor`, `core.hooksPath`, `core.pager`,
`diff.external`, filter drivers, ...) would run the candidate's programs as the workbench's user the
next time the host runs `git status` there. So no git command here ever discovers its repository
from a worktree: the git dir is the main repository's administrative folder for that worktree, found
from the main repository (`<common>/worktrees/*/gitdir`), and passed with the work tree explicitly;
on top, every command runs with the keys that start programs forced off. Diffs with content pass
`--no-ext-diff`.
"""

from __future__ import annotations

import os
from pathlib import Path

import git

# Each of these makes git start a program named in configuration, or read configuration beyond the
# repository's own: forced off for every command on a worktree (defence in depth: the git dir is ours).
HARDENING = (
    "core.fsmonitor=false",
    "core.hooksPath=/dev/null",
    "core.pager=cat",
    "core.editor=false",
    "core.askPass=false",
    "core.sshCommand=false",
    "core.untrackedCache=false",
    "core.attributesFile=/dev/null",
    "sequence.editor=false",
    "commit.gpgSign=false",
    "tag.gpgSign=false",
    "credential.helper=",
    "filter.lfs.clean=",
    "filter.lfs.smudge=",
    "filter.lfs.process=",
    "filter.lfs.required=false",
    "protocol.allow=never",
)
class SafeGitError(Exception):
    """A worktree the main repository does not know (never guessed from the worktree's own files)."""


def worktree_admin_dir(common_dir: Path, worktree: Path) -> Path:
    """The main repository's administrative folder for `worktree`, read from the main repository only."""
    want = os.path.realpath(worktree)
    root = Path(common_dir) / "worktrees"
    if root.is_dir():
        for d in sorted(root.iterdir()):
            try:
                gitdir = (d / "gitdir").read_text().strip()
            except OSError:
                continue
            if os.path.realpath(os.path.dirname(gitdir)) == want:
                return d
    raise SafeGitError(f"{worktree} is not a registered worktree of {common_dir}; "
                       f"`specpilot branch recover` re-creates lost worktrees")


def hardened(git_dir: Path, work_tree: Path) -> git.Git:
    """A `git.Git` bound to `git_dir` and `work_tree` (both chosen by the caller) with HARDENING applied."""
    g = git.Git(str(work_tree))
    # Explicit values win over whatever the caller's environment says (a GIT_DIR exported in a shell).
    g.update_environment(GIT_DIR=str(git_dir), GIT_WORK_TREE=str(work_tree),
                         GIT_INDEX_FILE=str(Path(git_dir) / "index"), GIT_CONFIG_COUNT="0", GIT_PAGER="cat",
                         GIT_EDITOR="false", GIT_TERMINAL_PROMPT="0", GIT_OPTIONAL_LOCKS="0")
    g.set_persistent_git_options(c=list(HARDENING))
    return g


def worktree_git(common_dir: Path, worktree: Path) -> git.Git:
    """Hardened git for a linked worktree of the repository whose common git dir is `common_dir`."""
    return hardened(worktree_admin_dir(common_dir, worktree), worktree)
