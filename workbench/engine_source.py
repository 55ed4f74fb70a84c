"""A llama.cpp workspace that carries the engine's source, so candidates may edit its C++ (#19, #24).

`specpilot init --engine llama.cpp --with-source` copies the part of the vendored llama.cpp that the build
reads (`SOURCE_PARTS`, about 51 MB) into the workspace at `engine/llama.cpp/` and commits it with stock.
The system's entry then names `{engine_server}`: the `llama-server` built from the engine source at the
commit being run.

A candidate's engine is built from its commit, never from its worktree (which the candidate controls):

1. the commit's engine tree (`git rev-parse COMMIT:engine/llama.cpp`, hardened git on the main repository)
   names the build, `.specpilot/engine-builds/<tree>/bin/llama-server`, shared by every commit with that
   tree; stock's tree (the source as carried) is the engine cache's own build (`make llama-cpp`);
2. the tree is exported with `git archive` (hardened) and unpacked with tarfile's `data` filter (no
   absolute paths, no links leaving it, no special files); every file equal to stock's (by blob, from
   `git diff --name-only`) gets an old fixed mtime, every changed one the current time;
3. a copy of the engine cache's CMake/ninja build folder (configured for the cache's source path) seeds
   the build, so only what changed is compiled: in the sandbox the exported source is mounted read-only
   at the cache's source path and the copy, writable, at the cache's build path, and `cmake --build
   --target llama-server` recompiles the changed files and links (re-configuring when a CMake file
   changed); no network, the sandbox's limits, a time limit, the log in `.specpilot/logs/`;
4. only the binary is kept, renamed into place whole; a failure is the candidate's crash, its reason the
   compiler's first error line.

Building is untimed work (it holds the timing gate shared), done when a system of that commit first
starts, before any timed run: its time never enters a measurement. There is no ccache: the seeded ninja
build already recompiles only the changed translation units.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import stat
import subprocess
import tarfile
import time
from pathlib import Path

import git

from costmodel.kernels import BENCH_SOURCE, KernelBenchError, compile_command, stock_bench
from decoder.engines.llamacpp_build import binary, engine_dir, source_dir
from workbench.gate import untimed
from workbench.harness import SystemCrash, _die_with_parent, _host_env, sandbox_command, sandbox_spec, sandbox_status
from workbench.progress import step
from workbench.safegit import hardened

SOURCE_REL = "engine/llama.cpp"  # where a workspace carries the engine source
# What the build reads of the vendored tree (tests, examples, docs and models are off or unused).
SOURCE_PARTS = ("CMakeLists.txt", "LICENSE", "cmake", "include", "src", "ggml", "common", "tools", "vendor", "app",
                "licenses", "scripts")
OLD_MTIME = 946_684_800  # 2000-01-01: files unchanged from stock are older than every output of the seed build
BUILD_TIMEOUT_S = 1800
BUILD_JOBS = 2
# What a candidate's build keeps: the server, llama-bench (its forward cost per width) and the kernel bench
# (kernels/ggml_matmul_bench.c linked against the candidate's ggml: the kernel test and micro-benchmark).
TOOLS = ("llama-server", "llama-bench", "ggml-matmul-bench")


class EngineSourceError(Exception):
    """The engine source cannot be carried (no engine cache, no build folder); one line."""


def carry_source(workspace_root: Path) -> Path:
    """Copy the build's part of the cached llama.cpp source into `workspace_root/engine/llama.cpp`."""
    src = source_dir()
    if not (engine_dir() / "build" / "build.ninja").is_file() or not src.is_dir():
        raise EngineSourceError(f"--with-source needs the engine cache's source and its ninja build folder "
                                f"({src}, {engine_dir() / 'build'}); run `make llama-cpp` first")
    dst = workspace_root / SOURCE_REL
    dst.mkdir(parents=True)
    for part in SOURCE_PARTS:
        p = src / part
        if p.is_dir():
            shutil.copytree(p, dst / part, symlinks=True)
        elif p.is_file():
            shutil.copy2(p, dst / part)
    return dst


def _git(ws) -> object:
    """Hardened git on the main repository (objects and refs only; never a candidate's configuration)."""
    return hardened(Path(ws.repo.git_dir), ws.path)


