"""The fused w12 kernel: unpack 12-bit weights in registers and multiply, for decode shapes (1-64 rows).

out[M, N] = x[M, K] @ W[N, K]^T with W in w12 (`kernels/w12.py`). Each program owns BLOCK_N output
features and BLOCK_M activation rows and walks K in BLOCK_K steps: it loads the sign/mantissa plane
(one byte per weight) and the code plane (rows 2r and 2r+1 share a byte, so two rows of a tile read
the same bytes: one DRAM read, one L1 hit), rebuilds the bf16 bits, zeroes escape slots, and
accumulates in fp32. After the K loop it adds the program's escapes from the row-sorted escape table
(rare: ~1e-4 of weights on trained checkpoints) and stores bf16.

One row of x is a GEMV: elementwise FMA into a [BLOCK_N, BLOCK_K] fp32 accumulator, reduced once
after the loop. 2 to 64 rows use tl.dot on bf16 tiles, BLOCK_M padded to at least 16 (masked rows
load zeros and cost no traffic; at these shapes the tensor cores idle anyway).

The result is the same sum of exact bf16 products as the reference path (torch's F.linear on the
unpacked weight), accumulated in fp32 in a different order, then rounded to bf16; it can differ from
the reference by rounding (about one bf16 ulp of the output), never by more than fp32 accumulation
error allows.

On a CPU machine the kernel runs only under TRITON_INTERPRET=1, set before this module is imported
(triton decides at decoration time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.w12_format import MAX_KERNEL_ROWS, W12Weight


@triton.jit
def _w12_matmul_kernel(
    x_ptr, sm_ptr, codes_ptr, base_ptr, lo_ptr, esc_ptr_ptr, esc_col_ptr, esc_bits_ptr, out_ptr,
    M, N,
    stride_xm, stride_xk, stride_om, stride_on, stride_gn, stride_gk,
    K: tl.constexpr, GROUP: tl.constexpr, PER_TENSOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    mask_m = offs_m < M
    mask_n = offs_n < N
    shift = (offs_n % 2) * 4  # [BN]: low nibble for even rows, high for odd
    sm_row = sm_ptr + offs_n.to(tl.int64)[:, None] * K  # [BN, 1]
    code_row = codes_ptr + (offs_n // 2).to(tl.int64)[:, None] * K  # [BN, 1]
    x_row = x_ptr + offs_m[:, None] * stride_xm  # [BM, 1]
    if PER_TENSOR:
        base_t = tl.load(base_ptr).to(tl.int32)
        lo_t = tl.load(lo_ptr).to(tl.int32)

    if BLOCK_M == 1:  # GEMV: elementwise FMA into [BN, BK], one reduction after the loop
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k  # [BK]
        mask_k = k < K
        mask_nk = mask_n[:, None] & mask_k[None, :]
        sm = tl.load(sm_row + k[None, :], mask=mask_nk, other=0).to(tl.int32)  # [BN, BK]
        code = (tl.load(code_row + k[None, :], mask=mask_nk, other=0).to(tl.int32) >> shift[:, None]) & 15
        if PER_TENSOR:
            exp = tl.where(code == 0, lo_t, base_t + code)
        else:
            g_off = offs_n[:, None] * stride_gn + (k // GROUP)[None, :] * stride_gk  # [BN, BK]
            base = tl.load(base_ptr + g_off, mask=mask_nk, other=0).to(tl.int32)
            lo = tl.load(lo_ptr + g_off, mask=mask_nk, other=0).to(tl.int32)
            exp = tl.where(code == 0, lo, base + code)
        bits = ((sm & 0x80) << 8) | (exp << 7) | (sm & 0x7F)
        bits = tl.where(code == 15, 0, bits)  # escapes are added after the loop
        w = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)  # [BN, BK]
        if BLOCK_M == 1:
            x1 = tl.load(x_ptr + pid_m * stride_xm + k * stride_xk, mask=mask_k, other=0.0)  # [BK]
            acc2 += w.to(tl.float32) * x1.to(tl.float32)[None, :]  # [BN, BK]
        else:
            x = tl.load(x_row + k[None, :] * stride_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
            if DOT_F32:  # exact: bf16 values are fp32 values, and products of two fit fp32's mantissa
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)  # [BM, BN]
    if BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)[None, :]  # [1, BN]

    # Escapes: the table is sorted by row, so this program's are esc_ptr[n0 + r] .. esc_ptr[n0 + r + 1].
    n0 = pid_n * BLOCK_N
    for r in range(BLOCK_N):
        n = n0 + r
        i = tl.load(esc_ptr_ptr + tl.minimum(n, N))
        end = tl.load(esc_ptr_ptr + tl.minimum(n + 1, N))
        while i < end:  # a while loop, not range(i, end): triton 3.6's interpreter cannot range over tensors
            col = tl.load(esc_col_ptr + i)
            wv = tl.load(esc_bits_ptr + i).to(tl.bfloat16, bitcast=True).to(tl.float32)
            xk = tl.load(x_ptr + offs_m * stride_xm + col * stride_xk, mask=mask_m, other=0.0).to(tl.float32)  # [BM]
            acc += tl.where((offs_n == n)[None, :], xk[:, None] * wv, 0.0)
            i += 1

    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(tl.bfloat16), mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.block_m != 1 and (self.block_m < 16 or self.block_n < 16 or self.block_k < 16):
            raise ValueError(f"{self}: the tl.dot path (block_m > 1) needs block_m, block_n, block_k >= 16")


def default_config(m: int, n: int, k: int) -> KernelConfig:
    """Tile sizes for M activation rows against W [N, K]: GEMV for one row, tl.dot (M padded to 16+) beyond.

    Small BLOCK_N keeps enough programs in flight to saturate HBM at decode shapes (N / BLOCK_N
    programs per row block: 512 for N = 4096 at one row). Untuned on a GPU so far:
    scripts/gpu_check_w12.py sweeps alternatives.
    """
    block_k = min(256, max(16, triton.next_power_of_2(k)))
    if m == 1:
        return KernelConfig(1, 8, block_k)
    return KernelConfig(max(16, triton.next_power_of_2(m)), 16, min(block_k, 128))


def w12_matmul(x: torch.Tensor, p: W12Weight, config: KernelConfig | None = None) -> torch.Tensor:
    """x [M, K] bf16 (M <= 64) @ W^T -> [M, N] bf16, W in w12 on x's device."""
    m, k = x.shape
    n = p.shape[0]
    if k != p.shape[1]:
        raise ValueError(f"w12_matmul: x has {k} features, the weight expects {p.shape[1]}")
    if m > MAX_KERNEL_ROWS:
        raise ValueError(f"w12_matmul takes at most {MAX_KERNEL_ROWS} rows (got {m}); use the reference path")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"w12_matmul: x must be bf16, got {x.dtype}")
    cfg = config or default_config(m, n, k)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)  # [M, N]
    per_tensor = p.group_size is None
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    _w12_matmul_kernel[grid](
        x, p.sm, p.codes, p.base, p.lo, p.esc_ptr, p.esc_col, p.esc_bits, out,
        m, n,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        0 if per_tensor else p.base.stride(0), 0 if per_tensor else p.base.stride(1),
        K=k, GROUP=1 if per_tensor else p.group_size, PER_TENSOR=per_tensor,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        # triton 3.6's interpreter multiplies bf16 dot operands as their uint16 storage: on the CPU
        # (interpreted) the kernel gives tl.dot fp32 copies instead.
        DOT_F32=x.device.type == "cpu",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
