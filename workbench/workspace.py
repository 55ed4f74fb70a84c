"""Workspaces: a git repository whose first commit is stock, and a worktree per candidate branch.

Layout of a workspace (`specpilot init demo [PATH]`):

    specpilot.toml        deployment, the system's entry point, editable config, protected paths
    system.toml           the editable mechanism config (a DecodeConfig; stock = all mechanisms off)
    decoder/ kernels/     the system under optimization, as shipped
    prompts/visible.jsonl the forcing prompts agents may see
    .specpilot/           never committed, never visible to a candidate's sandbox:
        memory.db         the workspace memory (store.Memory)
        hidden.jsonl      the hidden forcing split
        stock/            stock's cached reference outputs and margins
        worktrees/NAME    one git worktree per branch
        logs/             each system run's stderr

Branch state lives in git (branch, worktree) and in the store (round, agent, direction, status);
`recover()` reconciles the two after a crash.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import git

import decoder
import kernels
from decoder.capabilities import drafter_files_refusal, drafters_dir, native_bf16_cpu, refusal
from decoder.config import ConfigError, DecodeConfig, read_table
from decoder.engines import EngineError
from decoder.engines.llamacpp import LlamaServer, ServerSettings, SpecSettings
from decoder.engines.llamacpp_build import binary, engine_dir, gguf_path, is_built, missing_build_message
from decoder.engines.llamacpp_config import LlamaCppConfig
from decoder.engines.smollm2 import (
    ModelFetchError,
    has_drafter,
    has_lookup_corpus,
    smollm2_drafter_gguf,
    smollm2_gguf,
    smollm2_hf_dir,
    smollm2_lookup_cache,
    smollm2_prompts,
)
from decoder.mechanisms import ENGINES, Contract, contract_for
from store import Branch, Memory, StoreError, data_dir
from workbench.agents import engine_patch
from workbench.engine_source import SOURCE_REL, carry_source
from workbench.harness import sandbox_status, unreadable_for_sandbox
from workbench.progress import pid_alive
from workbench.safegit import SafeGitError, worktree_admin_dir, worktree_git

STOCK_TAG = "stock"
# The keep threshold (cascade.noise_floor): the base timed against itself in this many fresh process
# pairs; a candidate must beat 1 + margin x the largest deviation they show.
NOISE_PAIRS, NOISE_MARGIN = 3, 2.0
MANUAL_ROUND = "manual"  # branches made by hand (`specpilot branch create`) belong to the round in this status
NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
LIVE_STATUSES = ("evaluating", "running")  # an evaluation or an agent in progress
MAX_CONFIG_BYTES = 64 * 1024  # a system.toml larger than this is refused, not parsed


class WorkspaceError(Exception):
    """A user-facing workspace problem; the message says what to do."""


MAX_LOAD_BATCH = 256


def load_points(deployment: dict, path: Path) -> list[int]:
    """The deployment's load profile: `load = {batch_sizes = [1, 8]}` (or the older `batch_sizes = [..]`),
    ascending distinct batch sizes; a one-line WorkspaceError naming the bad value otherwise."""
    load = deployment.get("load", {})
    if not isinstance(load, dict):
        raise WorkspaceError(f"{path}: load = {load!r} must be a table, e.g. load = {{batch_sizes = [1, 8]}}")
    unknown = sorted(set(load) - {"batch_sizes"})
    if unknown:
        raise WorkspaceError(f"{path}: load has unknown key(s) {', '.join(unknown)}; write load = "
                             f"{{batch_sizes = [1, 8]}} (Poisson arrivals are not supported in a workspace yet)")
    sizes = load.get("batch_sizes", deployment.get("batch_sizes", [1]))
    if (not isinstance(sizes, list) or not sizes
            or not all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= MAX_LOAD_BATCH for b in sizes)
            or sizes != sorted(set(sizes))):
        raise WorkspaceError(f"{path}: load batch_sizes = {sizes!r} is invalid; use ascending distinct integers "
                             f"from 1 to {MAX_LOAD_BATCH}, e.g. load = {{batch_sizes = [1, 8]}}")
    return list(sizes)


@dataclass
class WorkspaceConfig:
    name: str
    target: Path
    drafter: Path | None
    tokenizer: Path
    dtype: str = "bfloat16"
    device: str = "cpu"
    hardware: str = "cpu-local"
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    entry: list[str] = field(default_factory=list)
    config_file: str = "system.toml"
    protected: list[str] = field(default_factory=list)
    forcing_max_new_tokens: int = 64
    max_mismatches_per_prompt: int = 16
    limits: dict = field(default_factory=dict)
    bench: dict = field(default_factory=dict)  # noise_pairs, noise_margin: see cascade.noise_floor
    llm: dict = field(default_factory=dict)  # the [llm] table: the LLM agent's endpoint (the environment fills gaps)
    executor: dict = field(default_factory=dict)  # the [executor] table: where evaluations run (workbench.executor)
    engine: str = "torch"  # [system] engine: torch (decoder/serve.py) or llama.cpp (decoder/engines/serve_llamacpp.py)
    engine_bin: Path | None = None  # [system] engine_bin: the engine's binaries, read-only in the sandbox (llama.cpp)
    engine_source: str | None = None  # [system] engine_source: the engine source the workspace carries (llama.cpp)
    # [deployment] lookup_cache: a folder of llama.cpp n-gram caches made from the deployment's own answers
    # (decoder/engines/lookup_cache.py), read-only in the sandbox; the system's `lookup_cache = "corpus"` loads it
    lookup_cache: Path | None = None

    @classmethod
    def load(cls, path: Path) -> WorkspaceConfig:
        try:
            data = tomllib.loads(path.read_text())
        except OSError as e:
            raise WorkspaceError(f"{path}: cannot read ({e.strerror}); is this a workspace? "
                                 f"create one with `specpilot init demo PATH`") from None
        except tomllib.TOMLDecodeError as e:
            raise WorkspaceError(f"{path}: not valid TOML ({e})") from None
        try:
            d, s = data["deployment"], data["system"]
            f, lim, bench = data.get("forcing", {}), data.get("limits", {}), data.get("bench", {})
            return cls(name=d["name"], target=Path(d["target"]), drafter=Path(d["drafter"]) if d.get("drafter")
                       else None, tokenizer=Path(d.get("tokenizer", d["target"])), dtype=d.get("dtype", "bfloat16"),
                       device=d.get("device", "cpu"), hardware=d.get("hardware", "cpu-local"),
                       batch_sizes=load_points(d, path), entry=list(s["entry"]),
                       config_file=s.get("config", "system.toml"), protected=list(s.get("protected", [])),
                       forcing_max_new_tokens=int(f.get("max_new_tokens", 64)),
                       max_mismatches_per_prompt=int(f.get("max_mismatches_per_prompt", 16)), limits=dict(lim),
                       bench=dict(bench), llm=dict(data.get("llm", {})), executor=data.get("executor", {}),
                       engine=str(s.get("engine", "torch")),
                       engine_bin=Path(s["engine_bin"]) if s.get("engine_bin") else None,
                       engine_source=str(s["engine_source"]) if s.get("engine_source") else None,
                       lookup_cache=Path(d["lookup_cache"]) if d.get("lookup_cache") else None)
        except KeyError as e:
            raise WorkspaceError(f"{path}: missing key {e}; see `specpilot init demo` for a complete file") from None

    def to_toml(self) -> str:
        def q(v) -> str:
            return json.dumps(str(v))

        lines = ["# SpecPilot workspace: the deployment, the system under optimization and its guard rails.",
                 "[deployment]", f"name = {q(self.name)}", f"target = {q(self.target)}"]
        if self.drafter:
            lines.append(f"drafter = {q(self.drafter)}")
        if self.lookup_cache:
            lines.append(f"lookup_cache = {q(self.lookup_cache)}")
        lines += [f"tokenizer = {q(self.tokenizer)}", f"dtype = {q(self.dtype)}", f"device = {q(self.device)}",
                  f"hardware = {q(self.hardware)}",
                  "# the load the deployment serves: the loop times every point, a kept change loses at none",
                  f"load = {{batch_sizes = {json.dumps(self.batch_sizes)}}}", "",
                  "[system]", "# run as a subprocess from the branch's worktree; {target} {drafter} {python}"
                  + (" {lookup_cache}" if self.lookup_cache else "")
                  + (" {engine_server}" if self.engine_source else "") + " expand",
                  f"entry = {json.dumps(self.entry)}", f"config = {q(self.config_file)}",
                  *([f"engine = {q(self.engine)}"] if self.engine != "torch" else []),
                  *([f"engine_bin = {q(self.engine_bin)}"] if self.engine_bin else []),
                  *(["# the engine's source, built per commit into {engine_server} (workbench/engine_source.py)",
                     f"engine_source = {q(self.engine_source)}"] if self.engine_source else []),
                  "# a candidate commit touching one of these is rejected before it runs",
                  f"protected = {json.dumps(self.protected)}", "",
                  "[forcing]", f"max_new_tokens = {self.forcing_max_new_tokens}",
                  f"max_mismatches_per_prompt = {self.max_mismatches_per_prompt}", "", "[limits]"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in self.limits.items()]
        if self.bench:
            lines += ["", "[bench]"] + [f"{k} = {json.dumps(v)}" for k, v in self.bench.items()]
        if self.llm:
            lines += ["", "[llm]"] + [f"{k} = {json.dumps(v)}" for k, v in self.llm.items()]
        if self.executor:
            lines += ["", "[executor]"] + [f"{k} = {json.dumps(v)}" for k, v in self.executor.items()]
        return "\n".join(lines) + "\n"

    def model_dirs(self) -> list[Path]:
        """What the system's sandbox may read besides the Python environment: the models (directories or GGUF
        files), the tokenizer, the engine's binaries and the n-gram caches."""
        return [p for p in (self.target, self.drafter, self.tokenizer, self.engine_bin, self.lookup_cache)
                if p is not None]


