"""The LLM agent: a tool-calling loop over any OpenAI-compatible chat endpoint (vLLM, llama.cpp, Ollama, hosted).

    cfg = LLMConfig.load(config_section)            # [llm] section of a config file, environment fills the gaps
    result = LLMAgent(cfg).run(ctx)                 # ctx: workbench.agents.base.AgentContext

The model reads and edits its branch's worktree through tools (list_files, read_file, grep, edit with
SEARCH/REPLACE blocks, run_smoke, finish). Every failure (bad JSON arguments, an unknown tool, a block that
does not apply) goes back to it as the tool result, so it can correct itself; HTTP 5xx, timeouts and
connection errors are retried with exponential backoff. Budgets on turns, tokens and wall time end a model
that never finishes: whatever it changed is committed and the reason is given in one line. Every request
and response is written to the ledger through ctx.log with secrets redacted.
"""

from __future__ import annotations

import ipaddress
import json
import os
import queue
import re
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

import git

from workbench.agents.base import AgentContext, AgentResult
from workbench.agents.edits import EditError, apply_blocks, parse_blocks
from workbench.progress import step
from workbench.safegit import SafeGitError

ENV_PREFIX = "SPECPILOT_LLM_"
LOCAL_API_KEY = "EMPTY"  # what local servers (vLLM, llama.cpp, Ollama) accept when they check no key
MAX_TOOL_RESULT_CHARS = 12_000  # a tool result longer than this is cut, with a note saying how to see the rest
MAX_READ_LINES = 400
MAX_LIST_ENTRIES = 400
MAX_GREP_HITS = 200
MAX_PROMPT_CHARS = 2_000  # per visible prompt in the opening message
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache", ".specpilot"}
UNSTAGED = (":(exclude,glob)**/__pycache__/**", ":(exclude,glob)**/*.pyc")  # smoke runs leave these behind
COMMIT_IDENTITY = {"GIT_AUTHOR_NAME": "SpecPilot llm agent", "GIT_AUTHOR_EMAIL": "specpilot@localhost",
                   "GIT_COMMITTER_NAME": "SpecPilot llm agent", "GIT_COMMITTER_EMAIL": "specpilot@localhost"}


class LLMConfigError(ValueError):
    """A missing or bad LLM setting; the message names it and how to set it."""


class ToolError(Exception):
    """A tool call that cannot be done; the message goes back to the model."""


# -- configuration ---------------------------------------------------------------------------------------------


