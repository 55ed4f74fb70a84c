"""How accurate the step model is: predicted against measured step times, per step kind.

Step kinds, each one forward as the stock path runs it (`STEP_POINTS`):

    ar        the target's one-token forward (q = 1, B = 1)
    verify    the target scoring q = 1, 2, 4, 8, 16 tokens of one request
    batched   the target scoring q = 1 or 4 rows for each of B = 1, 2, 4, 8, 16 requests
    draft     the draft model's one-token forward (q = 1, B = 1)

A `StepSweep` holds measured milliseconds for these points (`specpilot profile hardware` stores one
in the profile, `decoder/lab/hardware.py: measure_steps` times one), with the target, drafter, context,
format and threads it was measured at; `prediction_error` prices the same points with the hardware
profile and reports |predicted - measured| / measured for each, the worst per kind, and which points
the profile was fitted on (`fit_on`), so an in-sample error is never read as a held-out one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from costmodel.hardware import HardwareProfile
from costmodel.model_profile import ModelProfile
from costmodel.step import forward_time

STEP_KINDS = ("ar", "verify", "batched", "draft")
VERIFY_QS = (1, 2, 4, 8, 16)
BATCH_SIZES = (1, 2, 4, 8, 16)
BATCH_QS = (1, 4)
KV_FIT_BATCH_SIZES = (2, 8)  # batched points the profile's KV rate is fitted on; B = 4, 16 stay held out
GOAL_ABS_REL_ERROR = 0.10  # issue #21: a schedule chosen from predicted step costs needs them within 10%


class AccuracyError(ValueError):
    """A step sweep that cannot be scored; the message names the field and the fix."""


@dataclass(frozen=True)
class StepPoint:
    """One measured forward shape: `kind` (STEP_KINDS), q new tokens for each of `batch` requests."""

    kind: str
    q: int
    batch: int = 1

    @property
    def role(self) -> str:
        """Which model runs the forward: the draft model for `draft`, else the target."""
        return "drafter" if self.kind == "draft" else "target"


STEP_POINTS: tuple[StepPoint, ...] = (
    StepPoint("ar", 1),
    *(StepPoint("verify", q) for q in VERIFY_QS),
    *(StepPoint("batched", q, b) for q in BATCH_QS for b in BATCH_SIZES),
    StepPoint("draft", 1),
)


def abs_rel_error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured."""
    if not measured > 0:
        raise AccuracyError(f"measured time {measured!r} ms: must be positive")
    return abs(predicted - measured) / measured


@dataclass(frozen=True)
class StepSweep:
    """Measured ms of step points for one target (and drafter) at one context, format and thread count."""

    target: str
    target_fingerprint: str
    context: int
    fmt: str
    measured_ms: Mapping[StepPoint, float]
    drafter: str | None = None
    drafter_fingerprint: str | None = None
    threads: int | None = None
    forward: str = "hf"  # the Hugging Face forward with a DynamicCache, a batch dimension for B > 1
    extra: Mapping = field(default_factory=dict)  # when and how it was measured (load average, seconds, ...)

    def as_dict(self) -> dict:
        return {**self.extra, "forward": self.forward, "target": self.target,
                "target_fingerprint": self.target_fingerprint, "drafter": self.drafter,
                "drafter_fingerprint": self.drafter_fingerprint, "context": self.context, "format": self.fmt,
                "threads": self.threads,
                "points": [{"kind": p.kind, "q": p.q, "batch": p.batch, "measured_ms": round(ms, 4)}
                           for p, ms in self.measured_ms.items()]}

    @classmethod
    def from_dict(cls, d: Mapping) -> StepSweep:
        """Read `as_dict`'s output (a profile's `measured["steps"]`)."""
        if not isinstance(d, Mapping):
            raise AccuracyError(f"a step sweep is a JSON object, not {type(d).__name__}; re-run "
                                f"`specpilot profile hardware --model DIR`")
        missing = [k for k in ("target", "target_fingerprint", "context", "format", "points") if k not in d]
        if missing:
            raise AccuracyError(f"step sweep lacks {', '.join(missing)}; re-run `specpilot profile hardware "
                                f"--model DIR`")
        points: dict[StepPoint, float] = {}
        for p in d["points"]:
            try:
                point, ms = StepPoint(str(p["kind"]), int(p["q"]), int(p.get("batch", 1))), float(p["measured_ms"])
            except (KeyError, TypeError, ValueError) as e:
                raise AccuracyError(f"step sweep point {p!r}: needs kind, q, batch and measured_ms") from e
            if point.kind not in STEP_KINDS:
                raise AccuracyError(f"step sweep point kind {point.kind!r}: unknown; one of {', '.join(STEP_KINDS)}")
            points[point] = ms
        known = {"forward", "target", "target_fingerprint", "drafter", "drafter_fingerprint", "context", "format",
                 "threads", "points"}
        return cls(target=str(d["target"]), target_fingerprint=str(d["target_fingerprint"]),
                   context=int(d["context"]), fmt=str(d["format"]), measured_ms=points,
                   drafter=d.get("drafter"), drafter_fingerprint=d.get("drafter_fingerprint"),
                   threads=d.get("threads"), forward=str(d.get("forward", "hf")),
                   extra={k: v for k, v in d.items() if k not in known})


