"""The memory's schema, as numbered migrations. Never edit a released step: add the next number.

Tables are plain so they read well by hand (`sqlite-utils tables memory.db`, Datasette): integer ids,
foreign keys, `created_at` in UTC ISO 8601, and JSON text (checked by `json_valid`) for nested
evidence such as phase timings, metrics, mismatches and per-deployment results.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlite_utils
from sqlite_utils import Migrations

from decoder.contract import GAP_FAMILIES

SET_NAME = "specpilot.memory"

# Gap families as costmodel.gaps.FAMILIES names them (store does not import costmodel; a test keeps them equal).
EVALUATION_STATUSES = ("keep", "discard", "crash", "rejected")
MECHANISM_STATUSES = ("candidate", "accepted", "rejected")

_NOW = "(strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))"


def _in(values: tuple[str, ...]) -> str:
    return "(" + ", ".join(f"'{v}'" for v in values) + ")"


def m0001_initial(db: sqlite_utils.Database) -> None:
    """Deployments, hardware, bench runs, the loop's rounds/branches/evaluations/forcing, mechanisms, events."""
    db.executescript(f"""
    CREATE TABLE deployments (
        id INTEGER PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        target TEXT NOT NULL,
        drafter TEXT,
        hardware TEXT,
        dtype TEXT,
        regime TEXT NOT NULL DEFAULT '{{}}' CHECK (json_valid(regime)),
        fingerprint TEXT,
        created_at TEXT NOT NULL DEFAULT {_NOW}
    );
    CREATE TABLE hardware_profiles (
        id INTEGER PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        profile TEXT NOT NULL CHECK (json_valid(profile)),
        created_at TEXT NOT NULL DEFAULT {_NOW}
    );
    CREATE TABLE bench_runs (
        id INTEGER PRIMARY KEY,
        deployment_id INTEGER NOT NULL REFERENCES deployments(id),
        method TEXT NOT NULL,
        config TEXT NOT NULL DEFAULT '{{}}' CHECK (json_valid(config)),
        tokens_per_s REAL,
        tau REAL,
        speedup REAL,
        phase_timings TEXT NOT NULL DEFAULT '{{}}' CHECK (json_valid(phase_timings)),
        report TEXT NOT NULL DEFAULT '{{}}' CHECK (json_valid(report)),
        created_at TEXT NOT NULL DEFAULT {_NOW}
    );
    CREATE INDEX bench_runs_deployment ON bench_runs(deployment_id, method);
    CREATE TABLE rounds (
        id INTEGER PRIMARY KEY,
        deployment_id INTEGER NOT NULL REFERENCES deployments(id),
        number INTEGER NOT NULL CHECK (number >= 1),
        status TEXT NOT NULL,
        base_commit TEXT,
        summary TEXT NOT NULL DEFAULT '{{}}' CHECK (json_valid(summary)),
        created_at TEXT NOT NULL DEFAULT {_NOW},
        updated_at TEXT NOT NULL DEFAULT {_NOW},
        UNIQUE (deployment_id, number)
    );
    CREATE TABLE branches (
        id INTEGER PRIMARY KEY,
        round_id INTEGER NOT NULL REFERENCES rounds(id),
        name TEXT NOT NULL,
        agent TEXT NOT NULL,
        direction TEXT NOT NULL DEFAULT '',
        status TEXT NOT NULL,
        head_commit TEXT,
        worktree_path TEXT,
        created_at TEXT NOT NULL DEFAULT {_NOW},
        updated_at TEXT NOT NULL DEFAULT {_NOW},
        UNIQUE (round_id, name)
    );
    CREATE TABLE evaluations (
        id INTEGER PRIMARY KEY,
        branch_id INTEGER NOT NULL REFERENCES branches(id),
        stage TEXT NOT NULL,
        status TEXT NOT NULL CHECK (status IN {_in(EVALUATION_STATUSES)}),
        -- one line, so a ledger listing stays one row per attempt
        reason TEXT NOT NULL CHECK (instr(reason, char(10)) = 0),
        metrics TEXT NOT NULL DEFAULT '{{}}' CHECK (json_valid(metrics)),
        created_at TEXT NOT NULL DEFAULT {_NOW}
    );
    CREATE INDEX evaluations_branch ON evaluations(branch_id);
    CREATE TABLE forcing_reports (
        id INTEGER PRIMARY KEY,
        branch_id INTEGER NOT NULL REFERENCES branches(id),
        evaluation_id INTEGER REFERENCES evaluations(id),
        match_rate REAL NOT NULL CHECK (match_rate BETWEEN 0 AND 1),
        positions_checked INTEGER NOT NULL CHECK (positions_checked >= 0),
        -- [{{"prompt_id", "position", "stock_token", "candidate_token", "margin", ...}}]
        mismatches TEXT NOT NULL DEFAULT '[]' CHECK (json_valid(mismatches) AND json_type(mismatches) = 'array'),
        -- the rest of the report: per-split rates, noise floor, ...
        details TEXT NOT NULL DEFAULT '{{}}' CHECK (json_valid(details)),
        created_at TEXT NOT NULL DEFAULT {_NOW}
    );
    CREATE INDEX forcing_reports_branch ON forcing_reports(branch_id);
    CREATE INDEX forcing_reports_evaluation ON forcing_reports(evaluation_id);
    CREATE TABLE mechanisms (
        id INTEGER PRIMARY KEY,
        -- stable across memories, so copying a mechanism into the global memory twice updates one row
        uid TEXT NOT NULL UNIQUE,
        name TEXT NOT NULL,
        gap_family TEXT NOT NULL CHECK (gap_family IN {_in(GAP_FAMILIES)}),
        summary TEXT NOT NULL DEFAULT '',
        notes TEXT NOT NULL DEFAULT '',
        patch TEXT NOT NULL DEFAULT '',
        status TEXT NOT NULL DEFAULT 'candidate' CHECK (status IN {_in(MECHANISM_STATUSES)}),
        reviewer_note TEXT NOT NULL DEFAULT '',
        -- [{{"deployment": name, "speedup": x, "forcing": {{"match_rate": r, ...}}, ...}}]
        evidence TEXT NOT NULL DEFAULT '[]' CHECK (json_valid(evidence) AND json_type(evidence) = 'array'),
        created_at TEXT NOT NULL DEFAULT {_NOW},
        updated_at TEXT NOT NULL DEFAULT {_NOW}
    );
    CREATE INDEX mechanisms_family ON mechanisms(gap_family, status);
    CREATE TABLE events (
        id INTEGER PRIMARY KEY,
        ts TEXT NOT NULL DEFAULT {_NOW},
        kind TEXT NOT NULL,
        message TEXT NOT NULL,
        payload TEXT NOT NULL DEFAULT '{{}}' CHECK (json_valid(payload))
    );
    CREATE INDEX events_kind ON events(kind, id);
    -- the ledger is append-only: history is never rewritten, only added to
    CREATE TRIGGER events_no_update BEFORE UPDATE ON events
        BEGIN SELECT RAISE(ABORT, 'events is an append-only ledger'); END;
    CREATE TRIGGER events_no_delete BEFORE DELETE ON events
        BEGIN SELECT RAISE(ABORT, 'events is an append-only ledger'); END;
    """)