@dataclass
class LLMConfig:
    base_url: str
    model: str
    api_key: str = field(default="", repr=False)
    max_turns: int = 40  # model replies per run
    max_tokens_total: int = 400_000  # sum of usage.total_tokens over the run (when the server reports usage)
    wall_s: float = 1800.0  # the whole run, requests, retries and tools included
    request_timeout_s: float = 120.0  # one request
    retries: int = 4  # extra attempts after an HTTP 5xx / 429, a timeout or a connection error
    temperature: float = 0.2
    backoff_s: float = 1.0  # first retry delay; doubles each retry

    def __post_init__(self) -> None:
        for name, kind, low in (("max_turns", int, 1), ("max_tokens_total", int, 1), ("wall_s", float, 0.001),
                                ("request_timeout_s", float, 0.001), ("retries", int, 0),
                                ("temperature", float, 0.0), ("backoff_s", float, 0.0)):
            raw = getattr(self, name)
            try:
                if isinstance(raw, bool):
                    raise ValueError
                value = kind(raw)
                if kind is int and value != float(raw):
                    raise ValueError
            except (TypeError, ValueError):
                raise LLMConfigError(f"LLM setting {name} must be a{'n integer' if kind is int else ' number'}, "
                                     f"got {raw!r}") from None
            if value < low:
                raise LLMConfigError(f"LLM setting {name} must be at least {low}, got {raw!r}")
            setattr(self, name, value)

    @classmethod
    def load(cls, section: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> LLMConfig:
        """From a config section (e.g. a file's [llm] table); the environment fills what the section leaves out.

        Environment: SPECPILOT_LLM_BASE_URL, SPECPILOT_LLM_MODEL, SPECPILOT_LLM_API_KEY (falling back to
        OPENAI_BASE_URL and OPENAI_API_KEY), and SPECPILOT_LLM_<SETTING> for the numeric settings. The section
        may name the variable holding the key with `api_key_env` rather than hold the key itself.
        """
        env = os.environ if env is None else env
        data = dict(section or {})
        known = {f.name for f in fields(cls)}
        key_env = data.pop("api_key_env", None)
        unknown = sorted(set(data) - known)
        if unknown:
            raise LLMConfigError(f"unknown LLM setting {unknown[0]!r}; known: {', '.join(sorted(known))}, api_key_env")
        values: dict[str, Any] = {k: v for k, v in data.items() if v not in (None, "")}
        for f in fields(cls):
            if f.name not in values and env.get(ENV_PREFIX + f.name.upper()):
                values[f.name] = env[ENV_PREFIX + f.name.upper()]
        if "base_url" not in values and env.get("OPENAI_BASE_URL"):
            values["base_url"] = env["OPENAI_BASE_URL"]
        if "api_key" not in values:
            if key_env:
                if not env.get(str(key_env)):
                    raise LLMConfigError(f"LLM API key not set: api_key_env names {key_env}, which is empty; "
                                         f"export {key_env}=...")
                values["api_key"] = env[str(key_env)]
            elif env.get("OPENAI_API_KEY"):
                values["api_key"] = env["OPENAI_API_KEY"]
        if not values.get("base_url"):
            raise LLMConfigError("LLM base URL not set: set base_url in the [llm] config section or export "
                                 "SPECPILOT_LLM_BASE_URL (e.g. http://127.0.0.1:8000/v1 for vLLM, "
                                 "http://127.0.0.1:11434/v1 for Ollama, https://api.openai.com/v1)")
        url = urlparse(str(values["base_url"]))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise LLMConfigError(f"LLM base URL {values['base_url']!r} is not an http(s) URL; "
                                 f"give one like http://127.0.0.1:8000/v1")
        if not values.get("model"):
            raise LLMConfigError("LLM model not set: set model in the [llm] config section or export "
                                 "SPECPILOT_LLM_MODEL (the name the server serves, e.g. qwen2.5-coder:7b)")
        if not values.get("api_key"):
            if not _is_local(url.hostname):
                raise LLMConfigError(f"LLM API key not set for {url.hostname}: export SPECPILOT_LLM_API_KEY "
                                     f"(or OPENAI_API_KEY), or name the variable with api_key_env in [llm]")
            values["api_key"] = LOCAL_API_KEY
        return cls(**values)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> LLMConfig:
        """From a config section alone (the environment is not read)."""
        return cls.load(section, env={})

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LLMConfig:
        """From the environment alone (see load)."""
        return cls.load({}, env)


def _is_local(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# -- secrets ---------------------------------------------------------------------------------------------------

_BEARER = re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]+")
_SK = re.compile(r"\bsk-[A-Za-z0-9_-]{6,}")
_SECRET_KEYS = {"api_key", "authorization", "x-api-key"}
REDACTED = "[redacted]"


def redact(value: Any, secrets: tuple[str, ...] = ()) -> Any:
    """`value` (str, list, dict, nested) with the given secrets, bearer tokens and sk-... keys replaced."""
    if isinstance(value, str):
        for s in secrets:
            if s:
                value = value.replace(s, REDACTED)
        return _SK.sub("sk-" + REDACTED, _BEARER.sub("Bearer " + REDACTED, value))
    if isinstance(value, Mapping):
        return {k: REDACTED if str(k).lower() in _SECRET_KEYS else redact(v, secrets) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v, secrets) for v in value]
    return value


# -- the worktree tools ----------------------------------------------------------------------------------------


