"""The LLM agent end to end against a scripted OpenAI-compatible server (tests/openai_stub.py), on real git."""

from __future__ import annotations

import json
import os
import queue
import threading
from pathlib import Path

import git
import pytest
from conftest import needs_demo
from openai_stub import OpenAIStub, call, calls, http_error, prompt_tokens, say, slow

from decoder.contract import data_dir
from decoder.engines import EngineError
from decoder.engines import llamacpp_build as llamacpp
from decoder.engines.llamacpp import LlamaServer, ServerSettings
from decoder.engines.smollm2 import ModelFetchError, smollm2_gguf
from workbench.agents.base import AgentContext, Direction, SmokeResult
from workbench.agents.edits import EditBlock, EditError, apply_blocks, nearest_lines, parse_blocks
from workbench.agents.llm import (
    NUDGE,
    TOOL_NAMES,
    LLMAgent,
    LLMConfig,
    LLMConfigError,
    ToolError,
    WorktreeTools,
    redact,
)

KEY = "sk-test-9f8e7d6c5b4a39281706"
# The user's engine build and model cache, read before conftest gives each test a private data dir: the
# llama.cpp test reuses them (the build is read only; SmolLM2 is fetched into the cache once).
ENGINES = llamacpp.engines_root()
USER_MODELS = data_dir() / "models"

GENERATE = '''"""A toy decoder."""


def draft(tokens, k):
    out = []
    for t in tokens[-k:]:
        out.append(t + 1)
    return out


def verify(draft_tokens, target_tokens):
    n = 0
    for a, b in zip(draft_tokens, target_tokens):
        if a != b:
            break
        n += 1
    return n
'''
SPECPILOT_TOML = '''[deployment]
name = "toy"
target = "models/target"

[system]
entry = ["{python}", "-m", "decoder.serve"]
config = "system.toml"
protected = ["specpilot.toml", "prompts/", "decoder/serve.py", ".gitignore"]
'''


def block(search: str, replace: str) -> str:
    return f"<<<<<<< SEARCH\n{search}=======\n{replace}>>>>>>> REPLACE\n"


@pytest.fixture
def worktree(tmp_path: Path) -> Path:
    """A small workspace-shaped repository (stock tag) with branch llm-1 checked out in its own worktree."""
    root = tmp_path / "ws"
    (root / "decoder").mkdir(parents=True)
    (root / "prompts").mkdir()
    (root / "specpilot.toml").write_text(SPECPILOT_TOML)
    (root / "system.toml").write_text('[decode]\nmethod = "sd"\ndraft_len = 3\n')
    (root / "decoder" / "generate.py").write_text(GENERATE)
    (root / "decoder" / "serve.py").write_text("print('serve')\n")
    (root / "prompts" / "visible.jsonl").write_text(json.dumps({"id": "p1", "text": "def f(x):"}) + "\n")
    (root / ".gitignore").write_text(".specpilot/\n__pycache__/\n")
    repo = git.Repo.init(root, initial_branch="main")
    with repo.config_writer() as w:
        w.set_value("user", "name", "Test").set_value("user", "email", "test@localhost")
    repo.git.add("-A")
    repo.index.commit("stock")
    repo.create_tag("stock")
    wt = root / ".specpilot" / "worktrees" / "llm-1"
    repo.git.worktree("add", "-b", "llm-1", str(wt), "stock")
    return wt


def make_ctx(wt: Path, events: list, smoke=None, branch: str = "llm-1") -> AgentContext:
    direction = Direction("drafting", 4.2, "drafting costs 4.2 ms/token over its ceiling",
                          mechanisms=[{"name": "draft_len", "summary": "tokens drafted per step"}],
                          memory=[{"name": "ngram_drafter", "summary": "n-gram drafting on code"}])
    return AgentContext(
        branch=branch, worktree=wt, direction=direction,
        gap_breakdown=[{"family": "drafting", "ms_per_token": 4.2}, {"family": "weights", "ms_per_token": 1.0}],
        visible_prompts=[{"id": "p1", "text": "def f(x):"}],
        smoke=smoke or (lambda: SmokeResult(True, "12.0 tok/s, matches stock")),
        log=lambda kind, message, payload: events.append((kind, message, json.loads(json.dumps(payload)))))


def config(stub: OpenAIStub, **kw) -> LLMConfig:
    # the stub answers at once: the timeouts are request_timeout_s, not a prompt's predicted prefill time
    base = {"base_url": stub.base_url, "model": "stub-coder", "api_key": KEY, "request_timeout_s": 5.0,
            "retries": 3, "backoff_s": 0.01, "wall_s": 60.0, "prefill_tokens_per_s": 1e6,
            "decode_tokens_per_s": 1e6}
    return LLMConfig(**{**base, **kw})


def tool_results(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "tool"]


def branch_repo(wt: Path) -> git.Repo:
    return git.Repo(wt)


def varied(name: str, **kw):
    """A stub step: the same tool call with a different pattern each time (identical replies end a run)."""
    return lambda body: call(name, pattern=f"x{len(body['messages'])}", **kw)


# -- the scripted session ---------------------------------------------------------------------------------------