def sweep_mismatch(sweep: StepSweep, target: ModelProfile, fmt: str) -> str | None:
    """Why `sweep` was not measured on this deployment's target and format (None when it was)."""
    if sweep.target_fingerprint != target.fingerprint:
        return f"the step sweep was measured on {sweep.target}, not this target ({target.name})"
    if sweep.fmt != fmt:
        return f"the step sweep was measured in {sweep.fmt}, the deployment runs {fmt}"
    return None


def fitted_samples(hw: HardwareProfile) -> tuple[dict | None, set[tuple[int, int, int]]]:
    """What the profile's overheads and rates were fitted on: (a description for the JSON, or None for a
    datasheet profile, and the fitted (q, batch, context) shapes of its model)."""
    sweep = hw.measured.get("validation")
    if not sweep:
        return None, set()
    batch, context = int(sweep.get("batch", 1)), int(sweep["context"])
    shapes = {(int(q), batch, context) for q in sweep["q"]}
    groups = [{"kind": "verify", "q": list(sweep["q"]), "batch": [batch]}]
    fitted = "fixed and per-layer overhead, achieved bandwidth and matmul rate of the hardware profile"
    kv = sweep.get("kv_fit")
    if kv:
        pairs = [(int(s["q"]), int(s["batch"])) for s in kv["samples"]]
        shapes |= {(q, b, context) for q, b in pairs}
        groups.append({"kind": "batched", "q": sorted({q for q, _ in pairs}), "batch": sorted({b for _, b in pairs})})
        fitted += ", and its KV rate (kv_bandwidth_GBps), jointly"
    return {"groups": groups, "context": context, "model": sweep.get("model"), "fingerprint": sweep.get("fingerprint"),
            "fitted": fitted, "measured_at": hw.measured.get("measured_at")}, shapes


