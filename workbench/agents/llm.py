"""The LLM agent: a tool-calling loop over any OpenAI-compatible chat endpoint (vLLM, llama.cpp, Ollama,
LM Studio, hosted), with a plain-text protocol for endpoints and models that do not call tools.

    cfg = LLMConfig.load(config_section)            # [llm] section of a config file, environment fills the gaps
    result = LLMAgent(cfg).run(ctx)                 # ctx: workbench.agents.base.AgentContext

The model reads and edits its branch's worktree through tools (list_files, read_file, grep, edit with
SEARCH/REPLACE blocks, run_smoke, finish). Every failure (bad JSON arguments, an unknown tool, a block that
does not apply) goes back to it as the tool result, so it can correct itself; HTTP 5xx, timeouts and
connection errors are retried with exponential backoff. Budgets on turns, tokens and wall time end a model
that never finishes: whatever it changed is committed and the reason is given in one line. Every request
and response is written to the ledger through ctx.log with secrets redacted.

Small local endpoints (workbench/agents/endpoint.py, textproto.py):
- Context: the endpoint's size is learnt (llama.cpp /props, Ollama /api/show, LM Studio, /v1/models, the
  [llm] context_tokens setting, or the first overflow error) and every request is kept inside it: a compact
  opening message when the context is small, tool results cut to a sixth of it, older turns cut and
  summarised in one line each, and max_tokens so that prompt plus reply fit.
- Protocol: with protocol "auto" a reply without tool calls is read as text (SEARCH/REPLACE blocks after a
  file line, and LIST/READ/GREP/SMOKE/FINISH lines); from then on, or from the start when the endpoint says
  its chat template takes no tools, the agent speaks only text. A reply with no action gets one corrective
  message; a second in a row ends the run with "model produced no actionable edit".
- Time: each request streams, with a first-token timeout and a total timeout scaled by the prompt's size and
  the measured prefill and decode rates; a timed-out request is cancelled (its socket shut down) before a
  retry. The wall budget, cut to the loop's deadline, is hard: no request or backoff outlives it, and a
  smoke run starts only when one fits.
- Repetition: two identical replies in a row end the run early.
"""

from __future__ import annotations

import ipaddress
import json
import os
import queue
import re
import threading
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

import git

from costmodel.kernels import worst_per_group
from workbench.agents.base import AgentContext, AgentResult
from workbench.agents.edits import EditError, apply_blocks, parse_blocks
from workbench.agents.endpoint import (
    EndpointInfo,
    Reply,
    RequestError,
    context_from_error,
    is_overflow,
    probe,
    stream_chat,
)
from workbench.agents.textproto import TEXT_NUDGE, TEXT_RULES, Action, parse_reply, signature
from workbench.engine_source import SOURCE_REL
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
PROTOCOLS = ("auto", "tools", "text")
ASSUMED_CONTEXT = 32_768  # an endpoint that does not say its context size, until an overflow error does
COMPACT_BELOW = 16_384  # contexts smaller than this get the compact opening message
ASSUMED_PREFILL_TPS = 25.0  # prompt tokens per second assumed before one request has measured it
ASSUMED_DECODE_TPS = 5.0
TIMEOUT_SLACK = 2.0  # a timeout allows this many times the time the measured rates predict
CONTEXT_MARGIN = 64  # tokens kept free of the estimate's error
STOP_GRACE_S = 0.3  # a request in flight when the engineer stops gets this long to finish its reply
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
    context_tokens: int = 0  # the endpoint's context size; 0: learn it (/props, /api/show, /v1/models, overflow error)
    protocol: str = "auto"  # tools, text (SEARCH/REPLACE blocks and commands in the reply), auto: tools until the
    #                         endpoint says it takes none or the model answers in text
    max_reply_tokens: int = 1024  # max_tokens of one request (less when the context is small)
    prefill_tokens_per_s: float = 0.0  # assumed prompt rate until one is measured; 0: 25 tok/s (a slow CPU)
    decode_tokens_per_s: float = 0.0  # assumed generation rate until one is measured; 0: 5 tok/s

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise LLMConfigError(f"LLM setting protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        for name, kind, low in (("max_turns", int, 1), ("max_tokens_total", int, 1), ("wall_s", float, 0.001),
                                ("request_timeout_s", float, 0.001), ("retries", int, 0),
                                ("temperature", float, 0.0), ("backoff_s", float, 0.0), ("context_tokens", int, 0),
                                ("max_reply_tokens", int, 16), ("prefill_tokens_per_s", float, 0.0),
                                ("decode_tokens_per_s", float, 0.0)):
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

    def text_files(self) -> list[str]:
        """Relative paths of the worktree's files under 2 MB (candidates for a block that names no file)."""
        out = []
        for d, dirs, files in os.walk(self.root):
            dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
            for name in sorted(files):
                p = Path(d) / name
                if name != ".git" and not p.is_symlink() and p.stat().st_size < 2_000_000:
                    out.append(self.rel(p))
        return out

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
         "when your change is ready (or with no change to give up). If you cannot call tools, write a "
         "SEARCH/REPLACE block after a line naming the file, or a command line: READ path, FINISH name: summary. "
         "Another reply without an action ends your work.")

