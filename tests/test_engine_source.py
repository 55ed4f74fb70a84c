"""A llama.cpp workspace carrying the engine's source (workbench/engine_source.py, #19): candidates edit its
C++, each commit runs the llama-server built from its own engine tree (incrementally, in the sandbox,
untimed), a commit that does not build is a one-line crash, and forcing checks what the rebuilt engine says.

Real llama.cpp (built by `make llama-cpp`), real git, the real sandbox; skipped in one line when the engine
is not built. The rebuilds of real translation units are slow tests."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from decoder.engines import llamacpp_build as build
from workbench.cli import main
from workbench.harness import SystemCrash, sandbox_status

ENGINES = build.engines_root()  # the user's engine cache, read before conftest gives each test a private data dir


def _ready() -> bool:
    return (build.is_built() and (build.engine_dir() / "build" / "build.ninja").is_file()
            and all(build.gguf_path(m, "bf16").is_file() for m in build.DEMO_MODELS) and sandbox_status()[0])


needs_engine = pytest.mark.skipif(not _ready(), reason="llama.cpp is not built with its build folder (run `make "
                                                       "llama-cpp`), or no sandbox here")
IO_CPP = "engine/llama.cpp/src/llama-io.cpp"  # a tiny translation unit of libllama
SAMPLING_CPP = "engine/llama.cpp/common/sampling.cpp"
SAMPLED = "    id = cur_p.data[cur_p.selected].id;\n\n    if (grammar_first"  # the server's sampled token
MARK = "specpilot: the candidate's engine"


@pytest.fixture(autouse=True)
def _real_engines(monkeypatch):
    monkeypatch.setenv("SPECPILOT_ENGINES_DIR", str(ENGINES))


@pytest.fixture(scope="module")
def src_ws(tmp_path_factory):
    if not _ready():
        pytest.skip("llama.cpp is not built with its build folder (run `make llama-cpp`), or no sandbox here")
    from workbench.workspace import init_llamacpp

    mp = pytest.MonkeyPatch()
    mp.setenv("SPECPILOT_ENGINES_DIR", str(ENGINES))
    try:
        ws = init_llamacpp(tmp_path_factory.mktemp("lcsrc") / "ws", deployment="demo", prompt_limit=3,
                           forcing_max_new_tokens=16, with_source=True)
    finally:
        mp.undo()
    yield ws
    ws.close()


def _commit(ws, branch: str, rel: str, edit) -> Path:
    b = ws.create_branch(branch)
    wt = Path(b.worktree_path)
    edit(wt / rel)
    g = ws.worktree_git(branch)
    g.add("-A")
    g.commit("-q", "-m", f"{branch}: {rel}")
    return wt


def _replace(old: str, new: str):
    def edit(p: Path) -> None:
        text = p.read_text()
        assert old in text, f"{p}: {old!r} not found"
        p.write_text(text.replace(old, new, 1))
    return edit


@needs_engine
def test_the_workspace_carries_the_engine_and_stock_runs_the_cache_build(src_ws):
    from workbench.engine_source import SOURCE_REL, engine_server, engine_tree
    from workbench.forcing import run_system

    c = src_ws.config
    assert c.engine_source == SOURCE_REL and "{engine_server}" in c.entry
    assert (src_ws.path / SOURCE_REL / "ggml" / "src" / "ggml-cpu" / "ggml-cpu.c").is_file()
    files = src_ws.repo.git.ls_files(SOURCE_REL).splitlines()
    assert len(files) > 500 and "engine/llama.cpp/CMakeLists.txt" in files  # committed with stock
    assert engine_tree(src_ws, src_ws.stock_commit) == src_ws.repo.git.rev_parse(f"stock:{SOURCE_REL}")
    assert engine_server(src_ws, src_ws.stock_commit) == build.binary("llama-server")  # nothing to build
    wt = src_ws.detached_worktree("_stock_check", src_ws.stock_commit)
    with run_system(src_ws, wt, "stock-check") as sp:
        assert len(sp.generate(list(range(5, 30)), 8).tokens) == 8
    assert not (src_ws.state / "engine-builds").exists()


@needs_engine
def test_a_commit_whose_engine_does_not_compile_is_a_one_line_build_crash(src_ws):
    from workbench.cascade import smoke_run

    wt = _commit(src_ws, "broken", IO_CPP, lambda p: p.write_text(p.read_text() + "\nthis is not C++;\n"))
    ok, msg = smoke_run(src_ws, wt, "broken")
    assert not ok and msg.startswith("build: the engine does not build: ") and "error" in msg, msg
    assert "\n" not in msg and "llama-io.cpp" in msg
    builds = src_ws.state / "engine-builds"
    assert [p.name for p in builds.iterdir() if not p.name.endswith(".lock")] == []  # nothing half-built left


@needs_engine
def test_a_link_out_of_the_engine_tree_is_refused_before_anything_builds(src_ws):
    from workbench.engine_source import engine_server

    _commit(src_ws, "linky", "engine/llama.cpp/src/passwd.h", lambda p: os.symlink("/etc/passwd", p))
    with pytest.raises(SystemCrash) as e:
        engine_server(src_ws, src_ws.head("linky"))
    assert e.value.kind == "build" and "passwd.h" in e.value.reason and "\n" not in e.value.reason


@needs_engine
def test_init_with_source_errors_are_one_line(tmp_path, capsys):
    assert main(["init", "demo", str(tmp_path / "a"), "--with-source"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--with-source go with --engine llama.cpp" in err, err
    assert not (tmp_path / "a").exists()


@pytest.mark.slow
@needs_engine
def test_an_edited_engine_is_rebuilt_incrementally_runs_and_is_forced(src_ws):
    """A lossless edit (a line on stderr at start-up) is built from one changed file and runs: smoke passes,
    the binary it ran holds the candidate's code, forcing is clean. An edit that emits the token before the
    sampled one builds and runs too, and forcing discards it: what the rebuilt engine says is checked, not only
    that it builds."""
    from workbench.cascade import smoke_run
    from workbench.engine_source import engine_server
    from workbench.forcing import force

    mark = f'\n#include <cstdio>\nstatic const int specpilot_mark = (std::fprintf(stderr, "{MARK}\\n"), 0);\n'
    wt = _commit(src_ws, "marked", IO_CPP, lambda p: p.write_text(p.read_text() + mark))
    t0 = time.monotonic()
    ok, msg = smoke_run(src_ws, wt, "marked")
    built_s = time.monotonic() - t0
    assert ok, msg
    server = engine_server(src_ws, src_ws.head("marked"))
    assert server.parent.parent.parent == src_ws.state / "engine-builds" and server.is_file()
    log = max((src_ws.state / "logs").glob("build-*.log"), key=lambda p: p.stat().st_mtime).read_text()
    assert "(1 changed file(s))" in log, log[-2000:]
    assert "llama-io.cpp.o" in log and "ggml-cpu.c.o" not in log  # only what changed was compiled
    assert MARK.encode() in server.read_bytes()  # the candidate's code is in the binary that ran
    assert MARK.encode() not in build.binary("llama-server").read_bytes()
    rep = force(src_ws, "marked", progress=False, record=False)
    assert rep["status"] == "keep", rep["reason"]
    print(f"incremental engine build + smoke: {built_s:.0f} s", flush=True)

    off_by_one = SAMPLED.replace("\n\n", "\n    id = id > 0 ? id - 1 : id;  // not the best token\n\n", 1)
    _commit(src_ws, "off-by-one", SAMPLING_CPP, _replace(SAMPLED, off_by_one))
    rep = force(src_ws, "off-by-one", progress=False, record=False)
    assert rep["status"] == "discard" and rep["mismatches"], rep["reason"]


@pytest.mark.slow
@needs_engine
def test_an_llm_agent_edits_the_engines_cpp_and_the_loop_evaluates_the_rebuilt_engine(src_ws):
    """One loop round with the LLM agent (a scripted OpenAI-protocol server: the test double for a hosted LLM)
    on the workspace carrying llama.cpp's source: told where the C++ is, it edits `llama-io.cpp`, its smoke run
    builds the engine and answers ok, and the cascade forces and times the rebuilt engine (a start-up line:
    clean, no gain, discarded at the bench)."""
    import json

    from tests.openai_stub import OpenAIStub, call
    from tests.test_llm_agent import block
    from workbench.loop import Loop, LoopOptions

    old = "#include <vector>\n"
    new = old + f'#include <cstdio>\nstatic const int specpilot_llm = (std::fprintf(stderr, "{MARK}\\n"), 0);\n'
    script = [call("edit", path=IO_CPP, blocks=block(old, new)), call("run_smoke"),
              call("finish", summary="a start-up line in libllama", mechanism_name="startup-line")]
    with OpenAIStub(script) as stub:
        opts = LoopOptions(rounds=1, agents=1, agent="llm", budget_minutes=30, use_global_memory=False,
                           auto_accept=False, llm={"base_url": stub.base_url, "model": "stub", "backoff_s": 0.1})
        summary = Loop(src_ws, opts).run()
    first = json.dumps(stub.requests[0]["body"]["messages"])
    assert "engine/llama.cpp/" in first and "compiler's first error" in first  # told where the C++ is
    smoke_reply = [m for m in stub.requests[2]["body"]["messages"] if m.get("role") == "tool"][-1]["content"]
    assert smoke_reply.startswith("ok: "), smoke_reply
    (att,) = summary["rounds"][0]["attempts"]
    assert "startup-line" in src_ws.repo.git.log("-1", "--format=%s", att["branch"])
    stages = [(e.stage, e.status) for e in src_ws.memory.list_evaluations(src_ws.branch(att["branch"]).id)]
    assert stages[:2] == [("smoke", "keep"), ("forcing", "keep")] and stages[2][0] == "bench", stages
    server = src_ws.state / "engine-builds" / src_ws.repo.git.rev_parse(f"{att['branch']}:engine/llama.cpp")
    assert MARK.encode() in (server / "bin" / "llama-server").read_bytes()  # the bench ran the rebuilt engine
    print(f"attempt: {att['status']}: {att['reason']}", flush=True)


@needs_engine
def test_a_commit_without_the_engine_source_is_a_one_line_build_crash(src_ws):
    from workbench.engine_source import SOURCE_REL, engine_server

    b = src_ws.create_branch("no-engine")
    g = src_ws.worktree_git("no-engine")
    g.rm("-r", "-q", SOURCE_REL)
    g.commit("-q", "-m", "drop the engine source")
    with pytest.raises(SystemCrash) as e:
        engine_server(src_ws, src_ws.head("no-engine"))
    assert e.value.kind == "build" and "has no engine/llama.cpp/" in e.value.reason, e.value.reason
    assert Path(b.worktree_path).is_dir()


@needs_engine
def test_export_upstream_writes_the_engine_part_for_git_am_on_an_upstream_checkout(src_ws, tmp_path, capsys):
    """`specpilot export --upstream DIR`: the engine source's changes with paths relative to llama.cpp's root
    (what else the mechanism changed stays out), applied by `git am` to an upstream tree; a folder that cannot
    take files is one line, exit 2, before anything is written."""
    import subprocess

    from workbench.export import record_mechanism

    comment = "\n// specpilot: exported upstream\n"
    _commit(src_ws, "exported", IO_CPP, lambda p: p.write_text(p.read_text() + comment))
    wt = Path(src_ws.branch("exported").worktree_path)
    (wt / "NOTES.md").write_text("not part of the engine\n")
    g = src_ws.worktree_git("exported")
    g.add("-A")
    g.commit("-q", "-m", "notes")
    m = record_mechanism(src_ws, "exported", "io-comment", "host-overhead", "a comment in llama-io.cpp")
    base = ["export", "--mechanism", str(m.id), "--workspace", str(src_ws.path)]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main([*base, "--out", str(tmp_path / "out0"), "--upstream", str(blocker)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a-file" in err, err
    assert not (tmp_path / "out0").exists() or not any((tmp_path / "out0").iterdir())

    assert main([*base, "--out", str(tmp_path / "out"), "--upstream", str(tmp_path / "up")]) == 0
    series = "".join(p.read_text() for p in sorted((tmp_path / "out").iterdir()))  # the edit, then the notes
    assert "engine/llama.cpp/src/llama-io.cpp" in series and "NOTES.md" in series
    ups = sorted((tmp_path / "up").iterdir())
    assert len(ups) == 1 and "a/src/llama-io.cpp" in ups[0].read_text()
    assert "a/engine/llama.cpp" not in ups[0].read_text() and "NOTES.md" not in ups[0].read_text()
    tree = tmp_path / "llama.cpp"  # the upstream file as the sdist ships it, in a repository of its own
    (tree / "src").mkdir(parents=True)
    (tree / "src" / "llama-io.cpp").write_bytes((build.source_dir() / "src" / "llama-io.cpp").read_bytes())
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "upstream"], ["am", "-q", str(ups[0])]):
        subprocess.run(["git", "-C", str(tree), *cmd], check=True, env=env, capture_output=True)
    assert (tree / "src" / "llama-io.cpp").read_text().endswith(comment)