def test_scripted_session_recovers_from_every_failure_and_commits(worktree: Path):
    events: list = []
    smoke_heads: list[str] = []

    def smoke() -> SmokeResult:
        smoke_heads.append(git.Repo(worktree).git.show("HEAD:system.toml"))
        return SmokeResult(True, "11.5 tok/s, matches stock on p1")

    ctx = make_ctx(worktree, events, smoke)
    wrong = block("    for t in tokens[-k:]:\n        out.append(t + 2)\n", "    out = list(tokens)\n")
    # whitespace-tolerant: the model's indentation is off by four spaces and it has trailing blanks
    right = block("for t in tokens[-k:]:   \n    out.append(t + 1)\n",
                  "for t in tokens[-k:]:\n    out.append(t + 1)\n    out.append(t + 2)\n")

    def steer(body):
        ctx.steering.put(f"try draft_len 4 first (my key is {KEY})")
        return call("read_file", path="system.toml")

    script = [
        call("list_files", path="."),                                          # 0
        call("read_file", raw_arguments='{"path": "decoder/generate.py", '),   # 1 malformed JSON
        call("rewrite_everything", path="decoder"),                            # 2 unknown tool
        call("edit", path="decoder/generate.py", blocks=wrong),                # 3 SEARCH does not match
        http_error(500),                                                       # 4 retried
        slow(1.5, say("this reply comes too late")),                           # 5 timeout, retried
        call("edit", path="decoder/generate.py", blocks=right),                # 6 corrected block
        steer,                                                                 # 7 steering arrives mid-run
        call("edit", path="system.toml", blocks=block("draft_len = 3\n", "draft_len = 4\n")),  # 8
        call("run_smoke"),                                                     # 9
        say("All done, I believe."),                                           # 10 no tool call: nudged
        calls([("finish", json.dumps({"summary": "draft 4 tokens, two per position",
                                      "mechanism_name": "draft len 4"}))]),    # 11
    ]
    with OpenAIStub(script) as stub:
        result = LLMAgent(config(stub, request_timeout_s=0.5)).run(ctx)
    reqs = stub.requests

    assert result.committed, result.message
    assert result.mechanism == "draft_len_4"
    assert len(reqs) == 12
    # the branch carries one commit on stock, naming the direction, with both changes (smoke commit squashed)
    repo = branch_repo(worktree)
    assert repo.git.rev_list("--count", "stock..llm-1") == "1"
    head = repo.commit("llm-1")
    assert head.message.startswith("llm[drafting] draft_len_4: draft 4 tokens")
    assert "Direction: drafting gap" in head.message
    assert sorted(repo.git.diff("--name-only", "stock", "llm-1").splitlines()) == ["decoder/generate.py",
                                                                                 "system.toml"]
    assert "        out.append(t + 1)\n        out.append(t + 2)\n" in repo.git.show("llm-1:decoder/generate.py")
    assert "draft_len = 4" in repo.git.show("llm-1:system.toml")
    assert not repo.is_dirty(untracked_files=True)
    assert result.details["files"] == ["decoder/generate.py", "system.toml"]
    assert result.details["tool_errors"] == 3 and result.details["retries"] == 2
    # run_smoke ran the committed work
    assert smoke_heads == ['[decode]\nmethod = "sd"\ndraft_len = 4']

    # the first request: rules, direction, visible prompts, tools
    first = stub.messages(0)
    assert "token-identical" in first[0]["content"] and "finish" in first[0]["content"]
    assert '"family": "drafting"' in first[1]["content"] and "ngram_drafter" in first[1]["content"]
    assert "def f(x):" in first[1]["content"]
    assert [t["function"]["name"] for t in reqs[0]["body"]["tools"]] == TOOL_NAMES
    assert reqs[0]["body"]["model"] == "stub-coder"
    assert reqs[0]["headers"]["authorization"] == f"Bearer {KEY}"

    # every failure went back to the model as a tool result, and the loop carried on
    assert "decoder/generate.py" in tool_results(stub.messages(1))[-1]
    assert "not valid JSON" in tool_results(stub.messages(2))[-1]
    assert "unknown tool 'rewrite_everything'" in tool_results(stub.messages(3))[-1]
    mismatch = tool_results(stub.messages(4))[-1]
    assert "not applied" in mismatch and "Nearest lines" in mismatch
    assert "    6 |     for t in tokens[-k:]:" in mismatch and "    7 |         out.append(t + 1)" in mismatch
    # the 500 and the timeout were retried with the same conversation
    assert stub.messages(4) == stub.messages(5) == stub.messages(6)
    assert tool_results(stub.messages(7))[-1].startswith("edited decoder/generate.py")
    # the steering message joined the conversation right after the turn it arrived in
    assert not any(m["role"] == "user" and "Engineer:" in m["content"] for m in stub.messages(7))
    steering = stub.messages(8)[-1]
    assert steering["role"] == "user" and steering["content"].startswith("Engineer: try draft_len 4 first")
    assert tool_results(stub.messages(10))[-1].startswith("ok: 11.5 tok/s")
    assert stub.messages(11)[-1] == {"role": "user", "content": NUDGE}

    # the ledger: every request, response and retry, and never the key
    kinds = [k for k, _, _ in events]
    assert kinds[0] == "llm.start" and kinds[-1] == "llm.end"
    assert kinds.count("llm.request") == 12 and kinds.count("llm.response") == 10 and kinds.count("llm.retry") == 2
    retries = [m for k, m, _ in events if k == "llm.retry"]
    assert "HTTP 500" in retries[0] and "timed out" in retries[1]
    dumped = json.dumps(events)
    assert KEY not in dumped and "[redacted]" in dumped
    assert "try draft_len 4 first" in dumped


