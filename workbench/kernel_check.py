"""The kernel-level test of a candidate that changes the engine's kernels (#24).

A commit of a workspace that carries llama.cpp's source and changes a file under `ggml/` (the tensor library:
the CPU kernels) is a kernel candidate. Before forcing, its kernels multiply the deployment's real weights by
the same deterministic activations as stock's, at the verify widths, and every output is held against
stock's: bit-exact, or within `costmodel.kernels.TOLERANCE` of the group's mean |output| (a reordered float
sum), which token forcing then confirms. The candidate's side runs in the sandbox (its kernel bench is
linked against the ggml its own commit built: `engine_source.engine_tool`), its outputs come back as a tar
stream on stdout (capped at the size they must have, unpacked with tarfile's `data` filter), and stock's
are computed once per model on the host with the engine cache's build.

The micro-benchmark beside it (the whole forward's matmuls per width) is timed inside the candidate's
build, so it is reported as the candidate's own account: evidence for the reader, never an input to a
verdict or to the plausibility ceiling (the harness times the system from outside).
"""

from __future__ import annotations

import fcntl
import io
import os
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import git

from costmodel.kernels import (
    TOLERANCE,
    KernelBenchError,
    bench_args,
    compare_outputs,
    compile_command,
    parse_rows,
    run_bench,
    source_digest,
    stock_bench,
)
from decoder.engines.llamacpp_build import CMAKE_FLAGS, LLAMA_CPP_PYTHON_VERSION, source_dir
from workbench.engine_source import BUILD_JOBS, changed_engine_files, engine_tool, sandboxed_build
from workbench.gate import measurement_lock, untimed
from workbench.harness import (
    SystemCrash,
    _die_with_parent,
    _host_env,
    sandbox_command,
    sandbox_spec,
    sandbox_status,
)
from workbench.progress import step
from workbench.safegit import hardened

KERNEL_DIR = "ggml/"  # under the engine source: a change here is a kernel change
CHECK_WIDTHS = (1, 2, 3, 4, 8, 16, 17, 32, 33, 64)  # long drafts go past 16, short prompts past 32
MICRO_WIDTHS = (1, 2, 4, 8, 16)
RUN_TIMEOUT_S = 600


def kernel_files(ws, commit: str) -> list[str]:
    """The engine files under ggml/ that `commit` changes against stock (hardened git on the main repository)."""
    if not ws.config.engine_source:
        return []
    return changed_engine_files(ws, commit, KERNEL_DIR)


def _threads(ws) -> int:
    return int(ws.config.limits.get("threads") or 1)


def stock_outputs(ws) -> Path:
    """Stock's kernel outputs on the deployment's weights at CHECK_WIDTHS (computed once per model, bench
    version and widths; the engine cache's build, on the host: stock is trusted)."""
    model = ws.config.target
    st = model.stat()
    key = f"{model.name}-{st.st_size}-{int(st.st_mtime)}-{source_digest()}-{'-'.join(map(str, CHECK_WIDTHS))}"
    out = ws.state / "kernel-check" / "stock" / key
    if (out / ".done").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # agents of one round (threads of one process) compute it once
        if (out / ".done").is_file():
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=out.parent))
        try:
            with untimed():
                run_bench(stock_bench(), model, threads=_threads(ws), widths=CHECK_WIDTHS, check=True, dump=tmp)
            (tmp / ".done").write_text("")
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
        except KernelBenchError as e:
            raise SystemCrash("kernel", f"stock's kernel outputs: {e}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _expected_bytes(stock: Path) -> int:
    return sum(p.stat().st_size for p in stock.glob("*.f32"))


def run_sandboxed(ws, bench: Path, shell: str, cap: int) -> bytes:
    """Run `shell` (which calls one of a candidate's engine binaries, `bench`, whose folder it sees) in the
    sandbox, the deployment's model folder read-only; its stdout, at most `cap` bytes (more is the candidate's
    crash)."""
    model = ws.config.target.resolve()  # the sandbox shows the real folder at its real path
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C",
           "OMP_NUM_THREADS": str(_threads(ws))}
    spec = sandbox_spec(bench.parent, [model.parent], ["/bin/sh", "-c", shell], env,
                        int(ws.config.limits.get("memory_mb", 4096)))
    spec["tmp_size"] = f"{max(256, 2 * cap // 2**20 + 64)}m"
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(sandbox_command(spec), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                env=_host_env(), preexec_fn=_die_with_parent)
        try:
            data = proc.stdout.read(cap + 1)
            if len(data) > cap:
                proc.kill()
                raise SystemCrash("kernel", f"the candidate's kernel test wrote more than the {cap} bytes its "
                                            f"outputs take")
            proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise SystemCrash("kernel", f"the candidate's kernel test ran over {RUN_TIMEOUT_S} s") from None
        finally:
            proc.stdout.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proc.returncode != 0:
            err.seek(0)
            lines = err.read().decode(errors="replace").strip().splitlines()
            why = lines[-1][:200] if lines else f"exit status {proc.returncode}"
            raise SystemCrash("kernel", f"the candidate's kernel test failed: {why}")
    return data


