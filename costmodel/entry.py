"""MethodEntry: one measured method as the cost model reads it, the one typed record from a bench run
(`specpilot bench --json`'s "methods", a file) or the harness's profile of a running system
(`workbench/measure.py: profile_entry`) to the measured gaps (`costmodel/gaps.py`), the store and the TUI.

The JSON field names are a public contract (`specpilot bench --json`, `.specpilot/gaps/<commit>.json`):
`as_dict` writes them unchanged, `from_dict` reads what a bench wrote, and extra fields of a bench entry
(speedups, divergences, ...) are kept in `extra` so nothing a reader had is lost on a round trip.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from decoder.stats import PHASES


class GapError(ValueError):
    """A method entry the cost model cannot split; the message names the field and the fix."""


def _num(d: Mapping, key: str) -> float | None:
    v = d.get(key)
    if v is None or isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


@dataclass(frozen=True)
class MethodEntry:
    """Measured time per token of one method at batch 1, with the counts that split it into gaps."""

    name: str
    tokens_per_s: float
    tau: float  # new tokens per verify forward (AR = 1.0)
    phase_ms_per_token: Mapping[str, float]  # prefill/draft/verify/accept/other, as the system counted them
    draft_len: int = 0  # tokens drafted per verify step (0 = AR)
    target_forwards: int | None = None  # including one prefill forward per prompt
    new_tokens: int | None = None
    acceptance_rate: float | None = None
    seconds: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # other fields of a bench entry, passed through

    @classmethod
    def read(cls, entry: MethodEntry | Mapping) -> MethodEntry:
        """The entry checked: a mapping is parsed by `from_dict`, a MethodEntry must have every phase and tau > 0."""
        return cls.from_dict(entry.as_dict() if isinstance(entry, MethodEntry) else entry)

    @classmethod
    def from_dict(cls, d: Mapping) -> MethodEntry:
        """Read one entry of `specpilot bench --json` (or a saved profile); a field the gaps need that is
        missing or of the wrong type raises GapError naming it."""
        if not isinstance(d, Mapping):
            raise GapError(f"a method entry is a JSON object, not {type(d).__name__}")
        name = str(d.get("name", "method"))
        phases = d.get("phase_ms_per_token")
        if not isinstance(phases, Mapping):
            raise GapError(f"method {name} has no phase_ms_per_token; use one of our methods (ar, sd-draft-model, "
                             f"sd-ngram) from `specpilot bench --json`")
        missing = [p for p in PHASES if _num(phases, p) is None]
        if missing:
            raise GapError(f"method {name}: phase_ms_per_token lacks {', '.join(missing)}; re-run `specpilot bench`")
        tau = _num(d, "tau") or 0.0
        if tau <= 0:
            raise GapError(f"method {name}: tau {d.get('tau')!r} must be positive; re-run `specpilot bench`")
        forwards, new = _num(d, "target_forwards"), _num(d, "new_tokens")
        known = {"name", "tokens_per_s", "tau", "phase_ms_per_token", "draft_len", "target_forwards", "new_tokens",
                 "acceptance_rate", "seconds"}
        return cls(
            name=name,
            tokens_per_s=_num(d, "tokens_per_s") or 0.0,
            tau=tau,
            phase_ms_per_token={p: float(phases[p]) for p in PHASES},
            draft_len=int(_num(d, "draft_len") or 0),
            target_forwards=int(forwards) if forwards is not None else None,
            new_tokens=int(new) if new is not None else None,
            acceptance_rate=_num(d, "acceptance_rate"),
            seconds=_num(d, "seconds"),
            extra={k: v for k, v in d.items() if k not in known},
        )

    def as_dict(self) -> dict:
        return {**self.extra, "name": self.name, "tokens_per_s": self.tokens_per_s, "tau": self.tau,
                "draft_len": self.draft_len, "target_forwards": self.target_forwards, "new_tokens": self.new_tokens,
                "acceptance_rate": self.acceptance_rate,
                "phase_ms_per_token": dict(self.phase_ms_per_token), "seconds": self.seconds}

    @property
    def ms_per_token(self) -> float:
        """Measured wall time per new token; the phases' sum when no rate was measured."""
        return 1000.0 / self.tokens_per_s if self.tokens_per_s > 0 else sum(self.phase_ms_per_token.values())