def test_mechanism_commit_survives_a_multi_call_reply(worktree: Path):
    events: list = []
    ctx = make_ctx(worktree, events)
    edit = json.dumps({"path": "system.toml", "blocks": block("draft_len = 3\n", "draft_len = 5\n")})
    done = json.dumps({"summary": "longer drafts", "mechanism_name": "draft_len_5"})
    with OpenAIStub([calls([("edit", edit), ("finish", done)])]) as stub:
        result = LLMAgent(config(stub)).run(ctx)
    assert result.committed and result.mechanism == "draft_len_5"
    assert "draft_len = 5" in branch_repo(worktree).git.show("llm-1:system.toml")


# -- budgets, stop, failures ------------------------------------------------------------------------------------


def test_turn_budget_stops_a_model_that_never_finishes(worktree: Path):
    events: list = []
    with OpenAIStub([], after=varied("grep")) as stub:
        result = LLMAgent(config(stub, max_turns=3)).run(make_ctx(worktree, events))
    assert not result.committed
    assert result.message == "turn budget spent (3 turns) before finish; no change made"
    assert len(stub.requests) == 3
    assert branch_repo(worktree).git.rev_list("--count", "stock..llm-1") == "0"


def test_token_budget_commits_the_work_so_far(worktree: Path):
    events: list = []
    script = [call("edit", path="decoder/fast.py", blocks=block("", "FAST = True\n"), tokens=1000)]
    with OpenAIStub(script, after=varied("grep", tokens=1000)) as stub:
        result = LLMAgent(config(stub, max_tokens_total=2500)).run(make_ctx(worktree, events))
    assert result.committed
    assert result.message.startswith("token budget spent (3000 of 2500 tokens) before finish; committed")
    assert len(stub.requests) == 3
    repo = branch_repo(worktree)
    assert repo.git.show("llm-1:decoder/fast.py") == "FAST = True"
    assert repo.commit("llm-1").message.startswith("llm[drafting] llm_drafting: work in progress, token budget")


def test_wall_budget_stops_a_slow_model(worktree: Path):
    events: list = []
    with OpenAIStub([], after=lambda body: slow(0.3, varied("grep")(body))) as stub:
        result = LLMAgent(config(stub, wall_s=1.0)).run(make_ctx(worktree, events))
    assert not result.committed
    assert "wall-time budget" in result.message
    assert result.details["wall_s"] < 2.5
    assert 2 <= len(stub.requests) <= 5


def test_stop_ends_at_the_next_turn_boundary(worktree: Path):
    events: list = []
    ctx = make_ctx(worktree, events)

    def stop_now(body):
        ctx.stop.set()
        return call("edit", path="system.toml", blocks=block("draft_len = 3\n", "draft_len = 2\n"))

    with OpenAIStub([call("list_files"), stop_now], after=lambda body: call("list_files")) as stub:
        result = LLMAgent(config(stub)).run(ctx)
    assert len(stub.requests) == 2  # the edit of the turn in flight is done, then no further request
    assert result.committed and result.message.startswith("stopped by the engineer; committed")


def test_retries_give_up_with_a_one_line_reason(worktree: Path):
    events: list = []
    with OpenAIStub([], after=http_error(503)) as stub:
        result = LLMAgent(config(stub, retries=2)).run(make_ctx(worktree, events))
    assert not result.committed
    assert result.message == "LLM request failed: HTTP 503; gave up after 3 attempts; no change made"
    assert len(stub.requests) == 3


def test_client_errors_are_not_retried(worktree: Path):
    events: list = []
    with OpenAIStub([http_error(401, "invalid api key")]) as stub:
        result = LLMAgent(config(stub)).run(make_ctx(worktree, events))
    assert len(stub.requests) == 1
    assert result.message.startswith("LLM request failed: HTTP 401")
    assert KEY not in json.dumps(events)


def test_unreachable_server_is_retried_then_reported(worktree: Path):
    with OpenAIStub([]) as stub:
        url = stub.base_url  # the port is free again once the stub is closed
    result = LLMAgent(LLMConfig(base_url=url, model="m", api_key=KEY, retries=1, backoff_s=0.01,
                                request_timeout_s=2)).run(make_ctx(worktree, []))
    assert not result.committed and "connection error" in result.message


def test_wrong_branch_checked_out_does_nothing(worktree: Path):
    with OpenAIStub([]) as stub:
        result = LLMAgent(config(stub)).run(make_ctx(worktree, [], branch="llm-2"))
    assert not result.committed and "is on llm-1, not branch llm-2" in result.message
    assert stub.requests == []


