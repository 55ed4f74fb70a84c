"""w12: a lossless 12-bit format for bf16 weights, its torch reference, and `W12Linear`.

A bf16 value is sign (1 bit) | exponent (8) | mantissa (7). Trained weights use a narrow band of
exponents, so w12 keeps sign and mantissa as they are and replaces the exponent by a 4-bit *code*
relative to a base chosen per tensor or per group of `group_size` weights along a row:

    code 0..14 -> exponent base + code          code 15 -> escape (value in the escape table)
    except in *zero mode*, where code 0 -> exponent 0 (zeros and subnormals, mantissa kept)

Zero mode is chosen per group when it covers more weights than exponent `base` would (a pruned
tensor with many exact zeros); exponent 0 never needs an escape then. Everything outside the window
(rare outliers, and in random data most values: NaN with any payload, infinities) goes to the
escape table as (row, column, original bf16 bits). Unpacking writes the same 16 bits back: the round
trip is bit-exact for all 65,536 bf16 patterns.

Layout (chosen so a GPU reads every plane with contiguous, vectorisable loads along K; no 3-byte
pairs that straddle words):

    sm       uint8 [N, K]            sign << 7 | mantissa, one byte per weight
    codes    uint8 [ceil(N/2), K]    code of row 2r in the low nibble, of row 2r+1 in the high nibble
    base, lo uint8 [Gn, Gk]          per group: exponent of code c (c >= 1) is base + c; of code 0 is lo
                                     (lo == base, or 0 in zero mode); [1, 1] per tensor, else
                                     [N, ceil(K / group_size)]
    esc_ptr  int32 [N + 1]           escapes of row n are esc_col/esc_bits[esc_ptr[n]:esc_ptr[n+1]]
    esc_col  int32 [E], esc_bits int16 [E]   column and original bf16 bits (flat index = n * K + col)

That is 12 bits per weight plus 16 bits per group, 32 per row and 48 per escape.

`w12_linear_reference` (unpack, then torch's own `F.linear`) computes exactly what bf16 computes;
the Triton kernel (`kernels/w12_triton.py`) unpacks in registers and multiplies in one pass for 1 to
64 rows of activations, accumulating in fp32 in its own order.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kernels.w12_format import ESCAPE, MAX_KERNEL_ROWS, WINDOW, W12Weight  # noqa: F401 (re-exported)

# ---------------------------------------------------------------------------------------------------
# Choosing the exponent window


def _bf16_fields(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bits, exponent) as int32 tensors of w's shape; bits in 0..65535."""
    if w.dtype != torch.bfloat16:
        raise TypeError(f"w12 packs bf16 tensors; got {w.dtype} (cast with .to(torch.bfloat16) first)")
    bits = w.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return bits, (bits >> 7) & 0xFF


