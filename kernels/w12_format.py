"""The w12 storage format (kernels/w12.py's module docstring describes the planes): the packed weight
and its constants, shared by the reference path (kernels/w12.py) and the Triton kernel
(kernels/w12_triton.py) without either importing the other."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

ESCAPE = 15  # the code reserved for escapes
WINDOW = 15  # exponents a group covers without escapes (codes 0..14)
MAX_KERNEL_ROWS = 64  # activation rows the fused kernel takes; more (prefill) unpack and use torch's matmul


@dataclass
class W12Weight:
    """One bf16 matrix [N, K] in w12 (see the module docstring for the planes)."""

    sm: torch.Tensor  # uint8 [N, K]
    codes: torch.Tensor  # uint8 [ceil(N/2), K]
    base: torch.Tensor  # uint8 [Gn, Gk]
    lo: torch.Tensor  # uint8 [Gn, Gk]
    esc_ptr: torch.Tensor  # int32 [N + 1]
    esc_col: torch.Tensor  # int32 [E]
    esc_bits: torch.Tensor  # int16 [E]
    shape: tuple[int, int]
    group_size: int | None  # None: one base for the whole tensor

    TENSORS = ("sm", "codes", "base", "lo", "esc_ptr", "esc_col", "esc_bits")

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def num_escapes(self) -> int:
        return int(self.esc_col.numel())

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in self.TENSORS)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.numel

    def to(self, device: torch.device | str) -> W12Weight:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        moved.update({name: getattr(self, name).to(device) for name in self.TENSORS})
        return W12Weight(**moved)
