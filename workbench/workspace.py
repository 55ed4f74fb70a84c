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
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import git

import decoder
import kernels
from decoder.config import ConfigError, DecodeConfig, read_table
from store import Branch, Memory, data_dir
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
                       batch_sizes=list(d.get("batch_sizes", [1])), entry=list(s["entry"]),
                       config_file=s.get("config", "system.toml"), protected=list(s.get("protected", [])),
                       forcing_max_new_tokens=int(f.get("max_new_tokens", 64)),
                       max_mismatches_per_prompt=int(f.get("max_mismatches_per_prompt", 16)), limits=dict(lim),
                       bench=dict(bench), llm=dict(data.get("llm", {})))
        except KeyError as e:
            raise WorkspaceError(f"{path}: missing key {e}; see `specpilot init demo` for a complete file") from None

    def to_toml(self) -> str:
        def q(v) -> str:
            return json.dumps(str(v))

        lines = ["# SpecPilot workspace: the deployment, the system under optimization and its guard rails.",
                 "[deployment]", f"name = {q(self.name)}", f"target = {q(self.target)}"]
        if self.drafter:
            lines.append(f"drafter = {q(self.drafter)}")
        lines += [f"tokenizer = {q(self.tokenizer)}", f"dtype = {q(self.dtype)}", f"device = {q(self.device)}",
                  f"hardware = {q(self.hardware)}", f"batch_sizes = {json.dumps(self.batch_sizes)}", "",
                  "[system]", "# run as a subprocess from the branch's worktree; {target} {drafter} {python} expand",
                  f"entry = {json.dumps(self.entry)}", f"config = {q(self.config_file)}",
                  "# a candidate commit touching one of these is rejected before it runs",
                  f"protected = {json.dumps(self.protected)}", "",
                  "[forcing]", f"max_new_tokens = {self.forcing_max_new_tokens}",
                  f"max_mismatches_per_prompt = {self.max_mismatches_per_prompt}", "", "[limits]"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in self.limits.items()]
        if self.bench:
            lines += ["", "[bench]"] + [f"{k} = {json.dumps(v)}" for k, v in self.bench.items()]
        if self.llm:
            lines += ["", "[llm]"] + [f"{k} = {json.dumps(v)}" for k, v in self.llm.items()]
        return "\n".join(lines) + "\n"

    def model_dirs(self) -> list[Path]:
        return [p for p in (self.target, self.drafter, self.tokenizer) if p is not None]


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
        for sub in ("stock", "worktrees", "logs"):
            (self.state / sub).mkdir(parents=True, exist_ok=True)
        self._memory: Memory | None = None
        self._configs: dict[str, dict] = {}  # commit -> its [decode] table (commits never change)

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

    def entry_argv(self) -> list[str]:
        c = self.config
        subs = {"{python}": sys.executable, "{target}": str(c.target), "{drafter}": str(c.drafter or ""),
                "{config}": c.config_file}
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
        if wt.exists():
            shutil.rmtree(wt)  # a leftover of a crash: git no longer knows it (recover prunes)
        self.repo.git.worktree("add", "-b", name, str(wt), base_sha)
        self.repo.git.config(f"branch.{name}.specpilotbase", base_sha)
        return self.memory.add_branch(round_id if round_id is not None else self.manual_round_id(), name,
                                      agent=agent, direction=direction, head_commit=base_sha, worktree_path=wt)

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