def _group_layout(shape: tuple[int, int], group_size: int | None) -> tuple[int, int]:
    n, k = shape
    if group_size is None:
        return 1, 1
    if group_size < 1:
        raise ValueError(f"group_size {group_size} must be a positive number of weights (or None: per tensor)")
    return n, -(-k // group_size)


def exponent_histogram(w: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """Counts of each bf16 exponent per group: int64 [Gn * Gk, 256] (one row per tensor if group_size is None)."""
    _, exp = _bf16_fields(w)
    if w.dim() != 2:
        raise ValueError(f"w12 packs matrices [N, K]; got shape {tuple(w.shape)}")
    n, k = w.shape
    if group_size is None:
        return torch.bincount(exp.flatten(), minlength=256).view(1, 256)
    gk = -(-k // group_size)
    col_group = torch.arange(k, dtype=torch.int32, device=w.device) // group_size  # [K]
    out = torch.empty(n * gk, 256, dtype=torch.int64, device=w.device)
    rows = max(1, (1 << 24) // max(k, 1))  # bound the int64 index tensor to ~128 MB
    for r0 in range(0, n, rows):
        e = exp[r0 : r0 + rows]  # [r, K]
        row = torch.arange(e.shape[0], dtype=torch.int32, device=w.device)  # [r]
        gid = (row[:, None] * gk + col_group[None, :]) * 256 + e  # [r, K]: flat (group, exponent) bin
        out[r0 * gk : (r0 + e.shape[0]) * gk] = torch.bincount(gid.flatten(), minlength=e.shape[0] * gk * 256).view(
            -1, 256)
    return out


def choose_window(hist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group, the window covering the most weights: (base, lo, covered), each int64 [G].

    Plain mode covers exponents base..base+14; zero mode covers exponent 0 and base+1..base+14 and
    is taken only when it covers strictly more (so groups without zeros never pay for it).
    """
    cs = torch.nn.functional.pad(hist.cumsum(dim=1), (1, 0))  # [G, 257]: cs[:, e] = count of exponents < e
    plain = cs[:, WINDOW:] - cs[:, : 257 - WINDOW]  # [G, 242]: plain[:, b] covers b..b+14
    zero = hist[:, :1] + cs[:, WINDOW:] - cs[:, 1 : 258 - WINDOW]  # [G, 242]: 0 and b+1..b+14
    zero[:, 0] = -1  # base 0 in zero mode is plain mode
    p_cov, p_base = plain.max(dim=1)
    z_cov, z_base = zero.max(dim=1)
    use_zero = z_cov > p_cov
    base = torch.where(use_zero, z_base, p_base)
    lo = torch.where(use_zero, torch.zeros_like(base), base)
    return base, lo, torch.maximum(p_cov, z_cov)


def packed_nbytes(shape: tuple[int, int], group_size: int | None, escapes: int) -> int:
    """Bytes of a W12Weight of this shape, grouping and escape count (what `W12Weight.nbytes` returns)."""
    n, k = shape
    gn, gk = _group_layout(shape, group_size)
    return n * k + -(-n // 2) * k + 2 * gn * gk + 4 * (n + 1) + 6 * escapes


def window_stats(w: torch.Tensor, group_size: int | None = None) -> dict:
    """What packing `w` would give, without packing: escapes, escape rate, bytes and bits per weight."""
    base, _, covered = choose_window(exponent_histogram(w, group_size))
    shape = (int(w.shape[0]), int(w.shape[1]))
    escapes = w.numel() - int(covered.sum())
    nbytes = packed_nbytes(shape, group_size, escapes)
    return {"shape": list(shape), "numel": w.numel(), "escapes": escapes, "escape_rate": escapes / w.numel(),
            "bytes_bf16": 2 * w.numel(), "bytes_w12": nbytes, "bytes_saved": 2 * w.numel() - nbytes,
            "bits_per_weight": 8 * nbytes / w.numel(),
            "base": int(base[0]) if group_size is None else None}


# ---------------------------------------------------------------------------------------------------
# Pack / unpack


def _group_param(param: torch.Tensor, shape: tuple[int, int], group_size: int | None) -> torch.Tensor:
    """A per-group uint8 parameter [Gn, Gk] as something that broadcasts against [N, K]."""
    if group_size is None:
        return param.view(1, 1)
    col_group = torch.arange(shape[1], device=param.device) // group_size  # [K]
    return param.index_select(1, col_group)  # [N, K]


def pack(w: torch.Tensor, group_size: int | None = None) -> W12Weight:
    """bf16 [N, K] -> W12Weight on w's device; bit-exact for every value (see the module docstring)."""
    if w.dim() != 2:
        raise ValueError(f"w12 packs matrices [N, K]; got shape {tuple(w.shape)}")
    w = w.detach()
    n, k = shape = (int(w.shape[0]), int(w.shape[1]))
    bits, exp = _bf16_fields(w)  # [N, K]
    base_g, lo_g, _ = choose_window(exponent_histogram(w, group_size))
    gn, gk = _group_layout(shape, group_size)
    base_g, lo_g = base_g.view(gn, gk).to(torch.uint8), lo_g.view(gn, gk).to(torch.uint8)
    base = _group_param(base_g, shape, group_size).to(torch.int32)  # [N, K] or [1, 1]
    lo = _group_param(lo_g, shape, group_size).to(torch.int32)

    code = exp - base
    zero_mode = lo != base
    zero_here = zero_mode & (exp == 0)
    valid = ((code >= 1) & (code < WINDOW)) | ((code == 0) & ~zero_mode) | zero_here
    code = torch.where(zero_here, 0, code)
    code = torch.where(valid, code, ESCAPE).to(torch.uint8)  # [N, K]

    sm = (((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8)  # [N, K]
    padded = torch.cat([code, code.new_zeros(n % 2, k)]) if n % 2 else code  # [2 * ceil(N/2), K]
    codes = padded[0::2] | (padded[1::2] << 4)  # [ceil(N/2), K]

    escaped = ~valid
    esc_ptr = torch.zeros(n + 1, dtype=torch.int32, device=w.device)
    esc_ptr[1:] = escaped.sum(dim=1).cumsum(0).to(torch.int32)
    esc_col = escaped.nonzero()[:, 1].to(torch.int32)  # row-major order: sorted by row, then column
    esc_bits = w.contiguous().view(torch.int16)[escaped]  # original 16 bits
    return W12Weight(sm.contiguous(), codes.contiguous(), base_g, lo_g, esc_ptr, esc_col, esc_bits.contiguous(),
                     shape, group_size)


def unpack(p: W12Weight) -> torch.Tensor:
    """W12Weight -> the original bf16 [N, K], bit for bit, on p's device.

    Byte arithmetic: the bf16 high byte is sign | exp >> 1, the low byte exp & 1 | mantissa.
    """
    n, k = p.shape
    code = torch.stack([p.codes & 0xF, p.codes >> 4], dim=1).view(-1, k)[:n]  # uint8 [N, K]
    base, lo = _group_param(p.base, p.shape, p.group_size), _group_param(p.lo, p.shape, p.group_size)
    exp = code + base  # uint8 [N, K]: exponents <= 255 never wrap (escape slots are overwritten below)
    if bool((p.lo != p.base).any()):  # some group is in zero mode
        exp = torch.where(code == 0, lo, exp)
    high = (p.sm & 0x80) | (exp >> 1)
    low = ((exp & 1) << 7) | (p.sm & 0x7F)
    # (low, high) byte pairs read as int16 on a little-endian machine (x86, ARM, every CUDA GPU)
    bits = torch.stack([low, high], dim=-1).view(torch.int16).view(n, k)  # [N, K]
    if p.num_escapes:
        rows = torch.repeat_interleave(torch.arange(n, device=bits.device), torch.diff(p.esc_ptr.long()))  # [E]
        bits[rows, p.esc_col.long()] = p.esc_bits
    return bits.view(torch.bfloat16)


# ---------------------------------------------------------------------------------------------------
# Linear: the reference path and the fused kernel side by side


def w12_linear_reference(x: torch.Tensor, p: W12Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N]: unpack, then torch's F.linear: exactly what the bf16 layer computes."""
    return F.linear(x, unpack(p).to(x.dtype), bias)


def w12_linear_triton(x: torch.Tensor, p: W12Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] bf16 -> [..., N]: the fused Triton kernel for up to 64 rows (fp32 accumulation in the
    kernel's order), the reference path beyond (prefill is compute-bound: torch's matmul wins there)."""
    from kernels.w12_triton import w12_matmul

    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if rows.shape[0] > MAX_KERNEL_ROWS or x.dtype != torch.bfloat16:
        return w12_linear_reference(x, p, bias)
    out = w12_matmul(rows, p)  # [M, N]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], p.shape[0])


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


BACKENDS = ("auto", "reference", "triton")


class W12Linear(nn.Module):
    """nn.Linear with its bf16 weight held in w12 (buffers; no `weight` attribute).

    backend: "reference" unpacks and calls F.linear (bit-identical to the bf16 layer), "triton" runs
    the fused kernel (CUDA, or CPU under TRITON_INTERPRET=1), "auto" picks triton for CUDA inputs.
    """

    def __init__(self, packed: W12Weight, bias: torch.Tensor | None = None, backend: str = "auto") -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is unknown; use one of {', '.join(BACKENDS)}")
        self.out_features, self.in_features = packed.shape
        self.group_size = packed.group_size
        self.backend = backend
        for name in W12Weight.TENSORS:
            self.register_buffer(name, getattr(packed, name))
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int | None = None, backend: str = "auto") -> W12Linear:
        """Pack a bf16 nn.Linear's weight, on the linear's device."""
        return cls(pack(linear.weight.detach(), group_size), linear.bias, backend)

    @property
    def packed(self) -> W12Weight:
        return W12Weight(*(getattr(self, name) for name in W12Weight.TENSORS),
                         shape=(self.out_features, self.in_features), group_size=self.group_size)

    def unpacked_weight(self) -> torch.Tensor:
        """The original bf16 weight [N, K] (allocated on each call)."""
        return unpack(self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if self.backend == "triton" or (self.backend == "auto" and x.is_cuda and triton_available()):
            return w12_linear_triton(x, self.packed, self.bias)
        return w12_linear_reference(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        g = "tensor" if self.group_size is None else self.group_size
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={g}, "
                f"escapes={self.esc_col.numel()}, backend={self.backend}")