def prediction_error(hw: HardwareProfile, target: ModelProfile, drafter: ModelProfile | None,
                     sweep: StepSweep) -> dict:
    """Predicted (the step model on `hw`) against measured ms for every point of `sweep`, per kind.

    Points are priced at the sweep's own context and format, on the models it was measured on (the caller
    checks `sweep_mismatch`). A point is `held_out` unless the profile was fitted on the same model at the
    same q, batch and context. Draft points need `drafter` (its profile) and a sweep measured on it.
    """
    fit_on, fitted = fitted_samples(hw)
    fit_fingerprint = (fit_on or {}).get("fingerprint")
    kinds: dict[str, dict] = {}
    notes: list[str] = []
    for point, measured in sorted(sweep.measured_ms.items(),
                                  key=lambda pm: (STEP_KINDS.index(pm[0].kind), pm[0].q, pm[0].batch)):
        model = target if point.role == "target" else drafter
        if model is None or (point.role == "drafter" and sweep.drafter_fingerprint != model.fingerprint):
            notes.append(f"{point.kind} q={point.q} B={point.batch}: not scored (the sweep's drafter "
                         f"{sweep.drafter} is not this deployment's)")
            continue
        predicted = forward_time(hw, model, point.q, point.batch, sweep.context, sweep.fmt).total_ms
        held_out = not (model.fingerprint == fit_fingerprint and (point.q, point.batch, sweep.context) in fitted)
        kinds.setdefault(point.kind, {"points": []})["points"].append({
            "q": point.q, "batch": point.batch, "predicted_ms": round(predicted, 4), "measured_ms": round(measured, 4),
            "abs_rel_error": round(abs_rel_error(predicted, measured), 4), "held_out": held_out,
        })
    for entry in kinds.values():
        errors = [p["abs_rel_error"] for p in entry["points"]]
        entry["max_abs_rel_error"] = max(errors)
        held = [p["abs_rel_error"] for p in entry["points"] if p["held_out"]]
        entry["max_abs_rel_error_held_out"] = max(held) if held else None
    every = [p for entry in kinds.values() for p in entry["points"]]
    held = [p["abs_rel_error"] for p in every if p["held_out"]]
    missing = [k for k in STEP_KINDS if k not in kinds]
    if missing:
        notes.append(f"no measured points for {', '.join(missing)}")
    return {
        **{k: kinds.get(k) for k in STEP_KINDS},
        "max_abs_rel_error": max((p["abs_rel_error"] for p in every), default=None),
        "max_abs_rel_error_held_out": max(held) if held else None,
        "goal_abs_rel_error": GOAL_ABS_REL_ERROR,
        "fit_on": fit_on,
        "measurement": {k: v for k, v in sweep.as_dict().items() if k != "points"},
        "rule": "abs_rel_error = |predicted_ms - measured_ms| / measured_ms; a point is held_out unless the hardware "
                "profile was fitted on the same model at the same q, batch and context (fit_on)",
        "notes": notes,
    }


def format_prediction_error(pe: Mapping, kinds: Sequence[str] = STEP_KINDS) -> list[str]:
    """The plain-text table of `prediction_error`'s output: one row per point, the worst per kind."""
    m = pe["measurement"]
    threads = f", {m['threads']} thread{'s' if m['threads'] != 1 else ''}" if m.get("threads") else ""
    lines = [f"prediction error: step model against measured forwards ({m['forward']} forward, context "
             f"{m['context']}, {m['format']}{threads}; {m.get('source', 'measured')})"]
    fit = pe.get("fit_on")
    if fit:
        groups = "; ".join(f"{g['kind']} q={','.join(map(str, g['q']))} B={','.join(map(str, g['batch']))}"
                           for g in fit["groups"])
        lines.append(f"  fitted on: {groups}, context {fit['context']} (* = a fitted shape, in-sample)")
    else:
        lines.append("  fitted on: nothing (a datasheet profile)")
    lines.append(f"  {'kind':<8} {'q':>3} {'B':>3} {'predicted ms':>13} {'measured ms':>12} {'error':>7}")
    worst = []
    for kind in kinds:
        entry = pe.get(kind)
        if not entry:
            continue
        for p in entry["points"]:
            mark = "" if p["held_out"] else " *"
            lines.append(f"  {kind:<8} {p['q']:>3} {p['batch']:>3} {p['predicted_ms']:>13.3f} "
                         f"{p['measured_ms']:>12.3f} {p['abs_rel_error']:>7.1%}{mark}")
        worst.append(f"{kind} {entry['max_abs_rel_error']:.1%}")
    held = pe.get("max_abs_rel_error_held_out")
    lines.append(f"  max error: {', '.join(worst)}; held-out max {'-' if held is None else f'{held:.1%}'} "
                 f"(goal {pe['goal_abs_rel_error']:.0%})")
    lines += [f"  note: {n}" for n in pe.get("notes", [])]
    return lines
