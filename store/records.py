"""Typed rows of the memory, one frozen dataclass per table; JSON columns arrive decoded."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Deployment:
    """A target model, a drafter, a machine and a serving regime."""

    id: int
    name: str
    target: str
    drafter: str | None
    hardware: str | None
    dtype: str | None
    regime: dict[str, Any]
    fingerprint: str | None
    created_at: str


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """A stored hardware profile (datasheet or measured), as costmodel writes it."""

    id: int
    name: str
    profile: dict[str, Any]
    created_at: str


@dataclass(frozen=True, slots=True)
class BenchRun:
    """One method benchmarked on one deployment, with its phase timings and full report."""

    id: int
    deployment_id: int
    method: str
    config: dict[str, Any]
    tokens_per_s: float | None
    tau: float | None
    speedup: float | None
    phase_timings: dict[str, Any]
    report: dict[str, Any]
    created_at: str


@dataclass(frozen=True, slots=True)
class Round:
    """One round of the loop on a deployment: branches launched from `base_commit`."""

    id: int
    deployment_id: int
    number: int
    status: str
    base_commit: str | None
    summary: dict[str, Any]
    created_at: str
    updated_at: str


@dataclass(frozen=True, slots=True)
class Branch:
    """A candidate: an agent's git branch (and worktree) in a round, exploring one direction."""

    id: int
    round_id: int
    name: str
    agent: str
    direction: str
    status: str
    head_commit: str | None
    worktree_path: str | None
    created_at: str
    updated_at: str


@dataclass(frozen=True, slots=True)
class Evaluation:
    """One stage of the harness on a branch: keep, discard, crash or rejected, with a one-line reason."""

    id: int
    branch_id: int
    stage: str
    status: str
    reason: str
    metrics: dict[str, Any]
    created_at: str


@dataclass(frozen=True, slots=True)
class ForcingReport:
    """Token forcing of a branch against stock: every position checked, each mismatch kept."""

    id: int
    branch_id: int
    evaluation_id: int | None
    match_rate: float
    positions_checked: int
    mismatches: list[dict[str, Any]]
    details: dict[str, Any]
    created_at: str


@dataclass(frozen=True, slots=True)
class Mechanism:
    """A named, validated change with its patch, its evidence per deployment and the reviewer's verdict."""

    id: int
    uid: str
    name: str
    gap_family: str
    summary: str
    notes: str
    patch: str
    status: str
    reviewer_note: str
    evidence: list[dict[str, Any]]
    created_at: str
    updated_at: str


@dataclass(frozen=True, slots=True)
class Event:
    """One line of the append-only ledger."""

    id: int
    ts: str
    kind: str
    message: str
    payload: dict[str, Any]


# Columns holding JSON text, per record type.
JSON_FIELDS: dict[type, tuple[str, ...]] = {
    Deployment: ("regime",),
    HardwareProfile: ("profile",),
    BenchRun: ("config", "phase_timings", "report"),
    Round: ("summary",),
    Evaluation: ("metrics",),
    ForcingReport: ("mismatches", "details"),
    Mechanism: ("evidence",),
    Event: ("payload",),
}


def from_row(cls: type[T], row: dict[str, Any]) -> T:
    """Build a record from a row dict, decoding its JSON columns; extra columns (e.g. FTS rank) are ignored."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    values = {n: row[n] for n in names}
    for n in JSON_FIELDS.get(cls, ()):
        values[n] = json.loads(values[n])
    return cls(**values)


def to_dict(record: Any) -> dict[str, Any]:
    """A record as a plain JSON-ready dict."""
    return dataclasses.asdict(record)