def added_lines(patch: str) -> dict[str, list[str]]:
    """The lines a patch adds, per file (paths inside the engine tree)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in patch.splitlines():
        if line.startswith("+++ "):
            current = line[4:].removeprefix("b/").strip()
            out[current] = []
        elif current and line.startswith("+") and line[1:].strip():
            out[current].append(line[1:])
    return out


def carries(ws, commit: str, patch: str) -> bool:
    """Whether `commit`'s engine tree already has every line `patch` adds (hardened git on the main repository:
    the commit's objects are read as data, never with its configuration)."""
    g = _git(ws)
    for rel, lines in added_lines(patch).items():
        try:
            blob = g.show(f"{commit}:{SOURCE_REL}/{rel}")
        except git.GitCommandError:  # a file the engine tree lacks: the patch is not carried
            return False
        if not all(line in blob for line in lines):
            return False
    return True


def apply_patch(g, patch: Path) -> str | None:
    """Apply `patch` (paths inside the engine tree) to the worktree of `g` (an agent's own branch); None when it
    applied, else git's last line of why not."""
    try:
        g.apply(f"--directory={SOURCE_REL}", str(patch))
    except Exception as e:  # noqa: BLE001 - any failure to apply is this one patch not fitting the base
        return str(e).splitlines()[-1][:120]
    return None


def engine_tree(ws, commit: str) -> str:
    """The id of `commit`'s engine source tree; SystemCrash("build") when the commit has none."""
    try:
        return _git(ws).rev_parse("--verify", "--quiet", f"{commit}^{{commit}}:{SOURCE_REL}").strip()
    except git.GitCommandError:
        raise SystemCrash("build", f"commit {commit[:10]} has no {SOURCE_REL}/ (the engine's source was removed "
                                   f"or moved); the engine is built from it") from None


def changed_engine_files(ws, commit: str, under: str = "") -> list[str]:
    """The engine source files (paths inside the engine tree) that `commit` changes against stock, those under
    `under` (e.g. "ggml/") when given."""
    names = _git(ws).diff("--name-only", "--no-renames", "-z", ws.stock_commit, commit, "--",
                          f"{SOURCE_REL}/{under}".rstrip("/"))
    return sorted(n[len(SOURCE_REL) + 1:] for n in names.split("\0") if n.startswith(f"{SOURCE_REL}/{under}"))


def engine_server(ws, commit: str) -> Path:
    """`llama-server` built from the engine source at `commit` (built now when no commit with that tree
    was built before); SystemCrash("build", one line) when it does not build."""
    return engine_tool(ws, commit, "llama-server")


def engine_tool(ws, commit: str, name: str) -> Path:
    """One of TOOLS built from the engine source at `commit`: stock's tree gives the engine cache's own
    (`make llama-cpp`; the kernel bench compiled against its libraries), another tree the binaries of its
    build, built now when none was (a build of an older SpecPilot without all of TOOLS is built again)."""
    if name not in TOOLS:
        raise ValueError(f"unknown engine tool {name!r}; one of {', '.join(TOOLS)}")
    tree = engine_tree(ws, commit)
    if tree == engine_tree(ws, ws.stock_commit):  # the source as carried: the engine cache's own build
        if name == "ggml-matmul-bench":
            try:
                return stock_bench()
            except KernelBenchError as e:
                raise SystemCrash("build", str(e)) from None
        return binary(name)
    root = ws.state / "engine-builds"
    bin_dir = root / tree / "bin"
    if all((bin_dir / t).is_file() for t in TOOLS):
        return bin_dir / name
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{tree}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build per tree; a second evaluation waits and reuses it
        if not all((bin_dir / t).is_file() for t in TOOLS):
            shutil.rmtree(root / tree, ignore_errors=True)
            with untimed():
                _build(ws, commit, tree, root / tree)
    return bin_dir / name


