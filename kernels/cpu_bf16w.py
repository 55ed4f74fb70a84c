"""Mechanism bf16w-matmul on the CPU: float32 activations times weights held as bfloat16 (`cpu_bf16w.c`).

A float32 deployment of a bfloat16 checkpoint holds every weight as an exact bf16 value in four bytes; the
few-row matmuls of decode and verify steps are bound by reading them. `pack` keeps each weight in two bytes
(refusing any weight that bf16 does not hold exactly, so nothing is rounded), and `linear` multiplies float32
rows by it, widening in registers. Each output is one float32 FMA chain in k order at any row count, so the
products are the float32 ones in another summation order than F.linear's (forcing judges any changed token).

The C source is compiled once per process with the system's C compiler into a private temporary folder, loaded,
and the folder removed: nothing is cached where another process (a candidate) could write, and the library
never outlives the process that built it (about one second with gcc -O3).
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_bf16w.c")
CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mfma", "-fopenmp", "-shared", "-fPIC")
PANEL = 32  # outputs per packed panel (cpu_bf16w.c)
MAX_ROWS = 64  # calls of more rows (a prefill) are compute-bound: F.linear on the float32 weights wins there


class KernelUnavailable(RuntimeError):
    """This machine cannot build or run the kernel; the message says why in one line and what to use instead."""


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def unavailable() -> str | None:
    """Why the kernel cannot run here (one line), or None when it can."""
    if sys.platform != "linux":
        return f"the bf16w kernel is built for Linux, not {sys.platform}"
    missing = {"avx512f", "avx512bw"} - _cpu_flags()
    if missing:
        return f"the bf16w kernel needs a CPU with AVX-512F and AVX-512BW; this one lacks {', '.join(sorted(missing))}"
    if not _compiler():
        return "the bf16w kernel is compiled at start-up and no C compiler (cc, gcc or $CC) is on PATH"
    return None


@functools.cache
def _lib() -> ctypes.CDLL:
    why = unavailable()
    if why:
        raise KernelUnavailable(why)
    cc = _compiler()
    tmp = tempfile.mkdtemp(prefix="specpilot-bf16w-")
    try:
        out = Path(tmp) / "libbf16w.so"
        r = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", str(out)], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1][:200]
            raise KernelUnavailable(f"the bf16w kernel did not compile with {cc}: {tail}")
        lib = ctypes.CDLL(str(out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.bf16w_pack.argtypes = [p, i, i, p]
    lib.bf16w_pack.restype = None
    lib.bf16w_linear.argtypes = [p, i, i, p, i, p, p]
    lib.bf16w_linear.restype = None
    return lib


def pack(w: torch.Tensor) -> torch.Tensor:
    """A float32 or bfloat16 weight [N, K] as the kernel's bf16 panels (int16 [ceil(N/32) * K * 32]).

    Raises ValueError when a float32 weight holds a value bf16 cannot represent exactly (the kernel would
    change the model), KernelUnavailable when the kernel cannot run here."""
    if w.dim() != 2 or w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"bf16w packs a 2-D float32 or bfloat16 CPU weight, not {w.dtype} {tuple(w.shape)} "
                         f"on {w.device.type}")
    wb = w.detach().to(torch.bfloat16).contiguous()
    if w.dtype == torch.float32 and not torch.equal(wb.float(), w.detach()):
        bad = int((wb.float() != w.detach()).sum())
        raise ValueError(f"a {tuple(w.shape)} weight holds {bad} values bfloat16 cannot represent exactly "
                         f"(not a bfloat16 checkpoint)")
    n, k = wb.shape
    out = torch.empty(-(-n // PANEL) * k * PANEL, dtype=torch.int16)
    _lib().bf16w_pack(wb.data_ptr(), n, k, out.data_ptr())
    return out


def linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 @ W^T (+ bias) -> [M, n] float32, W as `pack` returned it (n = its output count)."""
    if x.dtype != torch.float32:
        raise ValueError(f"bf16w multiplies float32 rows, not {x.dtype}")
    x = x.contiguous()
    m, k = x.shape
    if panels.numel() != -(-n // PANEL) * k * PANEL:
        raise ValueError(f"packed weight of {panels.numel()} values does not fit x [{m}, {k}] and {n} outputs")
    y = torch.empty(m, n, dtype=torch.float32)
    b = bias.float().contiguous() if bias is not None else None
    _lib().bf16w_linear(x.data_ptr(), m, k, panels.data_ptr(), n, b.data_ptr() if b is not None else None,
                        y.data_ptr())
    return y
