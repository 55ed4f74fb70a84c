"""The repository API over one memory database: add / get / list per table family, search, review, ledger.

    mem = Memory(workspace_memory_path(ws))          # creates and migrates the file if needed
    dep = mem.add_deployment("demo", target="demo/target", drafter="demo/drafter", dtype="bfloat16")
    ev = mem.add_evaluation(branch.id, "forcing", "discard", "3 real mismatches", forcing=report)

A `Memory` may be shared by threads: each thread gets its own connection. Every write method is one
transaction; wrap several in `with mem.transaction():` to make them land together or not at all.
Getters raise `NotFound`; bad arguments raise `ValueError`; a locked or broken file raises `StoreError`.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import sqlite_utils

from store.db import NotFound, connect, migrate, schema_version, transaction
from store.migrations import EVALUATION_STATUSES, GAP_FAMILIES, MECHANISM_STATUSES
from store.records import (
    BenchRun,
    Branch,
    Deployment,
    Evaluation,
    Event,
    ForcingReport,
    HardwareProfile,
    Mechanism,
    Round,
    from_row,
)

T = TypeVar("T")
_NOW_SQL = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"

# Connections inherited through fork() are never closed in the child: closing one there could
# checkpoint or unlink files the parent still uses. Keeping a reference stops the GC from closing them.
_inherited: list[sqlite_utils.Database] = []


def _json(value: Any, field: str) -> str:
    try:
        return json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{field}: cannot store {type(value).__name__} as JSON ({e})") from None


def _one_line(text: str, field: str) -> str:
    line = " ".join(str(text).split())  # stderr tails arrive multi-line; the ledger keeps one line per attempt
    if not line:
        raise ValueError(f"{field} must not be empty: say in one line why")
    return line


def _choice(value: str, allowed: tuple[str, ...], field: str) -> str:
    if value not in allowed:
        raise ValueError(f"{field} {value!r} is not one of {', '.join(allowed)}")
    return value


def _check_evidence(item: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(item, Mapping) or not isinstance(item.get("deployment"), str) or not item["deployment"]:
        raise ValueError(f"evidence must be a mapping with a 'deployment' name, got {item!r}")
    speedup = item.get("speedup")
    if speedup is not None and not (isinstance(speedup, int | float) and math.isfinite(speedup)):
        raise ValueError(f"evidence speedup must be a finite number, got {speedup!r}")
    return dict(item)


class Memory:
    """One memory database (a workspace's or the global one), usable from many threads."""

    def __init__(self, path: str | Path, *, create: bool = True) -> None:
        """Open `path` (creating it if `create`) and bring its schema to the latest version."""
        self.path = Path(path)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: weakref.WeakSet[sqlite_utils.Database] = weakref.WeakSet()
        self._pid = os.getpid()
        try:
            migrate(self._connect(create=create))
        except BaseException:  # no connection left open behind a failed open
            self.close()
            raise

    # -- connections and transactions ------------------------------------------------------------------

    def _connect(self, *, create: bool = True) -> sqlite_utils.Database:
        db = connect(self.path, create=create)
        self._local.db, self._local.pid = db, os.getpid()
        with self._lock:
            self._open.add(db)
        return db

    @property
    def db(self) -> sqlite_utils.Database:
        """This thread's connection (sqlite-utils Database), opened on first use."""
        db = getattr(self._local, "db", None)
        if db is not None and self._local.pid == os.getpid():
            return db
        if db is not None:
            _inherited.append(db)
        return self._connect()

    @contextmanager
    def transaction(self) -> Iterator[sqlite_utils.Database]:
        """Writes inside land together or not at all (nested: a savepoint)."""
        with transaction(self.db) as db:
            yield db

    @property
    def version(self) -> int:
        """The schema version (number of migrations applied)."""
        return schema_version(self.db)

    def close(self) -> None:
        """Close every thread's connection to this file."""
        with self._lock:
            dbs = list(self._open) if os.getpid() == self._pid else []
            self._open = weakref.WeakSet()
        for db in dbs:
            db.close()
        self._local = threading.local()

    def __enter__(self) -> Memory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Memory({str(self.path)!r})"

    # -- helpers ---------------------------------------------------------------------------------------

    def _insert(self, table: str, row: Mapping[str, Any]) -> int:
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        return self.db.execute(f"INSERT INTO {table} ({cols}) VALUES ({marks})", list(row.values())).lastrowid

    def _get(self, cls: type[T], table: str, what: str, id: int) -> T:
        rows = list(self.db.query(f"SELECT * FROM {table} WHERE id = ?", [id]))
        if not rows:
            raise NotFound(f"no {what} with id {id} in {self.path}")
        return from_row(cls, rows[0])

    def _list(self, cls: type[T], table: str, where: Mapping[str, Any], order: str = "id",
              limit: int | None = None) -> list[T]:
        conds = [f"{col} = ?" for col, v in where.items() if v is not None]
        args = [v for v in where.values() if v is not None]
        sql = f"SELECT * FROM {table}" + (f" WHERE {' AND '.join(conds)}" if conds else "") + f" ORDER BY {order}"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return [from_row(cls, r) for r in self.db.query(sql, args)]

    def _insert_and_get(self, cls: type[T], table: str, what: str, row: Mapping[str, Any]) -> T:
        try:
            with self.transaction():
                new_id = self._insert(table, row)
                return self._get(cls, table, what, new_id)
        except sqlite3.IntegrityError as e:
            raise ValueError(f"cannot add {what}: {e}") from None

    # -- deployments and hardware ----------------------------------------------------------------------

    def add_deployment(self, name: str, target: str, *, drafter: str | None = None, hardware: str | None = None,
                       dtype: str | None = None, regime: Mapping[str, Any] | None = None,
                       fingerprint: str | None = None) -> Deployment:
        """Record a deployment; `name` is unique in this memory."""
        return self._insert_and_get(Deployment, "deployments", "deployment", {
            "name": name, "target": target, "drafter": drafter, "hardware": hardware, "dtype": dtype,
            "regime": _json(dict(regime or {}), "regime"), "fingerprint": fingerprint})

    def get_deployment(self, id: int) -> Deployment:
        """The deployment with this id."""
        return self._get(Deployment, "deployments", "deployment", id)

    def find_deployment(self, name: str) -> Deployment | None:
        """The deployment called `name`, or None."""
        found = self._list(Deployment, "deployments", {"name": name})
        return found[0] if found else None

    def list_deployments(self) -> list[Deployment]:
        """Every deployment, oldest first."""
        return self._list(Deployment, "deployments", {})

    def add_hardware_profile(self, name: str, profile: Mapping[str, Any]) -> HardwareProfile:
        """Store a hardware profile (costmodel's JSON) under a unique name."""
        return self._insert_and_get(HardwareProfile, "hardware_profiles", "hardware profile",
                                    {"name": name, "profile": _json(dict(profile), "profile")})

    def get_hardware_profile(self, id: int) -> HardwareProfile:
        """The hardware profile with this id."""
        return self._get(HardwareProfile, "hardware_profiles", "hardware profile", id)

    def find_hardware_profile(self, name: str) -> HardwareProfile | None:
        """The hardware profile called `name`, or None."""
        found = self._list(HardwareProfile, "hardware_profiles", {"name": name})
        return found[0] if found else None

    def list_hardware_profiles(self) -> list[HardwareProfile]:
        """Every stored hardware profile."""
        return self._list(HardwareProfile, "hardware_profiles", {})

    # -- bench runs ------------------------------------------------------------------------------------

    def add_bench_run(self, deployment_id: int, method: str, *, config: Mapping[str, Any] | None = None,
                      tokens_per_s: float | None = None, tau: float | None = None, speedup: float | None = None,
                      phase_timings: Mapping[str, Any] | None = None,
                      report: Mapping[str, Any] | None = None) -> BenchRun:
        """Record one benchmarked method with its phase timings (ms per token) and the full report."""
        return self._insert_and_get(BenchRun, "bench_runs", "bench run", {
            "deployment_id": deployment_id, "method": method, "config": _json(dict(config or {}), "config"),
            "tokens_per_s": tokens_per_s, "tau": tau, "speedup": speedup,
            "phase_timings": _json(dict(phase_timings or {}), "phase_timings"),
            "report": _json(dict(report or {}), "report")})

    def get_bench_run(self, id: int) -> BenchRun:
        """The bench run with this id."""
        return self._get(BenchRun, "bench_runs", "bench run", id)

    def list_bench_runs(self, deployment_id: int | None = None, method: str | None = None) -> list[BenchRun]:
        """Bench runs, oldest first, optionally of one deployment and/or method."""
        return self._list(BenchRun, "bench_runs", {"deployment_id": deployment_id, "method": method})

    # -- rounds and branches ---------------------------------------------------------------------------

    def add_round(self, deployment_id: int, *, number: int | None = None, status: str = "running",
                  base_commit: str | None = None, summary: Mapping[str, Any] | None = None) -> Round:
        """Start a round; `number` defaults to one past the deployment's last."""
        with self.transaction():  # the write lock makes "last + 1" safe against a concurrent add
            if number is None:
                last = self.db.execute("SELECT max(number) FROM rounds WHERE deployment_id = ?",
                                       [deployment_id]).fetchone()[0]
                number = (last or 0) + 1
            return self._insert_and_get(Round, "rounds", "round", {
                "deployment_id": deployment_id, "number": number, "status": status, "base_commit": base_commit,
                "summary": _json(dict(summary or {}), "summary")})

    def get_round(self, id: int) -> Round:
        """The round with this id."""
        return self._get(Round, "rounds", "round", id)

    def list_rounds(self, deployment_id: int | None = None) -> list[Round]:
        """Rounds in order, optionally of one deployment."""
        return self._list(Round, "rounds", {"deployment_id": deployment_id}, order="deployment_id, number")

    def update_round(self, id: int, *, status: str | None = None, summary: Mapping[str, Any] | None = None) -> Round:
        """Change a round's status and/or replace its summary."""
        return self._update(Round, "rounds", "round", id, {
            "status": status, "summary": None if summary is None else _json(dict(summary), "summary")})

    def add_branch(self, round_id: int, name: str, *, agent: str, direction: str = "", status: str = "created",
                   head_commit: str | None = None, worktree_path: str | Path | None = None) -> Branch:
        """Record a candidate branch of a round (name unique within the round)."""
        return self._insert_and_get(Branch, "branches", "branch", {
            "round_id": round_id, "name": name, "agent": agent, "direction": direction, "status": status,
            "head_commit": head_commit, "worktree_path": None if worktree_path is None else str(worktree_path)})

    def get_branch(self, id: int) -> Branch:
        """The branch with this id."""
        return self._get(Branch, "branches", "branch", id)

    def list_branches(self, round_id: int | None = None, status: str | None = None) -> list[Branch]:
        """Branches, oldest first, optionally of one round and/or in one status."""
        return self._list(Branch, "branches", {"round_id": round_id, "status": status})

    def update_branch(self, id: int, *, status: str | None = None, head_commit: str | None = None,
                      worktree_path: str | Path | None = None) -> Branch:
        """Change a branch's status, head commit and/or worktree path (None leaves a field as it is)."""
        return self._update(Branch, "branches", "branch", id, {
            "status": status, "head_commit": head_commit,
            "worktree_path": None if worktree_path is None else str(worktree_path)})

    def _update(self, cls: type[T], table: str, what: str, id: int, changes: Mapping[str, Any]) -> T:
        changes = {k: v for k, v in changes.items() if v is not None}
        with self.transaction():
            self._get(cls, table, what, id)  # NotFound rather than a silent no-op
            if changes:
                sets = ", ".join(f"{k} = ?" for k in changes)
                self.db.execute(f"UPDATE {table} SET {sets}, updated_at = {_NOW_SQL} WHERE id = ?",
                                [*changes.values(), id])
            return self._get(cls, table, what, id)

    # -- evaluations and forcing reports ---------------------------------------------------------------

    def add_evaluation(self, branch_id: int, stage: str, status: str, reason: str, *,
                       metrics: Mapping[str, Any] | None = None,
                       forcing: Mapping[str, Any] | None = None) -> Evaluation:
        """Record one harness stage on a branch, its forcing report if any, and a ledger event: all or nothing.

        `status` is keep, discard, crash or rejected; `reason` is folded to one line. `forcing` is the
        report `specpilot force --json` prints (match_rate, positions_checked, mismatches).
        """
        _choice(status, EVALUATION_STATUSES, "evaluation status")
        reason = _one_line(reason, "reason")
        metrics_json = _json(dict(metrics or {}), "metrics")
        with self.transaction():
            try:
                eval_id = self._insert("evaluations", {"branch_id": branch_id, "stage": stage, "status": status,
                                                       "reason": reason, "metrics": metrics_json})
            except sqlite3.IntegrityError as e:
                raise ValueError(f"cannot add evaluation for branch {branch_id}: {e}") from None
            report_id = None
            if forcing is not None:
                report_id = self._insert_forcing(branch_id, eval_id, forcing)
            row = self.db.execute("SELECT name FROM branches WHERE id = ?", [branch_id]).fetchone()
            who = row[0] if row else f"branch {branch_id}"
            self.record_event("evaluation", f"{who} {stage}: {status}: {reason}",
                              {"evaluation_id": eval_id, "branch_id": branch_id, "stage": stage, "status": status,
                               "forcing_report_id": report_id})
            return self.get_evaluation(eval_id)

    def add_forcing_report(self, branch_id: int, forcing: Mapping[str, Any], *,
                           evaluation_id: int | None = None) -> ForcingReport:
        """Record a forcing report on its own (e.g. from `specpilot force`), optionally tied to an evaluation."""
        with self.transaction():
            return self.get_forcing_report(self._insert_forcing(branch_id, evaluation_id, forcing))

    def _insert_forcing(self, branch_id: int, evaluation_id: int | None, forcing: Mapping[str, Any]) -> int:
        try:
            match_rate = float(forcing["match_rate"])
            positions = int(forcing["positions_checked"])
            mismatches = list(forcing.get("mismatches", []))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"forcing report needs match_rate, positions_checked and mismatches: {e!r}") from None
        if not 0.0 <= match_rate <= 1.0:
            raise ValueError(f"forcing match_rate must lie in [0, 1], got {match_rate}")
        # The rest of the report (per-split rates, noise floor, ...) is kept whole, not dropped.
        details = {k: v for k, v in forcing.items() if k not in ("match_rate", "positions_checked", "mismatches")}
        try:
            return self._insert("forcing_reports", {
                "branch_id": branch_id, "evaluation_id": evaluation_id, "match_rate": match_rate,
                "positions_checked": positions, "mismatches": _json(mismatches, "mismatches"),
                "details": _json(details, "forcing details")})
        except sqlite3.IntegrityError as e:
            raise ValueError(f"cannot add forcing report for branch {branch_id}: {e}") from None

    def get_evaluation(self, id: int) -> Evaluation:
        """The evaluation with this id."""
        return self._get(Evaluation, "evaluations", "evaluation", id)

    def list_evaluations(self, branch_id: int | None = None, status: str | None = None) -> list[Evaluation]:
        """Evaluations, oldest first, optionally of one branch and/or with one status."""
        return self._list(Evaluation, "evaluations", {"branch_id": branch_id, "status": status})

    def get_forcing_report(self, id: int) -> ForcingReport:
        """The forcing report with this id."""
        return self._get(ForcingReport, "forcing_reports", "forcing report", id)

    def list_forcing_reports(self, branch_id: int | None = None,
                             evaluation_id: int | None = None) -> list[ForcingReport]:
        """Forcing reports, oldest first, optionally of one branch and/or evaluation."""
        return self._list(ForcingReport, "forcing_reports", {"branch_id": branch_id, "evaluation_id": evaluation_id})

    # -- mechanisms ------------------------------------------------------------------------------------

    def add_mechanism(self, name: str, gap_family: str, summary: str = "", *, notes: str = "", patch: str = "",
                      evidence: Sequence[Mapping[str, Any]] = (), status: str = "candidate",
                      uid: str | None = None) -> Mechanism:
        """Record a mechanism (status candidate unless said otherwise); `patch` is `git format-patch` text."""
        _choice(gap_family, GAP_FAMILIES, "gap family")
        _choice(status, MECHANISM_STATUSES, "mechanism status")
        items = [_check_evidence(e) for e in evidence]
        return self._insert_and_get(Mechanism, "mechanisms", "mechanism", {
            "uid": uid or uuid.uuid4().hex, "name": name, "gap_family": gap_family, "summary": summary,
            "notes": notes, "patch": patch, "status": status, "evidence": _json(items, "evidence")})

    def get_mechanism(self, id: int) -> Mechanism:
        """The mechanism with this id."""
        return self._get(Mechanism, "mechanisms", "mechanism", id)

    def list_mechanisms(self, status: str | None = None, gap_family: str | None = None) -> list[Mechanism]:
        """Mechanisms, oldest first, optionally in one status and/or gap family."""
        if status is not None:
            _choice(status, MECHANISM_STATUSES, "mechanism status")
        if gap_family is not None:
            _choice(gap_family, GAP_FAMILIES, "gap family")
        return self._list(Mechanism, "mechanisms", {"status": status, "gap_family": gap_family})

    def update_mechanism(self, id: int, *, name: str | None = None, summary: str | None = None,
                         notes: str | None = None, patch: str | None = None) -> Mechanism:
        """Edit a mechanism's text (the search index follows); None leaves a field as it is."""
        return self._update(Mechanism, "mechanisms", "mechanism", id,
                            {"name": name, "summary": summary, "notes": notes, "patch": patch})

    def add_mechanism_evidence(self, id: int, item: Mapping[str, Any]) -> Mechanism:
        """Add the result on one deployment; an earlier result for the same deployment is replaced."""
        item = _check_evidence(item)
        with self.transaction():
            m = self.get_mechanism(id)
            evidence = [e for e in m.evidence if e.get("deployment") != item["deployment"]] + [item]
            return self._update(Mechanism, "mechanisms", "mechanism", id, {"evidence": _json(evidence, "evidence")})

    def set_mechanism_status(self, id: int, status: str, note: str) -> Mechanism:
        """Accept, reject or reopen a mechanism with the reviewer's note; the ledger records the verdict."""
        _choice(status, MECHANISM_STATUSES, "mechanism status")
        with self.transaction():
            before = self.get_mechanism(id)
            m = self._update(Mechanism, "mechanisms", "mechanism", id, {"status": status, "reviewer_note": note})
            self.record_event(f"mechanism.{status}", f"mechanism {id} ({m.name}): {before.status} -> {status}",
                              {"mechanism_id": id, "uid": m.uid, "from": before.status, "to": status, "note": note})
            return m

    def search_mechanisms(self, query: str, *, status: str | None = None, limit: int = 50) -> list[Mechanism]:
        """Full-text search on name, summary and notes, best match first; words are matched stemmed, in any order."""
        if not query.strip():
            raise ValueError("search query is empty; give a word from a mechanism's name, summary or notes")
        where, args = None, None
        if status is not None:
            _choice(status, MECHANISM_STATUSES, "mechanism status")
            where, args = "status = :status", {"status": status}
        # quote=True: user text such as "fused-qkv" or "kv:" must not be read as FTS5 query syntax.
        rows = self.db["mechanisms"].search(query, quote=True, where=where, where_args=args, limit=limit)
        return [from_row(Mechanism, r) for r in rows]

    def mechanisms_for_family(self, gap_family: str, status: str = "accepted", *,
                              exclude_deployment: str | None = None) -> list[Mechanism]:
        """Mechanisms of a gap family to try first on a deployment, best measured speedup first.

        `exclude_deployment` drops those already measured there (transfer means: accepted elsewhere).
        """
        _choice(gap_family, GAP_FAMILIES, "gap family")
        _choice(status, MECHANISM_STATUSES, "mechanism status")
        sql = """
            SELECT m.*, (SELECT max(json_extract(e.value, '$.speedup')) FROM json_each(m.evidence) e) AS best
            FROM mechanisms m WHERE m.gap_family = ? AND m.status = ?
        """
        args: list[Any] = [gap_family, status]
        if exclude_deployment is not None:
            sql += " AND NOT EXISTS (SELECT 1 FROM json_each(m.evidence) e " \
                   "WHERE json_extract(e.value, '$.deployment') = ?)"
            args.append(exclude_deployment)
        sql += " ORDER BY best DESC NULLS LAST, m.id"
        return [from_row(Mechanism, r) for r in self.db.query(sql, args)]

    def import_mechanism(self, m: Mechanism) -> Mechanism:
        """Copy a mechanism from another memory (e.g. a workspace's into the global one), matched by uid.

        Copying again updates the same row: text, status and note from `m`, evidence merged per deployment.
        """
        with self.transaction():
            found = list(self.db.query("SELECT id FROM mechanisms WHERE uid = ?", [m.uid]))
            evidence = list(m.evidence)
            if found:
                theirs = {e["deployment"] for e in m.evidence}
                mine = self.get_mechanism(found[0]["id"])
                evidence = [e for e in mine.evidence if e.get("deployment") not in theirs] + evidence
                return self._update(Mechanism, "mechanisms", "mechanism", mine.id, {
                    "name": m.name, "gap_family": m.gap_family, "summary": m.summary, "notes": m.notes,
                    "patch": m.patch, "status": m.status, "reviewer_note": m.reviewer_note,
                    "evidence": _json(evidence, "evidence")})
            return self._insert_and_get(Mechanism, "mechanisms", "mechanism", {
                "uid": m.uid, "name": m.name, "gap_family": m.gap_family, "summary": m.summary, "notes": m.notes,
                "patch": m.patch, "status": m.status, "reviewer_note": m.reviewer_note,
                "evidence": _json(evidence, "evidence")})

    # -- events ----------------------------------------------------------------------------------------

    def record_event(self, kind: str, message: str, payload: Mapping[str, Any] | None = None) -> Event:
        """Append one line to the ledger (append-only: the database refuses updates and deletes)."""
        return self._insert_and_get(Event, "events", "event", {
            "kind": kind, "message": message, "payload": _json(dict(payload or {}), "payload")})

    def get_event(self, id: int) -> Event:
        """The event with this id."""
        return self._get(Event, "events", "event", id)

    def list_events(self, kind: str | None = None, *, after_id: int = 0, limit: int | None = None) -> list[Event]:
        """Ledger lines in order, optionally of one kind and after a known id (to follow it)."""
        sql = "SELECT * FROM events WHERE id > ?" + (" AND kind = ?" if kind is not None else "") + " ORDER BY id"
        args: list[Any] = [after_id] + ([kind] if kind is not None else [])
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return [from_row(Event, r) for r in self.db.query(sql, args)]
