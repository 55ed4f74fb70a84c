"""Phase profiler: wall time of draft, verify, accept (bookkeeping) and other, per generation."""

from __future__ import annotations

import time

import torch

from decoder.stats import PHASES, DecodeStats  # noqa: F401 (re-exported: the timer's record)


class PhaseTimer:
    """Attributes wall time to phases. On CUDA it synchronises at phase boundaries only when `sync`
    is set (a profiling run); timing runs leave the device queue alone."""

    def __init__(self, stats: DecodeStats, device: torch.device, sync: bool = False) -> None:
        self.stats = stats
        self.sync = sync and device.type == "cuda"
        self._t = time.perf_counter()

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark to `phase`."""
        if self.sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.stats.phase_s[phase] += now - self._t
        self._t = now