# -- the worktree tools ------------------------------------------------------------------------------------------


def test_paths_stay_inside_the_worktree(worktree: Path, tmp_path: Path):
    tools = WorktreeTools(worktree)
    (tmp_path / "secret.txt").write_text("hidden prompt\n")
    os.symlink(tmp_path / "secret.txt", worktree / "link.txt")
    for bad, why in [("/etc/passwd", "absolute"), ("../../hidden.jsonl", "'..'"), ("decoder/../../x", "'..'"),
                     (".git", ".git is off limits"), ("link.txt", "symlink"), ("C:\\x", "absolute")]:
        with pytest.raises(ToolError, match=why):
            tools.read_file(bad)
    for protected in ("specpilot.toml", "prompts/visible.jsonl", "decoder/serve.py"):
        with pytest.raises(ToolError, match="protected"):
            tools.edit(protected, block("", "x\n"))
    with pytest.raises(ToolError, match="off limits"):
        tools.edit(".git/hooks/pre-commit", block("", "rm -rf /\n"))
    assert not any(ln.startswith(".git ") for ln in tools.list_files(".").splitlines())
    assert "decoder/generate.py" in tools.list_files(".")


def test_read_and_grep(worktree: Path):
    tools = WorktreeTools(worktree)
    out = tools.read_file("decoder/generate.py", start_line=4, end_line=5)
    assert out == "decoder/generate.py: lines 4-5 of 17\n    4 | def draft(tokens, k):\n    5 |     out = []"
    assert tools.grep(r"def (draft|verify)") == ("decoder/generate.py:4: def draft(tokens, k):\n"
                                                  "decoder/generate.py:11: def verify(draft_tokens, target_tokens):")
    with pytest.raises(ToolError, match="bad regular expression"):
        tools.grep("(")
    with pytest.raises(ToolError, match="line number"):
        tools.read_file("system.toml", start_line="two")


def test_edit_is_all_or_nothing(worktree: Path):
    tools = WorktreeTools(worktree)
    blocks = block("draft_len = 3\n", "draft_len = 4\n") + block("nope = 1\n", "x = 2\n")
    with pytest.raises(ToolError, match="nothing written: block 2 of 2"):
        tools.edit("system.toml", blocks)
    assert "draft_len = 3" in (worktree / "system.toml").read_text()
    (worktree / "dos.txt").write_bytes(b"a = 1\r\nb = 2\r\n")
    assert tools.edit("dos.txt", block("a = 1\n", "a = 3\n")) == "edited dos.txt (2 -> 2 lines)"
    assert (worktree / "dos.txt").read_bytes() == b"a = 3\r\nb = 2\r\n"  # the file keeps its line endings


# -- SEARCH/REPLACE ---------------------------------------------------------------------------------------------


def test_blocks_match_exactly_then_tolerantly():
    text = "def f():\n    a = 1  \n    return a\n"
    assert apply_blocks(text, [EditBlock("    a = 1  \n", "    a = 2\n")]) == "def f():\n    a = 2\n    return a\n"
    assert apply_blocks(text, [EditBlock("    a = 1\n", "    a = 3\n")]) == "def f():\n    a = 3\n    return a\n"
    # indentation off: the replacement is shifted by the same offset
    assert apply_blocks(text, [EditBlock("a = 1\nreturn a\n", "a = 1\nif a:\n    return a\n")]) == \
        "def f():\n    a = 1\n    if a:\n        return a\n"
    assert apply_blocks("x\n", [EditBlock("x\n", "y\n")]) == "y\n"
    assert apply_blocks("x", [EditBlock("x\n", "y\n")]) == "y"  # no final newline in the file: none added
    assert apply_blocks(None, [EditBlock("", "new\n")]) == "new\n"


def test_blocks_refuse_ambiguity_and_explain_misses():
    with pytest.raises(EditError, match=r"matches 2 places \(exactly\), starting at lines 1, 3"):
        apply_blocks("a\nb\na\nb\n", [EditBlock("a\n", "c\n")])
    with pytest.raises(EditError, match="only creates a new file"):
        apply_blocks("a\n", [EditBlock("", "b\n")])
    with pytest.raises(EditError, match="does not exist"):
        apply_blocks(None, [EditBlock("a\n", "b\n")])
    lines = [f"line {i}\n" for i in range(1, 40)] + ["    total = price * count\n", "    return total\n"]
    hint = nearest_lines(lines, ["    total = price * qty\n", "    return total\n"])
    assert "lines 40-41" in hint and "   40 |     total = price * count" in hint


def test_parse_blocks():
    text = ("Here is the change:\n```python\n" + block("a\n", "b\n") + "```\n" + block("c\n", ""))
    assert parse_blocks(text) == [EditBlock("a\n", "b\n"), EditBlock("c\n", "")]
    for bad, why in [("no blocks here", "no SEARCH/REPLACE block"),
                     ("<<<<<<< SEARCH\na\n>>>>>>> REPLACE\n", "expected '======='"),
                     ("<<<<<<< SEARCH\na\n=======\nb\n", "no '>>>>>>> REPLACE'"),
                     ("=======\n", "outside a block")]:
        with pytest.raises(EditError, match=why):
            parse_blocks(bad)


