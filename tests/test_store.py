"""The memory on real SQLite files: migrations, search, transactions, threads, kill -9, and the CLI."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from store import LATEST_VERSION, Memory, NotFound, StoreError, global_memory_path, workspace_memory_path
from store.db import connect, migrate, schema_version
from store.migrations import STEPS, build_migrations

ROOT = Path(__file__).resolve().parents[1]
FORCING = {"match_rate": 0.75, "positions_checked": 8, "hidden_match_rate": 0.5,
           "mismatches": [{"prompt_id": "p1", "position": 3, "stock_token": 5, "candidate_token": 9, "margin": 0.1},
                          {"prompt_id": "h2", "position": 6, "stock_token": 1, "candidate_token": 2, "margin": 4.0}]}


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECPILOT_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


@pytest.fixture
def mem(tmp_path):
    with Memory(tmp_path / "ws" / ".specpilot" / "memory.db") as m:
        yield m


def branch_of(mem: Memory, name: str = "b1") -> int:
    dep = mem.find_deployment("demo") or mem.add_deployment("demo", "demo/target", drafter="demo/drafter")
    rnd = mem.list_rounds(dep.id)[0] if mem.list_rounds(dep.id) else mem.add_round(dep.id, base_commit="abc")
    return mem.add_branch(rnd.id, name, agent="tuner", direction="draft length").id


def raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(str(path))


# -- locations and migrations -------------------------------------------------------------------------


def test_default_locations_agree_with_the_rest_of_specpilot(tmp_path, data_dir):
    from costmodel.gaps import FAMILIES
    from costmodel.hardware import data_dir as costmodel_data_dir
    from store import GAP_FAMILIES

    assert global_memory_path() == data_dir / "memory.db"
    assert global_memory_path().parent == costmodel_data_dir()
    assert workspace_memory_path(tmp_path) == tmp_path / ".specpilot" / "memory.db"
    assert GAP_FAMILIES == FAMILIES


def test_migrations_apply_once_and_set_up_wal_and_foreign_keys(tmp_path):
    path = tmp_path / "m.db"
    with Memory(path) as mem:
        assert mem.version == LATEST_VERSION
        assert mem.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert mem.db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        assert mem.db.execute("PRAGMA busy_timeout").fetchone()[0] >= 5000
        assert {"deployments", "hardware_profiles", "bench_runs", "rounds", "branches", "evaluations",
                "forcing_reports", "mechanisms", "mechanisms_fts", "events"} <= set(mem.db.table_names())
    for _ in range(2):  # reopening, and migrating an up-to-date file, change nothing
        with Memory(path) as mem:
            assert migrate(mem.db) == LATEST_VERSION
    rows = raw(path).execute("SELECT name FROM _sqlite_migrations ORDER BY id").fetchall()
    assert [r[0] for r in rows] == [name for name, _ in STEPS]
    assert raw(path).execute("PRAGMA user_version").fetchone()[0] == LATEST_VERSION


def test_upgrade_from_previous_version_keeps_data(tmp_path):
    path = tmp_path / "old.db"
    db = connect(path)
    assert migrate(db, stop_before=STEPS[-1][0]) == LATEST_VERSION - 1
    # Rows written by hand, as an older SpecPilot would have.
    db.execute("INSERT INTO deployments (name, target) VALUES ('old', 'old/target')")
    db.execute("INSERT INTO mechanisms (uid, name, gap_family, notes) VALUES ('u1', 'kv-prealloc', 'kv', "
               "'preallocate the cache buffer once')")
    db.close()
    with Memory(path) as mem:
        assert mem.version == LATEST_VERSION
        assert mem.find_deployment("old").target == "old/target"
        assert [m.uid for m in mem.search_mechanisms("buffer")] == ["u1"]  # indexed on upgrade


def test_concurrent_first_opens_migrate_once(tmp_path):
    path = tmp_path / "fresh.db"
    start, errors, mems = threading.Barrier(4), [], []

    def opener() -> None:
        try:
            start.wait()
            mems.append(Memory(path))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=opener) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for m in mems:
        m.close()
    assert raw(path).execute("SELECT count(*) FROM _sqlite_migrations").fetchone()[0] == LATEST_VERSION


def test_failing_migration_leaves_previous_version(tmp_path):
    path = tmp_path / "m.db"
    Memory(path).close()

    def broken(db):
        db.execute("CREATE TABLE half_done (x)")
        db.execute("INSERT INTO deployments (name, target) VALUES ('ghost', 't')")
        raise RuntimeError("disk on fire")

    db = connect(path)
    with pytest.raises(StoreError, match=rf"9999_broken failed.*disk on fire.*version {LATEST_VERSION}"):
        migrate(db, migrations=build_migrations([*STEPS, ("9999_broken", broken)]))
    assert schema_version(db) == LATEST_VERSION
    assert "half_done" not in db.table_names()
    assert db.execute("SELECT count(*) FROM deployments").fetchone()[0] == 0
    assert db.execute("PRAGMA user_version").fetchone()[0] == LATEST_VERSION


def test_newer_database_is_refused_not_downgraded(tmp_path):
    path = tmp_path / "m.db"
    Memory(path).close()
    raw_conn = raw(path)
    raw_conn.execute("INSERT INTO _sqlite_migrations (migration_set, name, applied_at) "
                     "VALUES ('specpilot.memory', '9999_future', 'later')")
    raw_conn.commit()
    with pytest.raises(StoreError, match="newer than this SpecPilot"):
        Memory(path)


def test_missing_or_corrupt_file_is_a_store_error(tmp_path):
    with pytest.raises(StoreError, match="no memory database at"):
        Memory(tmp_path / "absent.db", create=False)
    assert not (tmp_path / "absent.db").exists()
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"not a database at all" * 100)
    with pytest.raises(StoreError, match="bad.db"):
        Memory(bad)


# -- repository API -----------------------------------------------------------------------------------


def test_families_round_trip_with_json_columns(mem):
    dep = mem.add_deployment("demo", "demo/target", drafter="demo/drafter", hardware="cpu-local", dtype="bfloat16",
                             regime={"batch": [1, 4]}, fingerprint="f00")
    assert mem.get_deployment(dep.id).regime == {"batch": [1, 4]}
    with pytest.raises(ValueError, match="UNIQUE"):
        mem.add_deployment("demo", "other")
    hw = mem.add_hardware_profile("cpu-local", {"bandwidth_gbs": 20.0})
    assert mem.find_hardware_profile("cpu-local") == hw
    run = mem.add_bench_run(dep.id, "sd-draft-model", config={"k": 4}, tokens_per_s=120.0, tau=2.5, speedup=1.8,
                            phase_timings={"draft": 2.0, "verify": 5.0}, report={"prompts": 3})
    assert mem.list_bench_runs(dep.id, "sd-draft-model") == [run]
    with pytest.raises(ValueError, match="JSON"):
        mem.add_bench_run(dep.id, "ar", phase_timings={"verify": float("nan")})
    r1, r2 = mem.add_round(dep.id, base_commit="abc"), mem.add_round(dep.id)
    assert (r1.number, r2.number) == (1, 2)
    assert mem.update_round(r1.id, status="done", summary={"kept": 1}).summary == {"kept": 1}
    br = mem.add_branch(r1.id, "tuner-1", agent="tuner", direction="draft length", worktree_path=Path("/w/1"))
    br = mem.update_branch(br.id, status="evaluated", head_commit="def")
    assert (br.status, br.head_commit, br.worktree_path) == ("evaluated", "def", "/w/1")
    with pytest.raises(NotFound, match="no branch with id 99"):
        mem.get_branch(99)
    with pytest.raises(ValueError, match="FOREIGN KEY"):
        mem.add_branch(99, "orphan", agent="x")


def test_evaluation_and_forcing_report_land_together(mem):
    bid = branch_of(mem)
    ev = mem.add_evaluation(bid, "forcing", "discard", "2 real mismatches\n  at 3 and 6", metrics={"t": 1.5},
                            forcing=FORCING)
    assert ev.reason == "2 real mismatches at 3 and 6"
    (rep,) = mem.list_forcing_reports(evaluation_id=ev.id)
    assert (rep.match_rate, rep.positions_checked, rep.mismatches) == (0.75, 8, FORCING["mismatches"])
    assert rep.details == {"hidden_match_rate": 0.5}
    assert mem.list_events("evaluation")[-1].payload["forcing_report_id"] == rep.id
    # A bad report fails the whole write: no evaluation, no report, no ledger line.
    with pytest.raises(ValueError, match="match_rate"):
        mem.add_evaluation(bid, "forcing", "keep", "ok", forcing={**FORCING, "match_rate": 1.5})
    with pytest.raises(ValueError, match="status"):
        mem.add_evaluation(bid, "bench", "maybe", "ok")
    assert len(mem.list_evaluations(bid)) == 1 and len(mem.list_forcing_reports(bid)) == 1
    assert len(mem.list_events("evaluation")) == 1
    with pytest.raises(RuntimeError), mem.transaction():
        mem.add_evaluation(bid, "bench", "keep", "1.3x")
        raise RuntimeError("caller gave up")
    assert len(mem.list_evaluations(bid)) == 1


def test_events_are_an_append_only_ledger(mem):
    e = mem.record_event("round.start", "round 1 on demo", {"round": 1})
    assert mem.get_event(e.id) == e
    for sql in ("UPDATE events SET message = 'x'", "DELETE FROM events"):
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            mem.db.execute(sql)
    assert mem.list_events(after_id=0) == [e] and mem.list_events(after_id=e.id) == []


def test_search_finds_a_word_in_notes_and_follows_updates(mem):
    m = mem.add_mechanism("kv-prealloc", "kv", "preallocate the KV cache", notes="One buffer, sliced per step.")
    mem.add_mechanism("fused-qkv", "compute", "one GEMV for q, k and v")
    assert [x.id for x in mem.search_mechanisms("buffers")] == [m.id]  # only in notes; stemmed
    mem.update_mechanism(m.id, notes="A ring of pages instead.")
    assert mem.search_mechanisms("buffer") == []
    assert [x.id for x in mem.search_mechanisms("ring")] == [m.id]
    mem.set_mechanism_status(m.id, "accepted", "clean forcing")  # status changes keep the index intact
    assert [x.id for x in mem.search_mechanisms("ring", status="accepted")] == [m.id]
    assert mem.search_mechanisms("ring", status="rejected") == []
    assert [x.name for x in mem.search_mechanisms('fused-qkv ("')] == ["fused-qkv"]  # FTS syntax is quoted away
    with pytest.raises(ValueError, match="empty"):
        mem.search_mechanisms("  ")


def test_review_and_transfer_across_deployments(mem, tmp_path):
    slow = mem.add_mechanism("ngram-cache", "drafting", "incremental n-gram dict",
                             evidence=[{"deployment": "demo", "speedup": 1.2}])
    fast = mem.add_mechanism("tree-draft", "drafting", "tree of drafts",
                             evidence=[{"deployment": "other", "speedup": 1.6, "forcing": {"match_rate": 1.0}}])
    mem.add_mechanism("idea", "drafting", "untested")
    for m in (slow, fast):
        mem.set_mechanism_status(m.id, "accepted", "lossless, faster")
    assert [m.name for m in mem.mechanisms_for_family("drafting")] == ["tree-draft", "ngram-cache"]
    assert [m.name for m in mem.mechanisms_for_family("drafting", exclude_deployment="other")] == ["ngram-cache"]
    assert [m.name for m in mem.mechanisms_for_family("drafting", "candidate")] == ["idea"]
    assert mem.list_events("mechanism.accepted")[-1].payload["note"] == "lossless, faster"
    slow = mem.add_mechanism_evidence(slow.id, {"deployment": "demo", "speedup": 1.3})
    assert slow.evidence == [{"deployment": "demo", "speedup": 1.3}]
    with pytest.raises(ValueError, match="status"):
        mem.set_mechanism_status(slow.id, "maybe", "?")
    # Carried into the global memory: copying twice updates one row and merges evidence.
    with Memory(global_memory_path()) as glob:
        glob.import_mechanism(slow)
        glob.import_mechanism(mem.add_mechanism_evidence(slow.id, {"deployment": "b200", "speedup": 2.0}))
        (copy,) = glob.list_mechanisms()
        assert (copy.uid, copy.status, copy.reviewer_note) == (slow.uid, "accepted", "lossless, faster")
        assert {e["deployment"] for e in copy.evidence} == {"demo", "b200"}


# -- concurrency and crashes ----------------------------------------------------------------------------


def test_eight_threads_writing_evaluations_lose_nothing(mem):
    bids = [branch_of(mem, f"b{i}") for i in range(8)]
    per_thread = 25
    start = threading.Barrier(8)
    errors: list[BaseException] = []
    conns: set[int] = set()

    def writer(i: int) -> None:
        try:
            start.wait()
            conns.add(id(mem.db))
            for j in range(per_thread):
                mem.add_evaluation(bids[i], "bench", "keep", f"t{i} e{j}", metrics={"thread": i, "n": j},
                                   forcing={**FORCING, "match_rate": j / per_thread})
        except BaseException as e:  # noqa: BLE001 - reported below with the thread's failure
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert len(conns) == 8  # one connection per thread
    evs = mem.list_evaluations()
    assert len(evs) == 8 * per_thread
    assert {(e.metrics["thread"], e.metrics["n"]) for e in evs} == {(i, j) for i in range(8) for j in range(per_thread)}
    assert all(e.reason == f"t{e.metrics['thread']} e{e.metrics['n']}" for e in evs)
    reports = {r.evaluation_id: r for r in mem.list_forcing_reports()}
    assert len(reports) == len(evs)
    assert all(reports[e.id].branch_id == e.branch_id == bids[e.metrics["thread"]] for e in evs)
    assert all(reports[e.id].match_rate == e.metrics["n"] / per_thread for e in evs)
    assert len(mem.list_events("evaluation")) == len(evs)


KILL_SCRIPT = textwrap.dedent("""
    import sys, time
    from store import Memory
    mem = Memory(sys.argv[1])
    when = sys.argv[2]
    if when == "before-commit":
        def stall(*a, **k):  # evaluation and report are written, the commit is not: die here
            print("ready", flush=True)
            time.sleep(60)
        Memory.record_event = stall
    mem.add_evaluation(int(sys.argv[3]), "forcing", "discard", "killed", forcing={
        "match_rate": 0.5, "positions_checked": 4, "mismatches": [{"position": 1}]})
    print("ready", flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("when", ["before-commit", "after-commit"])
def test_sigkill_mid_transaction_leaves_neither_or_both(tmp_path, when):
    path = tmp_path / "m.db"
    with Memory(path) as mem:
        bid = branch_of(mem)
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(path), when, str(bid)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    with Memory(path) as mem:
        assert mem.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert mem.db.execute("PRAGMA foreign_key_check").fetchall() == []
        n = 1 if when == "after-commit" else 0
        assert len(mem.list_evaluations()) == len(mem.list_forcing_reports()) == n
        mem.add_evaluation(bid, "bench", "keep", "still writable")  # no lock left behind by the dead writer
        assert len(mem.list_evaluations()) == n + 1


# -- the `specpilot memory` CLI -------------------------------------------------------------------------


def seed(path: Path) -> tuple[int, int]:
    with Memory(path) as mem:
        a = mem.add_mechanism("kv-prealloc", "kv", "preallocate the KV cache", notes="one buffer, sliced per step",
                              evidence=[{"deployment": "demo", "speedup": 1.25, "forcing": {"match_rate": 1.0}}],
                              patch="From abc\n---\n+x\n")
        b = mem.add_mechanism("fused-qkv", "compute", "one GEMV for q, k and v")
        return a.id, b.id


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench.memory_cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_memory_cli_lists_shows_searches_and_accepts(tmp_path):
    db = tmp_path / "m.db"
    a, b = seed(db)
    out = cli("list", "--db", str(db), "--json")
    assert out.returncode == 0, out.stderr
    assert [m["name"] for m in json.loads(out.stdout)] == ["kv-prealloc", "fused-qkv"]
    out = cli("show", str(a), "--db", str(db))
    assert out.returncode == 0, out.stderr
    assert "kv-prealloc" in out.stdout and "demo: speedup 1.25, forcing match rate 1.0" in out.stdout
    out = cli("search", "buffer", "--db", str(db), "--json")
    assert [m["id"] for m in json.loads(out.stdout)] == [a]
    out = cli("accept", str(a), "--note", "clean forcing, 1.25x", "--db", str(db), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["status"] == "accepted"
    with Memory(db) as mem:
        assert (mem.get_mechanism(a).status, mem.get_mechanism(a).reviewer_note) == ("accepted", "clean forcing, 1.25x")
        assert mem.get_mechanism(b).status == "candidate"
    out = cli("show", "99", "--db", str(db))
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.startswith("error: no mechanism with id 99") and out.stderr.count("\n") == 1


def test_memory_cli_in_process_errors_default_db_and_wiring(tmp_path, monkeypatch, capsys, data_dir):
    from workbench.memory_cli import add_parser, default_db_path, main

    monkeypatch.chdir(tmp_path)
    assert default_db_path() == data_dir / "memory.db"  # no workspace here: the global memory
    assert main(["list"]) == 2
    assert capsys.readouterr().err.startswith("error: no memory database at")
    assert not (data_dir / "memory.db").exists()  # reading never creates a database
    a, _ = seed(workspace_memory_path(tmp_path))
    assert default_db_path() == Path(".specpilot/memory.db").resolve()
    assert main(["reject", str(a), "--note", "slower on b200"]) == 0
    assert "is now rejected: slower on b200" in capsys.readouterr().out
    assert main(["list", "--status", "rejected", "--json"]) == 0
    assert [m["id"] for m in json.loads(capsys.readouterr().out)] == [a]
    with pytest.raises(SystemExit) as exc:
        main(["accept", str(a)])  # --note is required
    assert exc.value.code == 2

    parser = argparse.ArgumentParser(prog="specpilot")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["memory", "search", "ring buffer", "--db", "x.db", "--json"])
    assert (args.query, args.db, args.json, args.func.__name__) == ("ring buffer", "x.db", True, "_cmd_search")


def test_evaluation_events_name_the_branch(mem):
    b = branch_of(mem, "r1-drafting-tuner")
    mem.add_evaluation(b, "smoke", "keep", "ok: 16 tokens")
    ev = [e for e in mem.list_events() if e.kind == "evaluation"][-1]
    assert ev.message == "r1-drafting-tuner smoke: keep: ok: 16 tokens"
