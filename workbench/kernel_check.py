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
from pathlib import Path

from costmodel.kernels import (
    TOLERANCE,
    KernelBenchError,
    bench_args,
    compare_outputs,
    parse_rows,
    run_bench,
    source_digest,
    stock_bench,
)
from workbench.engine_source import changed_engine_files, engine_tool
from workbench.gate import measurement_lock, untimed
from workbench.harness import SystemCrash, _die_with_parent, _host_env, sandbox_command, sandbox_spec
from workbench.progress import step

KERNEL_DIR = "ggml/"  # under the engine source: a change here is a kernel change
CHECK_WIDTHS = (1, 2, 3, 4, 8, 16, 17, 32)  # verify batches of long drafts go past 16
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
    bench = engine_tool(ws, commit, "ggml-matmul-bench")
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
    cand = engine_tool(ws, commit, "ggml-matmul-bench")
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
        try:
            cmp = compare_outputs(stock, Path(tmp), TOLERANCE)
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
    result = {"kernel_files": files, **{k: v for k, v in cmp.items() if k != "per_file"},
              "per_file": {k: (v if v != float("inf") else "non-finite") for k, v in cmp["per_file"].items()},
              "reason": reason}
    if micro and cmp["ok"]:
        step("kernel test", detail="micro-benchmark of the forward's matmuls per width")
        result["micro"] = micro_benchmark(ws, commit)
    return result