class Workspace:
    """An open workspace: its config, git repository, memory and branches."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).resolve()
        if not (self.path / "specpilot.toml").exists():
            raise WorkspaceError(f"{self.path} is not a SpecPilot workspace (no specpilot.toml); "
                                 f"create one with `specpilot init demo {path}`")
        self.config = WorkspaceConfig.load(self.path / "specpilot.toml")
        try:
            self.repo = git.Repo(self.path)
        except git.InvalidGitRepositoryError:
            raise WorkspaceError(f"{self.path} has a specpilot.toml but is not a git repository") from None
        self.state = self.path / ".specpilot"
        self._detached_at: dict[str, str] = {}  # internal worktree -> the commit it was checked out at here
        for sub in ("stock", "worktrees", "logs"):
            (self.state / sub).mkdir(parents=True, exist_ok=True)
        self._memory: Memory | None = None
        self._configs: dict[str, dict] = {}  # commit -> its [decode] table (commits never change)
        self._model_configs: tuple | None = None  # (target, drafter) transformers configs, read on first use
        if self.config.engine not in ENGINES:
            raise WorkspaceError(f"{self.path / 'specpilot.toml'}: [system] engine = {self.config.engine!r}; "
                                 f"choose one of {', '.join(ENGINES)}")

    # -- basics ----------------------------------------------------------------------------------------

    @property
    def memory(self) -> Memory:
        if self._memory is None:
            self._memory = Memory(self.state / "memory.db")
        return self._memory

    def close(self) -> None:
        if self._memory is not None:
            self._memory.close()
            self._memory = None

    def rev(self, ref: str) -> str:
        """The commit a ref names. A `git rev-parse` process per call: GitPython's shared object reader
        is not thread-safe, and agents run in threads."""
        try:
            return self.repo.git.rev_parse("--verify", "--quiet", f"{ref}^{{commit}}").strip()
        except git.GitCommandError:
            raise WorkspaceError(f"{ref!r} is not a commit, branch or tag of {self.path}") from None

    def config_at(self, ref: str) -> dict:
        """The system's [decode] table at commit `ref`, read once per commit from the git object (never
        from a worktree): every key, the system's own knobs included. The workbench reads the keys it
        needs from it (`verify_width`, `method`, `device`) and never validates it against the installed
        DecodeConfig: a candidate that adds a key runs its own code with it."""
        sha = self.rev(ref)
        hit = self._configs.get(sha)
        if hit is None:
            name = self.config.config_file
            try:
                size = int(self.repo.git.cat_file("-s", f"{sha}:{name}"))
                if size > MAX_CONFIG_BYTES:
                    raise WorkspaceError(f"{name} at {sha[:10]} is {size} bytes (limit {MAX_CONFIG_BYTES}); "
                                         f"a decode config is a few dozen keys")
                hit = read_table(self.repo.git.show(f"{sha}:{name}"))
            except git.GitCommandError:
                raise WorkspaceError(f"{name} is missing at {sha[:10]}; the system's config must stay "
                                     f"in the repository") from None
            except ConfigError as e:
                raise WorkspaceError(f"{name} at {sha[:10]}: {e}") from None
            self._configs[sha] = hit
        return dict(hit)

    @property
    def contract(self) -> Contract:
        """The config contract of this workspace's system: system.toml's class, the registry the tuner composes,
        the keys of its AR reference."""
        return contract_for(self.config.engine)

    def refusal(self, cfg: DecodeConfig | LlamaCppConfig, commit: str | None = None) -> str | None:
        """Why this deployment's models cannot run `cfg` (decoder/capabilities.py: architecture, a missing
        draft model), in one line; None when they can. The tuner and planning propose only what can run.
        `commit`: the commit whose engine would run it (a llama.cpp flag that only a patched engine knows is
        refused where the commit's engine source lacks the patch)."""
        if isinstance(cfg, LlamaCppConfig):
            if cfg.spec_type == "draft-simple" and self.config.drafter is None:
                return "this deployment has no draft model GGUF (specpilot.toml: drafter)"
            if cfg.spec_type == "ngram-cache" and cfg.lookup_cache == "corpus" and self.config.lookup_cache is None:
                return "this deployment has no n-gram lookup cache (specpilot.toml: lookup_cache)"
            return engine_patch.missing(self, commit, cfg.patched_flags())
        if cfg.method == "sd" and cfg.drafter == "draft-model" and self.config.drafter is None:
            return "this deployment has no draft model (specpilot.toml: drafter)"
        why = drafter_files_refusal(cfg, drafters_dir(self.config.target), self.config.target)
        if why:
            return why
        if self._model_configs is None:
            self._model_configs = (_read_model_config(self.config.target),
                                   _read_model_config(self.config.drafter) if self.config.drafter else None)
        target, drafter = self._model_configs
        return refusal(cfg, target, drafter, cfg.dtype) if target is not None else None

    @property
    def stock_commit(self) -> str:
        try:
            return self.rev(STOCK_TAG)
        except WorkspaceError:
            raise WorkspaceError(f"{self.path}: no '{STOCK_TAG}' tag; the workspace's first commit must be "
                                 f"tagged stock") from None

    def deployment_id(self) -> int:
        m = self.memory
        d = m.find_deployment(self.config.name)
        if d is None:
            c = self.config
            d = m.add_deployment(c.name, str(c.target), drafter=str(c.drafter) if c.drafter else None,
                                 hardware=c.hardware, dtype=c.dtype, regime={"batch_sizes": c.batch_sizes})
        return d.id

    def manual_round_id(self) -> int:
        dep = self.deployment_id()
        for r in self.memory.list_rounds(dep):
            if r.status == MANUAL_ROUND:
                return r.id
        return self.memory.add_round(dep, status=MANUAL_ROUND, base_commit=self.stock_commit).id

    def entry_argv(self, engine_server: Path | None = None) -> list[str]:
        """The system's command line; `{engine_server}`: the engine built from the commit being run."""
        c = self.config
        subs = {"{python}": sys.executable, "{target}": str(c.target), "{drafter}": str(c.drafter or ""),
                "{lookup_cache}": str(c.lookup_cache or ""), "{config}": c.config_file,
                "{engine_server}": str(engine_server or "")}
        out = []
        for a in c.entry:
            for k, v in subs.items():
                a = a.replace(k, v)
            out.append(a)
        return out

    def hidden_prompts_path(self) -> Path:
        return self.state / "hidden.jsonl"

    # -- branches --------------------------------------------------------------------------------------

    def worktree_path(self, name: str) -> Path:
        return self.state / "worktrees" / name

    def worktree_git(self, name: str) -> git.Git:
        """Git for a branch's (or an internal) worktree, never configured by the worktree's own `.git`."""
        try:
            return worktree_git(Path(self.repo.git_dir), self.worktree_path(name))
        except SafeGitError as e:
            raise WorkspaceError(str(e)) from None

    def find_branch(self, name: str) -> Branch | None:
        rows = [b for b in self.memory.list_branches() if b.name == name and b.status != "removed"]
        return rows[-1] if rows else None

    def branch(self, name: str) -> Branch:
        b = self.find_branch(name)
        if b is None:
            known = ", ".join(x.name for x in self.list_branches()) or "none"
            raise WorkspaceError(f"no branch named {name!r} in {self.path} (known: {known}); "
                                 f"create one with `specpilot branch create {name}`")
        return b

    def create_branch(self, name: str, *, base: str = STOCK_TAG, agent: str = "manual", direction: str = "",
                      round_id: int | None = None) -> Branch:
        """A new git branch from `base` with its own worktree, recorded in the store."""
        if not name or set(name) - NAME_OK or name.startswith((".", "-")) or name == STOCK_TAG:
            raise WorkspaceError(f"branch name {name!r} is not allowed; use letters, digits, '-', '_' and '.'")
        if self.find_branch(name) is not None or name in self.repo.heads:
            raise WorkspaceError(f"branch {name!r} already exists; pick another name or remove it first")
        base_sha = self.rev(base)
        wt = self.worktree_path(name)
        git_dir = Path(self.repo.git_dir)
        self._check_writable(name, [git_dir, git_dir / "refs" / "heads", git_dir / "worktrees", wt.parent, self.state,
                                    self.state / "memory.db"])
        try:
            rid = round_id if round_id is not None else self.manual_round_id()
            if wt.exists():
                shutil.rmtree(wt)  # a leftover of a crash: git no longer knows it (recover prunes)
            self.repo.git.worktree("add", "-b", name, str(wt), base_sha)
            self.repo.git.config(f"branch.{name}.specpilotbase", base_sha)
            return self.memory.add_branch(rid, name, agent=agent, direction=direction, head_commit=base_sha,
                                          worktree_path=wt)
        except BaseException as e:
            # Nothing half made survives (a git branch without its store row would block the name for good).
            left = self._undo_branch(name, wt)
            if not isinstance(e, (git.GitCommandError, OSError, sqlite3.Error, StoreError)):
                raise
            undo = (f"; could not remove {', '.join(left)}: run `specpilot branch recover`" if left
                    else "; nothing was created")
            raise WorkspaceError(f"cannot create branch {name!r} in {self.path}: {_why(e)}{undo}") from None

    def _check_writable(self, name: str, paths: list[Path]) -> None:
        for p in paths:
            if p.exists() and not os.access(p, os.W_OK):
                raise WorkspaceError(f"cannot create branch {name!r}: {p} is not writable; make the workspace "
                                     f"writable (`chmod -R u+w {self.path}`) or work in a copy you own")

    def _undo_branch(self, name: str, wt: Path) -> list[str]:
        """Remove whatever a failed `create_branch` made (worktree, its registration, git branch, base
        record); returns what could not be removed."""
        left = []

        def attempt(what: str, *argv: str, absent_status: int | None = None) -> None:
            try:
                self.repo.git.execute(["git", *argv])
            except git.GitCommandError as e:
                if e.status != absent_status:
                    left.append(what)

        if wt.exists():
            attempt(f"worktree {wt}", "worktree", "remove", "--force", str(wt))
        attempt("stale worktree records", "worktree", "prune")
        if name in self.repo.heads:
            attempt(f"git branch {name}", "branch", "-D", name)
        attempt(f"branch.{name}.specpilotbase", "config", "--unset", f"branch.{name}.specpilotbase",
                absent_status=5)  # 5: the key was never set
        if wt.exists():
            shutil.rmtree(wt, ignore_errors=True)
            if wt.exists():
                left.append(f"folder {wt}")
        return left

    def branch_base(self, name: str) -> str:
        """The commit a branch was created (or last started over) from; stock for branches older than
        this record."""
        try:
            return self.repo.git.config("--get", f"branch.{name}.specpilotbase").strip()
        except git.GitCommandError:
            return self.stock_commit

    def detached_worktree(self, name: str, commit: str) -> Path:
        """An internal worktree (stock, AR reference, base, measurements) checked out at `commit`."""
        wt = self.worktree_path(name)
        self._detached_at[str(wt)] = self.rev(commit)
        if wt.is_dir() and self._registered(wt):
            g = self.worktree_git(name)
            g.checkout("--detach", "--force", commit)
            g.clean("-ffdx")  # nothing a previous run left (ignored files included) survives into this one
            return wt
        self.repo.git.worktree("prune")
        if wt.exists():
            shutil.rmtree(wt)
        self.repo.git.worktree("add", "--detach", str(wt), commit)
        return wt

    def commit_of(self, worktree: Path) -> str:
        """The commit a worktree of this workspace runs, from the main repository (a branch's ref, or the
        commit an internal worktree was last checked out at here), never from the worktree's own files."""
        wt = Path(worktree)
        if str(wt) in self._detached_at:
            return self._detached_at[str(wt)]
        if wt.parent == self.state / "worktrees" and self.find_branch(wt.name) is not None:
            return self.head(wt.name)
        raise WorkspaceError(f"{wt}: not a worktree of this workspace's branches")

    def reset_branch(self, name: str, base: str) -> Branch:
        """Start a branch over from `base` (an interrupted attempt resumed): same store row, fresh worktree."""
        b = self.branch(name)
        wt = self.worktree_path(name)
        self._drop_worktree(wt)
        base_sha = self.rev(base)
        self.repo.git.worktree("add", "-B", name, str(wt), base_sha)
        self.repo.git.config(f"branch.{name}.specpilotbase", base_sha)
        self._lock_path(name).unlink(missing_ok=True)
        self.memory.record_event("branch.reset", f"branch {name} started over from {base_sha[:10]}",
                                 {"branch_id": b.id})
        return self.memory.update_branch(b.id, status="created", head_commit=base_sha, worktree_path=wt)

    def head(self, name: str) -> str:
        return self.rev(name)

    def _drop_worktree(self, wt: Path) -> None:
        if wt.exists():
            self.repo.git.worktree("remove", "--force", str(wt))
        self.repo.git.worktree("prune")

    def list_branches(self) -> list[Branch]:
        return [b for b in self.memory.list_branches() if b.status != "removed"]

    def remove_branch(self, name: str) -> None:
        b = self.branch(name)
        self._drop_worktree(self.worktree_path(name))
        if name in self.repo.heads:
            self.repo.git.branch("-D", name)
        self.memory.update_branch(b.id, status="removed")
        self.memory.record_event("branch.removed", f"branch {name} removed", {"branch_id": b.id})

    def recover(self) -> list[str]:
        """Reconcile git and the store after a crash; returns what was done, one line each.

        - stale worktree registrations are pruned and unknown folders under worktrees/ removed;
        - a branch the store marks `evaluating` whose harness process is gone gets a crash evaluation
          ("interrupted") and status `interrupted`;
        - a branch the store knows whose worktree is missing gets it back (from the git branch), or is
          marked `lost` when the git branch itself is gone.
        """
        done = []
        self.repo.git.worktree("prune")
        known = {b.name: b for b in self.list_branches()}
        for d in sorted((self.state / "worktrees").iterdir()):
            registered = any(Path(w).resolve() == d.resolve() for w in self._git_worktrees())
            if (d.name not in known and d.name != "_stock") or not registered:
                shutil.rmtree(d, ignore_errors=True)
                done.append(f"removed stale worktree folder {d.name}")
        for name, b in known.items():
            if b.status in LIVE_STATUSES and not pid_alive(self._lock_pid(name)):
                what = "the evaluation" if b.status == "evaluating" else "the agent's work"
                self.memory.add_evaluation(b.id, "forcing" if b.status == "evaluating" else "agent", "crash",
                                           f"interrupted: the process died during {what}")
                self.memory.update_branch(b.id, status="interrupted")
                self._lock_path(name).unlink(missing_ok=True)
                done.append(f"branch {name}: interrupted {b.status} recorded as a crash")
            wt = self.worktree_path(name)
            if not wt.exists():
                if name in self.repo.heads:
                    self.repo.git.worktree("add", str(wt), name)
                    self.memory.update_branch(b.id, worktree_path=wt)
                    done.append(f"branch {name}: worktree re-created from its git branch")
                else:
                    self.memory.update_branch(b.id, status="lost")
                    done.append(f"branch {name}: git branch gone, marked lost")
        for line in done:
            self.memory.record_event("workspace.recover", line)
        return done

    def _registered(self, wt: Path) -> bool:
        try:
            worktree_admin_dir(Path(self.repo.git_dir), wt)
        except SafeGitError:
            return False
        return True

    def _git_worktrees(self) -> list[str]:
        out = self.repo.git.worktree("list", "--porcelain")
        return [ln.split(" ", 1)[1] for ln in out.splitlines() if ln.startswith("worktree ")]

    # -- evaluation lock (which branch is being evaluated, by which process) ----------------------------

    def _lock_path(self, name: str) -> Path:
        return self.state / "logs" / f"{name}.evaluating"

    def _lock_pid(self, name: str) -> int | None:
        try:
            return int(self._lock_path(name).read_text())
        except (OSError, ValueError):
            return None

    def evaluation_alive(self, name: str) -> bool:
        """Whether the process that marked `name` running/evaluating still runs."""
        return pid_alive(self._lock_pid(name))

    def begin_evaluation(self, b: Branch, status: str = "evaluating") -> None:
        """Mark a branch as worked on by this process (`evaluating`, or `running` for an agent)."""
        self._lock_path(b.name).write_text(str(os.getpid()))
        self.memory.update_branch(b.id, status=status)

    def end_evaluation(self, b: Branch, status: str) -> None:
        self.memory.update_branch(b.id, status=status, head_commit=self.head(b.name))
        self._lock_path(b.name).unlink(missing_ok=True)

    # -- guard rails -----------------------------------------------------------------------------------

    def changed_paths(self, name: str, base: str = STOCK_TAG) -> list[str]:
        """Paths a branch changes against `base` (committed), plus anything uncommitted in its worktree."""
        return sorted(set(self._committed_paths(name, base)) | {d.split(" -> ")[-1] for d in self.uncommitted(name)})

    def _committed_paths(self, name: str, base: str = STOCK_TAG) -> list[str]:
        return self.repo.git.diff("--no-ext-diff", "--name-only", f"{base}...{name}").splitlines()

    def uncommitted(self, name: str) -> list[str]:
        out = self.worktree_git(name).status("--porcelain", "--untracked-files=all")
        return [ln[3:] for ln in out.splitlines()]

    def protected_hits(self, paths: list[str]) -> list[str]:
        """Paths that touch a protected one, or would be imported in its place: for `pkg/mod.py` also a
        package `pkg/mod/`, `pkg/mod.<anything>` (a .so, a .pyc) and `pkg/__pycache__/mod.*`."""
        hits = []
        for p in paths:
            for rule in self.config.protected:
                shadows = ()
                if rule.endswith(".py"):
                    head, _, mod = rule[:-3].rpartition("/")
                    pre = f"{head}/" if head else ""
                    shadows = (f"{pre}{mod}/", f"{pre}{mod}.", f"{pre}__pycache__/{mod}.")
                if p == rule or (rule.endswith("/") and p.startswith(rule)) or (shadows and p.startswith(shadows)):
                    hits.append(p)
                    break
        return hits

    def guard(self, name: str) -> str | None:
        """Why a branch may not run (None: it may). The evaluated tree is exactly its committed sources:
        no uncommitted or untracked files, no protected path (or its shadow), no committed bytecode,
        binaries or files under stock's ignored paths; ignored files left in the worktree are deleted."""
        dirty = self.uncommitted(name)
        if dirty:
            return (f"uncommitted changes in the worktree ({', '.join(dirty[:3])}); commit them so the "
                    f"evaluated code is a commit")
        changed = self._committed_paths(name)  # nothing is uncommitted at this point
        hits = self.protected_hits(changed)
        if hits:
            return f"touches protected path(s) {', '.join(hits[:3])}; not run"
        g = self.worktree_git(name)
        present = set(g.ls_files("-z").split("\0")) - {""}
        added = [p for p in changed if p in present]
        binary = [p for p in added if p.endswith(BINARY_SUFFIXES) or "__pycache__" in p.split("/")]
        ignored = self._ignored_by_stock(added)
        if binary or ignored:
            return (f"commits bytecode, binaries or ignored paths ({', '.join((binary + ignored)[:3])}); "
                    f"only tracked sources are evaluated")
        g.clean("-ffdX")  # e.g. __pycache__ written by an earlier run: never reused
        return None

    def _ignored_by_stock(self, paths: list[str]) -> list[str]:
        """Which of `paths` stock's .gitignore ignores (its rules read from the stock commit, checked in a
        scratch repository of ours, never in the candidate's worktree)."""
        if not paths:
            return []
        try:
            rules = self.repo.git.show(f"{STOCK_TAG}:.gitignore")
        except git.GitCommandError:
            return []
        scratch = Path(tempfile.mkdtemp(prefix="specpilot-ignore-"))
        try:
            git.Repo.init(scratch).close()
            (scratch / ".gitignore").write_text(rules + "\n")
            r = subprocess.run(["git", "-C", str(scratch), "check-ignore", "--no-index", "--stdin"],
                               input="\n".join(paths) + "\n", capture_output=True, text=True, timeout=60)
            return [ln for ln in r.stdout.splitlines() if ln]
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _read_model_config(path: Path):
    """A model directory's transformers config (config.json only, no weights); None when it cannot be read
    (the system's start-up reports that in its own words)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError):
        return None


def _why(e: BaseException) -> str:
    """One line on what a git, file system or database error says."""
    if isinstance(e, git.GitCommandError):
        lines = [ln.strip(" '") for ln in str(e.stderr).splitlines() if ln.strip(" '")]
        return f"git: {lines[-1] if lines else e}"
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror} ({e.filename})" if e.filename else e.strerror
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


DEMO_PROTECTED = ["specpilot.toml", "prompts/", "decoder/serve.py", ".gitignore"]
BINARY_SUFFIXES = (".pyc", ".pyo", ".so", ".pyd", ".dll", ".dylib", ".o", ".a", ".exe")
DEMO_HIDDEN = 6  # of the demo's 16 held-out code prompts, never shown to agents (with its timing prompts)
HIDDEN_FRACTION = DEMO_HIDDEN / 16  # a user deployment's prompts are split like the demo's
MIN_PROMPTS = 2  # at least one visible and one hidden forcing prompt
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")  # any other prompts file is plain text, one prompt per line
WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
GITIGNORE = ".specpilot/\n__pycache__/\n*.pyc\n"
WORKSPACE_README = """# SpecPilot workspace: {name}

The first commit (tag `stock`) is the system as shipped. Candidates are branches, each in its own
worktree under `.specpilot/worktrees/`. `specpilot force --workspace . --branch NAME` checks a branch
token by token against stock; `.specpilot/` (memory, hidden prompts, stock's cached outputs) is
never committed and never visible to a candidate.
"""
TARGET_README = """
## The deployment

- target: `{target}`
- drafter: {drafter}
- prompts: {visible} visible (`prompts/visible.jsonl`) and {hidden} hidden (`.specpilot/hidden.jsonl`), from {source}
- stock (`system.toml`): `drafter = "{stock_drafter}"`, every mechanism off; the limits a run gets
  (start-up and request seconds, memory, threads) are `[limits]` in `specpilot.toml`

Feature drafters (a block drafter, MTP heads, the domain router) read the target's hidden states, so
they are trained for this target on demand, not shipped:

    specpilot train drafter --kind mtp --target {target}      # or --kind block, then --kind router

writes them under `{target}/drafters/`, where the system finds them (`drafter = "mtp"`, `"block"` or
`"routed"` in `system.toml`). Until then, a candidate that sets one of them crashes when it runs.
"""


def default_demo_path() -> Path:

    return data_dir() / "workspaces" / "demo"


def _copy_package(src: Path, dst: Path) -> None:
    # Not the demo's model files (assets) and not the lab (bench, training): the workspace carries the runtime.
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "assets", "lab"))


def _split_prompts(rows: list[dict], hidden: int) -> tuple[list[dict], list[dict]]:
    """A fixed split: the prompts whose id hashes lowest are hidden."""

    order = sorted(rows, key=lambda r: hashlib.sha256(r["id"].encode()).hexdigest())
    hidden_ids = {r["id"] for r in order[:hidden]}
    return [r for r in rows if r["id"] not in hidden_ids], [r for r in rows if r["id"] in hidden_ids]


def _check_new_folder(path: Path) -> None:
    """`path` can become a workspace: not a file, not a non-empty folder, under a folder we may write to."""
    if path.exists() and not path.is_dir():
        raise WorkspaceError(f"{path} is a file; pick a new folder for the workspace")
    if path.is_dir():
        try:
            used = any(path.iterdir())
        except OSError as e:
            raise WorkspaceError(f"{path}: cannot list it ({e.strerror}); pick a new folder for the "
                                 f"workspace") from None
        if used:
            raise WorkspaceError(f"{path} exists and is not empty; pick a new folder, or open it with "
                                 f"--workspace {path} if it is already a workspace")
    above = path.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise WorkspaceError(f"{path}: {above} is a file, not a folder; pick a path under a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        raise WorkspaceError(f"{path}: cannot create it, {above} is not writable; pick a folder you can write to "
                             f"(or `chmod u+w {above}`)")


def _check_name(name: str, flag: str = "--name") -> str:
    if not name or set(name) - NAME_OK or name.startswith((".", "-")):
        raise WorkspaceError(f"{flag} {name!r}: use letters, digits, '-', '_' and '.'")
    return name


def _default_limits(*model_dirs: Path | None) -> dict:
    """The demo's limits, with memory and start-up time grown with the weights' size on disk."""
    size = sum(f.stat().st_size for d in model_dirs if d is not None for g in WEIGHT_GLOBS for f in d.glob(g))
    gib = size / 2**30
    # one thread: on a shared 2-core machine OpenMP spin-waits make two threads up to 10x slower
    return {"start_s": 120 + int(30 * gib), "request_s": 120 + int(60 * gib),
            "memory_mb": max(4096, 2048 + int(2 * size / 2**20)), "threads": 1}


WORKSPACE_DTYPES = ("bfloat16", "float32")  # what `init --dtype` offers: the weights' dtype in system and stock
DTYPE_AUTO = "auto"  # `init demo` / `demo` without --dtype: the CPU decides (auto_dtype)


def check_dtype(dtype: str) -> None:
    """A WorkspaceError naming `dtype` and the choices when a workspace cannot be made in it."""
    if dtype not in (DTYPE_AUTO, *WORKSPACE_DTYPES):
        raise WorkspaceError(f"--dtype {dtype}: choose one of {', '.join((DTYPE_AUTO, *WORKSPACE_DTYPES))}")


def auto_dtype(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The demo's dtype on this CPU: float32 where it has no native bfloat16 (torch converts every bf16 matmul
    there: on an AVX-512 Xeon without AMX the demo's AR ran 68.8 tok/s in bf16 against 125.8 in f32, and the
    lean forward at 9 rows 13.9 against 8.5 ms), else bfloat16 (also where /proc/cpuinfo cannot tell)."""
    return "float32" if native_bf16_cpu(cpuinfo) is False else "bfloat16"


def resolve_dtype(dtype: str | None, cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, str | None]:
    """The dtype a demo workspace is made in, and a one-line note when the CPU chose float32: `dtype` as given
    (checked), or auto_dtype() for None or "auto"."""
    if dtype not in (None, DTYPE_AUTO):
        check_dtype(dtype)
        return dtype, None
    chosen = auto_dtype(cpuinfo)
    if chosen == "bfloat16":
        return chosen, None
    return chosen, ("note: float32: this CPU has no native bfloat16 (no amx_bf16 or avx512_bf16 flag), where "
                    "float32 decodes faster; `specpilot init demo PATH --dtype bfloat16` makes a bfloat16 workspace")


def bf16_hint(dtype: str) -> str | None:
    """One line advising float32 when a workspace decodes bfloat16 on a CPU that has no native bfloat16."""
    if dtype != "bfloat16" or native_bf16_cpu() is not False:
        return None
    return ("note: this CPU has no native bfloat16 (no amx_bf16 or avx512_bf16 flag): every bf16 matmul is converted; "
            "a demo made with --dtype float32 decodes faster here")


def init_demo(path: str | Path | None = None, *, forcing_max_new_tokens: int = 64, prompt_limit: int | None = None,
              hidden: int = DEMO_HIDDEN, limits: dict | None = None, prompts: str = "code",
              name: str | None = None, bench: dict | None = None, batch_sizes: list[int] | None = None,
              dtype: str = "bfloat16") -> Workspace:
    """Create the embedded demo workspace: stock decoder and kernels, demo models, visible prompts, in `dtype`.

    The keyword arguments shrink it (fewer prompts, shorter forcing, tighter limits), e.g. for tests.
    """
    from decoder.models import DEMO_DIR

    path = Path(path).absolute() if path is not None else default_demo_path()
    _check_new_folder(path)
    if prompts not in ("code", "prose"):
        raise WorkspaceError(f"--prompts {prompts}: the demo has code and prose prompt sets")
    name = _check_name(name or ("demo" if prompts == "code" else f"demo-{prompts}"))
    dtype = resolve_dtype(dtype)[0]  # "auto": the CPU decides
    for sub in ("target", "drafter", "tokenizer", f"prompts/{prompts}.jsonl"):
        if not (DEMO_DIR / sub).exists():
            raise WorkspaceError(f"the demo models are missing ({DEMO_DIR / sub}); run `specpilot train demo` "
                                 f"or reinstall specpilot")
    rows = _read_jsonl(DEMO_DIR / "prompts" / f"{prompts}.jsonl")[:prompt_limit]
    # The held-out timing prompts join the hidden split (all of it unless prompt_limit shrinks the demo, as tests
    # do): a timed pass at B = 8 then holds 32 distinct prompts, none repeated in a process (workbench.measure).
    timing = DEMO_DIR / "prompts" / f"{prompts}-timing.jsonl"
    extra = _read_jsonl(timing) if prompt_limit is None and timing.exists() else []
    cfg = WorkspaceConfig(
        batch_sizes=load_points({"load": {"batch_sizes": batch_sizes or [1]}}, path),
        name=name, target=(DEMO_DIR / "target").resolve(), drafter=(DEMO_DIR / "drafter").resolve(),
        tokenizer=(DEMO_DIR / "target").resolve(), dtype=dtype,  # the target directory carries its tokenizer
        entry=_entry(drafter=True), protected=list(DEMO_PROTECTED), forcing_max_new_tokens=forcing_max_new_tokens,
        # one thread: on a shared 2-core machine OpenMP spin-waits make two threads up to 10x slower
        limits={"start_s": 120, "request_s": 120, "memory_mb": 4096, "threads": 1, **(limits or {})},
        bench={"noise_pairs": NOISE_PAIRS, "noise_margin": NOISE_MARGIN, **(bench or {})})
    return _create(path, cfg, rows, hidden=hidden, stock=DecodeConfig(dtype=dtype),
                   readme=WORKSPACE_README.format(name=name),
                   label="the demo system", what=f"demo workspace ({prompts} prompts)", extra_hidden=extra)


def init_target(path: str | Path, target: str | Path, *, drafter: str | Path | None = None,
                prompts: str | Path | None = None, name: str | None = None, forcing_max_new_tokens: int = 64,
                limits: dict | None = None, bench: dict | None = None, batch_sizes: list[int] | None = None
                ) -> Workspace:
    """Create a workspace for the user's own deployment: a local Hugging Face target directory, an optional
    draft model sharing its tokenizer, and a prompts file (JSONL with a "text" per line, or plain text with
    one prompt per line; without one, the demo's code prompts if the target uses the demo's tokenizer).

    Everything is validated before anything is created; a failure raises WorkspaceError naming the value
    and the fix. Stock drafts with the draft model when there is one, else with n-grams (prompt lookup).
    """
    from decoder.models import DEMO_DIR, ModelLoadError, check_same_tokenizer, load_tokenizer, tokenizer_fingerprint

    path = Path(path).absolute()
    _check_new_folder(path)
    target = Path(target).absolute()
    name = _check_name(name or "".join(c if c in NAME_OK else "-" for c in target.name).strip(".-") or "target")
    try:
        _check_weights(target, "--target")
        tok = load_tokenizer(target, "target")
        if drafter is not None:
            drafter = Path(drafter).absolute()
            _check_weights(drafter, "--drafter")
            check_same_tokenizer(target, drafter)  # vocabulary, EOS and vocab_size
        _check_sandbox_can_read(target, "--target")
        if drafter is not None:
            _check_sandbox_can_read(drafter, "--drafter")
        if prompts is not None:
            source = Path(prompts).absolute()
            rows = read_prompts(source)
        else:
            demo = DEMO_DIR / "prompts" / "code.jsonl"
            same = demo.exists() and _same_vocab(tokenizer_fingerprint(tok),
                                                 tokenizer_fingerprint(load_tokenizer(DEMO_DIR / "target")))
            if not same:
                raise WorkspaceError(f"--target {target}: no --prompts given, and the demo's prompts are for the "
                                     f"demo's tokenizer only; pass --prompts FILE (JSONL with a \"text\" per line, "
                                     f"or one prompt per line)")
            source, rows = demo, _read_jsonl(demo)
    except ModelLoadError as e:
        raise WorkspaceError(str(e)) from None
    for r in rows:
        if not tok(r["text"], add_special_tokens=False)["input_ids"]:
            raise WorkspaceError(f"--prompts {source}: prompt {r['id']!r} has no tokens under the target's "
                                 f"tokenizer; remove it")
    cfg = WorkspaceConfig(
        batch_sizes=load_points({"load": {"batch_sizes": batch_sizes or [1]}}, path),
        name=name, target=target, drafter=drafter, tokenizer=target, entry=_entry(drafter=drafter is not None),
        protected=list(DEMO_PROTECTED), forcing_max_new_tokens=forcing_max_new_tokens,
        limits={**_default_limits(target, drafter), **(limits or {})},
        bench={"noise_pairs": NOISE_PAIRS, "noise_margin": NOISE_MARGIN, **(bench or {})})
    stock = DecodeConfig(drafter="draft-model" if drafter is not None else "ngram", lean_forward=False)
    # At least the largest batch hidden where the prompts allow: a timed batch then holds hidden prompts only
    # (with fewer, the visible ones, which a candidate can see, fill it: cascade.timing_prompts).
    hidden = max(1, min(len(rows) - 1, max(round(len(rows) * HIDDEN_FRACTION), max(cfg.batch_sizes))))
    readme = WORKSPACE_README.format(name=name) + TARGET_README.format(
        target=target, drafter=f"`{drafter}`" if drafter else "none (stock drafts with n-grams: prompt lookup)",
        visible=len(rows) - hidden, hidden=hidden, source=f"`{source}`", stock_drafter=stock.drafter)
    return _create(path, cfg, rows, hidden=hidden, stock=stock, readme=readme, label=f"the {name} system",
                   what=f"workspace for target {target} ({len(rows)} prompts from {source})")


LLAMA_CPP_DEPLOYMENTS = ("demo", "smollm2")
LLAMA_CPP_PROTECTED = ["specpilot.toml", "prompts/", "decoder/engines/serve_llamacpp.py", ".gitignore"]
LLAMA_CPP_SOURCE_README = """
## The engine's source

`engine/llama.cpp/` is llama.cpp's source as built for this workspace (the part its build reads). Edit its
C++ like any other file and commit: every commit runs the `llama-server` built from its own engine source
(incrementally from the engine cache's build, in the sandbox, before anything is timed); a commit that does
not build is a crash whose reason is the compiler's first error.
"""
LLAMA_CPP_README = """
## The deployment: llama.cpp

The system is llama.cpp's `llama-server` ({server}) serving `{target}`{drafter}, started and timed by the
harness through `decoder/engines/serve_llamacpp.py` (the JSON-lines protocol over a UNIX socket). `system.toml`
holds the server's flags (decoder/engines/llamacpp_config.py; 0 = the engine's default); stock is
`spec_type = "{spec_type}"`. The tuner composes the flags of decoder/engines/llamacpp_mechanisms.toml.
Prompts: {visible} visible, {hidden} hidden, from {source}. Fixed server flags: {fixed}.
"""


def _llama_cpp_models(deployment: str, prompts: str) -> tuple[Path, Path | None, Path, Path, Path | None]:
    """(target GGUF, drafter GGUF or None, tokenizer directory, prompts file, n-gram lookup cache folder or None)
    of a named deployment."""
    from decoder.models import DEMO_DIR

    if deployment == "demo":
        target, drafter = gguf_path("target", "bf16"), gguf_path("drafter", "bf16")
        if not target.is_file() or not drafter.is_file():
            raise WorkspaceError(f"--deployment demo: the demo's GGUF files are missing ({target}); run `make "
                                 f"llama-cpp` (it builds the engine and converts the demo models)")
        return target, drafter, (DEMO_DIR / "target").resolve(), DEMO_DIR / "prompts" / f"{prompts}.jsonl", None
    try:
        target = smollm2_gguf()
        hf = smollm2_hf_dir()  # its tokenizer (and chat template) tokenizes the prompts the harness sends
        # The draft model distilled for it (decoder/lab/smollm2_drafter.py), materialised from the committed
        # weights and the target's own embedding; none when no drafter is committed.
        drafter = smollm2_drafter_gguf() if has_drafter() else None
        # llama.cpp's n-gram caches made from SmolLM2's own answers (mechanism llama-ngram-corpus)
        lookup = smollm2_lookup_cache() if has_lookup_corpus() else None
        return target, drafter, hf, smollm2_prompts(hf) / f"{prompts}.jsonl", lookup
    except ModelFetchError as e:
        raise WorkspaceError(f"--deployment smollm2: {e}") from None


def _probe_server(server: Path, target: Path, cfg: LlamaCppConfig, drafter: Path | None = None) -> list[str]:
    """Start llama-server once on the target with stock's flags (and, with a draft model, with it drafting:
    llama.cpp refuses a drafter whose vocabulary differs) and decode a few tokens: the fixed flags the
    deployment needs on this machine ([] or ["--no-repack"] where the repacked quantised kernels use an
    instruction this CPU lacks, e.g. AMX under a VM); WorkspaceError when it cannot run at all."""
    last = ""
    spec = ["--spec-type", "draft-simple", "--spec-draft-model", str(drafter)] if drafter is not None else []
    for fixed in ([], ["--no-repack"]):
        with tempfile.TemporaryDirectory(prefix="specpilot-probe-") as tmp:
            srv = LlamaServer(target, SpecSettings(extra=(*cfg.server_flags(), *fixed, *spec)),
                              ServerSettings(threads=cfg.threads or len(os.sched_getaffinity(0)),
                                             ctx_size=cfg.ctx_size),
                              name="llama-server (probe)", log_dir=Path(tmp), server=server)
            try:
                with srv:
                    srv.generate([1, 2, 3], 4)
                return fixed
            except EngineError as e:
                last = str(e)
    what = f"--target {target}" + (f" with --drafter {drafter}" if drafter is not None else "")
    raise WorkspaceError(f"{what}: llama-server cannot serve it: {last}")


def _own_gguf(target: Path, drafter: Path | None, tokenizer: Path | None, prompts: str) -> tuple[Path, Path]:
    """Check a user's own GGUF deployment before anything is made: GGUF files, a tokenizer directory that loads,
    a prompts file; returns (tokenizer directory, prompts file)."""
    from decoder.models import ModelLoadError, load_tokenizer

    for p, flag in ((target, "--target"), (drafter, "--drafter")):
        if p is None:
            continue
        if not p.is_file():
            raise WorkspaceError(f"{flag} {p}: no such file; pass a GGUF model file")
        try:
            with p.open("rb") as fh:
                magic = fh.read(4)
        except OSError as e:
            raise WorkspaceError(f"{flag} {p}: cannot read it ({e.strerror})") from None
        if magic != b"GGUF":
            raise WorkspaceError(f"{flag} {p}: not a GGUF file (it does not start with 'GGUF'); convert the model "
                                 f"with llama.cpp's convert_hf_to_gguf.py")
    if tokenizer is None:
        raise WorkspaceError("--target FILE.gguf needs --tokenizer DIR (a Hugging Face directory with the model's "
                             "tokenizer): the harness sends token ids, so prompts are tokenized here")
    try:
        load_tokenizer(tokenizer, "tokenizer")
    except ModelLoadError as e:
        raise WorkspaceError(f"--tokenizer {tokenizer}: {e}") from None
    if prompts in ("code", "prose"):
        raise WorkspaceError(f"--prompts {prompts}: with --target, pass a prompts file (JSONL with a \"text\" per "
                             f"line, or one prompt per line)")
    return tokenizer, Path(prompts).absolute()


def init_llamacpp(path: str | Path, *, deployment: str | None = "smollm2", spec_type: str = "none",
                  prompts: str = "code", name: str | None = None, forcing_max_new_tokens: int = 64,
                  prompt_limit: int | None = None, limits: dict | None = None, bench: dict | None = None,
                  target: Path | None = None, drafter: Path | None = None, tokenizer: Path | None = None,
                  with_source: bool = False) -> Workspace:
    """Create a workspace whose system is llama.cpp's `llama-server` (built by `make llama-cpp`) on a named
    deployment: `demo` (the demo target and drafter as bf16 GGUFs) or `smollm2` (SmolLM2-135M-Instruct, Q4_1),
    or on the user's own GGUF (`target`, optional `drafter` GGUF, `tokenizer` directory, `prompts` file).
    Stock runs with speculation off, or with `spec_type`. One request at a time (load batch_sizes = [1]).
    `with_source`: the workspace carries llama.cpp's source (`engine/llama.cpp/`) and each commit runs the
    `llama-server` built from it (`workbench.engine_source`)."""
    path = Path(path).absolute()
    _check_new_folder(path)
    if target is None and deployment not in LLAMA_CPP_DEPLOYMENTS:
        raise WorkspaceError(f"--deployment {deployment}: choose one of {', '.join(LLAMA_CPP_DEPLOYMENTS)}, or "
                             f"pass your own --target FILE.gguf --tokenizer DIR --prompts FILE")
    if target is None and prompts not in ("code", "prose"):
        raise WorkspaceError(f"--prompts {prompts}: the {deployment} deployment has code and prose prompt sets")
    try:  # one thread, as the demo's: on a shared 2-core machine two spin-waiting threads are up to 30x slower
        stock = LlamaCppConfig(spec_type=spec_type, threads=1)
    except ConfigError as e:
        raise WorkspaceError(f"--spec-type {spec_type}: {str(e).split(': ', 2)[-1]}") from None
    if target is not None:
        target = Path(target).absolute()
        drafter = Path(drafter).absolute() if drafter is not None else None
        tokenizer, source = _own_gguf(target, drafter, Path(tokenizer).absolute() if tokenizer else None, prompts)
        rows = read_prompts(source)
        deployment = "".join(c if c in NAME_OK else "-" for c in target.stem).strip(".-") or "gguf"
    if not is_built():
        raise WorkspaceError(missing_build_message())
    lookup: Path | None = None
    if target is None:
        target, drafter, tokenizer, source, lookup = _llama_cpp_models(deployment, prompts)
        rows = _read_jsonl(source)
    if spec_type == "draft-simple" and drafter is None:
        raise WorkspaceError(f"--spec-type draft-simple: the {deployment} deployment has no draft model GGUF; choose "
                             f"an n-gram type or none")
    own = prompts not in ("code", "prose")  # a prompts file of the user's own deployment
    name = _check_name(name or f"{deployment}-llama.cpp" + ("" if own or prompts == "code" else f"-{prompts}"))
    for p in (target, drafter, tokenizer, binary("llama-server").parent, lookup):
        if p is not None:
            closed = unreadable_for_sandbox([p])
            if closed is not None and sandbox_status()[0]:
                raise WorkspaceError(f"{p}: {closed} is not readable by the sandbox's unprivileged uid; run "
                                     f"`chmod -R o+rX {p}`")
    server = binary("llama-server")
    fixed = _probe_server(server, target, stock, drafter)
    rows = rows[:prompt_limit]
    from decoder.models import load_tokenizer

    tok = load_tokenizer(tokenizer, "tokenizer")
    for r in rows:
        if not tok(r["text"], add_special_tokens=False)["input_ids"]:
            raise WorkspaceError(f"--prompts {source}: prompt {r['id']!r} has no tokens under {tokenizer}; remove it")
    hidden = max(1, min(len(rows) - 1, round(len(rows) * HIDDEN_FRACTION)))
    if with_source and not (engine_dir() / "build" / "build.ninja").is_file():
        raise WorkspaceError(f"--with-source: the engine cache has no ninja build folder ({engine_dir() / 'build'}); "
                             f"run `make llama-cpp` again")
    entry = ["{python}", "-m", "decoder.engines.serve_llamacpp", "--server",
             "{engine_server}" if with_source else str(server), "--model", "{target}",
             *(["--drafter", "{drafter}"] if drafter is not None else []),
             *(["--lookup-cache", "{lookup_cache}"] if lookup is not None else []), "--config", "{config}",
             *(f"--server-flag={f}" for f in fixed)]
    size_mb = sum(p.stat().st_size for p in (target, drafter) if p is not None) / 2**20
    cfg = WorkspaceConfig(
        name=name, target=target, drafter=drafter, tokenizer=tokenizer, dtype="gguf", batch_sizes=[1],
        entry=entry, protected=list(LLAMA_CPP_PROTECTED), forcing_max_new_tokens=forcing_max_new_tokens,
        limits={"start_s": 120, "request_s": 120, "memory_mb": max(4096, 2048 + int(4 * size_mb)), "threads": 1,
                **(limits or {})},
        bench={"noise_pairs": NOISE_PAIRS, "noise_margin": NOISE_MARGIN, **(bench or {})},
        engine="llama.cpp", engine_bin=server.parent, engine_source=SOURCE_REL if with_source else None,
        lookup_cache=lookup)
    readme = WORKSPACE_README.format(name=name) + LLAMA_CPP_README.format(
        server=server, target=target, drafter=(f" with the draft model `{drafter}`" if drafter else "") + (
            f" and the n-gram lookup caches `{lookup}` (made from its own answers; `lookup_cache = \"corpus\"` with "
            f"`spec_type = \"ngram-cache\"`)" if lookup else ""),
        spec_type=spec_type, visible=len(rows) - hidden, hidden=hidden, source=f"`{source}`",
        fixed=" ".join(fixed) or "none")
    if with_source:
        readme += LLAMA_CPP_SOURCE_README
    return _create(path, cfg, rows, hidden=hidden, stock=stock, readme=readme, label=f"llama.cpp on {deployment}",
                   what=f"llama.cpp workspace ({deployment}, {prompts} prompts, stock spec_type {spec_type}"
                        f"{', with its source' if with_source else ''})", carry=carry_source if with_source else None)


def read_prompts(path: Path) -> list[dict]:
    """Prompt rows {"id", "text"[, "domain"]} from a JSONL file (.jsonl, .json, .ndjson: a "text" per line,
    optional "id" and "domain") or a plain text file (one prompt per line); at least MIN_PROMPTS."""
    flag = f"--prompts {path}"
    if not path.is_file():
        raise WorkspaceError(f"{flag}: no such file; pass a JSONL file ({{\"text\": ...}} per line) or a text file "
                             f"with one prompt per line")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise WorkspaceError(f"{flag}: not UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start}); save it "
                             f"as UTF-8") from None
    except OSError as e:
        raise WorkspaceError(f"{flag}: cannot read it ({e.strerror})") from None
    jsonl = path.suffix.lower() in JSONL_SUFFIXES
    rows, seen = [], {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{flag}:{lineno}"
        if not jsonl:
            row = {"id": f"{path.stem}-{lineno}", "text": line}
        else:
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as e:
                raise WorkspaceError(f"{where}: not valid JSON ({e.msg}); each line must be {{\"text\": ...}} "
                                     f"(optional \"id\", \"domain\"), or name the file .txt for one prompt per "
                                     f"line") from None
            if not isinstance(raw, dict) or not isinstance(raw.get("text"), str) or not raw["text"].strip():
                raise WorkspaceError(f"{where}: each line must be an object with a non-empty string \"text\" "
                                     f"(optional \"id\", \"domain\")")
            row = {"id": str(raw.get("id", f"{path.stem}-{lineno}")), "text": raw["text"]}
            if "domain" in raw:
                if not isinstance(raw["domain"], str):
                    raise WorkspaceError(f"{where}: \"domain\" must be a string, e.g. \"code\" or \"prose\"")
                row["domain"] = raw["domain"]
        if row["id"] in seen:
            raise WorkspaceError(f"{where}: id {row['id']!r} repeats line {seen[row['id']]}; ids must be unique")
        seen[row["id"]] = lineno
        rows.append(row)
    if len(rows) < MIN_PROMPTS:
        raise WorkspaceError(f"{flag}: {len(rows)} prompt(s); a workspace needs at least {MIN_PROMPTS} (they are "
                             f"split into visible and hidden forcing prompts)")
    return rows


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _check_weights(model_dir: Path, flag: str) -> None:
    from decoder.models import check_model_dir

    check_model_dir(model_dir, flag.lstrip("-"))  # a ModelLoadError names the directory and the fix
    if not any(any(model_dir.glob(g)) for g in WEIGHT_GLOBS):
        raise WorkspaceError(f"{flag} {model_dir}: no weights (*.safetensors or *.bin); pass a model directory "
                             f"saved with save_pretrained")


def _check_sandbox_can_read(model_dir: Path, flag: str) -> None:
    """Run as root, the sandbox starts candidates as an unrelated uid: the model files must be world-readable
    (`save_pretrained` writes its weights with mode 600)."""
    closed = unreadable_for_sandbox([model_dir])
    if closed is not None and sandbox_status()[0]:
        raise WorkspaceError(f"{flag} {model_dir}: {closed} is not readable by the sandbox's unprivileged uid (mode "
                             f"{closed.stat().st_mode & 0o777:o}); run `chmod -R o+rX {model_dir}`, or SpecPilot as "
                             f"an unprivileged user")


def _same_vocab(a: dict, b: dict) -> bool:
    return a["vocab"] == b["vocab"] and a["eos"] == b["eos"]


def _entry(*, drafter: bool) -> list[str]:
    """The system's command line: `decoder.serve` on the target (and the draft model when there is one)."""
    return ["{python}", "-m", "decoder.serve", "--target", "{target}",
            *(["--drafter", "{drafter}"] if drafter else []), "--config", "{config}"]


def _create(final: Path, cfg: WorkspaceConfig, rows: list[dict], *, hidden: int, stock: DecodeConfig | LlamaCppConfig,
            readme: str, label: str, what: str, carry: Callable[[Path], object] | None = None,
            extra_hidden: list[dict] | None = None) -> Workspace:
    """Build a workspace in a sibling folder and rename it into place: a failure (a crash, a full disk, a
    read-only folder) leaves nothing behind, not even the parent folders it made. `extra_hidden` rows join the
    hidden split as they are (the demo's timing prompts)."""
    distinct = len({r["id"] for r in [*rows, *(extra_hidden or [])]})
    if max(cfg.batch_sizes) > distinct:
        raise WorkspaceError(f"load batch size {max(cfg.batch_sizes)} needs at least {max(cfg.batch_sizes)} distinct "
                             f"prompts (a timed batch never repeats one) and the workspace has {distinct}; "
                             f"give more prompts or a smaller --batch-sizes")
    made = None  # the outermost folder this call creates above the workspace
    above = final.parent
    while not above.exists() and above != above.parent:
        made, above = above, above.parent
    path = final.parent / f".{final.name}.partial-{os.getpid()}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir()
        _build(path, cfg, rows, hidden=hidden, stock=stock, readme=readme, label=label, carry=carry,
               extra_hidden=extra_hidden)
        os.replace(path, final)  # onto an empty folder too: allowed above, and rename(2) replaces it
    except BaseException as e:
        shutil.rmtree(path, ignore_errors=True)
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        if isinstance(e, (OSError, git.GitCommandError)):
            raise WorkspaceError(f"cannot create the workspace at {final}: {_why(e)}; nothing was created") from None
        raise
    ws = Workspace(final)
    ws.deployment_id()
    visible = len((final / "prompts" / "visible.jsonl").read_text().splitlines())
    ws.memory.record_event("workspace.init", f"{what} created at {final}",
                           {"visible": visible, "hidden": len(rows) + len(extra_hidden or []) - visible,
                            "stock": ws.stock_commit})
    return ws


def _build(path: Path, cfg: WorkspaceConfig, rows: list[dict], *, hidden: int, stock: DecodeConfig | LlamaCppConfig,
           readme: str, label: str, carry: Callable[[Path], object] | None = None,
           extra_hidden: list[dict] | None = None) -> None:
    """The workspace's files and its first commit (tag `stock`) in `path`, an empty folder; `carry(path)`
    adds more of stock's files (an engine's source)."""
    _copy_package(Path(decoder.__file__).parent, path / "decoder")
    _copy_package(Path(kernels.__file__).parent, path / "kernels")
    visible, hidden_rows = _split_prompts(rows, hidden)
    hidden_rows += extra_hidden or []
    (path / "prompts").mkdir()
    (path / "prompts" / "visible.jsonl").write_text("".join(json.dumps(r) + "\n" for r in visible))
    (path / "specpilot.toml").write_text(cfg.to_toml())
    stock.save(path / cfg.config_file)
    (path / ".gitignore").write_text(GITIGNORE)
    (path / "README.md").write_text(readme)
    if carry is not None:
        carry(path)
    repo = git.Repo.init(path, initial_branch="main")
    with repo.config_writer() as w:  # commits must work on a machine with no git identity
        if not repo.config_reader().has_option("user", "email"):
            w.set_value("user", "name", "SpecPilot").set_value("user", "email", "specpilot@localhost")
    repo.git.add("-A")
    repo.index.commit(f"stock: {label} as shipped (decoder, kernels, config, visible prompts)")
    repo.create_tag(STOCK_TAG)
    repo.close()
    (path / ".specpilot").mkdir()
    (path / ".specpilot" / "hidden.jsonl").write_text("".join(json.dumps(r) + "\n" for r in hidden_rows))
