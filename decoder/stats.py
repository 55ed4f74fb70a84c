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


def _number(v: object) -> float | None:
    """A non-negative JSON number as a float, else None (bools, strings, NaN and negatives are not figures)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0:
        return None
    return float(v)


def _whole(v: object) -> int | None:
    n = _number(v)
    return int(n) if n is not None and n == int(n) else None


@dataclass
class MethodEntry:
    """One method of `specpilot bench --json`'s "methods" (and the harness's profile of a running system, which
    has the same shape): what the cost model's gaps, the round summary and the TUI read.

    The JSON field names are a public contract: `as_dict` writes them unchanged and `from_dict` reads them back;
    fields this record does not name (a tree method's `mechanism_config`, sd-routed's `routes`, llama.cpp's
    `engine` fields, ...) ride in `extra` so nothing is lost on a round trip. Every field but `name` may be
    absent from a report: None here. Entries of our own decoder carry its counters (`phase_ms_per_token` set):
    their `acceptance_rate`, `draft_ms_per_step` and `draft_len` are written even when null, as the bench always
    wrote them."""

    name: str = "method"
    tokens_per_s: float = 0.0
    speedup_vs_ar: float | None = None
    ar_baseline: str | None = None  # the AR method speedup_vs_ar divides by
    speedup_vs_hf_greedy: float | None = None
    tau: float | None = None  # new tokens per target forward, prefill included (AR = 1.0)
    identical_to_hf_greedy: bool | None = None
    mismatched_prompts: int | None = None
    unexplained_mismatches: int | None = None
    new_tokens: int | None = None
    seconds: float | None = None
    target_forwards: int | None = None  # including one prefill forward per prompt
    target_forwards_per_token: float | None = None
    divergences: list[dict] | None = None
    ratio_vs_llama_cpp_ar: float | None = None  # with llama.cpp peers only
    # Our decoder's counters (absent from Hugging Face and llama.cpp entries).
    target_tokens_per_token: float | None = None
    drafter_forwards_per_token: float | None = None
    acceptance_rate: float | None = None
    accept_hist: dict[str, int] | None = None  # accepted drafts per verify step ("0", "1", ...) -> steps
    phase_ms_per_token: dict[str, float] | None = None  # prefill/draft/verify/accept/other, as the system counted
    draft_ms_per_step: float | None = None
    draft_len: int | None = None  # tokens drafted per verify step (None or 0: AR)
    extra: dict[str, object] = field(default_factory=dict)  # the report's other fields, passed through

    CORE = ("name", "tokens_per_s", "speedup_vs_ar", "ar_baseline", "speedup_vs_hf_greedy", "tau",
            "identical_to_hf_greedy", "mismatched_prompts", "unexplained_mismatches", "new_tokens", "seconds",
            "target_forwards", "target_forwards_per_token", "divergences")  # every bench entry has these
    COUNTERS = ("target_tokens_per_token", "drafter_forwards_per_token", "acceptance_rate", "accept_hist",
                "phase_ms_per_token", "draft_ms_per_step", "draft_len")

    @property
    def ms_per_token(self) -> float:
        """Measured wall time per new token; the phases' sum when no rate was measured."""
        if self.tokens_per_s > 0:
            return 1000.0 / self.tokens_per_s
        return sum((self.phase_ms_per_token or {}).values())

    def as_dict(self) -> dict:
        counted = self.phase_ms_per_token is not None
        out: dict = {k: getattr(self, k) for k in self.CORE}
        if self.ratio_vs_llama_cpp_ar is not None:
            out["ratio_vs_llama_cpp_ar"] = self.ratio_vs_llama_cpp_ar
        for k in self.COUNTERS:
            v = getattr(self, k)
            # A drafting llama.cpp entry reports its acceptance too (null for its AR).
            always = counted and k in ("acceptance_rate", "draft_ms_per_step", "draft_len") or (
                k == "acceptance_rate" and "engine" in self.extra)
            if v is not None or always:
                out[k] = dict(v) if isinstance(v, dict) else v
        out.update({k: v for k, v in self.extra.items() if k not in out})
        return out

    @classmethod
    def from_dict(cls, d: object) -> MethodEntry:
        """The entry back from `as_dict` or a report file. A report may come from a candidate's system, so a
        missing or ill-typed field reads as its default (never an exception)."""
        if not isinstance(d, dict):
            return cls()
        known = set(cls.CORE) | set(cls.COUNTERS) | {"ratio_vs_llama_cpp_ar"}

        def opt_str(key: str) -> str | None:
            v = d.get(key)
            return v if isinstance(v, str) else None

        def table(key: str, read) -> dict | None:
            v = d.get(key)
            if not isinstance(v, dict):
                return None
            return {str(k): x for k, x in ((k, read(x)) for k, x in v.items()) if x is not None}

        identical = d.get("identical_to_hf_greedy")
        divergences = d.get("divergences")
        return cls(
            name=str(d["name"]) if isinstance(d.get("name"), (str, int, float)) else "method",
            tokens_per_s=_number(d.get("tokens_per_s")) or 0.0,
            speedup_vs_ar=_number(d.get("speedup_vs_ar")),
            ar_baseline=opt_str("ar_baseline"),
            speedup_vs_hf_greedy=_number(d.get("speedup_vs_hf_greedy")),
            tau=_number(d.get("tau")),
            identical_to_hf_greedy=identical if isinstance(identical, bool) else None,
            mismatched_prompts=_whole(d.get("mismatched_prompts")),
            unexplained_mismatches=_whole(d.get("unexplained_mismatches")),
            new_tokens=_whole(d.get("new_tokens")),
            seconds=_number(d.get("seconds")),
            target_forwards=_whole(d.get("target_forwards")),
            target_forwards_per_token=_number(d.get("target_forwards_per_token")),
            divergences=[x for x in divergences if isinstance(x, dict)] if isinstance(divergences, list) else None,
            ratio_vs_llama_cpp_ar=_number(d.get("ratio_vs_llama_cpp_ar")),
            target_tokens_per_token=_number(d.get("target_tokens_per_token")),
            drafter_forwards_per_token=_number(d.get("drafter_forwards_per_token")),
            acceptance_rate=_number(d.get("acceptance_rate")),
            accept_hist=table("accept_hist", _whole),
            phase_ms_per_token=table("phase_ms_per_token", _number),
            draft_ms_per_step=_number(d.get("draft_ms_per_step")),
            draft_len=_whole(d.get("draft_len")),
            extra={str(k): v for k, v in d.items() if k not in known},
        )
