"""Opening a memory database: where it lives, the connection settings, transactions and migrations.

One SQLite file per memory. A workspace keeps its own in `<workspace>/.specpilot/memory.db`; the
global memory, which carries mechanisms across deployments, lives in the user's data directory.

Every connection runs in WAL mode (readers never block the one writer), waits up to
`BUSY_TIMEOUT_S` for the write lock instead of failing, and enforces foreign keys. Write
transactions start with `BEGIN IMMEDIATE`: taking the write lock up front means a transaction never
has to upgrade a read snapshot to a write, which in WAL mode fails at once with "database is
locked" no matter the busy timeout.

The schema moves forward by numbered migrations (`store.migrations`), applied with sqlite-utils'
`Migrations` and recorded in the `_sqlite_migrations` table; `PRAGMA user_version` mirrors the
number so `sqlite3 memory.db 'pragma user_version'` tells the version at a glance. Each migration
commits on its own, so a failing one leaves the database at the version before it.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sqlite_utils
from sqlite_utils import Migrations

from decoder.contract import data_dir
from store.migrations import MIGRATIONS, migration_names

BUSY_TIMEOUT_S = 10.0
MEMORY_FILE = "memory.db"
WORKSPACE_DIR = ".specpilot"


class StoreError(Exception):
    """A memory database cannot be opened, migrated or written; the message says which and why."""


class NotFound(StoreError, LookupError):
    """No row with that id (or name) in this memory."""


def global_memory_path() -> Path:
    """The global memory: mechanisms accepted on any deployment, for transfer to new ones."""
    return data_dir() / MEMORY_FILE


def workspace_memory_path(workspace: str | Path) -> Path:
    """A workspace's own memory: `<workspace>/.specpilot/memory.db`."""
    return Path(workspace) / WORKSPACE_DIR / MEMORY_FILE


def connect(path: str | Path, *, create: bool = True) -> sqlite_utils.Database:
    """Open one connection with the memory's settings (WAL, busy timeout, foreign keys); no migrations.

    Use one connection per thread (`store.Memory` does that for you).
    """
    path = Path(path)
    if not create and not path.exists():
        raise StoreError(f"no memory database at {path}; pass --db PATH or create one first")
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # check_same_thread=False only so `Memory.close()` may close every thread's connection;
        # each connection is still used by one thread at a time (thread-local in Memory).
        conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        mode = _set_wal(conn)
        conn.execute("PRAGMA foreign_keys = ON")
        # FULL: a commit that returned survives power loss too; commits are rare (one per evaluation).
        conn.execute("PRAGMA synchronous = FULL")
    except sqlite3.DatabaseError as e:
        raise StoreError(f"cannot open memory database {path}: {e}") from e
    if mode.lower() != "wal":
        raise StoreError(f"memory database {path} refused WAL mode (journal_mode is {mode}); is it on a network drive?")
    return sqlite_utils.Database(conn, execute_plugins=False)


def _set_wal(conn: sqlite3.Connection) -> str:
    """Switch to WAL, retrying while another connection holds the lock: on a new file the switch can fail at
    once with "database is locked" without waiting on the busy timeout (several processes opening a fresh
    memory together), so it is retried here for up to BUSY_TIMEOUT_S."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            return conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


@contextmanager
def transaction(db: sqlite_utils.Database) -> Iterator[sqlite_utils.Database]:
    """All writes inside commit together or not at all; nested calls become savepoints."""
    conn = db.conn
    if conn.in_transaction:
        with db.atomic():
            yield db
        return
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as e:
        raise StoreError(f"memory database is busy: {e} (another writer held it over {BUSY_TIMEOUT_S:g} s)") from e
    try:
        yield db
    except BaseException:
        if conn.in_transaction:  # an error may already have rolled it back
            conn.execute("ROLLBACK")
        raise
    try:
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def applied_migrations(db: sqlite_utils.Database, migrations: Migrations | None = None) -> list[str]:
    """Names of the migrations of this set already applied to `db`, in order."""

    return [m.name for m in (migrations or MIGRATIONS).applied(db)]


def schema_version(db: sqlite_utils.Database, migrations: Migrations | None = None) -> int:
    """How many numbered migrations `db` has had (0 for a new file)."""
    return len(applied_migrations(db, migrations))


def migrate(db: sqlite_utils.Database, *, migrations: Migrations | None = None,
            stop_before: str | None = None) -> int:
    """Apply pending migrations one transaction each, in order; return the resulting version.

    A migration that raises leaves the database at the version before it and raises StoreError.
    Safe when several processes open the same file at once: each step re-reads what is pending
    under the write lock, so no migration runs twice.
    """

    migrations = migrations or MIGRATIONS
    known = migration_names(migrations)
    path = _path_of(db)
    applied = applied_migrations(db, migrations)
    unknown = [n for n in applied if n not in known]
    if unknown:
        raise StoreError(f"memory database {path} has schema version {len(applied)} (migrations {unknown} are "
                         f"newer than this SpecPilot, which knows {len(known)}); upgrade SpecPilot to use it")
    if stop_before is not None and stop_before not in known:
        raise ValueError(f"stop_before={stop_before!r} is not a migration; known: {known}")
    while True:
        pending = migrations.pending(db)  # cheap read; the decisive check is repeated under the lock
        if not pending or pending[0].name == stop_before:
            return schema_version(db, migrations)
        with transaction(db):
            pending = migrations.pending(db)
            if not pending or pending[0].name == stop_before:
                continue
            step = pending[0]
            try:
                # Inside our transaction, apply() runs the step in a savepoint; stopping before the next
                # pending one makes it apply exactly this step, which then commits on its own.
                migrations.apply(db, stop_before=pending[1].name if len(pending) > 1 else None)
            except Exception as e:
                version = len(known) - len(pending)
                raise StoreError(f"migration {step.name} failed on {path}: {e}; "
                                 f"the memory stays at schema version {version}") from e
            db.execute(f"PRAGMA user_version = {len(known) - len(pending) + 1}")


def _path_of(db: sqlite_utils.Database) -> str:
    row = db.conn.execute("PRAGMA database_list").fetchone()
    return row[2] if row and row[2] else ":memory:"