class WorktreeTools:
    """What the model may do in one worktree: read, search, edit. Paths are relative and stay inside it."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.protected = _protected_paths(self.root)

    def resolve(self, path: str, *, write: bool = False) -> Path:
        """The real path for a model-given relative path, refused if it leaves the worktree or touches .git."""
        if not isinstance(path, str):
            raise ToolError(f"path must be a string, got {type(path).__name__}")
        raw = path.strip().replace("\\", "/")
        if raw.startswith(("/", "~")) or re.match(r"^[A-Za-z]:", raw):
            raise ToolError(f"absolute path {path!r} refused; give a path relative to the worktree root, "
                            f"e.g. decoder/generate.py")
        parts = PurePosixPath(raw or ".").parts
        if ".." in parts:
            raise ToolError(f"path {path!r} refused: '..' would leave the worktree")
        if ".git" in parts:
            raise ToolError(f"path {path!r} refused: .git is off limits (commit with finish)")
        real = (self.root / raw).resolve()
        if real != self.root and self.root not in real.parents:
            raise ToolError(f"path {path!r} refused: it leaves the worktree through a symlink")
        if write:
            rel = real.relative_to(self.root).as_posix()
            for rule in self.protected:
                if rel == rule.rstrip("/") or (rule.endswith("/") and rel.startswith(rule)):
                    raise ToolError(f"{rel} is protected (specpilot.toml [system] protected); a commit touching "
                                    f"it is rejected, change the system code instead")
            if real == self.root or real.is_dir():
                raise ToolError(f"{path!r} is a folder; edit a file in it")
        return real

    def rel(self, p: Path) -> str:
        return p.relative_to(self.root).as_posix() or "."

    def list_files(self, path: str = ".") -> str:
        """The files under `path`, recursively, with sizes."""
        base = self.resolve(path)
        if not base.exists():
            raise ToolError(f"{path!r} does not exist; list_files('.') shows the worktree")
        if base.is_file():
            return f"{self.rel(base)} ({base.stat().st_size} bytes)"
        out: list[str] = []
        total = 0
        for d, dirs, files in os.walk(base):
            dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
            for name in sorted(x for x in files if x != ".git"):  # a worktree's .git is a file
                total += 1
                if len(out) < MAX_LIST_ENTRIES:
                    p = Path(d) / name
                    out.append(f"{self.rel(p)} ({p.stat().st_size if p.exists() else 0} bytes)")
        if total > len(out):
            out.append(f"... {total - len(out)} more files; list a subfolder")
        return "\n".join(out) if out else f"{self.rel(base)} is empty"

    def read_file(self, path: str, start_line: int | None = None, end_line: int | None = None) -> str:
        """Numbered lines start_line..end_line (1-based, inclusive) of a text file."""
        p = self.resolve(path)
        lines = self._text(p, path).splitlines()
        n = len(lines)
        a = _line_arg(start_line, "start_line", 1)
        b = _line_arg(end_line, "end_line", n)
        a, b = max(1, a), min(n, b)
        if n == 0:
            return f"{self.rel(p)} is empty"
        if a > b:
            raise ToolError(f"no lines in range {start_line}..{end_line}; {self.rel(p)} has {n} lines")
        cut = min(b, a + MAX_READ_LINES - 1)
        body = "\n".join(f"{k:>5} | {lines[k - 1]}" for k in range(a, cut + 1))
        head = f"{self.rel(p)}: lines {a}-{cut} of {n}"
        if cut < b:
            head += f" (cut at {MAX_READ_LINES} lines; ask for start_line={cut + 1} to go on)"
        return head + "\n" + body

    def grep(self, pattern: str, path: str = ".") -> str:
        """Lines matching a Python regular expression, as path:line: text."""
        try:
            rx = re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ToolError(f"bad regular expression {pattern!r}: {e}") from None
        base = self.resolve(path)
        if not base.exists():
            raise ToolError(f"{path!r} does not exist; list_files('.') shows the worktree")
        targets = [base] if base.is_file() else []
        if base.is_dir():
            for d, dirs, files in os.walk(base):
                dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
                targets += [Path(d) / f for f in sorted(files) if f != ".git"]
        hits: list[str] = []
        more = 0
        for p in targets:
            try:
                if p.stat().st_size > 2_000_000:
                    continue
                text = p.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            for k, line in enumerate(text.splitlines(), 1):
                if rx.search(line):
                    if len(hits) < MAX_GREP_HITS:
                        hits.append(f"{self.rel(p)}:{k}: {line.strip()[:200]}")
                    else:
                        more += 1
        if more:
            hits.append(f"... {more} more matches; narrow the pattern or the path")
        return "\n".join(hits) if hits else f"no match for {pattern!r} under {self.rel(base)}"

    def edit(self, path: str, blocks: str) -> str:
        """Apply SEARCH/REPLACE blocks to one file (all or nothing); an empty SEARCH creates a new file."""
        if not isinstance(blocks, str):
            raise ToolError("blocks must be one string holding SEARCH/REPLACE blocks")
        p = self.resolve(path, write=True)
        old = self._text(p, path) if p.exists() else None
        try:
            new = apply_blocks(old, parse_blocks(blocks))
        except EditError as e:
            raise ToolError(f"edit of {self.rel(p)} not applied, nothing written: {e}") from None
        if new == old:
            return f"{self.rel(p)}: the blocks change nothing"
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "w", encoding="utf-8", newline="") as f:  # newline="": keep the file's line endings
            f.write(new)
        n_old = 0 if old is None else len(old.splitlines())
        verb = "created" if old is None else "edited"
        return f"{verb} {self.rel(p)} ({n_old} -> {len(new.splitlines())} lines)"

    def _text(self, p: Path, given: str) -> str:
        if not p.exists():
            raise ToolError(f"{given!r} does not exist; list_files shows what does")
        if p.is_dir():
            raise ToolError(f"{given!r} is a folder; list_files({given!r}) shows its files")
        try:
            with open(p, encoding="utf-8", newline="") as f:
                return f.read()
        except UnicodeDecodeError:
            raise ToolError(f"{given!r} is not a UTF-8 text file") from None


def _line_arg(value: Any, name: str, default: int) -> int:
    if value is None:
        return default
    try:
        if isinstance(value, bool) or int(value) != float(value):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise ToolError(f"{name} must be a line number (integer), got {value!r}") from None


def _protected_paths(root: Path) -> list[str]:
    try:
        data = tomllib.loads((root / "specpilot.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return []
    return [str(p) for p in data.get("system", {}).get("protected", [])]


# -- the tool schemas the model sees ---------------------------------------------------------------------------


def _tool(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required, "additionalProperties": False}}}


_PATH = {"type": "string", "description": "relative to the worktree root, e.g. decoder/generate.py"}
TOOLS: list[dict[str, Any]] = [
    _tool("list_files", "List the files under a folder of the worktree, recursively, with sizes.",
          {"path": {**_PATH, "description": "a folder relative to the worktree root; '.' for all"}}, []),
    _tool("read_file", f"Read a text file with line numbers (at most {MAX_READ_LINES} lines per call).",
          {"path": _PATH, "start_line": {"type": "integer", "description": "first line, 1-based"},
           "end_line": {"type": "integer", "description": "last line, inclusive"}}, ["path"]),
    _tool("grep", "Search the worktree's text files for a Python regular expression; returns path:line: text.",
          {"pattern": {"type": "string"}, "path": {**_PATH, "description": "a file or folder; '.' by default"}},
          ["pattern"]),
    _tool("edit", "Edit one file with SEARCH/REPLACE blocks, applied all or nothing. Each block is\n"
          "<<<<<<< SEARCH\n<lines copied exactly from the file>\n=======\n<the new lines>\n>>>>>>> REPLACE\n"
          "SEARCH must match one place only; an empty SEARCH creates a new file.",
          {"path": _PATH, "blocks": {"type": "string", "description": "one or more SEARCH/REPLACE blocks"}},
          ["path", "blocks"]),
    _tool("run_smoke", "Commit the work so far and run the system on one visible prompt: tokens/s and whether "
          "the output matches stock. Slow (seconds to minutes); use it before finish.", {}, []),
    _tool("finish", "Commit your change on the branch and end your work. Call it with no change made to give up.",
          {"summary": {"type": "string", "description": "one line: what changed and why it is faster"},
           "mechanism_name": {"type": "string", "description": "a short name for the change, e.g. fused_qkv"}},
          ["summary", "mechanism_name"]),
]
TOOL_NAMES = [t["function"]["name"] for t in TOOLS]
_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

SYSTEM_PROMPT = """You are a performance engineer optimizing a speculative-decoding system for one deployment.
You work in a git worktree of the system, on your own branch, through tools only.