def m0002_mechanism_search(db: sqlite_utils.Database) -> None:
    """Full-text search (FTS5, Porter stemming) on mechanism name, summary and notes, kept in sync by triggers."""
    # enable_fts also indexes the rows already there, so an upgraded memory is searchable at once.
    db["mechanisms"].enable_fts(["name", "summary", "notes"], fts_version="FTS5", create_triggers=True,
                                tokenize="porter")


# Numbered steps, in order. The name is what `_sqlite_migrations` records.
STEPS: list[tuple[str, Callable[[sqlite_utils.Database], None]]] = [
    ("0001_initial", m0001_initial),
    ("0002_mechanism_search", m0002_mechanism_search),
]
LATEST_VERSION = len(STEPS)


def build_migrations(steps: list[tuple[str, Callable[[sqlite_utils.Database], None]]] | None = None) -> Migrations:
    """A `Migrations` set holding `steps` (default: the memory's own), in order."""
    migrations = Migrations(SET_NAME)
    for name, fn in STEPS if steps is None else steps:
        migrations(name=name)(fn)
    return migrations


def migration_names(migrations: Migrations) -> list[str]:
    """Names of every migration in the set, in order (applied or not)."""
    # Migrations has no public listing; pending() on an empty in-memory database lists them all.
    return [m.name for m in migrations.pending(sqlite_utils.Database(memory=True, execute_plugins=False))]


MIGRATIONS = build_migrations()