# -- configuration and secrets -----------------------------------------------------------------------------------


def test_config_from_env_and_section():
    env = {"SPECPILOT_LLM_BASE_URL": "http://gpu-box:8000/v1", "SPECPILOT_LLM_MODEL": "qwen",
           "OPENAI_API_KEY": "sk-fallback-123456", "SPECPILOT_LLM_MAX_TURNS": "7"}
    cfg = LLMConfig.from_env(env)
    assert (cfg.base_url, cfg.model, cfg.api_key, cfg.max_turns) == ("http://gpu-box:8000/v1", "qwen",
                                                                     "sk-fallback-123456", 7)
    assert "sk-fallback" not in repr(cfg)
    cfg = LLMConfig.load({"model": "llama3", "wall_s": 60, "api_key_env": "MY_KEY"},
                         {"OPENAI_BASE_URL": "https://api.example.com/v1", "MY_KEY": "k1"})
    assert (cfg.base_url, cfg.model, cfg.api_key, cfg.wall_s) == ("https://api.example.com/v1", "llama3", "k1", 60.0)
    local = LLMConfig.from_dict({"base_url": "http://127.0.0.1:11434/v1", "model": "qwen2.5-coder"})
    assert local.api_key == "EMPTY"  # local servers take any key


@pytest.mark.parametrize("section, env, why", [
    ({}, {}, "LLM base URL not set: .*SPECPILOT_LLM_BASE_URL"),
    ({"base_url": "http://localhost:8000/v1"}, {}, "LLM model not set: .*SPECPILOT_LLM_MODEL"),
    ({"base_url": "https://api.example.com/v1", "model": "m"}, {}, "API key not set for api.example.com: .*"
                                                                   "SPECPILOT_LLM_API_KEY"),
    ({"base_url": "localhost:8000", "model": "m"}, {}, "not an http"),
    ({"base_url": "http://localhost/v1", "model": "m", "max_turns": "many"}, {}, "max_turns must be an integer"),
    ({"base_url": "http://localhost/v1", "model": "m", "retries": -1}, {}, "retries must be at least 0"),
    ({"base_url": "http://localhost/v1", "model": "m", "max_turn": 3}, {}, "unknown LLM setting 'max_turn'"),
    ({"base_url": "http://x/v1", "model": "m", "api_key_env": "NOPE"}, {}, "api_key_env names NOPE"),
])
def test_config_errors_name_the_setting(section, env, why):
    with pytest.raises(LLMConfigError, match=why):
        LLMConfig.load(section, env)


def test_redact():
    payload = {"headers": {"Authorization": "Bearer abc.def"}, "text": f"key {KEY} and Bearer xyz123 and sk-abcdef12",
               "api_key": "plain", "items": [KEY]}
    out = json.dumps(redact(payload, (KEY,)))
    for secret in (KEY, "abc.def", "xyz123", "sk-abcdef12", "plain"):
        assert secret not in out


# -- on a real demo workspace, logging into its ledger ------------------------------------------------------------


@needs_demo
def test_on_the_demo_workspace_into_the_ledger(tmp_path: Path):
    from workbench.workspace import init_demo

    ws = init_demo(tmp_path / "ws", prompt_limit=2, hidden=1)
    try:
        ws.create_branch("llm-1")
        wt = ws.worktree_path("llm-1")
        visible = [json.loads(ln) for ln in (ws.path / "prompts" / "visible.jsonl").read_text().splitlines()]
        hidden = [json.loads(ln) for ln in ws.hidden_prompts_path().read_text().splitlines()]
        ctx = AgentContext(branch="llm-1", worktree=wt, direction=Direction("drafting", 3.0, "drafting gap"),
                           gap_breakdown=[{"family": "drafting", "ms_per_token": 3.0}], visible_prompts=visible,
                           smoke=lambda: SmokeResult(True, "ok"), log=ws.memory.record_event,
                           steering=queue.Queue(), stop=threading.Event())
        script = [call("read_file", path="system.toml"),
                  call("edit", path="system.toml", blocks=block("draft_len = 3\n", "draft_len = 4\n")),
                  call("edit", path="specpilot.toml", blocks=block("", "x\n")),
                  call("finish", summary="draft four tokens", mechanism_name="draft_len_4")]
        with OpenAIStub(script) as stub:
            result = LLMAgent(config(stub)).run(ctx)
        assert result.committed and "protected" in tool_results(stub.messages(3))[-1]
        assert ws.changed_paths("llm-1") == ["system.toml"] and ws.uncommitted("llm-1") == []
        opening = stub.messages(0)[1]["content"]
        assert all(p["id"] in opening for p in visible) and not any(p["id"] in opening for p in hidden)
        events = ws.memory.list_events()
        assert {"llm.start", "llm.request", "llm.response", "llm.tool", "llm.end"} <= {e.kind for e in events}
        assert KEY not in json.dumps([(e.message, e.payload) for e in events], default=str)
    finally:
        ws.close()