TEXT_SYSTEM_PROMPT = SYSTEM_PROMPT.split("\n\nRules:")[0].replace("through tools only", "by writing actions in "
                                                                  "your reply") + """

Rules:
- The output must stay token-identical to the stock system under greedy decoding; every token is checked \
against stock, on hidden prompts too. Never special-case prompts, memoize outputs or play with clocks.
- Change only the system code and its mechanism config; protected paths (specpilot.toml, prompts) are off limits.
- Copy SEARCH lines exactly from the file. Make one small change, then SMOKE, then FINISH.

""" + TEXT_RULES


ENGINE_NOTE = ("The engine's C++ source is in engine/llama.cpp/ (llama.cpp, the part its build reads; the kernels "
               "are in engine/llama.cpp/ggml/src/ggml-cpu/). Every commit runs the llama-server built from it: "
               "run_smoke builds what you changed (about a minute per file) and reports the compiler's first error.")


def kernel_note(path: Path) -> str:
    """Stock's worst kernels against their roofline (the loop's `.specpilot/kernels.json`), for an agent that may
    edit them; "" when none were measured."""
    try:
        prof = json.loads(path.read_text())["profile"]
    except (OSError, ValueError, KeyError):
        return ""
    rows = "; ".join(f"{k['type']} {k['k']}x{k['n']} (x{k['count']}) at width {k['width']}: {k['us']:.0f} us per "
                     f"tensor against a roofline of {k['roofline_us']:.0f}, {k['gap_ms']:.1f} ms lost per forward"
                     for k in worst_per_group(prof.get("kernels", []), 4))
    ratio = prof.get("forward_ratio", {}).get("4")
    return ("The engine's matmul kernels against their roofline (stock's, measured on this machine): " + rows
            + (f". A forward's matmuls over 4 tokens cost {ratio:.2f}x one token's" if ratio else "")
            + ". A commit that changes ggml/ is first held against stock's kernel outputs on the deployment's real "
              "weights (error at most 1e-4 of the mean |output|), then forced token by token.") if rows else ""