def candidate_outputs(ws, commit: str, dest: Path, stock: Path) -> None:
    """The candidate's kernel outputs (same model, activations, widths) unpacked into `dest`."""
    sandboxed_outputs(ws, engine_tool(ws, commit, "ggml-matmul-bench"), dest, stock)


def sandboxed_outputs(ws, bench: Path, dest: Path, stock: Path) -> None:
    """A kernel bench not trusted on the host (a candidate's, or one built from an exported patch) run in the
    sandbox on the deployment's weights at CHECK_WIDTHS; its outputs unpacked into `dest`."""
    args = bench_args(ws.config.target.resolve(), threads=_threads(ws), widths=CHECK_WIDTHS, check=True,
                      dump=Path("/tmp/out"))
    shell = (f"mkdir /tmp/out && {' '.join(map(shlex.quote, [str(bench), *args]))} > /dev/null && "
             f"tar -cf - -C /tmp/out .")
    cap = _expected_bytes(stock) + (len(list(stock.glob('*.f32'))) + 8) * 2048 + 2**20  # tar headers and padding
    data = run_sandboxed(ws, bench, shell, cap)
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            members = [m for m in tf.getmembers() if m.isfile() and m.name.endswith(".f32") and "/" not in
                       m.name.removeprefix("./")]
            tf.extractall(dest, members=members, filter="data")
    except (tarfile.TarError, OSError) as e:
        raise SystemCrash("kernel", f"the candidate's kernel test returned no readable outputs ({e})") from None


def micro_benchmark(ws, commit: str) -> dict:
    """The whole forward's matmuls per width, stock's and the candidate's, measured back to back under the
    timing gate. The candidate's figures are timed inside its own build: reported, never trusted."""
    return bench_micro(ws, engine_tool(ws, commit, "ggml-matmul-bench"))


def bench_micro(ws, cand: Path) -> dict:
    """micro_benchmark for a kernel bench binary `cand` (run in the sandbox)."""
    args = bench_args(ws.config.target.resolve(), threads=_threads(ws), widths=MICRO_WIDTHS, min_ms=60.0)
    with measurement_lock():
        stock = {r["width"]: r["us"] / 1000.0 for r in run_bench(stock_bench(), ws.config.target,
                                                                  threads=_threads(ws), widths=MICRO_WIDTHS,
                                                                  min_ms=60.0) if r["type"] == "forward"}
        out = run_sandboxed(ws, cand, " ".join(map(shlex.quote, [str(cand), *args])), 2**20).decode(errors="replace")
    try:
        mine = {r["width"]: float(r["us"]) / 1000.0 for r in parse_rows(out) if r.get("type") == "forward"}
    except (KernelBenchError, KeyError, TypeError, ValueError):
        mine = {}
    return {"stock_forward_ms": {str(w): round(v, 3) for w, v in sorted(stock.items())},
            "candidate_forward_ms": {str(w): round(v, 3) for w, v in sorted(mine.items())},
            "candidate_timing": "reported by the candidate's build (informational; verdicts use the harness's timing)"}


def _jsonable(cmp: dict) -> dict:
    return {**{k: v for k, v in cmp.items() if k != "per_file"},
            "per_file": {k: (v if v != float("inf") else "non-finite") for k, v in cmp["per_file"].items()}}