# -- small local endpoints: context, text protocol, time, repetition (#25) ---------------------------------------

LLAMA_PROPS = {"/props": {"default_generation_settings": {"n_ctx": 4096}, "total_slots": 1,
                          "chat_template_caps": {"supports_tool_calls": False, "supports_tools": False}}}


def test_a_text_only_model_edits_with_search_replace_blocks(worktree: Path):
    """An endpoint whose template takes no tools: no tools are sent, the opening is compact and shows the
    config, and SEARCH/REPLACE blocks in plain text (one with its file named, one found by its text) and a
    FINISH line make the commit."""
    events: list = []
    reply = ("Sure, here is my change.\n\nsystem.toml\n```toml\n" + block("draft_len = 3\n", "draft_len = 4\n")
             + "```\nAnd a second one:\n" + block("        out.append(t + 1)\n", "        out.append(t + 2)\n"))
    script = [say("Let me look first.\nREAD decoder/generate.py 1 9"), say(reply),
              say("SMOKE\nFINISH draft_len_4: draft four tokens a step")]
    with OpenAIStub(script, routes=LLAMA_PROPS) as stub:
        result = LLMAgent(config(stub)).run(make_ctx(worktree, events))
    assert result.committed, result.message
    assert result.mechanism == "draft_len_4" and result.details["protocol"] == "text"
    assert result.details["context_tokens"] == 4096 and result.details["context_source"] == "llama.cpp /props"
    assert all("tools" not in r["body"] for r in stub.requests)
    opening = stub.messages(0)[1]["content"]
    assert "draft_len = 3" in opening and "Known mechanisms for it: draft_len" in opening
    assert '"family"' not in opening  # the compact opening, not the JSON dump
    assert "READ path" in stub.messages(0)[0]["content"]
    assert "decoder/generate.py: lines 1-9 of 17" in stub.messages(1)[-1]["content"]
    assert "edited system.toml" in stub.messages(2)[-1]["content"]
    assert "edited decoder/generate.py" in stub.messages(2)[-1]["content"]
    repo = branch_repo(worktree)
    assert "draft_len = 4" in repo.git.show("llm-1:system.toml")
    assert "out.append(t + 2)" in repo.git.show("llm-1:decoder/generate.py")
    assert [k for k, _, _ in events].count("llm.action") == 5  # READ, two edits, SMOKE, FINISH


def test_auto_switches_to_text_when_the_model_answers_in_text(worktree: Path):
    events: list = []
    script = [say("system.toml\n" + block("draft_len = 3\n", "draft_len = 5\n")), say("FINISH draft_len_5: longer")]
    with OpenAIStub(script) as stub:  # no /props: tools are offered first
        result = LLMAgent(config(stub)).run(make_ctx(worktree, events))
    assert result.committed and result.details["protocol"] == "text"
    assert "tools" in stub.requests[0]["body"] and "tools" not in stub.requests[1]["body"]
    assert "You cannot call tools here" in stub.messages(1)[-1]["content"]  # the rules come with the results
    assert "llm.protocol" in [k for k, _, _ in events]


def test_a_model_that_repeats_itself_is_stopped_after_two_identical_replies(worktree: Path):
    events: list = []
    same = "You're right, I should have been more precise.\nREAD system.toml"
    with OpenAIStub([], after=say(same)) as stub:
        result = LLMAgent(config(stub)).run(make_ctx(worktree, events))
    assert len(stub.requests) == 2
    assert not result.committed
    assert result.message.startswith("the model repeated its previous reply word for word (2 identical replies")


def test_a_reply_with_no_action_gets_one_correction_then_the_run_ends(worktree: Path):
    events: list = []
    script = [say("You're right, I should have been more precise."), say("I will be more precise now.")]
    with OpenAIStub(script, routes=LLAMA_PROPS) as stub:
        result = LLMAgent(config(stub)).run(make_ctx(worktree, events))
    assert len(stub.requests) == 2
    assert "last reminder" in stub.messages(1)[-1]["content"]
    assert result.message.startswith("model produced no actionable edit")