DEMO_PROTECTED = ["specpilot.toml", "prompts/", "decoder/serve.py", ".gitignore"]
BINARY_SUFFIXES = (".pyc", ".pyo", ".so", ".pyd", ".dll", ".dylib", ".o", ".a", ".exe")
DEMO_HIDDEN = 6  # of the demo's 16 held-out code prompts, never shown to agents
GITIGNORE = ".specpilot/\n__pycache__/\n*.pyc\n"
WORKSPACE_README = """# SpecPilot workspace: {name}

The first commit (tag `stock`) is the system as shipped. Candidates are branches, each in its own
worktree under `.specpilot/worktrees/`. `specpilot force --workspace . --branch NAME` checks a branch
token by token against stock; `.specpilot/` (memory, hidden prompts, stock's cached outputs) is
never committed and never visible to a candidate.
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


def init_demo(path: str | Path | None = None, *, forcing_max_new_tokens: int = 64, prompt_limit: int | None = None,
              hidden: int = DEMO_HIDDEN, limits: dict | None = None, prompts: str = "code",
              name: str | None = None, bench: dict | None = None) -> Workspace:
    """Create the embedded demo workspace: stock decoder and kernels, demo models, visible prompts.

    The keyword arguments shrink it (fewer prompts, shorter forcing, tighter limits), e.g. for tests.
    """
    from decoder.models import DEMO_DIR

    path = Path(path).absolute() if path is not None else default_demo_path()
    if path.exists() and not path.is_dir():
        raise WorkspaceError(f"{path} is a file; pick a new folder for the workspace")
    if path.exists() and any(path.iterdir()):
        raise WorkspaceError(f"{path} exists and is not empty; pick a new folder, or open it with "
                             f"--workspace {path} if it is already a workspace")
    if prompts not in ("code", "prose"):
        raise WorkspaceError(f"--prompts {prompts}: the demo has code and prose prompt sets")
    name = name or ("demo" if prompts == "code" else f"demo-{prompts}")
    if not name or set(name) - NAME_OK:
        raise WorkspaceError(f"--name {name!r}: use letters, digits, '-', '_' and '.'")
    for sub in ("target", "drafter", "tokenizer", f"prompts/{prompts}.jsonl"):
        if not (DEMO_DIR / sub).exists():
            raise WorkspaceError(f"the demo models are missing ({DEMO_DIR / sub}); run `specpilot train demo` "
                                 f"or reinstall specpilot")
    # Built in a sibling folder and renamed into place: a crash or a full disk leaves no half workspace.
    final, path = path, path.parent / f".{path.name}.partial-{os.getpid()}"
    final.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    try:
        _build_demo(path, name=name, forcing_max_new_tokens=forcing_max_new_tokens, limits=limits, prompts=prompts,
                    prompt_limit=prompt_limit, hidden=hidden, bench=bench)
        if final.exists():
            final.rmdir()  # an empty folder was allowed above; a non-empty one was refused
        os.replace(path, final)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    ws = Workspace(final)
    ws.deployment_id()
    rows = [json.loads(ln) for ln in ws.hidden_prompts_path().read_text().splitlines() if ln.strip()]
    ws.memory.record_event("workspace.init", f"demo workspace ({prompts} prompts) created at {final}",
                           {"visible": len((final / "prompts" / "visible.jsonl").read_text().splitlines()),
                            "hidden": len(rows), "stock": ws.stock_commit})
    return ws


def _build_demo(path: Path, *, name: str, forcing_max_new_tokens: int, limits: dict | None, prompts: str,
                prompt_limit: int | None, hidden: int, bench: dict | None = None) -> None:
    from decoder.models import DEMO_DIR

    _copy_package(Path(decoder.__file__).parent, path / "decoder")
    _copy_package(Path(kernels.__file__).parent, path / "kernels")
    rows = [json.loads(ln) for ln in (DEMO_DIR / "prompts" / f"{prompts}.jsonl").read_text().splitlines()
            if ln.strip()]
    visible, hidden_rows = _split_prompts(rows[:prompt_limit], hidden)
    (path / "prompts").mkdir()
    (path / "prompts" / "visible.jsonl").write_text("".join(json.dumps(r) + "\n" for r in visible))
    cfg = WorkspaceConfig(
        name=name, target=(DEMO_DIR / "target").resolve(), drafter=(DEMO_DIR / "drafter").resolve(),
        tokenizer=(DEMO_DIR / "target").resolve(),  # the target directory carries its tokenizer
        entry=["{python}", "-m", "decoder.serve", "--target", "{target}", "--drafter", "{drafter}",
               "--config", "{config}"],
        protected=list(DEMO_PROTECTED),
        forcing_max_new_tokens=forcing_max_new_tokens,
        # one thread: on a shared 2-core machine OpenMP spin-waits make two threads up to 10x slower
        limits={"start_s": 120, "request_s": 120, "memory_mb": 4096, "threads": 1, **(limits or {})},
        bench={"noise_pairs": NOISE_PAIRS, "noise_margin": NOISE_MARGIN, **(bench or {})})
    (path / "specpilot.toml").write_text(cfg.to_toml())
    DecodeConfig().save(path / cfg.config_file)
    (path / ".gitignore").write_text(GITIGNORE)
    (path / "README.md").write_text(WORKSPACE_README.format(name=cfg.name))
    repo = git.Repo.init(path, initial_branch="main")
    with repo.config_writer() as w:  # commits must work on a machine with no git identity
        if not repo.config_reader().has_option("user", "email"):
            w.set_value("user", "name", "SpecPilot").set_value("user", "email", "specpilot@localhost")
    repo.git.add("-A")
    repo.index.commit("stock: the demo system as shipped (decoder, kernels, config, visible prompts)")
    repo.create_tag(STOCK_TAG)
    repo.close()
    (path / ".specpilot").mkdir()
    (path / ".specpilot" / "hidden.jsonl").write_text("".join(json.dumps(r) + "\n" for r in hidden_rows))
