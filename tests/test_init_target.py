"""`specpilot init --target DIR [--drafter DIR] [--prompts FILE] PATH`: a workspace for the user's own model.

Tiny random Llamas with the demo's tokenizer stand in for the user's models. Every bad input is one line
on stderr, exit 2, and leaves nothing behind; a branch that cannot be created leaves no half branch.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_runs import run_many
from conftest import write_jsonl

from decoder.models import DEMO_DIR
from workbench.workspace import Workspace, WorkspaceError, init_target
from workbench.workspace_cli import main as workspace_main

ROOT = os.geteuid() == 0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _save_llama(out: Path, *, hidden: int, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=6144, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for f in TOKENIZER_FILES:  # the demo's tokenizer: 6144 tokens
        shutil.copy(DEMO_DIR / "target" / f, out / f)
    for p in (out, *out.iterdir()):  # save_pretrained writes the weights 600; a sandboxed candidate reads them
        p.chmod(p.stat().st_mode | 0o005 if p.is_dir() else p.stat().st_mode | 0o004)
    return out


@pytest.fixture(scope="module")
def m(tmp_path_factory):
    """The user's files: a target, a smaller drafter, drafters that do not fit, prompt files."""
    root = tmp_path_factory.mktemp("user")
    target = _save_llama(root / "target", hidden=32, seed=0)
    drafter = _save_llama(root / "drafter", hidden=16, seed=1)
    other_tok = root / "other-tokenizer"
    shutil.copytree(drafter, other_tok)
    tj = json.loads((other_tok / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    vocab["def"], vocab["class"] = vocab["class"], vocab["def"]
    (other_tok / "tokenizer.json").write_text(json.dumps(tj))
    wide = root / "wide-vocab"
    shutil.copytree(drafter, wide)
    cfg = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**cfg, "vocab_size": 6208}))
    broken_tok = root / "broken-tokenizer"
    shutil.copytree(target, broken_tok)
    (broken_tok / "tokenizer.json").write_text('{"model": ')
    no_config = root / "no-config"
    no_config.mkdir()
    for f in TOKENIZER_FILES:
        shutil.copy(DEMO_DIR / "target" / f, no_config / f)
    jsonl = write_jsonl(root / "prompts.jsonl", [
        {"id": "fib", "text": "def fib(n):\n    if n < 2:\n        return n\n", "domain": "code"},
        {"id": "sort", "text": "def sort_items(items):\n    return sorted(", "domain": "code"},
        {"text": "The quick brown fox jumps over", "domain": "prose"},
        {"id": "main", "text": "import os\nimport sys\n\ndef main():\n"}])
    txt = root / "prompts.txt"
    txt.write_text("def add(a, b):\n\nclass Point:\n")
    one = write_jsonl(root / "one.jsonl", [{"text": "def f():"}])
    latin1 = root / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait\nna\xefve\n".encode("latin-1"))
    bad_json = write_jsonl(root / "bad.jsonl", [{"text": "def f():"}, "{not json"])
    dup = write_jsonl(root / "dup.jsonl", [{"id": "a", "text": "x = 1"}, {"id": "a", "text": "y = 2"}])
    a_file = root / "a-file"
    a_file.write_text("not a folder")
    return SimpleNamespace(root=root, target=target, drafter=drafter, other_tok=other_tok, wide=wide,
                           broken_tok=broken_tok, no_config=no_config, jsonl=jsonl, txt=txt, one=one,
                           latin1=latin1, bad_json=bad_json, dup=dup, a_file=a_file)


@pytest.fixture(scope="module")
def cli(m, tmp_path_factory) -> dict:
    """The journey's two `specpilot init` command lines, each into a folder of its own, run one after the other
    in one child interpreter (`cli_runs.run_many`: each captured as a process of its own)."""
    root = tmp_path_factory.mktemp("cli")
    good, bad = root / "good", root / "bad"
    good.mkdir()
    bad.mkdir()
    runs = run_many("workbench.cli", {
        "good": ["init", "--target", str(m.target), "--drafter", str(m.drafter), "--prompts", str(m.jsonl), "--name",
                 "my-model", "--json", str(good / "ws")],
        "bad": ["init", "--target", str(m.target), "--drafter", str(m.other_tok), "--prompts", str(m.jsonl),
                str(bad / "ws")],
    })
    return {"good": (good, runs["good"]), "bad": (bad, runs["bad"])}