def opening_message(ctx: AgentContext, compact: bool = False, config_excerpt: str = "",
                    files: list[str] | None = None) -> str:
    """The task: the gap breakdown, the direction, the visible prompts (never the hidden split).

    `compact` (a small context): one line per item, one prompt, names and summaries only; `config_excerpt`
    (the mechanism config file, clipped) and `files` (the worktree's file names) are added when given.
    """
    d = ctx.direction
    extra = []
    if (Path(ctx.worktree) / SOURCE_REL).is_dir():
        extra.append(ENGINE_NOTE)
        kernels = kernel_note(Path(ctx.worktree).parent.parent / "kernels.json")
        if kernels:
            extra.append(kernels)
    if config_excerpt:
        extra.append(config_excerpt)
    if files:
        extra.append("Files: " + ", ".join(files))
    if compact:
        def names(items: list[dict[str, Any]]) -> str:
            return "; ".join(f"{m.get('name')} ({_clip(' '.join(str(m.get('summary', '')).split()), 120)})"
                             for m in items[:8]) or "none"
        gaps = ", ".join(f"{g.get('family')} {float(g.get('ms_per_token', 0)):.2f}" for g in ctx.gap_breakdown[:5])
        first = ctx.visible_prompts[0] if ctx.visible_prompts else None
        return "\n\n".join([
            f"Your direction: the {d.family} gap ({d.gap_ms:.3f} ms per generated token lost against its "
            f"ceiling): {d.summary}. Close as much of it as you can without changing a single output token.",
            f"Known mechanisms for it: {names(d.mechanisms)}.\nAccepted on other deployments: {names(d.memory)}.",
            f"Largest gaps (ms per token): {gaps}.",
            *([f"A visible prompt (1 of {len(ctx.visible_prompts)}): "
               + _clip(str(first.get('text', '')), 300)] if first else []),
            *extra,
            "Make one small change to the system, check it, and hand it in.",
        ])
    prompts = [{"id": p.get("id"), "text": _clip(str(p.get("text", "")), MAX_PROMPT_CHARS)}
               for p in ctx.visible_prompts]
    return "\n\n".join([
        f"Your direction: the {d.family} gap ({d.gap_ms:.3f} ms per generated token lost "
        f"against its ceiling). Close as much of it as you can without changing a single output token.",
        "Direction (gap family, measured gap, the decoder's registry mechanisms for it, mechanisms memory holds "
        "for it):\n" + json.dumps(d.as_dict(), indent=1, default=str),
        "Gap breakdown of the current base (the cost model's ranked gaps):\n"
        + json.dumps(ctx.gap_breakdown, indent=1, default=str),
        f"Visible prompts ({len(prompts)}; the system is also checked on hidden ones):\n"
        + json.dumps(prompts, indent=1, ensure_ascii=False),
        *extra,
        "Start by reading specpilot.toml and the system code, then make your change and call finish.",
    ])


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters cut]"


# -- the agent -------------------------------------------------------------------------------------------------


class _RequestFailed(Exception):
    """The model could not be reached (retries spent or a non-retryable error): the run ends."""


class _OutOfTime(Exception):
    """The wall budget ran out during a request or its retries: the run ends with the budget's reason."""


