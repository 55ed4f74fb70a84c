"""What every agent gets and gives back.

An agent works on one branch, in its own worktree, against one direction (a gap family with its
measured gap, the decoder's mechanisms for it and the mechanisms memory holds for it). It commits
its change on the branch and returns an `AgentResult`; the round's evaluation cascade (not the
agent) then decides whether the change is kept. Agents see the visible prompts only.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import git

from workbench.safegit import worktree_git


@dataclass
class Direction:
    family: str  # a gap family (costmodel.gaps.FAMILIES)
    gap_ms: float  # measured ms per generated token the family loses against its ceiling
    summary: str  # one line from the cost model
    mechanisms: list[dict[str, Any]] = field(default_factory=list)  # registry entries for the family
    memory: list[dict[str, Any]] = field(default_factory=list)  # accepted mechanisms (name, summary, patch, evidence)

    def as_dict(self) -> dict[str, Any]:
        return {"family": self.family, "gap_ms": self.gap_ms, "summary": self.summary,
                "mechanisms": self.mechanisms, "memory": self.memory}


@dataclass
class SmokeResult:
    ok: bool
    message: str  # one line: tokens/s and match against stock on one visible prompt, or the failure


@dataclass
class AgentContext:
    branch: str
    worktree: Path
    direction: Direction
    gap_breakdown: list[dict[str, Any]]  # the cost model's ranked gaps for the current base
    visible_prompts: list[dict[str, Any]]  # {"id", "text"}: never the hidden split
    smoke: Callable[[], SmokeResult]  # run the worktree's committed system on one visible prompt
    log: Callable[[str, str, dict[str, Any]], None]  # (kind, message, payload) into the store's ledger
    steering: queue.Queue[str] = field(default_factory=queue.Queue)  # engineer's messages, read each turn
    stop: threading.Event = field(default_factory=threading.Event)  # set: finish as soon as possible
    # The main repository's git dir (trusted); None: the workspace layout's, WS/.git for
    # WS/.specpilot/worktrees/NAME. Never discovered from the worktree's own `.git`, which the candidate controls.
    git_common_dir: Path | None = None
    # time.monotonic() by which the agent must have returned (the loop's budget); None: only its own budgets
    deadline: float | None = None

    def git(self) -> git.Git:
        """Hardened git for this worktree (see `workbench.safegit`)."""
        common = self.git_common_dir or self.worktree.parent.parent.parent / ".git"
        return worktree_git(common, self.worktree)


@dataclass
class AgentResult:
    committed: bool  # a commit on the branch is ready for evaluation
    message: str  # one line: what was changed, or why nothing was
    mechanism: str = ""  # a short name for the change (becomes the mechanism's name if kept)
    summary: str = ""
    details: dict[str, Any] = field(default_factory=dict)


class Agent(Protocol):
    name: str  # "tuner" or "llm"

    def run(self, ctx: AgentContext) -> AgentResult:
        """Work on ctx.worktree, commit on ctx.branch, return what was done."""
        ...
