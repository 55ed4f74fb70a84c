"""Mechanisms as git patches: record a branch as a mechanism, export mechanisms as a patch series.

A mechanism's patch is `git format-patch` text of its branch's commits on top of the base it was
made from. Export replays the chosen mechanisms on stock with `git am --3way` in a scratch
worktree, then writes the result as one `git format-patch` series, so `git am` on a fresh clone of
stock applies it cleanly; `--branch NAME` keeps the result as a branch of the workspace. For a workspace
carrying its engine's source (`engine/llama.cpp/`), `--upstream DIR` also writes the engine part of the
series with paths relative to the engine's root: `git am` applies it to an upstream checkout of the engine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import git

from store import Mechanism
from workbench.engine_source import SOURCE_REL
from workbench.safegit import worktree_git
from workbench.workspace import STOCK_TAG, Workspace, WorkspaceError


def branch_patch(ws: Workspace, branch: str, base: str = STOCK_TAG) -> str:
    """The branch's commits since `base` as `git format-patch --stdout` text."""
    b = ws.branch(branch)
    if ws.uncommitted(b.name):
        raise WorkspaceError(f"branch {branch} has uncommitted changes; commit them before recording it")
    patch = ws.repo.git.format_patch("--stdout", "--no-signature", f"{base}..{branch}")
    if not patch.strip():
        raise WorkspaceError(f"branch {branch} has no commits on top of {base}; nothing to record")
    return patch + "\n"


def record_mechanism(ws: Workspace, branch: str, name: str, gap_family: str, summary: str, *,
                     notes: str = "", evidence: Mapping[str, Any] | None = None, base: str = STOCK_TAG) -> Mechanism:
    """A candidate mechanism from a branch (its commits since `base`), with the branch's latest forcing
    result as evidence unless `evidence` is given."""
    b = ws.branch(branch)
    patch = branch_patch(ws, branch, base)
    items = []
    if evidence is not None:
        items.append(dict(evidence))
    else:
        reports = ws.memory.list_forcing_reports(b.id)
        if reports:
            r = reports[-1]
            items.append({"deployment": ws.config.name, "branch": branch, "match_rate": r.match_rate,
                          "positions_checked": r.positions_checked,
                          "unexplained": r.details.get("unexplained"),
                          "tokens_per_s": r.details.get("timing", {}).get("tokens_per_s")})
    m = ws.memory.add_mechanism(name, gap_family, summary, notes=notes, patch=patch, evidence=items)
    ws.memory.record_event("mechanism.recorded", f"mechanism {m.id} ({name}) from branch {branch}",
                           {"mechanism_id": m.id, "branch": branch})
    return m


def _writable(folder: Path) -> None:
    """`folder` exists and takes files, or a one-line WorkspaceError naming it (before anything is written)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WorkspaceError(f"cannot create the patch folder {folder} ({e.strerror})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise WorkspaceError(f"the patch folder {folder} is not writable; pick another with --out/--upstream")


def export(ws: Workspace, mechanisms: list[Mechanism], out: Path | None, branch: str | None = None,
           upstream: Path | None = None) -> list[Path]:
    """Replay `mechanisms` on stock in order and write the series to `out` (and/or keep it as `branch`);
    `upstream`: also the series' changes to the engine source, relative to the engine's root."""
    if upstream is not None and not ws.config.engine_source:
        raise WorkspaceError("--upstream needs a workspace carrying its engine's source (`specpilot init --engine "
                             "llama.cpp ... --with-source`)")
    if not mechanisms:
        raise WorkspaceError("no mechanisms to export (none accepted yet? see `specpilot memory list`)")
    if branch and branch in ws.repo.heads:
        raise WorkspaceError(f"branch {branch!r} already exists; pick another name")
    for folder in (out, upstream):  # both take files, or nothing is written
        if folder is not None:
            _writable(folder)
    scratch = Path(tempfile.mkdtemp(prefix="specpilot-export-"))
    wt = scratch / "wt"
    ws.repo.git.worktree("add", "--detach", str(wt), ws.stock_commit)
    try:
        wrepo = worktree_git(Path(ws.repo.git_dir), wt)  # patches are candidate text: no hooks, no filters
        for m in mechanisms:
            if not m.patch.strip():
                raise WorkspaceError(f"mechanism {m.id} ({m.name}) has no patch to export")
            pfile = scratch / f"{m.id}.patch"
            pfile.write_text(m.patch)
            try:
                wrepo.am("--3way", "--keep-cr", str(pfile))
            except git.GitCommandError as e:
                wrepo.am("--abort")
                first = (e.stderr or "").strip().splitlines()
                raise WorkspaceError(f"mechanism {m.id} ({m.name}) does not apply on stock plus the ones before "
                                     f"it: {first[0] if first else e}") from None
        if upstream is not None and not wrepo.diff("--name-only", f"{ws.stock_commit}..HEAD", "--", SOURCE_REL):
            raise WorkspaceError(f"the mechanisms change nothing under {SOURCE_REL}/: no engine patch to write")
        written: list[Path] = []
        if out is not None:
            names = wrepo.format_patch("--no-signature", "-o", str(out.resolve()),
                                       f"{ws.stock_commit}..HEAD").splitlines()
            written = [Path(n) for n in names if n.strip()]
        if upstream is not None:
            names = wrepo.format_patch("--no-signature", f"--relative={SOURCE_REL}", "-o", str(upstream.resolve()),
                                       f"{ws.stock_commit}..HEAD", "--", SOURCE_REL).splitlines()
            written += [Path(n) for n in names if n.strip()]
        if branch:
            ws.repo.create_head(branch, wrepo.rev_parse("HEAD").strip())
        return written
    finally:
        ws.repo.git.worktree("remove", "--force", str(wt))
        shutil.rmtree(scratch, ignore_errors=True)