def test_requests_stay_inside_a_small_context(worktree: Path):
    """A 2048-token context: big tool results are cut, older turns are summarised, and an overflow error
    (llama.cpp's wording) shrinks the assumed size and resends the turn."""
    events: list = []
    (worktree / "decoder" / "big.py").write_text("".join(f"x_{i} = {i}  # a long line of filler text\n"
                                                         for i in range(3000)))
    overflow = http_error(400, "request (2300 tokens) exceeds the available context size (1800 tokens), try "
                               "increasing it", type="exceed_context_size_error", n_ctx=1800)
    reads = [call("read_file", path="decoder/big.py", start_line=1 + 300 * k, end_line=300 * (k + 1))
             for k in range(8)]
    script = [*reads[:4], overflow, *reads[4:], call("finish", summary="nothing", mechanism_name="none")]
    props = {"/props": {"default_generation_settings": {"n_ctx": 2048}}}
    with OpenAIStub(script, routes=props) as stub:
        result = LLMAgent(config(stub, max_reply_tokens=256)).run(make_ctx(worktree, events))
    assert result.details["reason"] == "finish", result.message
    assert result.details["context_tokens"] == 1800 and "overflow error" in result.details["context_source"]
    sent = [r["body"] for r in stub.requests]
    # every request, prompt (as the stub counts it) plus max_tokens, fits the context the agent knew of then
    limits = [e[2]["context_tokens"] for e in events if e[0] == "llm.request"]
    assert limits[0] == 2048 and limits[-1] == 1800
    for body, limit in zip(sent, limits, strict=True):
        assert prompt_tokens(body) + body["max_tokens"] <= limit, (prompt_tokens(body), limit)
        assert body["max_tokens"] <= 256
    assert max(len(m["content"] or "") for body in sent for m in body["messages"] if m["role"] == "tool") < 3000
    assert "Earlier turns, summarised" in sent[-1]["messages"][1]["content"]
    assert "read_file" in sent[-1]["messages"][1]["content"]
    assert any(k == "llm.compact" for k, _, _ in events) and any(k == "llm.context" for k, _, _ in events)


def test_a_timed_out_request_is_cancelled_before_the_retry(worktree: Path):
    events: list = []
    script = [slow(3.0, say("too late")), call("finish", summary="nothing", mechanism_name="none")]
    with OpenAIStub(script) as stub:
        result = LLMAgent(config(stub, request_timeout_s=0.4)).run(make_ctx(worktree, events))
    assert result.details["reason"] == "finish" and result.details["retries"] == 1
    first, retry = stub.requests
    assert first["closed_at"] is not None and first["closed_at"] <= retry["arrived_at"]
    req = next(p for k, _, p in events if k == "llm.request")
    assert req["first_token_timeout_s"] == 0.4 and req["timeout_s"] == 0.8


def test_first_token_timeout_scales_with_the_prompt_and_the_measured_prefill_rate(worktree: Path):
    events: list = []
    script = [call("list_files"), call("finish", summary="nothing", mechanism_name="none")]
    with OpenAIStub(script) as stub:
        LLMAgent(config(stub, request_timeout_s=0.1, prefill_tokens_per_s=100.0, decode_tokens_per_s=10.0,
                        max_reply_tokens=100)).run(make_ctx(worktree, events))
    reqs = [p for k, _, p in events if k == "llm.request"]
    # before any reply: the assumed 100 tok/s, twice over: 2 * prompt / 100 s to the first token
    assert reqs[0]["first_token_timeout_s"] == pytest.approx(2 * reqs[0]["prompt_tokens_est"] / 100, rel=0.01)
    assert reqs[0]["timeout_s"] == pytest.approx(reqs[0]["first_token_timeout_s"] + 2 * 100 / 10, rel=0.01)
    # after it: the stub's measured rate (90 prompt tokens in milliseconds) makes it the 0.1 s floor
    assert reqs[1]["first_token_timeout_s"] == 0.1


def test_the_wall_budget_is_hard(worktree: Path):
    events: list = []
    with OpenAIStub([], after=lambda body: slow(30.0, say("late"))) as stub:
        result = LLMAgent(config(stub, wall_s=2.0, request_timeout_s=30.0)).run(make_ctx(worktree, events))
    assert "wall-time budget spent (2 s)" in result.message
    assert result.details["wall_s"] <= 2.0 * 1.05
    assert all(r["closed_at"] is not None for r in stub.requests)  # nothing left running on the server


def test_the_loop_deadline_cuts_the_wall_budget(worktree: Path):
    import time

    ctx = make_ctx(worktree, [])
    ctx.deadline = time.monotonic() + 1.0
    with OpenAIStub([], after=lambda body: slow(30.0, say("late"))) as stub:
        result = LLMAgent(config(stub, wall_s=600.0, request_timeout_s=30.0)).run(ctx)
    # the budget is cut to the deadline (exact); the run ends near it, not after the 30 s reply (a loaded CI
    # machine ran 1.071 s: slack for scheduling, far below the reply it did not wait for)
    assert result.details["wall_budget_s"] <= 1.0 and result.details["wall_s"] <= 5.0


def test_probe_reads_each_servers_context_size():
    from workbench.agents.endpoint import context_from_error, probe

    cases = [
        (LLAMA_PROPS, 4096, "llama.cpp /props", False),
        ({"/api/show": {"model_info": {"qwen2.context_length": 32768}, "capabilities": ["completion", "tools"],
                        "parameters": "num_ctx 8192\ntemperature 0.7"}}, 8192, "Ollama /api/show num_ctx", True),
        ({"/api/show": {"model_info": {"llama.context_length": 131072}, "capabilities": ["completion"]}}, 4096,
         "Ollama default window (model trained for 131072)", False),
        ({"/api/v0/models": {"data": [{"id": "m", "loaded_context_length": 6000, "max_context_length": 32768}]}},
         6000, "LM Studio /api/v0/models", None),
        ({"/v1/models": {"data": [{"id": "other", "max_model_len": 1}, {"id": "m", "max_model_len": 16384}]}},
         16384, "vLLM /v1/models", None),
        ({}, None, "", None),
    ]
    for routes, n, source, tools in cases:
        with OpenAIStub([], routes=routes) as stub:
            info = probe(stub.base_url, "k", "m")
        assert (info.context_tokens, info.source, info.tool_calls) == (n, source, tools)
    assert context_from_error("request (9031 tokens) exceeds the available context size (8192 tokens)") == 8192
    assert context_from_error("This model's maximum context length is 4096 tokens. However, you requested") == 4096


