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
        flags = (*CFLAGS, "-DBF16W_DP") if "avx512_bf16" in _cpu_flags() else CFLAGS  # the pairs kernels too
        r = subprocess.run([cc, *flags, str(SOURCE), "-o", str(out)], capture_output=True, text=True, timeout=120)
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
    lib.bf16w_linear_bf16.argtypes = [p, i, i, p, p, i, i, p, p]
    lib.bf16w_pack_pairs.argtypes = [p, i, i, p]
    lib.bf16w_pack_pairs.restype = None
    lib.bf16w_has_pairs.argtypes = []
    lib.bf16w_has_pairs.restype = i
    lib.bf16w_linear_bf16.restype = None
    f = ctypes.c_float
    lib.bf16w_pre_attn.argtypes = [p, i, i, p, f, p, i, p, p, p, i, i, i, p, p]
    lib.bf16w_pre_attn.restype = None
    lib.bf16w_post_attn.argtypes = [p, p, i, i, i, p, p, p, f, p, p, i, p, p, p, p, p, p]
    lib.bf16w_post_attn.restype = None
    lib.bf16w_pre_attn_bf16.argtypes = [p, i, i, p, f, p, i, i, p, p, p, i, i, i, p, p, p, p]
    lib.bf16w_pre_attn_bf16.restype = None
    lib.bf16w_post_attn_bf16.argtypes = [p, p, i, i, i, p, p, p, f, p, p, i, p, p, i, p, p, p, p, p, p, p]
    lib.bf16w_post_attn_bf16.restype = None
    lib.bf16w_silu_mul.argtypes = [p, i, i, p]
    lib.bf16w_rms.argtypes = [p, i, i, p, f, p]
    lib.bf16w_add_rms.argtypes = [p, p, i, i, p, f, p, p]
    lib.bf16w_rope.argtypes = [p, i, i, p, p, i, i]
    for fn in (lib.bf16w_silu_mul, lib.bf16w_rms, lib.bf16w_add_rms, lib.bf16w_rope):
        fn.restype = None
    return lib


def pairs_available() -> bool:
    """Whether this CPU and build have the AVX512-BF16 kernels that multiply bfloat16 rows by weights packed in
    pairs of k (`pack(w, pairs=True)`): a bfloat16 deployment's matmuls at twice the products per instruction."""
    return unavailable() is None and bool(_lib().bf16w_has_pairs())