class LLMAgent:
    """An agent that lets an LLM behind an OpenAI-compatible endpoint edit its branch with tools or text."""

    name = "llm"

    def __init__(self, config: LLMConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock

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
        self.messages: list[dict[str, Any]] = []
        self.opening = ""
        self.logged = 0  # messages already written to the ledger
        self.turns = 0
        self.tokens = 0
        self.t0 = agent._clock()
        self.wall_s = self.cfg.wall_s
        if ctx.deadline is not None:  # the loop's budget ends sooner than this agent's own
            self.wall_s = max(0.001, min(self.wall_s, ctx.deadline - time.monotonic()))
        self.tool_errors = 0
        self.retried = 0
        self.latency = 0.0
        self.mode = "text" if self.cfg.protocol == "text" else "tools"
        self.n_ctx = self.cfg.context_tokens or ASSUMED_CONTEXT
        self.ctx_source = "[llm] context_tokens" if self.cfg.context_tokens else "assumed (the endpoint did not say)"
        self.chars_per_token = 3.0  # conservative until a reply's usage measures it
        self.prefill_tps: float | None = None
        self.decode_tps: float | None = None
        self.notes: list[str] = []  # one line per action, for the summary of turns cut from the context
        self.last_signature: str | None = None
        self.idle = 0  # consecutive replies with no action
        self.smoke_s = 0.0  # how long the last smoke run took
        self.max_request_tokens = 0  # the largest prompt estimate sent (with its max_tokens)

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
        info = self.learn_endpoint()
        self.start_conversation()
        self.log("llm.start", f"llm agent on {self.ctx.branch}: {self.ctx.direction.family} with {self.cfg.model} "
                              f"({self.mode} protocol, context {self.n_ctx} tokens, {self.ctx_source})",
                 {"model": self.cfg.model, "base_url": self.cfg.base_url, "start_head": self.start_head,
                  "protocol": self.mode, "context_tokens": self.n_ctx, "context_source": self.ctx_source,
                  "endpoint_tool_calls": info.tool_calls,
                  "budgets": {"max_turns": self.cfg.max_turns, "max_tokens_total": self.cfg.max_tokens_total,
                              "wall_s": self.wall_s}})
        while True:
            self.drain_steering()
            reason = self.budget_spent()
            if reason:
                return self.end(reason)
            self.turns += 1
            step("llm turn", self.turns, self.cfg.max_turns, self.cfg.model)
            try:
                reply = self.request()
            except _OutOfTime:
                return self.end(self.wall_reason())
            except _RequestFailed as e:
                return self.end(str(e) if str(e) == "stopped by the engineer" else f"LLM request failed: {e}")
            calls = self.take_reply(reply)
            sig = signature(reply.content, [(c.name, c.arguments) for c in calls])
            if sig == self.last_signature:
                return self.end("the model repeated its previous reply word for word (2 identical replies in a "
                                "row); stopped early")
            self.last_signature = sig
            if calls and self.mode == "tools":
                self.idle = 0
                for call in calls:
                    result, done = self.dispatch(call)
                    self.messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
                    if done is not None:
                        return self.close(done)
                continue
            actions = parse_reply(reply.content) if self.cfg.protocol != "tools" else []
            if not actions:
                self.idle += 1
                self.notes.append(f"turn {self.turns}: no action")
                if self.idle >= 2:
                    return self.end("model produced no actionable edit (two replies in a row with neither a tool "
                                    "call nor a SEARCH/REPLACE block or command)")
                self.messages.append({"role": "user", "content": TEXT_NUDGE if self.mode == "text" else NUDGE})
                continue
            self.idle = 0
            switched = self.mode == "tools"
            if switched:
                self.mode = "text"
                self.log("llm.protocol", f"turn {self.turns}: the model answered in text; switching to the text "
                                         f"protocol", {"turn": self.turns})
            results, done = self.run_actions(actions)
            if done is not None:
                return self.close(done)
            self.messages.append({"role": "user", "content": ("Results:\n" + results) + (
                "\n\n" + TEXT_RULES if switched else "")})

    def learn_endpoint(self) -> EndpointInfo:
        """The endpoint's context size and tool support, unless the settings fix both."""
        if self.cfg.context_tokens and self.cfg.protocol != "auto":
            return EndpointInfo(self.cfg.context_tokens, "[llm] context_tokens", None)
        info = probe(self.cfg.base_url, self.cfg.api_key, self.cfg.model)
        if info.context_tokens and not self.cfg.context_tokens:
            self.n_ctx, self.ctx_source = info.context_tokens, info.source
        if info.tool_calls is False and self.cfg.protocol == "auto":
            self.mode = "text"
        return info

    def start_conversation(self) -> None:
        compact = self.n_ctx < COMPACT_BELOW
        excerpt = self.config_excerpt(1_500 if compact else 6_000)
        try:
            listing = self.tools.list_files(".").splitlines()
        except ToolError:
            listing = []
        files = [ln.rsplit(" (", 1)[0] for ln in listing[:40 if compact else 200]]
        self.opening = opening_message(self.ctx, compact=compact, config_excerpt=excerpt, files=files)
        system = TEXT_SYSTEM_PROMPT if self.mode == "text" else SYSTEM_PROMPT
        self.messages = [{"role": "system", "content": system}, {"role": "user", "content": self.opening}]

    def config_excerpt(self, limit: int) -> str:
        """The mechanism config named by specpilot.toml's [system] config, numbered, clipped to `limit` chars."""
        try:
            data = tomllib.loads((self.tools.root / "specpilot.toml").read_text())
            name = str(data.get("system", {}).get("config") or "")
            if not name:
                return ""
            text = self.tools.read_file(name)
        except (OSError, tomllib.TOMLDecodeError, ToolError):
            return ""
        return f"The mechanism config, {name} (edit it like any file):\n" + _clip(text, limit)

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
        if self.elapsed() >= self.wall_s:
            return self.wall_reason()
        return ""

    def wall_reason(self) -> str:
        return f"wall-time budget spent ({self.wall_s:g} s) before finish"

    def elapsed(self) -> float:
        return self.agent._clock() - self.t0

    def left(self) -> float:
        return self.wall_s - self.elapsed()

    # -- the context ---------------------------------------------------------------------------------------

    def estimate(self, messages: list[dict[str, Any]]) -> int:
        """Prompt tokens of `messages` (and the tool schemas in tools mode), from the measured chars per token."""
        chars = sum(len(str(m.get("content") or "")) + len(json.dumps(m.get("tool_calls") or "")) + 16
                    for m in messages)
        if self.mode == "tools":
            chars += len(json.dumps(TOOLS))
        return int(chars / self.chars_per_token) + 8 * len(messages)

    def reply_tokens(self) -> int:
        """max_tokens: the setting, a quarter of the context, and what half the budget left can generate."""
        rate = self.decode_tps or self.cfg.decode_tokens_per_s or ASSUMED_DECODE_TPS
        by_time = int(rate * max(0.0, self.left()) / (2 * TIMEOUT_SLACK))
        return max(16, min(self.cfg.max_reply_tokens, self.n_ctx // 4, max(64, by_time)))

    def prompt_budget(self) -> int:
        return self.n_ctx - self.reply_tokens() - CONTEXT_MARGIN

    def result_limit(self) -> int:
        """Characters a tool result may take: a sixth of the context, at most MAX_TOOL_RESULT_CHARS."""
        return max(400, min(MAX_TOOL_RESULT_CHARS, int(self.n_ctx * self.chars_per_token / 6)))

    def fit_context(self) -> None:
        """Keep the request inside the context: cut older turns (summarised in the opening message), then clip."""
        budget = self.prompt_budget()
        if self.estimate(self.messages) <= budget:
            return
        before = len(self.messages)
        head, tail = self.messages[:2], self.messages[2:]
        turns: list[list[dict[str, Any]]] = []
        for m in tail:  # a turn: an assistant message and what answered it (tool results, the next user text)
            if m["role"] == "assistant" or not turns:
                turns.append([])
            turns[-1].append(m)
        kept: list[list[dict[str, Any]]] = []
        for turn in reversed(turns):
            trial = [m for t in [turn, *kept] for m in t]
            if kept and self.estimate(head + trial) > budget * 0.8:
                break
            kept.insert(0, turn)
        cut = len(turns) - len(kept)
        summary = ""
        if cut:
            room, lines = int(budget * self.chars_per_token / 4), []  # a quarter of the budget at most
            for note in reversed(self.notes[-40:]):
                room -= len(note) + 1
                if room < 0:
                    break
                lines.insert(0, note)
            summary = (f"\n\nEarlier turns, summarised (cut to fit the model's context of {self.n_ctx} tokens):\n"
                       + "\n".join(lines))
        messages = [head[0], {"role": "user", "content": self.opening + summary}] + [m for t in kept for m in t]
        while messages and messages[2:3] and messages[2]["role"] == "tool":  # a result without its call
            messages.pop(2)
        over = self.estimate(messages) - budget
        if over > 0:  # still too long: clip the longest messages, then the opening (its summary stays whole)
            for m in sorted(messages[2:], key=lambda m: -len(str(m.get("content") or ""))):
                text = str(m.get("content") or "")
                keep = max(200, len(text) - int((over + 16) * self.chars_per_token))
                if keep < len(text):
                    m["content"] = _clip(text, keep)
                over = self.estimate(messages) - budget
                if over <= 0:
                    break
            if over > 0:
                keep = max(300, len(self.opening) - int((over + 16) * self.chars_per_token))
                messages[1]["content"] = _clip(self.opening, keep) + summary
        self.messages = messages
        self.logged = min(self.logged, len(self.messages))
        self.log("llm.compact", f"turn {self.turns}: {before} messages -> {len(messages)} to fit {self.n_ctx} tokens",
                 {"turn": self.turns, "context_tokens": self.n_ctx, "turns_cut": cut,
                  "estimate": self.estimate(messages), "budget": budget})

    # -- requests ------------------------------------------------------------------------------------------

    def timeouts(self, prompt_tokens: int, reply_tokens: int) -> tuple[float, float]:
        """(first-token, total) timeouts: the floor request_timeout_s, or the time the rates predict times slack."""
        prefill = self.prefill_tps or self.cfg.prefill_tokens_per_s or ASSUMED_PREFILL_TPS
        decode = self.decode_tps or self.cfg.decode_tokens_per_s or ASSUMED_DECODE_TPS
        first = max(self.cfg.request_timeout_s, TIMEOUT_SLACK * prompt_tokens / prefill)
        total = first + max(self.cfg.request_timeout_s, TIMEOUT_SLACK * reply_tokens / decode)
        return first, total

    def request(self) -> Reply:
        """One streamed chat completion, retried on 5xx / 429, timeouts and connection errors with exponential
        backoff, each attempt cancelled before the next; an overflow error shrinks the context and resends."""
        new = self.flush_messages(log=False)
        attempt = 0
        overflows = 0
        while True:
            self.fit_context()
            left = self.left()
            if left <= 0:
                raise _OutOfTime
            est = self.estimate(self.messages)
            reply_tokens = self.reply_tokens()
            first_s, total_s = self.timeouts(est, reply_tokens)
            first_s, total_s = min(first_s, left), min(total_s, left)
            self.max_request_tokens = max(self.max_request_tokens, est + reply_tokens)
            body: dict[str, Any] = {"model": self.cfg.model, "messages": self.messages,
                                    "temperature": self.cfg.temperature, "max_tokens": reply_tokens}
            if self.mode == "tools":
                body.update(tools=TOOLS, tool_choice="auto")
            self.log("llm.request", f"turn {self.turns} attempt {attempt + 1}: {len(self.messages)} messages, "
                                    f"~{est} prompt tokens of {self.n_ctx}",
                     {"turn": self.turns, "attempt": attempt + 1, "model": self.cfg.model, "protocol": self.mode,
                      "n_messages": len(self.messages), "prompt_tokens_est": est, "max_tokens": reply_tokens,
                      "context_tokens": self.n_ctx, "first_token_timeout_s": round(first_s, 3),
                      "timeout_s": round(total_s, 3), "new_messages": new if attempt == 0 else []})
            stop = _GracefulStop(self.ctx.stop, STOP_GRACE_S)
            try:
                reply = stream_chat(self.cfg.base_url.rstrip("/") + "/chat/completions",
                                    {"Authorization": f"Bearer {self.cfg.api_key}"}, body,
                                    first_token_s=first_s, total_s=total_s, stop=stop)
            except RequestError as e:
                if e.kind == "stopped":
                    raise _RequestFailed("stopped by the engineer") from None
                if e.status is not None and 400 <= e.status < 500 and is_overflow(e.body or str(e)) and overflows < 2:
                    overflows += 1
                    named = context_from_error(e.body or str(e))
                    self.n_ctx = min(named or int(est * 0.8), self.n_ctx)
                    self.ctx_source = f"overflow error ({_clip(_one_line(e), 120)})"
                    self.log("llm.context", f"turn {self.turns}: the request did not fit; context now {self.n_ctx} "
                                            f"tokens", {"turn": self.turns, "context_tokens": self.n_ctx,
                                                        "error": _clip(_one_line(e), 300)})
                    continue
                if not e.retryable:
                    text = _clip(_one_line(e), 300)
                    if e.kind == "status" and e.status:
                        text = text.replace(f"HTTP {e.status}", f"HTTP {e.status} from {self.cfg.base_url}", 1)
                    raise _RequestFailed(text) from None
                why = "HTTP " + str(e.status) if e.kind == "status" and e.status else _one_line(e)
                if e.kind == "timeout" and self.left() <= 0.01 * self.wall_s:
                    raise _OutOfTime from None
            else:
                self.measure(reply, est)
                return reply
            if attempt == self.cfg.retries:
                raise _RequestFailed(f"{why}; gave up after {attempt + 1} attempts")
            delay = min(self.cfg.backoff_s * 2 ** attempt, max(0.0, self.left()))
            self.retried += 1
            self.log("llm.retry", f"turn {self.turns}: {why}; retrying in {delay:.2f} s",
                     {"turn": self.turns, "attempt": attempt + 1, "error": why, "delay_s": delay})
            if self.ctx.stop.wait(delay):
                raise _RequestFailed("stopped by the engineer")
            attempt += 1

    def measure(self, reply: Reply, est: int) -> None:
        """Learn chars per token and the prefill and decode rates from a completed reply."""
        self.latency = reply.total_s
        usage = reply.usage or {}
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int) and prompt > 50:
            chars = est * self.chars_per_token  # what the estimate counted, in characters
            self.chars_per_token = max(1.5, min(5.0, 0.9 * chars / prompt))
        t = reply.timings or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        if t.get("prompt_n", 0) >= 32 and t.get("prompt_per_second"):
            rate = float(t["prompt_per_second"])
        elif isinstance(prompt, int) and prompt - cached >= 64 and reply.first_token_s > 0:
            rate = (prompt - cached) / reply.first_token_s
        else:
            rate = None
        if rate:
            self.prefill_tps = rate if self.prefill_tps is None else (self.prefill_tps + rate) / 2
        done = usage.get("completion_tokens")
        if t.get("predicted_n", 0) >= 8 and t.get("predicted_per_second"):
            rate = float(t["predicted_per_second"])
        elif isinstance(done, int) and done >= 8 and reply.total_s > reply.first_token_s:
            rate = done / (reply.total_s - reply.first_token_s)
        else:
            rate = None
        if rate:
            self.decode_tps = rate if self.decode_tps is None else (self.decode_tps + rate) / 2

    def take_reply(self, reply: Reply) -> list[_Call]:
        """Append the assistant message to the conversation, count tokens, log it; return its tool calls."""
        calls = [_Call(c["id"] or f"call_{self.turns}_{k}", c["name"], c["arguments"])
                 for k, c in enumerate(reply.tool_calls)] if self.mode == "tools" else []
        usage = reply.usage or {}
        total = usage.get("total_tokens")
        if isinstance(total, int):
            self.tokens += total
        else:  # a server that reports no usage: count what was sent and received
            self.tokens += self.estimate(self.messages) + int(len(reply.content) / self.chars_per_token)
        entry: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if calls:
            entry["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        self.messages.append(entry)
        self.logged = len(self.messages)
        names = ", ".join(c.name for c in calls) or ("text" if reply.content.strip() else "empty reply")
        self.log("llm.response", f"turn {self.turns}: {names}",
                 {"turn": self.turns, "content": reply.content, "finish_reason": reply.finish_reason,
                  "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls],
                  "usage": reply.usage, "timings": reply.timings, "tokens_so_far": self.tokens,
                  "latency_s": round(reply.total_s, 3), "first_token_s": round(reply.first_token_s, 3),
                  "prefill_tokens_per_s": self.prefill_tps, "decode_tokens_per_s": self.decode_tps})
        return calls

    # -- the text protocol ---------------------------------------------------------------------------------

    def run_actions(self, actions: list[Action]) -> tuple[str, AgentResult | None]:
        """Run the actions of a text reply in order; (their results, numbered; the run's result at FINISH)."""
        out: list[str] = []
        for k, a in enumerate(actions, 1):
            done: AgentResult | None = None
            try:
                if a.kind == "error":
                    text = "error: " + a.args["error"]
                elif a.kind == "edit":
                    text = self.text_edit(a)
                elif a.kind == "list":
                    text = self.tools.list_files(a.args["path"])
                elif a.kind == "read":
                    text = self.tools.read_file(a.args["path"], a.args["start_line"] or None,
                                                a.args["end_line"] or None)
                elif a.kind == "grep":
                    text = self.tools.grep(a.args["pattern"], a.args["path"])
                elif a.kind == "smoke":
                    text = self.run_smoke()
                else:
                    text, done = self.finish(a.args["summary"], a.args["mechanism_name"])
            except ToolError as e:
                text = f"error: {e}"
            except (OSError, git.GitCommandError) as e:
                text = f"error: {a.kind} failed: {_clip(_one_line(e), 500)}"
            text = _clip(text, self.result_limit() // max(1, len(actions)))
            ok = not text.startswith("error:")
            self.tool_errors += not ok
            self.notes.append(f"turn {self.turns}: {a.describe()} -> {_clip(text.splitlines()[0], 120)}")
            first = _clip(text.splitlines()[0] if text else "", 200)
            self.log("llm.action", f"turn {self.turns}: {a.describe()} {'ok' if ok else first}",
                     {"turn": self.turns, "action": a.kind, "args": a.args, "ok": ok, "result": text,
                      "blocks": len(a.blocks)})
            out.append(f"[{k}] {a.describe()}: {text}")
            if done is not None:
                return "\n\n".join(out), done
        return "\n\n".join(out), None

    def text_edit(self, a: Action) -> str:
        """Apply a text reply's blocks to the file it named, or to the one file whose text they match."""
        path = a.args.get("path") or ""
        blocks = "".join(f"<<<<<<< SEARCH\n{b.search}=======\n{b.replace}>>>>>>> REPLACE\n" for b in a.blocks)
        if path:
            return self.tools.edit(path, blocks)
        if not any(b.search.strip() for b in a.blocks):
            raise ToolError("a block with an empty SEARCH creates a file: put the new file's path on the line "
                            "before '<<<<<<< SEARCH'")
        hits = []
        for rel in self.tools.text_files():
            try:
                apply_blocks(self.tools._text(self.tools.root / rel, rel), a.blocks)
            except (EditError, ToolError):
                continue
            hits.append(rel)
        if len(hits) != 1:
            where = "no file" if not hits else f"{len(hits)} files ({', '.join(hits[:5])})"
            raise ToolError(f"SEARCH matches {where}; put the file's path on the line before '<<<<<<< SEARCH'")
        return self.tools.edit(hits[0], blocks)

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
        result = _clip(result, self.result_limit())
        ok = not result.startswith("error:")
        self.tool_errors += not ok
        self.notes.append(f"turn {self.turns}: {call.name}({_clip(' '.join(call.arguments.split()), 100)}) -> "
                          f"{_clip(result.splitlines()[0] if result else '', 120)}")
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
        need = max(self.smoke_s * 1.2, 0.05 * self.wall_s)  # a smoke run cannot be cut short: it must fit
        if self.left() < need:
            return (f"error: not enough of the wall budget left for a smoke run ({self.left():.0f} s left, one takes "
                    f"about {need:.0f} s); call finish now")
        sha = self.commit_wip()
        t = time.monotonic()
        try:
            r = self.ctx.smoke()
        except Exception as e:  # the smoke runner is the loop's; its crash is news for the model, not the end
            return f"error: the smoke run crashed: {type(e).__name__}: {_clip(_one_line(e), 500)}"
        finally:
            self.smoke_s = time.monotonic() - t
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
                   "wall_s": round(self.elapsed(), 3), "wall_budget_s": round(self.wall_s, 3),
                   "tool_errors": self.tool_errors, "retries": self.retried, "protocol": self.mode,
                   "context_tokens": self.n_ctx, "context_source": self.ctx_source,
                   "max_request_tokens": self.max_request_tokens,
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


class _GracefulStop:
    """An event for stream_chat that reads as set only once `stop` has been set for `grace_s`: a reply already
    on its way gets to finish (its edits are done), a request still waiting is cancelled."""

    def __init__(self, stop: threading.Event, grace_s: float) -> None:
        self.stop, self.grace_s, self.since = stop, grace_s, None

    def is_set(self) -> bool:
        if not self.stop.is_set():
            return False
        if self.since is None:
            self.since = time.monotonic()
        return time.monotonic() - self.since >= self.grace_s