def _one_line(stderr: str, *needles: str) -> str:
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _init(capsys, *args: str) -> tuple[int, str, str]:
    """`specpilot init ARGS` in this process (the same parser and code as the CLI; no interpreter start-up)."""
    rc = workspace_main(["init", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


# -- the user's journey, through real processes ------------------------------------------------------


def test_init_with_a_drafter_through_the_cli(m, cli):
    tmp_path, r = cli["good"]
    ws_path = tmp_path / "ws"
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["workspace"] == str(ws_path.resolve()) and out["name"] == "my-model"
    assert out["target"] == str(m.target) and out["drafter"] == str(m.drafter)
    assert out["visible"] + out["hidden"] == 4 and out["hidden"] >= 1
    assert "created workspace my-model" in r.stderr and r.stderr.count("\n") == 1
    toml = tomllib.loads((ws_path / "specpilot.toml").read_text())
    assert toml["deployment"]["target"] == str(m.target) and toml["deployment"]["drafter"] == str(m.drafter)
    assert "--drafter" in toml["system"]["entry"]
    stock = tomllib.loads((ws_path / "system.toml").read_text())["decode"]
    assert stock["drafter"] == "draft-model" and stock["lean_forward"] is False and stock["method"] == "sd"
    ws = Workspace(ws_path)
    assert ws.repo.commit("stock").hexsha == ws.repo.head.commit.hexsha and not ws.repo.is_dirty()
    visible = [json.loads(x) for x in (ws_path / "prompts" / "visible.jsonl").read_text().splitlines()]
    hidden = [json.loads(x) for x in ws.hidden_prompts_path().read_text().splitlines()]
    assert {r["id"] for r in visible + hidden} == {"fib", "sort", "prompts-3", "main"}
    assert {r.get("domain") for r in visible + hidden} == {"code", "prose", None}
    assert "specpilot train drafter" in (ws_path / "README.md").read_text()
    assert _listing(tmp_path) == ["ws"]  # no .partial folder left


def test_init_without_a_drafter_drafts_with_ngrams_and_forces_clean(m, tmp_path, capsys):
    from workbench.forcing import force

    ws_path = tmp_path / "ws"
    rc, out, err = _init(capsys, "--target", str(m.target), "--prompts", str(m.txt), str(ws_path))
    assert rc == 0, err
    assert out.strip() == str(ws_path.resolve()) and "n-gram drafting" in err
    toml_text = (ws_path / "specpilot.toml").read_text()
    toml = tomllib.loads(toml_text)
    assert "drafter" not in toml["deployment"] and "--drafter" not in toml["system"]["entry"]
    assert tomllib.loads((ws_path / "system.toml").read_text())["decode"]["drafter"] == "ngram"
    rows = [json.loads(x) for x in (ws_path / "prompts" / "visible.jsonl").read_text().splitlines()]
    rows += [json.loads(x) for x in (ws_path / ".specpilot" / "hidden.jsonl").read_text().splitlines()]
    assert sorted(r["text"] for r in rows) == ["class Point:", "def add(a, b):"]
    # A short forcing run keeps this test quick; the workspace's own file is where a user tunes it.
    (ws_path / "specpilot.toml").write_text(toml_text.replace("max_new_tokens = 64", "max_new_tokens = 8"))
    assert workspace_main(["branch", "create", "trivial", "--workspace", str(ws_path)]) == 0
    ws = Workspace(ws_path)
    with open(ws.worktree_path("trivial") / "decoder" / "generate.py", "a") as f:
        f.write("# a comment\n")
    ws.worktree_git("trivial").commit("-qam", "a comment")
    report = force(ws, "trivial", progress=False)  # the system runs through the harness, as `specpilot force`
    assert report["status"] == "keep", report
    ws.close()


# -- bad input: one line, exit 2, nothing created ----------------------------------------------------


def test_a_bad_drafter_through_the_cli_is_one_line_and_leaves_nothing(cli):
    tmp_path, r = cli["bad"]
    assert r.returncode == 2
    _one_line(r.stderr, "different tokenizers")
    assert _listing(tmp_path) == []


@pytest.mark.parametrize("case", [
    "target-missing", "target-no-config", "target-broken-tokenizer",
    "drafter-missing", "drafter-other-tokenizer", "drafter-wide-vocab",
    "prompts-missing", "prompts-not-utf8", "prompts-one", "prompts-bad-json", "prompts-duplicate-id",
    "path-is-a-file", "path-under-a-file", "path-not-empty", "bad-name", "no-prompts-other-tokenizer",
    "drafter-without-target", "target-without-path", "target-two-paths", "batch-over-prompts"])
def test_bad_input(m, tmp_path, capsys, case):
    ws = tmp_path / "ws"
    t, p, nope = ["--target", str(m.target)], ["--prompts", str(m.jsonl)], str(tmp_path / "nope")
    args, needles = {
        "target-missing": (["--target", nope, *p, str(ws)], [nope, "does not exist"]),
        "target-no-config": (["--target", str(m.no_config), *p, str(ws)], [str(m.no_config), "config.json"]),
        "target-broken-tokenizer": (["--target", str(m.broken_tok), *p, str(ws)], [str(m.broken_tok), "tokenizer"]),
        "drafter-missing": ([*t, "--drafter", nope, *p, str(ws)], [nope, "does not exist"]),
        "drafter-other-tokenizer": ([*t, "--drafter", str(m.other_tok), *p, str(ws)], ["different tokenizers"]),
        "drafter-wide-vocab": ([*t, "--drafter", str(m.wide), *p, str(ws)], [str(m.wide), "vocab_size 6208"]),
        "prompts-missing": ([*t, "--prompts", str(tmp_path / "p.jsonl"), str(ws)], [str(tmp_path / "p.jsonl")]),
        "prompts-not-utf8": ([*t, "--prompts", str(m.latin1), str(ws)], [str(m.latin1), "not UTF-8", "0xe9"]),
        "prompts-one": ([*t, "--prompts", str(m.one), str(ws)], [str(m.one), "at least 2"]),
        "prompts-bad-json": ([*t, "--prompts", str(m.bad_json), str(ws)], [f"{m.bad_json}:2", "not valid JSON"]),
        "prompts-duplicate-id": ([*t, "--prompts", str(m.dup), str(ws)], [f"{m.dup}:2", "'a'", "unique"]),
        "path-is-a-file": ([*t, *p, str(m.a_file)], [str(m.a_file), "is a file"]),
        "path-under-a-file": ([*t, *p, str(m.a_file / "ws")], [str(m.a_file), "not a folder"]),
        "path-not-empty": ([*t, *p, str(m.root)], [str(m.root), "not empty"]),
        "bad-name": ([*t, *p, "--name", "my model", str(ws)], ["'my model'"]),
        "no-prompts-other-tokenizer": (["--target", str(m.other_tok), str(ws)], ["--prompts FILE"]),
        "drafter-without-target": (["--drafter", str(m.drafter), str(ws)], ["--target"]),
        "target-without-path": ([*t, *p], ["PATH"]),
        "target-two-paths": ([*t, *p, str(ws), str(tmp_path / "other")], ["exactly one PATH"]),
        "batch-over-prompts": ([*t, *p, "--batch-sizes", "1,8", str(ws)],
                               ["load batch size 8 needs at least 8 distinct prompts", "has 4", "--batch-sizes"]),
    }[case]
    before = _listing(tmp_path)
    rc, out, err = _init(capsys, *args)
    assert rc == 2 and out == ""
    _one_line(err, *needles)
    assert _listing(tmp_path) == before and not ws.exists()


def test_without_prompts_the_demo_tokenizer_gets_the_demo_prompts(m, tmp_path):
    ws = init_target(tmp_path / "ws", m.target)
    demo = [json.loads(x) for x in (DEMO_DIR / "prompts" / "code.jsonl").read_text().splitlines() if x.strip()]
    visible = (ws.path / "prompts" / "visible.jsonl").read_text().splitlines()
    hidden = ws.hidden_prompts_path().read_text().splitlines()
    assert (len(visible), len(hidden)) == (len(demo) - 6, 6)  # split like the demo workspace
    assert ws.config.name == "target" and ws.config.drafter is None
    ws.close()
    loaded = init_target(tmp_path / "ws8", m.target, batch_sizes=[1, 8])  # a timed batch of 8: 8 hidden prompts
    hidden = loaded.hidden_prompts_path().read_text().splitlines()
    assert len(hidden) == 8 and len((loaded.path / "prompts" / "visible.jsonl").read_text().splitlines()) == 8
    loaded.close()


@pytest.mark.skipif(not ROOT, reason="as root, the sandbox runs candidates as another uid")
def test_weights_the_sandbox_cannot_read_are_refused(m, tmp_path):
    from workbench.harness import sandbox_status

    if not sandbox_status()[0]:
        pytest.skip("no sandbox here: the candidate runs as this user")
    closed = tmp_path / "closed"
    shutil.copytree(m.target, closed)
    (closed / "model.safetensors").chmod(0o600)
    with pytest.raises(WorkspaceError, match=r"chmod -R o\+rX"):
        init_target(tmp_path / "ws", closed, prompts=m.jsonl)
    assert _listing(tmp_path) == ["closed"]


def test_init_demo_still_works_and_refuses_a_file(tmp_path, capsys):
    rc, out, err = _init(capsys, "demo", str(tmp_path / "d"), "--json")
    assert rc == 0 and set(json.loads(out)) == {"workspace", "stock_commit"}
    assert err.startswith("created demo workspace at ")
    (tmp_path / "f").write_text("x")
    for path in (tmp_path / "f", tmp_path / "f" / "ws"):
        rc, out, err = _init(capsys, "demo", str(path))
        assert rc == 2
        _one_line(err, str(tmp_path / "f"))
    rc, _, err = _init(capsys, "demo", str(tmp_path / "e"), "--prompts", "poems")
    assert rc == 2 and "code and prose" in _one_line(err)
    assert _listing(tmp_path) == ["d", "f"]


# -- read-only folders ----------------------------------------------------------------------------------


@pytest.mark.skipif(ROOT, reason="root writes through chmod")
def test_read_only_parent_is_refused(m, tmp_path, capsys):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        rc, _, err = _init(capsys, "--target", str(m.target), "--prompts", str(m.jsonl), str(parent / "ws"))
        assert rc == 2
        _one_line(err, str(parent), "not writable")
        assert _listing(parent) == []
    finally:
        parent.chmod(0o755)


@pytest.fixture
def small_ws(m, tmp_path):
    ws = init_target(tmp_path / "ws", m.target, prompts=m.jsonl)
    yield ws
    ws.close()


def _no_half_branch(ws: Workspace, name: str) -> None:
    assert name not in ws.repo.heads
    assert not ws.worktree_path(name).exists()
    assert str(ws.worktree_path(name)) not in ws.repo.git.worktree("list")
    assert ws.find_branch(name) is None
    assert not ws.repo.git.config("--get-regexp", "specpilotbase", with_exceptions=False)


@pytest.mark.skipif(ROOT, reason="root writes through chmod")
def test_branch_in_a_read_only_workspace_fails_in_one_line(small_ws, capsys):
    ws = small_ws
    folders = [ws.state / "worktrees", Path(ws.repo.git_dir)]
    for f in folders:
        f.chmod(0o555)
    try:
        rc = workspace_main(["branch", "create", "b1", "--workspace", str(ws.path)])
        assert rc == 2
        _one_line(capsys.readouterr().err, "b1", "not writable", "chmod")
    finally:
        for f in folders:
            f.chmod(0o755)
    _no_half_branch(ws, "b1")
    assert workspace_main(["branch", "create", "b1", "--workspace", str(ws.path)]) == 0


def test_a_branch_that_fails_half_way_is_undone(small_ws, monkeypatch):
    """The store refuses the row after git made the branch and its worktree (a read-only memory.db): git's
    half is removed, so the same name can be created once the workspace is writable again."""
    ws = small_ws
    real = ws.memory.add_branch

    def read_only(*a, **k):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(ws.memory, "add_branch", read_only)
    with pytest.raises(WorkspaceError, match="attempt to write a readonly database; nothing was created") as e:
        ws.create_branch("b2")
    assert "\n" not in str(e.value)
    _no_half_branch(ws, "b2")
    monkeypatch.setattr(ws.memory, "add_branch", real)
    assert ws.create_branch("b2").name == "b2" and ws.worktree_path("b2").is_dir()


@pytest.mark.skipif(not ROOT or not shutil.which("unshare"), reason="a read-only bind mount needs root")
def test_branch_and_init_under_a_read_only_mount(m, small_ws, tmp_path):
    """Read-only for root too: the folder is bind-mounted read-only in a private mount namespace."""
    ws = small_ws

    def in_ro(folder: Path, *args: str) -> subprocess.CompletedProcess:
        cmd = " ".join(f"'{a}'" for a in (sys.executable, "-m", "workbench.cli", *args))
        return subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind -o ro '{folder}' '{folder}' && {cmd}"],
                              capture_output=True, text=True, timeout=300)

    r = in_ro(ws.state / "worktrees", "branch", "create", "b3", "--workspace", str(ws.path))
    if "mount" in r.stderr and r.returncode != 2:
        pytest.skip(f"no bind mounts here: {r.stderr.strip()}")
    assert r.returncode == 2
    _one_line(r.stderr, "b3", "not writable")
    _no_half_branch(ws, "b3")
    parent = tmp_path / "ro"
    parent.mkdir()
    r = in_ro(parent, "init", "--target", str(m.target), "--prompts", str(m.jsonl), str(parent / "ws"))
    assert r.returncode == 2
    _one_line(r.stderr, str(parent), "not writable")
    assert _listing(parent) == []
