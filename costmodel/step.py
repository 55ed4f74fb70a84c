"""Roofline step times: one forward, a draft, and a speculative-decoding step.

A forward of q new tokens for each of B requests at context L, weights in format `fmt`:

    time = max(bytes moved / bandwidth, FLOPs / peak) + fixed overheads
    bytes moved = weights (read once per step, shared by the batch)
                + KV reads and writes (B * (L + q) * kv_bytes_per_token; a sliding-window
                  layer reads at most its window of the L cached tokens)
                + recurrent state (read and written once per step, per request)

With a fitted KV rate (`HardwareProfile.kv_bandwidth_GBps`), the KV and state traffic leaves the max:
time = max(weight bytes / bandwidth, FLOPs / peak) + (KV + state bytes) / kv_bandwidth + overheads.

An SD step = draft + verify (q = k + 1) + bookkeeping, and yields tau tokens per request.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.hardware import HardwareProfile
from costmodel.model_profile import COMPUTE_DTYPE, ModelProfile, bytes_per_weight

DRAFTER_KINDS = ("model", "block", "ngram", "none")
NGRAM_HOST_MS = 0.005  # an incremental n-gram index lookup (measured ~5 us a step, DESIGN.md)


class StepError(ValueError):
    """Bad step-model input; the message names the value and the fix."""


@dataclass(frozen=True)
class StepTime:
    """One forward's bytes, FLOPs and time, with the roofline's parts kept apart."""

    q: int
    batch: int
    context: int
    fmt: str
    weight_bytes: float
    kv_bytes: float
    state_bytes: float
    flops: float
    weights_ms: float
    kv_ms: float
    state_ms: float
    compute_ms: float
    overhead_ms: float
    kv_separate: bool = False  # KV and state priced at the profile's fitted KV rate, outside the max

    @property
    def memory_ms(self) -> float:
        return self.weights_ms + self.kv_ms + self.state_ms

    @property
    def compute_beyond_memory_ms(self) -> float:
        """What compute adds to the memory time in the roofline (the gap the compute family owns)."""
        return max(0.0, self.compute_ms - (self.weights_ms if self.kv_separate else self.memory_ms))

    @property
    def roofline_ms(self) -> float:
        return self.memory_ms + self.compute_beyond_memory_ms

    @property
    def total_ms(self) -> float:
        return self.roofline_ms + self.overhead_ms

    @property
    def bound(self) -> str:
        return "compute" if self.compute_beyond_memory_ms > 0 else "memory"


def _check_shape(q: int, batch: int, context: int) -> None:
    if q < 1:
        raise StepError(f"q {q}: a forward scores at least one new token")
    if batch < 1:
        raise StepError(f"--batch {batch}: must be at least 1")
    if context < 0:
        raise StepError(f"--context {context}: must be 0 or more tokens")


def forward_time(hw: HardwareProfile, model: ModelProfile, q: int, batch: int = 1, context: int = 0,
                 fmt: str = "bf16", kv_dtype_bytes: float = 2.0, overheads: bool = True) -> StepTime:
    """Time of one forward scoring q new tokens for each of `batch` requests at context `context`."""
    _check_shape(q, batch, context)
    tokens = q * batch
    weight_bytes = model.weight_bytes(fmt, tokens)
    # Read the cache held at context L (a sliding layer holds at most its window), write q new entries.
    kv_bytes = batch * (model.kv_cache_bytes(context, kv_dtype_bytes) + q * model.kv_bytes_per_token(kv_dtype_bytes))
    state_bytes = 2 * batch * model.recurrent_state_bytes()  # read and write back, once per step
    # Each new token attends to the context plus, on average, half of the other new tokens.
    flops = tokens * model.flops_per_token(context + (q + 1) / 2)
    bw = hw.bandwidth_GBps() * 1e9  # bytes per second
    kv_bw = (hw.kv_bandwidth_GBps or hw.bandwidth_GBps()) * 1e9
    peak = hw.peak_tflops(COMPUTE_DTYPE[fmt]) * 1e12  # FLOPs per second
    return StepTime(
        q=q, batch=batch, context=context, fmt=fmt,
        weight_bytes=weight_bytes, kv_bytes=kv_bytes, state_bytes=state_bytes, flops=flops,
        weights_ms=1e3 * weight_bytes / bw, kv_ms=1e3 * kv_bytes / kv_bw, state_ms=1e3 * state_bytes / kv_bw,
        compute_ms=1e3 * flops / peak,
        overhead_ms=hw.overhead_ms(model.num_layers) if overheads else 0.0,
        kv_separate=hw.kv_bandwidth_GBps is not None,
    )


@dataclass(frozen=True)
class Drafter:
    """How drafts are made: `model` (k sequential one-token forwards of a draft model), `block` (one
    forward drafts all k tokens in parallel), `ngram` (a host-side lookup), or `none` (AR)."""

    kind: str = "none"
    model: ModelProfile | None = None
    host_ms: float = 0.0  # host time per draft call (the n-gram lookup)

    def __post_init__(self) -> None:
        if self.kind not in DRAFTER_KINDS:
            raise StepError(f"--drafter-kind {self.kind}: unknown; use one of {', '.join(DRAFTER_KINDS)}")
        if self.kind in ("model", "block") and self.model is None:
            raise StepError(f"a {self.kind} drafter needs its config; pass --drafter-config NAME|PATH")

    @classmethod
    def ngram(cls) -> Drafter:
        return cls("ngram", None, NGRAM_HOST_MS)


def draft_time(hw: HardwareProfile, drafter: Drafter, k: int, batch: int = 1, context: int = 0, fmt: str = "bf16",
               overheads: bool = True) -> float:
    """Milliseconds to draft k tokens for each of `batch` requests."""
    if k < 0:
        raise StepError(f"--draft-len {k}: must be 0 or more")
    if k == 0 or drafter.kind == "none":
        return 0.0
    if drafter.kind == "ngram":
        return drafter.host_ms * batch  # one lookup per request, on the host
    assert drafter.model is not None
    if drafter.kind == "block":
        return forward_time(hw, drafter.model, k, batch, context, fmt, overheads=overheads).total_ms
    # A chain drafter runs k one-token forwards, its context growing by one each time.
    return sum(forward_time(hw, drafter.model, 1, batch, context + i, fmt, overheads=overheads).total_ms
               for i in range(k))


@dataclass(frozen=True)
class SDStep:
    """One speculative step for a batch: draft, verify, bookkeeping, and the tokens it yields."""

    draft_ms: float
    verify: StepTime
    bookkeeping_ms: float
    tau: float  # tokens per request per step (mean accepted + 1)
    batch: int

    @property
    def step_ms(self) -> float:
        return self.draft_ms + self.verify.total_ms + self.bookkeeping_ms

    @property
    def ms_per_token(self) -> float:
        """Machine time per generated token (all requests together)."""
        return self.step_ms / (self.tau * self.batch)

    @property
    def latency_ms_per_token(self) -> float:
        """Time per token as one request sees it."""
        return self.step_ms / self.tau


def check_tau(tau: float, k: int) -> None:
    if not 1.0 <= tau <= k + 1:
        raise StepError(f"--tau {tau}: must lie in [1, draft_len + 1] = [1, {k + 1}] (tau counts accepted drafts "
                        f"plus the bonus token)")


def sd_step(hw: HardwareProfile, target: ModelProfile, drafter: Drafter, k: int, tau: float, batch: int = 1,
            context: int = 0, fmt: str = "bf16", drafter_fmt: str | None = None, bookkeeping_ms: float = 0.0,
            overheads: bool = True) -> SDStep:
    """A speculative step: draft k, verify k + 1 positions in one target forward, accept tau on average."""
    check_tau(tau, k)
    bytes_per_weight(fmt)
    draft = draft_time(hw, drafter, k, batch, context, drafter_fmt or fmt, overheads)
    verify = forward_time(hw, target, k + 1, batch, context, fmt, overheads=overheads)
    return SDStep(draft, verify, bookkeeping_ms, tau, batch)


def ar_step(hw: HardwareProfile, target: ModelProfile, batch: int = 1, context: int = 0, fmt: str = "bf16",
            overheads: bool = True) -> SDStep:
    """Plain autoregressive decoding as a degenerate SD step: no draft, q = 1, tau = 1."""
    return SDStep(0.0, forward_time(hw, target, 1, batch, context, fmt, overheads=overheads), 0.0, 1.0, batch)