def pack(w: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """A float32 or bfloat16 weight [N, K] as the kernel's bf16 panels: int16 [ceil(N/32) * K * 32] by k, or with
    `pairs` (K even, `pairs_available()`) the same bytes as int32 [ceil(N/32) * K * 16], each a pair of k, which
    multiply bfloat16 rows only.

    Raises ValueError when a float32 weight holds a value bf16 cannot represent exactly (the kernel would
    change the model) or pairs are asked where they cannot run, KernelUnavailable when the kernel cannot run
    here."""
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
    if not pairs:
        _lib().bf16w_pack(wb.data_ptr(), n, k, out.data_ptr())
        return out
    if k % 2 or not pairs_available():
        raise ValueError(f"bf16w packs a {tuple(w.shape)} weight in pairs of k only for an even K on a CPU with "
                         f"AVX512-BF16 (this one {'has' if pairs_available() else 'lacks'} it); use pairs=False")
    _lib().bf16w_pack_pairs(wb.data_ptr(), n, k, out.data_ptr())
    return out.view(torch.int32)


def _fits(panels: torch.Tensor, k: int, n: int) -> bool:
    return panels.numel() * (2 if panels.dtype == torch.int32 else 1) == -(-n // PANEL) * k * PANEL


def linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, n] in x's dtype, W as `pack` returned it (n = its output count). float32 rows
    give float32; bfloat16 rows (a bfloat16 deployment) are widened exactly, multiplied in float32 and each output
    rounded once to bfloat16 after the bias, as a bfloat16 matmul accumulating in float32 rounds it."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"bf16w multiplies float32 or bfloat16 rows, not {x.dtype}")
    x = x.contiguous()
    m, k = x.shape
    if not _fits(panels, k, n):
        raise ValueError(f"packed weight of {panels.numel()} values does not fit x [{m}, {k}] and {n} outputs")
    pairs = panels.dtype == torch.int32
    if pairs and x.dtype != torch.bfloat16:
        raise ValueError(f"weights packed in pairs multiply bfloat16 rows, not {x.dtype}")
    y = torch.empty(m, n, dtype=x.dtype)
    b = _f32(bias)
    if x.dtype == torch.float32:
        _lib().bf16w_linear(x.data_ptr(), m, k, panels.data_ptr(), n, _ptr(b), y.data_ptr())
    else:
        xf = torch.empty(0 if pairs else m * k, dtype=torch.float32)
        _lib().bf16w_linear_bf16(x.data_ptr(), m, k, xf.data_ptr(), panels.data_ptr(), int(pairs), n, _ptr(b),
                                 y.data_ptr())
    return y


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float().contiguous()


def _rows32(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.float32:
        raise ValueError(f"the fused layer's rows are float32 or bfloat16, not {t.dtype}")
    return t


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """[g | u] [T, 2I] float32 -> silu(g) * u [T, I], as the fused layer computes it (its exp a polynomial)."""
    gu = gu.float().contiguous()
    t, n = gu.shape
    out = torch.empty(t, n // 2, dtype=torch.float32)
    _lib().bf16w_silu_mul(gu.data_ptr(), t, n // 2, out.data_ptr())
    return out


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of x [T, D] float32 scaled by w [D], in one pass."""
    x, w = x.contiguous(), _f32(w)
    out = torch.empty_like(x)
    _lib().bf16w_rms(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), eps, out.data_ptr())
    return out


def add_rms(x: torch.Tensor, o: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) = (x + o, RMSNorm(x + o) * w) for x, o [T, D] float32, in one pass."""
    x, o, w = x.contiguous(), o.contiguous(), _f32(w)
    if o.shape != x.shape:
        raise ValueError(f"add_rms: x {tuple(x.shape)} and o {tuple(o.shape)} differ")
    y, h = torch.empty_like(x), torch.empty_like(x)
    _lib().bf16w_add_rms(x.data_ptr(), o.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), eps, y.data_ptr(),
                         h.data_ptr())
    return y, h


def rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nheads: int, hd: int) -> torch.Tensor:
    """RoPE in place on the first `nheads` heads (hd values each) of every row of qkv [T, N] (contiguous
    float32), row t by cos/sin [T, hd]; returns qkv."""
    t, n = qkv.shape
    if not qkv.is_contiguous() or cos.numel() != t * hd or nheads * hd > n:
        raise ValueError(f"rope_: qkv {tuple(qkv.shape)} (contiguous), cos of {cos.numel()} values for {t} x {hd}, "
                         f"{nheads} heads of {hd}")
    cos, sin = cos.contiguous(), sin.contiguous()
    _lib().bf16w_rope(qkv.data_ptr(), t, n, cos.data_ptr(), sin.data_ptr(), nheads, hd)
    return qkv


def pre_attn(x: torch.Tensor, ln: torch.Tensor, eps: float, wqkv: tuple[torch.Tensor, int], bias: torch.Tensor | None,
             cos: torch.Tensor, sin: torch.Tensor, nq: int, nk: int, hd: int) -> torch.Tensor:
    """Mechanism bf16w-fused-layer, before attention: x [T, D] -> rope(rms(x) * ln @ Wqkv^T + bias) [T, N] in one
    call; q's nq and k's nk heads (hd values each, first in a row) rotated by cos/sin [T, hd] (float32). float32 x
    gives float32; bfloat16 x (a bfloat16 deployment) gives bfloat16, each step rounded where the op-by-op
    bfloat16 layer rounds it."""
    x = x.contiguous()
    t, d = x.shape
    panels, n = wqkv
    if t > MAX_ROWS or cos.numel() != t * hd or (nq + nk) * hd > n:
        raise ValueError(f"bf16w pre_attn: {t} rows (at most {MAX_ROWS}), cos of {cos.numel()} values for {t} x "
                         f"{hd}, {nq} + {nk} heads of {hd} in {n} outputs")
    h = torch.empty(t, d, dtype=torch.float32)
    out = torch.empty(t, n, dtype=x.dtype)
    cos, sin, ln, bias = _f32(cos), _f32(sin), _f32(ln), _f32(bias)
    pairs = panels.dtype == torch.int32
    if x.dtype == torch.bfloat16:
        q32, hb = torch.empty(t, n, dtype=torch.float32), torch.empty(t, d, dtype=torch.int16)
        _lib().bf16w_pre_attn_bf16(x.data_ptr(), t, d, ln.data_ptr(), eps, panels.data_ptr(), int(pairs), n,
                                   _ptr(bias), cos.data_ptr(), sin.data_ptr(), nq, nk, hd, h.data_ptr(),
                                   hb.data_ptr(), q32.data_ptr(), out.data_ptr())
        return out
    if pairs:
        raise ValueError("bf16w pre_attn: weights packed in pairs multiply bfloat16 rows, not float32")
    _lib().bf16w_pre_attn(_rows32(x).data_ptr(), t, d, ln.data_ptr(), eps, panels.data_ptr(), n, _ptr(bias),
                          cos.data_ptr(), sin.data_ptr(), nq, nk, hd, h.data_ptr(), out.data_ptr())
    return out


def post_attn(x: torch.Tensor, att: torch.Tensor, wo: tuple[torch.Tensor, int], bo: torch.Tensor | None,
              ln: torch.Tensor, eps: float, wgu: tuple[torch.Tensor, int], bgu: torch.Tensor | None,
              wdown: tuple[torch.Tensor, int], bdown: torch.Tensor | None) -> torch.Tensor:
    """Mechanism bf16w-fused-layer, after attention: y = x + att Wo^T + bo, then y + down(silu(g) * u) with
    [g | u] = rms(y) * ln @ Wgu^T + bgu, in one call (x [T, D], att [T, QS] -> y [T, D], all float32, or all
    bfloat16 with each step rounded where the op-by-op bfloat16 layer rounds it)."""
    x, att = x.contiguous(), att.contiguous()
    t, d = x.shape
    qs = att.shape[1]
    (po, no), (pgu, ngu), (pd, nd) = wo, wgu, wdown
    if t > MAX_ROWS or att.shape[0] != t or no != d or nd != d or ngu % 2 or att.dtype != x.dtype:
        raise ValueError(f"bf16w post_attn: x {tuple(x.shape)} (at most {MAX_ROWS} rows), att {tuple(att.shape)} "
                         f"(x's dtype {x.dtype}, not {att.dtype}), outputs {no} / {ngu} / {nd}")
    inter = ngu // 2
    y = torch.empty(t, d, dtype=x.dtype)
    h = torch.empty(t, d, dtype=torch.float32)
    gu = torch.empty(t, ngu, dtype=torch.float32)
    a = torch.empty(t, inter, dtype=torch.float32)
    ln, bo, bgu, bdown = _f32(ln), _f32(bo), _f32(bgu), _f32(bdown)
    pairs = {pp.dtype == torch.int32 for pp in (po, pgu, pd)}
    if len(pairs) > 1:
        raise ValueError("bf16w post_attn: weights packed by k and in pairs mixed in one call")
    pairs = pairs.pop()
    if x.dtype == torch.bfloat16:
        att32 = torch.empty(0 if pairs else t * qs, dtype=torch.float32)
        y32, xs = torch.empty(t, d, dtype=torch.float32), torch.empty(t * max(d, inter), dtype=torch.int16)
        _lib().bf16w_post_attn_bf16(x.data_ptr(), att.data_ptr(), t, d, qs, po.data_ptr(), _ptr(bo), ln.data_ptr(),
                                    eps, pgu.data_ptr(), _ptr(bgu), inter, pd.data_ptr(), _ptr(bdown), int(pairs),
                                    y.data_ptr(), att32.data_ptr(), y32.data_ptr(), h.data_ptr(), gu.data_ptr(),
                                    a.data_ptr(), xs.data_ptr())
        return y
    if pairs:
        raise ValueError("bf16w post_attn: weights packed in pairs multiply bfloat16 rows, not float32")
    x, att = _rows32(x), _rows32(att)
    _lib().bf16w_post_attn(x.data_ptr(), att.data_ptr(), t, d, qs, po.data_ptr(), _ptr(bo), ln.data_ptr(), eps,
                           pgu.data_ptr(), _ptr(bgu), inter, pd.data_ptr(), _ptr(bdown), y.data_ptr(), h.data_ptr(),
                           gu.data_ptr(), a.data_ptr())
    return y