Rules:
- The output must stay token-identical to the stock system under greedy decoding. Every generated token of \
your branch is checked against stock by token forcing, on the prompts you see and on hidden ones; any real \
mismatch rejects your work. A measured speedup above the cost model's ceiling is treated as cheating.
- Touch only the system code and its mechanism config. Paths listed as protected in specpilot.toml (the \
deployment file, the entry point, the prompts) are off limits; never special-case prompts, memoize outputs \
or play with clocks.
- Read before you edit: list_files, read_file, grep. Edit with SEARCH/REPLACE blocks copied exactly from \
read_file output (without the line numbers). When a tool answers with an error, fix the call and go on.
- run_smoke commits your work so far and checks it on one visible prompt; use it before finishing.
- Commit via finish(summary, mechanism_name): it is the only way to hand in your change, and it ends your \
work. Plain-text replies are not read; keep working with tools until you call finish.
- Messages that start with "Engineer:" come from the engineer steering you; follow them."""

NUDGE = ("No tool call in your reply. Keep working with the tools, and call finish(summary, mechanism_name) "
         "when your change is ready (or with no change to give up).")


def opening_message(ctx: AgentContext) -> str:
    """The task: the gap breakdown, the direction, the visible prompts (never the hidden split)."""
    prompts = [{"id": p.get("id"), "text": _clip(str(p.get("text", "")), MAX_PROMPT_CHARS)}
               for p in ctx.visible_prompts]
    return "\n\n".join([
        f"Your direction: the {ctx.direction.family} gap ({ctx.direction.gap_ms:.3f} ms per generated token lost "
        f"against its ceiling). Close as much of it as you can without changing a single output token.",
        "Direction (gap family, measured gap, the decoder's registry mechanisms for it, mechanisms memory holds "
        "for it):\n" + json.dumps(ctx.direction.as_dict(), indent=1, default=str),
        "Gap breakdown of the current base (the cost model's ranked gaps):\n"
        + json.dumps(ctx.gap_breakdown, indent=1, default=str),
        f"Visible prompts ({len(prompts)}; the system is also checked on hidden ones):\n"
        + json.dumps(prompts, indent=1, ensure_ascii=False),
        "Start by reading specpilot.toml and the system code, then make your change and call finish.",
    ])


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters cut]"


# -- the agent -------------------------------------------------------------------------------------------------


class _RequestFailed(Exception):
    """The model could not be reached (retries spent or a non-retryable error): the run ends."""


class LLMAgent:
    """An agent that lets an LLM behind an OpenAI-compatible endpoint edit its branch with tools."""

    name = "llm"

    def __init__(self, config: LLMConfig, *, client: Any | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._client = client
        self._clock = clock

    def client(self) -> Any:
        """The openai client, its own retries off (this agent retries, so every attempt is logged)."""
        if self._client is None:
            try:
                import openai
            except ImportError:
                raise LLMConfigError("the LLM agent needs the openai package: pip install openai") from None
            self._client = openai.OpenAI(base_url=self.config.base_url, api_key=self.config.api_key,
                                         max_retries=0, timeout=self.config.request_timeout_s)
        return self._client

    def run(self, ctx: AgentContext) -> AgentResult:
        """Work on ctx.worktree until finish, a budget or ctx.stop; commit on ctx.branch; say what was done."""
        return _Session(self, ctx).run()


@dataclass
class _Call:
    id: str
    name: str
    arguments: str


class _Session:
    """One run of the agent on one branch."""

    def __init__(self, agent: LLMAgent, ctx: AgentContext) -> None:
        self.agent, self.cfg, self.ctx = agent, agent.config, ctx
        self.secrets = tuple(s for s in (self.cfg.api_key,) if s and s != LOCAL_API_KEY)
        self.tools = WorktreeTools(ctx.worktree)
        self.repo: git.Git | None = None
        self.start_head = ""
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                               {"role": "user", "content": opening_message(ctx)}]
        self.logged = 0  # messages already written to the ledger
        self.turns = 0
        self.tokens = 0
        self.t0 = agent._clock()
        self.tool_errors = 0
        self.retried = 0
        self.latency = 0.0

    # -- the loop ------------------------------------------------------------------------------------------

    def run(self) -> AgentResult:
        try:
            self.repo = self.ctx.git()
            self.start_head = self.repo.rev_parse("HEAD").strip()
        except (SafeGitError, git.GitCommandError, OSError):
            return AgentResult(False, f"{self.ctx.worktree} is not a git worktree with a commit; nothing done")
        try:
            branch = self.repo.symbolic_ref("--short", "HEAD").strip()
        except git.GitCommandError:
            branch = "(detached HEAD)"
        if branch != self.ctx.branch:
            return AgentResult(False, f"worktree {self.ctx.worktree} is on {branch}, not branch {self.ctx.branch}; "
                                      f"nothing done")
        self.log("llm.start", f"llm agent on {self.ctx.branch}: {self.ctx.direction.family} with {self.cfg.model}",
                 {"model": self.cfg.model, "base_url": self.cfg.base_url, "start_head": self.start_head,
                  "budgets": {"max_turns": self.cfg.max_turns, "max_tokens_total": self.cfg.max_tokens_total,
                              "wall_s": self.cfg.wall_s}})
        while True:
            self.drain_steering()
            reason = self.budget_spent()
            if reason:
                return self.end(reason)
            self.turns += 1
            step("llm turn", self.turns, self.cfg.max_turns, self.cfg.model)
            try:
                reply = self.request()
            except _RequestFailed as e:
                return self.end(f"LLM request failed: {e}")
            calls = self.take_reply(reply)
            if not calls:
                self.messages.append({"role": "user", "content": NUDGE})
                continue
            for call in calls:
                result, done = self.dispatch(call)
                self.messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
                if done is not None:
                    return self.close(done)

    def drain_steering(self) -> None:
        while True:
            try:
                text = self.ctx.steering.get_nowait()
            except queue.Empty:
                return
            self.messages.append({"role": "user", "content": f"Engineer: {text}"})
            self.log("llm.steering", f"engineer: {_clip(' '.join(str(text).split()), 200)}", {"text": text})

    def budget_spent(self) -> str:
        if self.ctx.stop.is_set():
            return "stopped by the engineer"
        if self.turns >= self.cfg.max_turns:
            return f"turn budget spent ({self.cfg.max_turns} turns) before finish"
        if self.tokens >= self.cfg.max_tokens_total:
            return f"token budget spent ({self.tokens} of {self.cfg.max_tokens_total} tokens) before finish"
        if self.elapsed() >= self.cfg.wall_s:
            return f"wall-time budget spent ({self.cfg.wall_s:g} s) before finish"
        return ""

    def elapsed(self) -> float:
        return self.agent._clock() - self.t0

    # -- requests ------------------------------------------------------------------------------------------

    def request(self) -> Any:
        """One chat completion, retried on 5xx / 429, timeouts and connection errors with exponential backoff."""
        client = self.agent.client()  # first: it says how to install openai when it is missing
        import openai

        new = self.flush_messages(log=False)
        for attempt in range(self.cfg.retries + 1):
            left = self.cfg.wall_s - self.elapsed()
            if left <= 0:
                raise _RequestFailed(f"wall-time budget ({self.cfg.wall_s:g} s) spent while retrying")
            timeout = min(self.cfg.request_timeout_s, left)
            self.log("llm.request", f"turn {self.turns} attempt {attempt + 1}: {len(self.messages)} messages",
                     {"turn": self.turns, "attempt": attempt + 1, "model": self.cfg.model, "timeout_s": timeout,
                      "n_messages": len(self.messages), "new_messages": new if attempt == 0 else []})
            t = time.monotonic()
            try:
                reply = client.chat.completions.create(
                    model=self.cfg.model, messages=self.messages, tools=TOOLS, tool_choice="auto",
                    temperature=self.cfg.temperature, timeout=timeout)
            except openai.APITimeoutError:
                why = f"timed out after {timeout:g} s"
            except openai.APIConnectionError as e:
                why = f"connection error ({_one_line(e)})"
            except openai.APIStatusError as e:
                if e.status_code < 500 and e.status_code != 429:
                    raise _RequestFailed(f"HTTP {e.status_code} from {self.cfg.base_url}: "
                                         f"{_clip(_one_line(e), 300)}") from None
                why = f"HTTP {e.status_code}"
            except openai.OpenAIError as e:
                raise _RequestFailed(f"{type(e).__name__}: {_clip(_one_line(e), 300)}") from None
            else:
                if not getattr(reply, "choices", None):
                    raise _RequestFailed(f"the server at {self.cfg.base_url} sent a reply with no choices")
                self.latency = time.monotonic() - t
                return reply
            if attempt == self.cfg.retries:
                raise _RequestFailed(f"{why}; gave up after {attempt + 1} attempts")
            delay = min(self.cfg.backoff_s * 2 ** attempt, max(0.0, self.cfg.wall_s - self.elapsed()))
            self.retried += 1
            self.log("llm.retry", f"turn {self.turns}: {why}; retrying in {delay:.2f} s",
                     {"turn": self.turns, "attempt": attempt + 1, "error": why, "delay_s": delay})
            if self.ctx.stop.wait(delay):
                raise _RequestFailed("stopped by the engineer while retrying")
        raise AssertionError("unreachable")

    def take_reply(self, reply: Any) -> list[_Call]:
        """Append the assistant message to the conversation, count tokens, log it; return its tool calls."""
        choice = reply.choices[0]
        msg = choice.message
        calls = [_Call(getattr(tc, "id", None) or f"call_{self.turns}_{k}", _fn(tc, "name"), _fn(tc, "arguments"))
                 for k, tc in enumerate(msg.tool_calls or [])]
        usage = getattr(reply, "usage", None)
        total = getattr(usage, "total_tokens", None) if usage is not None else None
        if isinstance(total, int):
            self.tokens += total
        entry: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
        if calls:
            entry["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        self.messages.append(entry)
        self.logged = len(self.messages)
        names = ", ".join(c.name for c in calls) or "no tool call"
        self.log("llm.response", f"turn {self.turns}: {names}",
                 {"turn": self.turns, "content": msg.content or "", "finish_reason": choice.finish_reason,
                  "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls],
                  "usage": usage.model_dump() if hasattr(usage, "model_dump") else None,
                  "tokens_so_far": self.tokens, "latency_s": round(self.latency, 3)})
        return calls

    def flush_messages(self, log: bool = True) -> list[dict[str, Any]]:
        """The messages not yet in the ledger (tool results, steering, nudges), marked as logged."""
        new = self.messages[self.logged:]
        self.logged = len(self.messages)
        if log and new:
            self.log("llm.messages", f"{len(new)} messages after turn {self.turns}", {"messages": new})
        return new

    # -- tools ---------------------------------------------------------------------------------------------

    def dispatch(self, call: _Call) -> tuple[str, AgentResult | None]:
        """Run one tool call; (the result for the model, the run's result when it was finish)."""
        result, done = self._dispatch(call)
        result = _clip(result, MAX_TOOL_RESULT_CHARS)
        ok = not result.startswith("error:")
        self.tool_errors += not ok
        self.log("llm.tool", f"turn {self.turns}: {call.name or '(no name)'} "
                             f"{'ok' if ok else _clip(result.splitlines()[0], 200)}",
                 {"turn": self.turns, "id": call.id, "name": call.name, "arguments": call.arguments,
                  "ok": ok, "result": result})
        return result, done

    def _dispatch(self, call: _Call) -> tuple[str, AgentResult | None]:
        if call.name not in _SCHEMAS:
            return (f"error: unknown tool {call.name!r}; the tools are {', '.join(TOOL_NAMES)}", None)
        try:
            args = json.loads(call.arguments) if call.arguments.strip() else {}
        except json.JSONDecodeError as e:
            return (f"error: the arguments of {call.name} are not valid JSON ({e.msg} at character {e.pos}); "
                    f"send one JSON object, e.g. {_example(call.name)}", None)
        if not isinstance(args, dict):
            return (f"error: the arguments of {call.name} must be a JSON object, got {type(args).__name__}; "
                    f"e.g. {_example(call.name)}", None)
        schema = _SCHEMAS[call.name]
        missing = [k for k in schema["required"] if k not in args]
        extra = [k for k in args if k not in schema["properties"]]
        if missing or extra:
            what = (f"missing {', '.join(missing)}" if missing else "") + ("; " if missing and extra else "") + \
                   (f"unknown {', '.join(extra)}" if extra else "")
            return (f"error: bad arguments for {call.name} ({what}); it takes "
                    f"{', '.join(schema['properties']) or 'no arguments'}", None)
        try:
            if call.name == "finish":
                return self.finish(str(args["summary"]), str(args["mechanism_name"]))
            if call.name == "run_smoke":
                return self.run_smoke(), None
            return getattr(self.tools, call.name)(**args), None
        except ToolError as e:
            return f"error: {e}", None
        except (OSError, git.GitCommandError) as e:
            return f"error: {call.name} failed: {_clip(_one_line(e), 500)}", None

    def run_smoke(self) -> str:
        sha = self.commit_wip()
        try:
            r = self.ctx.smoke()
        except Exception as e:  # the smoke runner is the loop's; its crash is news for the model, not the end
            return f"error: the smoke run crashed: {type(e).__name__}: {_clip(_one_line(e), 500)}"
        where = f" (work committed as {sha[:10]})" if sha else ""
        return ("ok: " if r.ok else "error: smoke failed: ") + r.message + where

    def finish(self, summary: str, mechanism_name: str) -> tuple[str, AgentResult]:
        summary = " ".join(summary.split()) or "no summary given"
        mech = re.sub(r"[^A-Za-z0-9_.-]+", "_", mechanism_name.strip()).strip("_")[:60] or f"llm_{self.family}"
        sha = self.commit(f"{mech}: {summary}")
        if sha is None:
            return "finished with no change", self.result(False, f"finished without a change: {summary}",
                                                          mech, summary, "finish")
        return f"committed {sha[:10]} on {self.ctx.branch}", self.result(
            True, f"{mech}: {summary}", mech, summary, "finish", sha)

    def end(self, reason: str) -> AgentResult:
        """The run ends without finish: commit what changed, if anything, and say why in one line."""
        mech = f"llm_{self.family}"
        sha = self.commit(f"{mech}: work in progress, {reason}")
        if sha is None:
            return self.close(self.result(False, f"{reason}; no change made", "", "", reason))
        return self.close(self.result(True, f"{reason}; committed the changes so far as {sha[:10]}", mech,
                                      "unfinished: " + reason, reason, sha))

    def close(self, result: AgentResult) -> AgentResult:
        """Write the last messages and the outcome to the ledger."""
        self.flush_messages()
        self.log("llm.end", result.message, {"committed": result.committed, "mechanism": result.mechanism,
                                             "summary": result.summary, **result.details})
        return result

    def result(self, committed: bool, message: str, mech: str, summary: str, reason: str,
               sha: str | None = None) -> AgentResult:
        details = {"reason": reason, "turns": self.turns, "tokens": self.tokens,
                   "wall_s": round(self.elapsed(), 3), "tool_errors": self.tool_errors, "retries": self.retried,
                   "model": self.cfg.model, "start_head": self.start_head, "commit": sha,
                   "files": self.changed_files() if sha else []}
        message = redact(message, self.secrets)
        return AgentResult(committed, message, mechanism=mech if committed else "", summary=summary, details=details)

    # -- git -----------------------------------------------------------------------------------------------

    @property
    def family(self) -> str:
        return self.ctx.direction.family

    def _git(self) -> git.Git:
        assert self.repo is not None
        return self.repo

    def _git_env(self) -> dict[str, str]:
        assert self.repo is not None
        try:
            self.repo.config("--get", "user.email")
        except git.GitCommandError:
            return COMMIT_IDENTITY
        return {}

    def commit_wip(self) -> str | None:
        """Commit the worktree as is (for run_smoke, which runs the committed system); finish squashes these."""
        self._git().add("-A", "--", ".", *UNSTAGED)
        if not self._git().diff("--cached", "--name-only").strip():
            return None
        self._git().commit("-q", "-m", f"wip: llm agent, {self.family} (smoke run)", env=self._git_env())
        return self._git().rev_parse("HEAD")

    def commit(self, subject: str) -> str | None:
        """One commit on the branch with everything this run changed (earlier smoke commits squashed in)."""
        self._git().add("-A", "--", ".", *UNSTAGED)
        self._git().reset("--soft", self.start_head)
        if not self._git().diff("--cached", "--name-only", self.start_head).strip():
            return None
        d = self.ctx.direction
        body = (f"Direction: {d.family} gap, {d.gap_ms:.3f} ms per token against its ceiling ({d.summary})\n"
                f"Agent: llm ({self.cfg.model}), {self.turns} turns, {self.tokens} tokens")
        self._git().commit("-q", "-m", f"llm[{d.family}] {_clip(subject, 200)}", "-m", body, env=self._git_env())
        return self._git().rev_parse("HEAD")

    def changed_files(self) -> list[str]:
        return self._git().diff("--name-only", self.start_head, "HEAD").splitlines()

    # -- ledger --------------------------------------------------------------------------------------------

    def log(self, kind: str, message: str, payload: dict[str, Any]) -> None:
        payload = {"branch": self.ctx.branch, **payload}
        self.ctx.log(kind, redact(message, self.secrets), redact(payload, self.secrets))


def _fn(tool_call: Any, attr: str) -> str:
    # llama.cpp and some proxies leave fields null; a non-function (custom) tool call has no .function at all
    fn = getattr(tool_call, "function", None)
    return str(getattr(fn, attr, None) or "")


def _one_line(e: BaseException | str) -> str:
    return " ".join(str(e).split())


def _example(name: str) -> str:
    return {"list_files": '{"path": "."}', "read_file": '{"path": "decoder/generate.py", "start_line": 1}',
            "grep": '{"pattern": "def verify", "path": "decoder"}', "run_smoke": "{}",
            "edit": '{"path": "system.toml", "blocks": "<<<<<<< SEARCH\\nold\\n=======\\nnew\\n>>>>>>> REPLACE\\n"}',
            "finish": '{"summary": "fused the QKV projections", "mechanism_name": "fused_qkv"}'}[name]
