"""Kernels ranked against their roofline (#24): every matmul shape and weight type on the decode path, at
widths 1-16, measured in the engine itself.

For a llama.cpp deployment the measurement is `kernels/ggml_matmul_bench.c` compiled against one engine
tree's own static ggml libraries (stock: the engine cache's build; a candidate: the libraries built from its
commit, by `workbench/engine_source.py`, in the sandbox). It loads the deployment's GGUF, groups the 2-D
weights by (type, k, n) and times each group at each width with the group's real weights streamed one after
another, as a forward does. Each row's roofline is the larger of its bytes (one tensor's weights, the
activations in and out) over the machine's memory bandwidth and its FLOPs over the machine's peak, and its
gap is what the group loses per forward against that roofline: `count * (measured - roofline)`.

The peak for integer-dot weight types (the quantised ones, which ggml multiplies as int8 dot products) is
the measured fp32 peak times the int8 lanes one fp32 lane holds where the CPU has VNNI (4), else 2; the
measured fp32 peak is the cost model's hardware profile's, scaled to the bench's threads. Both are stated in
the result (`roofline_source`).

The same binary is the kernel-level test: `--check --dump DIR` writes every group's outputs at every width,
and `compare_outputs` holds a candidate's against stock's, bit-exact or within a stated relative tolerance
(the error over the mean absolute output of the group), which token forcing then confirms.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from costmodel.hardware import LOCAL, HardwareError, get_profile
from decoder.engines.llamacpp_build import engine_dir, source_dir

BENCH_SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "ggml_matmul_bench.c"
GGML_LIBS = ("ggml/src/libggml.a", "ggml/src/libggml-cpu.a", "ggml/src/libggml-base.a")
WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)
TOLERANCE = 1e-4  # a candidate kernel's largest error over the group's mean |output| (float reordering: ~1e-5)
FLOAT_TYPES = ("f32", "f16", "bf16")


class KernelBenchError(Exception):
    """The kernel bench cannot be built or run; the message is one line naming what and why."""


def compile_command(include_dir: Path, build_dir: Path, out: Path) -> list[str]:
    """The compiler command that builds the bench against one engine build's static ggml libraries."""
    cc = shutil.which("cc") or shutil.which("gcc") or "cc"
    return [cc, "-O2", "-std=c11", "-o", str(out), str(BENCH_SOURCE), "-I", str(include_dir),
            *(str(build_dir / lib) for lib in GGML_LIBS), "-fopenmp", "-lstdc++", "-lm", "-lpthread"]


def source_digest() -> str:
    """The bench source's digest: a binary built from another version is rebuilt."""
    return hashlib.sha256(BENCH_SOURCE.read_bytes()).hexdigest()[:16]