def _verdict(stock: Path, mine: Path) -> tuple[dict, str]:
    """compare_outputs of a bench's outputs against stock's, and its one-line reason."""
    try:
        cmp = compare_outputs(stock, mine, TOLERANCE)
    except KernelBenchError as e:
        raise SystemCrash("kernel", str(e)) from None
    worst = max(cmp["per_file"].items(), key=lambda kv: kv[1])
    if cmp["bit_exact"]:
        reason = f"kernel test: bit-exact with stock on the deployment's weights at widths {CHECK_WIDTHS}"
    elif cmp["ok"]:
        reason = (f"kernel test: within {TOLERANCE:g} of stock (largest error {cmp['max_rel_error']:.2e} of the mean "
                  f"|output|, {worst[0]}); forcing confirms it token by token")
    else:
        reason = (f"kernel test: outputs differ from stock by {cmp['max_rel_error']:.3g} of the mean |output| "
                  f"({worst[0]}; tolerance {TOLERANCE:g})")
    return cmp, reason


def kernel_check(ws, commit: str, *, micro: bool = True) -> dict:
    """The kernel test of `commit` against stock: {"files", "bit_exact", "max_rel_error", "tolerance", "ok",
    "reason", ...}; {} when the commit changes no kernel. SystemCrash("build"/"kernel") when it cannot run."""
    files = kernel_files(ws, commit)
    if not files:
        return {}
    step("kernel test", detail=f"{len(files)} kernel file(s) changed: {', '.join(files[:3])}")
    stock = stock_outputs(ws)
    with tempfile.TemporaryDirectory(prefix="kernel-check-") as tmp:
        with untimed():
            candidate_outputs(ws, commit, Path(tmp), stock)
        cmp, reason = _verdict(stock, Path(tmp))
    result = {"kernel_files": files, **_jsonable(cmp), "reason": reason}
    if micro and cmp["ok"]:
        step("kernel test", detail="micro-benchmark of the forward's matmuls per width")
        result["micro"] = micro_benchmark(ws, commit)
    return result


def kernel_feedback(ws, commit: str) -> tuple[bool, str]:
    """For an agent's smoke run: `commit`'s kernel test and micro-benchmark in one line; (True, "") when it
    changes no kernel. What an LLM editing ggml/ iterates on before the cascade holds it to the same test."""
    try:
        r = kernel_check(ws, commit)
    except SystemCrash as e:
        return False, f"{e.kind}: {e.reason}"
    if not r:
        return True, ""
    if not r["ok"]:
        return False, r["reason"]
    micro = r.get("micro", {})
    stock, mine = micro.get("stock_forward_ms", {}), micro.get("candidate_forward_ms", {})
    rows = ", ".join(f"w{w} {stock[w]:.1f} -> {mine[w]:.1f} ms" for w in stock if w in mine)
    return True, r["reason"] + (f"; the forward's matmuls per width, stock -> yours (your build's own timing): "
                                f"{rows}" if rows else "")