def _build(ws, commit: str, tree: str, out: Path) -> None:
    ok, why = sandbox_status()
    if not ok:
        raise SystemCrash("build", f"building a candidate's engine needs the sandbox ({why})")
    tmp = out.with_name(f".{tree}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    src, bld = tmp / "src", tmp / "build"
    log = ws.state / "logs" / f"build-{tree[:12]}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        step("building the engine", detail=f"exporting {SOURCE_REL} at {commit[:10]}")
        changed = _export(ws, commit, src)
        step("building the engine", detail=f"{len(changed)} changed file(s); seeding from the engine cache's build")
        shutil.copytree(engine_dir() / "build", bld, symlinks=True)
        step("building the engine", detail=f"compiling what changed ({len(changed)} file(s)); log {log.name}")
        cache_build = engine_dir() / "build"
        build = shlex.join(["/usr/bin/cmake", "--build", str(cache_build), "--target", "llama-server", "llama-bench",
                            "-j", str(BUILD_JOBS)])
        kernel_bench = shlex.join(compile_command(source_dir() / "ggml" / "include", cache_build,
                                                  cache_build / "bin" / "ggml-matmul-bench"))
        # The sdist's git metadata: the seed build's CMake step depends on its index (read-only, from the cache).
        meta = [[str(m), str(m), False] for m in [source_dir().parent.parent / ".git"] if m.is_dir()]
        # as root: the build's copy belongs to the uid the sandbox drops to (own)
        sandboxed_build(src, f"{build} && {kernel_bench}", log, "the engine",
                        binds=[[str(src), str(source_dir()), False], [str(bld), str(cache_build), True], *meta],
                        own=cache_build, memory_mb=int(ws.config.limits.get("memory_mb", 4096)))
        (tmp / "bin").mkdir()
        for name in TOOLS:
            built = bld / "bin" / name
            if not stat.S_ISREG(os.lstat(built).st_mode):
                raise SystemCrash("build", f"the engine build made no {name} binary (log: {log})")
            shutil.copyfile(built, tmp / "bin" / name)
            os.chmod(tmp / "bin" / name, 0o755)
        shutil.rmtree(src)
        shutil.rmtree(bld)
        os.chmod(tmp, 0o755)
        os.chmod(tmp / "bin", 0o755)
        os.replace(tmp, out)
        with open(log, "a") as f:
            f.write(f"\nspecpilot: built {out / 'bin' / 'llama-server'} in {time.monotonic() - t0:.0f} s "
                    f"({len(changed)} changed file(s))\n")
    except FileNotFoundError as e:
        raise SystemCrash("build", f"the engine build made no binary ({e.filename}; log: {log})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sandboxed_build(root: Path, script: str, log: Path, what: str, *, binds: list, own: Path,
                    memory_mb: int) -> None:
    """Run a build `script` (sh) in the sandbox: `root` read-only as its worktree, the kernel bench's source
    visible, `binds` ([host, path inside, writable]) mounted, `own` (the build folder, also the working
    directory) given to the sandbox's uid; output to `log`. SystemCrash("build", one line naming `what` and
    the compiler's first error) when it fails or runs over BUILD_TIMEOUT_S."""
    spec = sandbox_spec(root, [BENCH_SOURCE.parent], ["/bin/sh", "-c", script],
                        {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C", "TMPDIR": "/tmp"}, memory_mb)
    spec["bind"] = binds
    spec["own"] = [str(own)]
    spec["cwd"] = str(own)
    spec["tmp_size"] = "1g"
    with open(log, "wb") as f:
        try:
            r = subprocess.run(sandbox_command(spec), stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                               env=_host_env(), timeout=BUILD_TIMEOUT_S, preexec_fn=_die_with_parent)
        except subprocess.TimeoutExpired:
            raise SystemCrash("build", f"the build of {what} ran over {BUILD_TIMEOUT_S} s (log: {log})") from None
    if r.returncode != 0:
        raise SystemCrash("build", f"{what} does not build: {_first_error(log)} (log: {log})")


def _export(ws, commit: str, dst: Path) -> set[str]:
    """`commit`'s engine tree unpacked into `dst` (mtimes set for an incremental build); the changed paths."""
    g = _git(ws)
    dst.mkdir(parents=True)
    archive = dst.parent / "src.tar"
    g.archive("--format=tar", "-o", str(archive), f"{commit}:{SOURCE_REL}")
    with tarfile.open(archive) as tf:
        try:
            tf.extractall(dst, filter="data")  # no absolute paths, no links out of dst, no devices
        except tarfile.FilterError as e:
            raise SystemCrash("build", f"{SOURCE_REL} at {commit[:10]}: {e}; the engine source must stay "
                                       f"inside its tree") from None
    archive.unlink()
    names = g.diff("--name-only", "--no-renames", "-z", ws.stock_commit, commit, "--", SOURCE_REL)
    changed = {n[len(SOURCE_REL) + 1:] for n in names.split("\0") if n.startswith(SOURCE_REL + "/")}
    now = time.time()
    for dirpath, dirnames, filenames in os.walk(dst):
        for name in filenames + dirnames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, dst)
            t = now if rel in changed else OLD_MTIME
            os.utime(p, (t, t), follow_symlinks=False)
    return changed


def _first_error(log: Path) -> str:
    """The compiler's first error line in the build log (else CMake's, else ninja's, else the last line)."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()]
    except OSError:
        return "no log"
    for test in (lambda ln: ": error: " in ln or ": fatal error: " in ln, lambda ln: ln.startswith("CMake Error"),
                 lambda ln: ln.startswith("FAILED:")):
        for ln in lines:
            if test(ln):
                return ln[:300]
    return (lines[-1] if lines else "no output")[:300]
