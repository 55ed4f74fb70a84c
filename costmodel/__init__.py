"""Roofline cost model: hardware and model profiles, step times, ceilings, ranked gaps (see DESIGN.md).

Plain arithmetic over profiles and measured timings; only `hardware.measure_cpu_local` runs torch.
The harness calls `plausible(measured_speedup, ceiling_or_deployment) -> (ok, reason)`.
"""

from costmodel.ceiling import ceiling, plausible

__all__ = ["ceiling", "plausible"]