def build_bench(include_dir: Path, build_dir: Path, out: Path) -> Path:
    """The bench compiled against `build_dir`'s ggml libraries (kept while the source and libraries are
    unchanged); KernelBenchError on failure."""
    missing = [lib for lib in GGML_LIBS if not (build_dir / lib).is_file()]
    if missing:
        raise KernelBenchError(f"no ggml libraries in {build_dir} ({', '.join(missing)}); run `make llama-cpp` first")
    stamp = out.with_name(out.name + ".digest")
    digest = source_digest() + "-" + "-".join(str(int((build_dir / lib).stat().st_mtime)) for lib in GGML_LIBS)
    if out.is_file() and stamp.is_file() and stamp.read_text().strip() == digest:
        return out
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.with_name(f".{out.name}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time (agents are threads of one process)
            if out.is_file() and stamp.is_file() and stamp.read_text().strip() == digest:
                return out
            r = subprocess.run(compile_command(include_dir, build_dir, tmp), capture_output=True, text=True,
                               stdin=subprocess.DEVNULL, timeout=300)
            if r.returncode != 0:
                first = next((ln for ln in r.stderr.splitlines() if "error" in ln), r.stderr.strip()[-200:])
                raise KernelBenchError(f"the kernel bench does not compile against {build_dir}: {first}")
            os.replace(tmp, out)
            stamp.write_text(digest)
    except OSError as e:
        raise KernelBenchError(f"cannot build the kernel bench at {out} ({e.strerror})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out


def stock_bench() -> Path:
    """The bench built against the engine cache's own build (`make llama-cpp`)."""
    return build_bench(source_dir() / "ggml" / "include", engine_dir() / "build",
                       engine_dir() / "bin" / "ggml-matmul-bench")


def bench_args(model: Path, *, threads: int, widths: Sequence[int], min_ms: float = 40.0, check: bool = False,
               dump: Path | None = None) -> list[str]:
    """The bench's arguments (after the binary)."""
    args = [str(model), "--threads", str(threads), "--widths", ",".join(str(w) for w in widths),
            "--min-ms", str(min_ms)]
    if check:
        args.append("--check")
    if dump is not None:
        args += ["--dump", str(dump)]
    return args


def parse_rows(stdout: str) -> list[dict]:
    """The bench's JSON lines; KernelBenchError when it printed none."""
    rows = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                raise KernelBenchError(f"the kernel bench printed a line that is not JSON: {line[:120]}") from None
    if not rows:
        raise KernelBenchError("the kernel bench printed no result (the model has no 2-D quantised weights?)")
    return rows


def run_bench(binary: Path, model: Path, *, threads: int, widths: Sequence[int] = WIDTHS, min_ms: float = 40.0,
              check: bool = False, dump: Path | None = None, timeout_s: float = 600.0) -> list[dict]:
    """Run the bench on the host (stock's binary only: a candidate's runs in the sandbox)."""
    cmd = [str(binary), *bench_args(model, threads=threads, widths=widths, min_ms=min_ms, check=check, dump=dump)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout_s,
                           env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    except subprocess.TimeoutExpired:
        raise KernelBenchError(f"the kernel bench ran over {timeout_s:.0f} s: {' '.join(cmd)}") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        raise KernelBenchError(f"the kernel bench failed ({last[:200]})")
    return parse_rows(r.stdout)


@dataclass(frozen=True)
class KernelRow:
    """One weight group's matmul at one width: measured against its roofline."""

    type: str
    k: int
    n: int
    count: int
    tensor: str  # the group's first tensor, for the reader
    width: int
    us: float  # median per tensor
    weight_bytes: int  # one tensor
    roofline_us: float

    @property
    def gap_ms(self) -> float:
        """ms per forward the group loses against its roofline at this width."""
        return self.count * max(0.0, self.us - self.roofline_us) / 1000.0

    @property
    def efficiency(self) -> float:
        return self.roofline_us / self.us if self.us > 0 else 0.0

    def label(self) -> str:
        return f"{self.type} {self.k}x{self.n} x{self.count} at width {self.width}"

    def as_dict(self) -> dict:
        return {**asdict(self), "gap_ms": round(self.gap_ms, 4), "efficiency": round(self.efficiency, 4)}


@dataclass(frozen=True)
class Roofline:
    """What a kernel's roofline is computed from."""

    bandwidth_GBps: float
    fp32_gflops: float  # at the bench's threads
    int8_factor: float  # integer-dot lanes per fp32 lane
    source: str

    def us(self, row: Mapping) -> float:
        w, k, n = int(row["width"]), int(row["k"]), int(row["n"])
        moved = int(row["weight_bytes"]) + 4 * k * w + 4 * n * w
        peak = self.fp32_gflops * (1.0 if row["type"] in FLOAT_TYPES else self.int8_factor)
        return max(moved / (self.bandwidth_GBps * 1e3), 2.0 * k * n * w / (peak * 1e3))


def cpu_has_vnni() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


def local_roofline(threads: int) -> Roofline:
    """This machine's roofline for the bench: the cpu-local hardware profile's bandwidth and fp32 peak."""
    try:
        hw = get_profile(LOCAL)
    except HardwareError as e:
        raise KernelBenchError(f"{e}") from None
    measured_threads = int(hw.measured.get("threads") or 1)
    fp32 = (hw.achieved_fp32_tflops or hw.fp32_tflops or hw.bf16_tflops) * 1e3 * threads / max(measured_threads, 1)
    vnni = cpu_has_vnni()
    factor = 4.0 if vnni else 2.0
    return Roofline(hw.mem_bandwidth_GBps, fp32, factor,
                    f"bandwidth {hw.mem_bandwidth_GBps:.1f} GB/s and fp32 {fp32:.0f} GFLOP/s at {threads} thread(s) "
                    f"from the {LOCAL} profile ({hw.source}); int8 dot products at {factor:.0f}x fp32 "
                    f"({'VNNI' if vnni else 'no VNNI'})")


def kernel_rows(rows: Sequence[Mapping], roofline: Roofline) -> list[KernelRow]:
    """The bench's group rows priced against the roofline, the largest gap first."""
    out = [KernelRow(str(r["type"]), int(r["k"]), int(r["n"]), int(r["count"]), str(r["tensor"]), int(r["width"]),
                     float(r["us"]), int(r["weight_bytes"]), roofline.us(r)) for r in rows if r["type"] != "forward"]
    return sorted(out, key=lambda r: -r.gap_ms)


def worst_per_group(kernels: Sequence[Mapping], top: int = 3) -> list[Mapping]:
    """The `top` weight groups with the largest gap, each at its worst width (`kernels` ranked by gap)."""
    seen, out = set(), []
    for k in kernels:
        g = (k["type"], k["k"], k["n"])
        if g not in seen:
            seen.add(g)
            out.append(k)
    return out[:top]


def width_totals(rows: Sequence[KernelRow]) -> dict[int, float]:
    """ms per forward spent in the measured matmuls at each width (every output position's lm_head included,
    as verification computes it)."""
    tot: dict[int, float] = {}
    for r in rows:
        tot[r.width] = tot.get(r.width, 0.0) + r.count * r.us / 1000.0
    return dict(sorted(tot.items()))


def profile(model: Path, *, threads: int, widths: Sequence[int] = WIDTHS, min_ms: float = 40.0,
            binary: Path | None = None, rows: Sequence[Mapping] | None = None,
            roofline: Roofline | None = None) -> dict:
    """The kernel profile of `model` on this machine: the groups ranked by gap, the whole forward's matmuls per
    width (measured in one graph) with their ratio to width 1, and the roofline used (this machine's cpu-local
    profile unless given)."""
    raw = rows if rows is not None else run_bench(binary or stock_bench(), model, threads=threads, widths=widths,
                                                  min_ms=min_ms)
    roof = roofline or local_roofline(threads)
    ranked = kernel_rows(raw, roof)
    forward = {int(r["width"]): float(r["us"]) / 1000.0 for r in raw if r["type"] == "forward"}
    if not forward:
        forward = width_totals(ranked)
    weights = sum(r.weight_bytes * r.count for r in ranked if r.width == min(r.width for r in ranked))
    base = forward[min(forward)]
    return {"model": str(model), "threads": threads, "roofline_source": roof.source,
            "weight_bytes": weights, "roofline_forward_ms": round(weights / (roof.bandwidth_GBps * 1e6), 4),
            "forward_ms": {str(w): round(v, 4) for w, v in sorted(forward.items())},
            "forward_ratio": {str(w): round(v / base, 4) for w, v in sorted(forward.items())},
            "kernels": [r.as_dict() for r in ranked]}


def format_profile(report: Mapping, top: int = 10) -> str:
    """The profile as a short table: the forward per width, then the largest gaps."""
    fw = report["forward_ms"]
    ratio = report["forward_ratio"]
    lines = [f"{Path(report['model']).name}: matmul kernels at {report['threads']} thread(s) "
             f"(roofline: {report['roofline_source']})",
             "every matmul of a forward, logits at every position (ms): "
             + ", ".join(f"w{w} {v:.1f} ({ratio[w]:.2f}x)" for w, v in fw.items())
             + f"; the weights' roofline {report['roofline_forward_ms']:.1f} ms",
             f"{'kernel':34} {'us/tensor':>10} {'roofline':>9} {'of roof':>8} {'gap ms/fwd':>11}"]
    for k in report["kernels"][:top]:
        label = f"{k['type']} {k['k']}x{k['n']} x{k['count']} at w{k['width']}"
        lines.append(f"{label:34} {k['us']:>10.1f} {k['roofline_us']:>9.1f} {k['efficiency']:>8.0%} "
                     f"{k['gap_ms']:>11.2f}")
    return "\n".join(lines)


def kernel_profile_report(model: Path, *, threads: int, widths: Sequence[int] = WIDTHS) -> tuple[dict, str]:
    """(the profile, its table) of `model` with stock's kernels."""
    report = profile(model, threads=threads, widths=widths)
    return report, format_profile(report)


def plot_kernel_widths(report: Mapping, path: Path) -> Path:
    """A PNG: the forward's matmul time per width against width x (no sharing) and the weights' roofline."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("--plot needs matplotlib; install it (`pip install matplotlib`) or drop --plot") from e
    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    ws = [int(w) for w in report["forward_ms"]]
    ms = [float(v) for v in report["forward_ms"].values()]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(ws, ms, "o-", label="measured (every matmul of a forward)")
    ax.plot(ws, [ms[0] * w for w in ws], ":", color="grey", label="width x the width-1 cost")
    ax.axhline(report["roofline_forward_ms"], color="red", ls="--", label="weights over memory bandwidth")
    ax.set_xlabel("tokens per forward (verify width)")
    ax.set_ylabel("ms per forward")
    ax.set_title(Path(report["model"]).name, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def compare_outputs(stock_dir: Path, candidate_dir: Path, tolerance: float = TOLERANCE) -> dict:
    """A candidate kernel's outputs against stock's (the bench's `--dump` files): per file the largest error
    over the group's mean |output|, and whether every file is bit-exact or within `tolerance`."""
    files = sorted(p.name for p in stock_dir.glob("*.f32"))
    if not files:
        raise KernelBenchError(f"no stock outputs in {stock_dir}")
    worst, exact, per = 0.0, True, {}
    for name in files:
        a = np.fromfile(stock_dir / name, dtype=np.float32)
        try:
            b = np.fromfile(candidate_dir / name, dtype=np.float32)
        except OSError:
            raise KernelBenchError(f"the candidate's kernel test wrote no {name}") from None
        if a.shape != b.shape:
            raise KernelBenchError(f"{name}: the candidate wrote {b.size} outputs, stock {a.size}")
        if not np.all(np.isfinite(b)):
            per[name] = float("inf")
            worst, exact = float("inf"), False
            continue
        same = bool(np.array_equal(a, b))
        exact = exact and same
        err = 0.0 if same else float(np.max(np.abs(a - b)) / max(float(np.mean(np.abs(a))), 1e-30))
        per[name] = err
        worst = max(worst, err)
    return {"files": len(files), "bit_exact": exact, "max_rel_error": worst, "tolerance": tolerance,
            "ok": exact or worst <= tolerance, "per_file": per}
