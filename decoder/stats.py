"""DecodeStats: what one generation did, the one record of a decode's statistics from the loop that counts
them through serving (`decoder/serve.py`), the harness's profile (`workbench/measure.py`), the cost model's
gaps and the store. No torch here: the workbench reads it without loading the engine."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

PHASES = ("prefill", "draft", "verify", "accept", "other")


@dataclass
class DecodeStats:
    """What one generation did: tokens, target forwards, acceptance, and where its time went."""

    new_tokens: int = 0
    target_forwards: int = 0  # including the prefill forward
    target_tokens: int = 0  # positions the target scored (prompt, verify widths, tree nodes): its work
    drafter_forwards: int = 0  # draft-model forwards (0 when a loop does not count them)
    alternatives_accepted: int = 0  # two-level: steps whose accepted path ended in a level-2 alternative
    draft_steps: int = 0  # verify steps that carried at least one drafted token
    drafted: int = 0
    accepted: int = 0
    accept_hist: Counter = field(default_factory=Counter)  # accepted drafts per verify step -> count
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    wall_s: float = 0.0
    routes: Counter = field(default_factory=Counter)  # domain routing: domain:drafter -> requests
    route_s: float = 0.0  # time the router took

    @property
    def tau(self) -> float:
        """Mean tokens per target forward (AR = 1.0)."""
        return self.new_tokens / max(1, self.target_forwards)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(1, self.drafted)

    def merge(self, other: DecodeStats) -> None:
        self.new_tokens += other.new_tokens
        self.target_forwards += other.target_forwards
        self.target_tokens += other.target_tokens
        self.drafter_forwards += other.drafter_forwards
        self.alternatives_accepted += other.alternatives_accepted
        self.draft_steps += other.draft_steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.accept_hist.update(other.accept_hist)
        for k, v in other.phase_s.items():
            self.phase_s[k] = self.phase_s.get(k, 0.0) + v
        self.wall_s += other.wall_s
        self.routes.update(other.routes)
        self.route_s += other.route_s

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "target_tokens": self.target_tokens,
            "drafter_forwards": self.drafter_forwards,
            "alternatives_accepted": self.alternatives_accepted,
            "tau": round(self.tau, 4),
            "draft_steps": self.draft_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "accept_hist": {str(k): v for k, v in sorted(self.accept_hist.items())},
            "phase_s": {k: round(v, 6) for k, v in self.phase_s.items()},
            "wall_s": round(self.wall_s, 6),
            **({"routes": dict(self.routes), "route_s": round(self.route_s, 6)} if self.routes else {}),
        }

    @classmethod
    def from_dict(cls, d: object) -> DecodeStats:
        """The record back from `as_dict` as a system reported it: a system's report is its own account,
        possibly malformed, so a missing or ill-typed field reads as zero (never an exception)."""
        out = cls()
        if not isinstance(d, dict):
            return out

        def num(key: str, kind: type) -> float:
            v = d.get(key)
            return v if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else kind()

        for key in ("new_tokens", "target_forwards", "target_tokens", "drafter_forwards", "alternatives_accepted",
                    "draft_steps", "drafted", "accepted"):
            setattr(out, key, int(num(key, int)))
        out.wall_s, out.route_s = float(num("wall_s", float)), float(num("route_s", float))
        phases = d.get("phase_s")
        if isinstance(phases, dict):
            out.phase_s.update({k: float(v) for k, v in phases.items() if k in PHASES and
                                isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0})
        for name, attr in (("accept_hist", "accept_hist"), ("routes", "routes")):
            table = d.get(name)
            if isinstance(table, dict):
                key = int if name == "accept_hist" else str
                for k, v in table.items():
                    try:
                        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                            getattr(out, attr)[key(k)] += v
                    except ValueError:
                        continue
        return out