def upstream_kernel_test(ws, patches: list[Path], *, micro: bool = True) -> dict:
    """The kernel test of exported engine patches (`specpilot export --upstream`) on the upstream source the
    workspace's engine came from: a fresh git repository of the engine cache's vendored llama.cpp tree, the
    patches applied with `git am`, ggml and the kernel bench configured and built there from scratch (in the
    sandbox: the patches are candidate text), the bench run in the sandbox on the deployment's weights at
    CHECK_WIDTHS against stock's outputs. Patches may change only C/C++ sources under ggml/src (no build files:
    CMake runs what they say). {"ok", "reason", "patches", "applied_on", ...}; SystemCrash("build"/"kernel")."""
    if not patches:
        raise SystemCrash("kernel", "no engine patches to test")
    for p in patches:
        bad = [f for f in _patched_files(p) if not _kernel_source(f)]
        if bad:
            raise SystemCrash("kernel", f"{p.name} changes {bad[0]}: the upstream kernel test takes patches of "
                                        "C/C++ sources under ggml/src only")
    ok, why = sandbox_status()
    if not ok:
        raise SystemCrash("build", f"the upstream kernel test needs the sandbox ({why})")
    stock = stock_outputs(ws)
    tmp = Path(tempfile.mkdtemp(prefix="kernel-upstream-"))
    try:
        tree, bld = tmp / "llama.cpp", tmp / "build"
        step("upstream kernel test", detail=f"copying {source_dir()} into a fresh repository")
        shutil.copytree(source_dir(), tree, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        git.Repo.init(tree)
        g = hardened(tree / ".git", tree)
        g.update_environment(GIT_AUTHOR_NAME="upstream", GIT_AUTHOR_EMAIL="upstream@localhost",
                             GIT_COMMITTER_NAME="specpilot", GIT_COMMITTER_EMAIL="specpilot@localhost")
        g.add("-A")
        g.commit("-q", "-m", f"llama.cpp as vendored in llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}")
        base = g.rev_parse("HEAD").strip()
        for p in patches:
            try:
                g.am("--keep-cr", str(p.resolve()))
            except git.GitCommandError as e:
                first = next((ln for ln in (e.stderr or "").splitlines() if ln.strip()), str(e))
                raise SystemCrash("build", f"{p.name} does not apply to the upstream tree: {first.strip()}") from None
        changed = g.diff("--name-only", f"{base}..HEAD").split()
        outside = [f for f in changed if not _kernel_source(f)]  # what was applied, not what the headers said
        if outside:
            raise SystemCrash("kernel", f"the patches change {outside[0]}: the upstream kernel test takes patches of "
                                        "C/C++ sources under ggml/src only")
        step("upstream kernel test", detail=f"{len(patches)} patch(es) applied ({', '.join(changed[:3])}); building "
                                            "ggml and the kernel bench there")
        bld.mkdir()
        log = ws.state / "logs" / f"upstream-kernel-build-{time.strftime('%Y%m%d-%H%M%S')}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        bench = bld / "bin" / "ggml-matmul-bench"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        script = " && ".join([
            shlex.join(["/usr/bin/cmake", "-S", str(tree), "-B", str(bld), *generator, *CMAKE_FLAGS]),
            shlex.join(["/usr/bin/cmake", "--build", str(bld), "--target", "ggml", "ggml-cpu", "ggml-base",
                        "-j", str(BUILD_JOBS)]),
            shlex.join(compile_command(tree / "ggml" / "include", bld, bench))])
        with untimed():
            sandboxed_build(tree, script, log, "ggml on the upstream tree with the patches",
                            binds=[[str(bld), str(bld), True]], own=bld,
                            memory_mb=int(ws.config.limits.get("memory_mb", 4096)))
        if not bench.is_file():
            raise SystemCrash("build", f"the upstream build made no kernel bench (log: {log})")
        step("upstream kernel test", detail="running the kernel bench built there on the deployment's weights")
        out = tmp / "outputs"
        out.mkdir()
        with untimed():
            sandboxed_outputs(ws, bench, out, stock)
        cmp, reason = _verdict(stock, out)
        result = {"ok": cmp["ok"], "reason": reason.replace("kernel test:", "kernel test on the upstream tree:", 1),
                  "patches": [p.name for p in patches], "changed": changed,
                  "applied_on": f"llama.cpp vendored in llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} ({source_dir()})",
                  "build_log": str(log), **_jsonable(cmp)}
        if micro and cmp["ok"]:
            step("upstream kernel test", detail="micro-benchmark of the forward's matmuls per width")
            result["micro"] = bench_micro(ws, bench)
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_KERNEL_SOURCES = (".c", ".cpp", ".h", ".hpp", ".inc")


def _kernel_source(path: str) -> bool:
    return path.startswith("ggml/src/") and path.endswith(_KERNEL_SOURCES) and ".." not in path.split("/")


def _patched_files(patch: Path) -> list[str]:
    """The paths a git-format patch touches (both sides of every diff header)."""
    out = []
    for line in patch.read_text(errors="replace").splitlines():
        if line.startswith(("--- a/", "+++ b/")):
            out.append(line[6:])
        elif line.startswith(("--- ", "+++ ")) and "/dev/null" not in line:
            out.append(line[4:])  # a path without the a/ b/ prefix: refused below unless it is a kernel source
    return out