def test_context_and_protocol_settings():
    cfg = LLMConfig.load({"base_url": "http://127.0.0.1:8080/v1", "model": "m", "context_tokens": 8192,
                          "protocol": "text"}, {})
    assert (cfg.context_tokens, cfg.protocol) == (8192, "text")
    with pytest.raises(LLMConfigError, match="protocol must be one of auto, tools, text, got 'json'"):
        LLMConfig.load({"base_url": "http://127.0.0.1:8080/v1", "model": "m", "protocol": "json"}, {})


# -- the real thing: llama-server serving SmolLM2-135M-Instruct ---------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Path:
    if not llamacpp.is_built():
        pytest.skip("llama.cpp is not built (run `make llama-cpp`)")
    try:
        return smollm2_gguf(USER_MODELS)
    except ModelFetchError as e:
        pytest.skip(f"SmolLM2 cannot be fetched: {e}")


@pytest.mark.slow
def test_smollm2_on_llama_server_ends_within_budget_inside_its_context(worktree: Path, smollm2: Path, tmp_path: Path,
                                                                       monkeypatch):
    """A user's local endpoint: llama-server (--jinja, one thread, 4096 tokens) serving SmolLM2-135M, which
    calls no tools. The attempt ends within its wall budget + 5%, no request passes the context (as the server
    counted it), and the ledger shows a parsed edit or the reason it stopped early."""
    monkeypatch.setenv("SPECPILOT_ENGINES_DIR", str(ENGINES))
    n_ctx, wall = 4096, 150.0
    # --no-repack: this build's AMX kernels for Q4_1 fault with an illegal instruction in this VM
    settings = ServerSettings(threads=1, ctx_size=n_ctx, extra=("--jinja", "--no-repack"))
    events: list = []
    try:
        with LlamaServer(smollm2, settings=settings, name="smollm2", log_dir=tmp_path) as server:
            cfg = LLMConfig(base_url=f"http://127.0.0.1:{server.port}/v1", model="smollm2", wall_s=wall,
                            max_turns=6, max_reply_tokens=192, retries=1, backoff_s=0.1, temperature=0.0)
            result = LLMAgent(cfg).run(make_ctx(worktree, events))
    except EngineError as e:
        pytest.fail(f"llama-server did not serve SmolLM2: {e}")
    d = result.details
    assert d["wall_s"] <= wall * 1.05, result.message
    assert d["context_tokens"] == n_ctx and d["context_source"] == "llama.cpp /props"
    assert d["protocol"] == "text"  # SmolLM2's chat template takes no tools (/props says so)
    responses = [p for k, _, p in events if k == "llm.response"]
    requests = [p for k, _, p in events if k == "llm.request"]
    assert responses, result.message
    for req, resp in zip(requests, responses, strict=False):
        assert resp["usage"]["prompt_tokens"] + req["max_tokens"] <= n_ctx
    edits = [p for k, _, p in events if k == "llm.action" and p["action"] == "edit"]
    early = ("model produced no actionable edit", "the model repeated its previous reply", "turn budget spent")
    assert edits or d["reason"].startswith(early), d["reason"]
    end = [m for k, m, _ in events if k == "llm.end"]
    assert end and (edits or end[0].startswith(early))


@pytest.mark.slow
@needs_demo
def test_a_text_only_model_yields_an_evaluated_candidate_in_the_loop(tmp_path: Path):
    """The loop with an endpoint whose template takes no tools: the model's plain-text SEARCH/REPLACE block
    and FINISH line become a branch commit that the cascade evaluates (forcing, then the bench)."""
    from workbench.loop import Loop, LoopOptions
    from workbench.workspace import init_demo

    w = init_demo(tmp_path / "demo", forcing_max_new_tokens=16, prompt_limit=4, hidden=1)
    fix = "system.toml\n" + block("lean_forward = false\n", "lean_forward = true\n")
    script = [say("I will turn on the lean forward.\n" + fix), say("FINISH lean-forward: fused lean forward")]
    try:
        with OpenAIStub(script, routes=LLAMA_PROPS) as stub:
            opts = LoopOptions(rounds=1, agents=1, agent="llm", budget_minutes=20, use_global_memory=False,
                               llm={"base_url": stub.base_url, "model": "stub", "backoff_s": 0.1})
            summary = Loop(w, opts).run()
        att = summary["rounds"][0]["attempts"][0]
        assert all("tools" not in r["body"] for r in stub.requests)
        assert "lean_forward = true" in w.repo.git.show(f"{att['branch']}:system.toml")
        assert att["status"] in ("keep", "discard") and att["speedup"] is not None, att  # evaluated, not refused
    finally:
        w.close()
