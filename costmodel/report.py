"""The cost model's outputs: one JSON object, a text table, and a PNG chart of gaps against the ceiling.

JSON contract (keys may be added, never renamed):
    ceiling_speedup      oracle-drafter ceiling for the deployment's batch (B = 1 with a bench run):
                         ideal SD on the pure roofline against stock AR; what `plausible` checks
    ceiling_speedup_with_overheads
                         the same with the machine's per-forward overheads charged to SD too: the
                         ceiling for changes that leave the host path alone (not a hard bound)
    measured_speedup     the bench's speedup_vs_ar, when a bench run was given (else absent)
    gaps                 [{"name", "family", "ms_per_token", "could_save"}], largest first
    validation           {"q", "predicted_ms", "measured_ms", "median_abs_rel_error"}, when the
                         hardware profile holds a verify sweep measured on this target
    prediction_error     predicted against measured step times per kind (ar, verify, batched, draft:
                         points with abs_rel_error and held_out, max_abs_rel_error), what the profile
                         was fitted on (fit_on) and how the steps were measured (costmodel/accuracy.py);
                         null when no step sweep of this deployment was measured (a note says why)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from costmodel.accuracy import StepSweep, format_prediction_error, prediction_error, sweep_mismatch
from costmodel.ceiling import plausible
from costmodel.deployment import CostDeployment
from costmodel.entry import MethodEntry, read_entry
from costmodel.fit import median_abs_rel_error, predict_ms
from costmodel.gaps import FAMILIES, GapBreakdown, check_accounting, measured_gaps, modelled_gaps
from costmodel.step import ar_step, forward_time, sd_step

FAMILY_COLOURS = {
    "weights": "#4c72b0", "kv": "#55a868", "compute": "#c44e52", "drafting": "#8172b2",
    "acceptance": "#ccb974", "batching": "#64b5cd", "host-overhead": "#8c8c8c",
}


def validation(dep: CostDeployment) -> dict | None:
    """Predicted against measured verify times, when the profile measured this very target."""
    sweep = dep.hardware.measured.get("validation")
    if not sweep or sweep.get("fingerprint") != dep.target.fingerprint:
        return None
    fmt = sweep.get("format", dep.fmt)
    samples = [(q, sweep.get("batch", 1), sweep["context"], m) for q, m in zip(sweep["q"], sweep["measured_ms"],
                                                                                strict=True)]
    predicted = predict_ms(dep.hardware, dep.target, samples, fmt)
    return {
        "q": list(sweep["q"]), "batch": sweep.get("batch", 1), "context": sweep["context"], "format": fmt,
        "predicted_ms": [round(p, 4) for p in predicted], "measured_ms": list(sweep["measured_ms"]),
        "median_abs_rel_error": round(median_abs_rel_error(predicted, sweep["measured_ms"]), 4),
    }


def build_report(dep: CostDeployment, tau: float | None = None, bench_entry: MethodEntry | Mapping | None = None,
                 ar_ms_per_token: float | None = None, num_prompts: int | None = None,
                 steps: StepSweep | None = None) -> dict:
    """The cost model's JSON for a deployment: ceilings, projection or measured gaps, validation.

    With `bench_entry` (one method of `specpilot bench --json`), the gaps split its measured time,
    tau defaults to its measured tau and `ar_ms_per_token` (the bench's AR) anchors the B = 1 ceiling.
    With `steps` (measured on this deployment's target and format), `prediction_error` scores the step
    model against them.
    """
    if steps is not None and (why := sweep_mismatch(steps, dep.target, dep.fmt)):
        raise ValueError(f"prediction error: {why}; measure this deployment's steps")
    k = dep.draft_len
    entry = read_entry(bench_entry) if bench_entry is not None else None
    measured = entry is not None
    if entry is not None and tau is None:
        tau = entry.tau
    if tau is not None and not 1.0 <= tau <= k + 1:
        if measured:
            tau = min(max(tau, 1.0), float(k + 1))  # bench tau counts the prefill forward: clip, do not fail
        else:
            raise ValueError(f"--tau {tau}: must lie in [1, draft_len + 1] = [1, {k + 1}]")
    batches = sorted({1, dep.batch})
    ceilings = []
    for b in batches:
        ar_anchor = ar_ms_per_token if b == 1 else None
        ceilings.append(dep.ceiling(None, b, ar_anchor).as_dict())
        if tau is not None:
            ceilings.append(dep.ceiling(tau, b, ar_anchor).as_dict())
    ceiling_batch = 1 if measured else dep.batch
    oracle = next(c for c in ceilings if c["batch"] == ceiling_batch and c["oracle"])
    notes: list[str] = []

    if measured:
        breakdown: GapBreakdown = measured_gaps(entry, dep.hardware, dep.target, dep.context, dep.fmt,
                                                num_prompts)
    else:
        if tau is None:
            notes.append(f"no --tau given: projecting with an oracle drafter (tau = {k + 1})")
        breakdown = modelled_gaps(dep.hardware, dep.target, dep.drafter, k, tau or float(k + 1), dep.batch,
                                  dep.context, dep.fmt)
    check_accounting(breakdown)
    gap_dict = breakdown.as_dict()
    report: dict = {
        "deployment": {
            "name": dep.name, "hardware": dep.hardware.name, "hardware_source": dep.hardware.source,
            "target": dep.target.name, "target_params": dep.target.total_params,
            "target_active_params": dep.target.active_params,
            "drafter": dep.drafter.kind, "drafter_model": dep.drafter.model.name if dep.drafter.model else None,
            "drafter_params": dep.drafter.model.total_params if dep.drafter.model else None,
            "draft_len": k, "batch": dep.batch, "context": dep.context, "format": dep.fmt,
        },
        "ceiling_speedup": oracle["speedup"],
        "ceiling_speedup_with_overheads": round(dep.ceiling(None, ceiling_batch, ar_ms_per_token
                                                            if ceiling_batch == 1 else None,
                                                            sd_overheads=True).speedup, 4),
        "ceiling_batch": ceiling_batch,
        "ceilings": ceilings,
        "tau": round(tau, 4) if tau is not None else None,
        "ms_per_token": gap_dict["measured_ms_per_token"],
        "ms_per_token_is_measured": measured,
        "gaps": gap_dict["gaps"],
        "families": gap_dict["families"],
        "gap_accounting": {
            "total_ms_per_token": gap_dict["measured_ms_per_token"],
            "components_sum_ms_per_token": gap_dict["components_sum_ms_per_token"],
            "acceptance_gap_ms_per_token": round(breakdown.acceptance_gap.ms_per_token, 6),
            "rule": "gaps with could_save false add up to total_ms_per_token; the acceptance gap (could_save "
                    "true) is the part of that total an oracle drafter would save, so it is not added again",
        },
        "verify_steps": _verify_table(dep),
        "notes": notes + gap_dict["notes"],
    }
    if entry is not None:
        speedup = entry.speedup_vs_ar
        if speedup is not None:
            report["measured_speedup"] = speedup
            ok, reason = plausible(float(speedup), oracle["speedup"])
            report["plausible"] = {"ok": ok, "reason": reason}
        report["method"] = breakdown.method
    elif tau is not None:
        ar = ar_step(dep.hardware, dep.target, dep.batch, dep.context, dep.fmt)
        sd = sd_step(dep.hardware, dep.target, dep.drafter, k, tau, dep.batch, dep.context, dep.fmt)
        report["projected_speedup"] = round(ar.ms_per_token / sd.ms_per_token, 4)
    val = validation(dep)
    if val is not None:
        report["validation"] = val
    drafter = dep.drafter.model if dep.drafter.kind == "model" else None
    report["prediction_error"] = prediction_error(dep.hardware, dep.target, drafter, steps) if steps else None
    return report


def _verify_table(dep: CostDeployment) -> dict:
    """Predicted verify forward times for q = 1 .. k + 1 at the deployment's batch and context."""
    qs = list(range(1, dep.draft_len + 2))
    steps = [forward_time(dep.hardware, dep.target, q, dep.batch, dep.context, dep.fmt) for q in qs]
    return {"q": qs, "batch": dep.batch, "ms": [round(s.total_ms, 6) for s in steps],
            "bound": [s.bound for s in steps]}


def _fmt_params(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def format_table(report: dict) -> str:
    """A human-readable summary of `build_report`'s output."""
    d = report["deployment"]
    drafter = d["drafter"] if not d["drafter_model"] else f"{d['drafter']} {d['drafter_model']} " \
        f"({_fmt_params(d['drafter_params'])})"
    lines = [
        f"costmodel · {d['name']} · {d['hardware']} · target {d['target']} ({_fmt_params(d['target_params'])}, "
        f"{_fmt_params(d['target_active_params'])} active) · drafter {drafter} · k {d['draft_len']} · "
        f"B {d['batch']} · context {d['context']} · {d['format']}",
    ]
    for c in report["ceilings"]:
        label = f"oracle (tau {c['tau']:.2f})" if c["oracle"] else f"tau {c['tau']:.2f}"
        lines.append(f"ceiling  B={c['batch']:<3} {label:<20} {c['speedup']:.2f}x   "
                     f"(AR {c['ar_ms_per_token']:.4f} ms/token, ideal SD {c['ideal_sd_ms_per_token']:.4f})")
    lines.append(f"ceiling  B={report['ceiling_batch']:<3} oracle, SD paying this machine's overheads too: "
                 f"{report['ceiling_speedup_with_overheads']:.2f}x (a guide, not a bound)")
    if "measured_speedup" in report:
        p = report["plausible"]
        lines.append(f"measured {report['measured_speedup']:.2f}x ({report.get('method')}): "
                     f"{'plausible' if p['ok'] else 'IMPLAUSIBLE'}: {p['reason']}")
    if "projected_speedup" in report:
        lines.append(f"projected {report['projected_speedup']:.2f}x at tau {report['tau']:.2f} (with overheads)")
    kind = "measured" if report["ms_per_token_is_measured"] else "projected"
    acc = report["gap_accounting"]
    lines.append(f"{kind} {acc['total_ms_per_token']:.4f} ms per token = sum of the parts below "
                 f"({acc['components_sum_ms_per_token']:.4f}); acceptance gap could save "
                 f"{acc['acceptance_gap_ms_per_token']:.4f} more")
    total = acc["total_ms_per_token"] or 1.0
    rows = [(g["name"] + (" (could save)" if g["could_save"] else ""), g["family"], f"{g['ms_per_token']:.4f}",
             f"{g['ms_per_token'] / total:.0%}") for g in report["gaps"]]
    cols = ("gap", "family", "ms/token", "share")
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    if "validation" in report:
        v = report["validation"]
        pairs = ", ".join(f"q{q}: {p:.2f}/{m:.2f}" for q, p, m in zip(v["q"], v["predicted_ms"], v["measured_ms"],
                                                                         strict=True))
        lines.append(f"validation (predicted/measured ms, context {v['context']}): {pairs}; median abs rel error "
                     f"{v['median_abs_rel_error']:.1%}")
    if report.get("prediction_error"):
        lines += format_prediction_error(report["prediction_error"])
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def plot_gaps(report: dict, path: Path | str) -> Path:
    """PNG: the time per token stacked by gap (coloured by family) beside the AR time and the ceiling's."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("--plot needs matplotlib; install it (`pip install matplotlib`) or drop --plot") from e
    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--plot {path}: the chart is a PNG; give a path ending in .png")
    batch = report["ceiling_batch"]
    oracle = next(c for c in report["ceilings"] if c["batch"] == batch and c["oracle"])
    measured = report["ms_per_token_is_measured"]
    # The bench's time and the ceiling's are per request; a batched projection is per generated token.
    scale = 1.0 if measured else 1.0 / batch
    fig, ax = plt.subplots(figsize=(10, 3.6))
    left = 0.0
    seen: set[str] = set()
    for g in sorted((g for g in report["gaps"] if not g["could_save"]), key=lambda g: -g["ms_per_token"]):
        if g["ms_per_token"] <= 0:
            continue
        fam = g["family"]
        ax.barh(2, g["ms_per_token"], left=left, color=FAMILY_COLOURS.get(fam, "#333333"),
                label=fam if fam not in seen else None, edgecolor="white")
        seen.add(fam)
        left += g["ms_per_token"]
    acc = report["gap_accounting"]["acceptance_gap_ms_per_token"]
    if acc > 0:
        # Hatched over the end of the bar: the part an oracle drafter would save.
        ax.barh(2, min(acc, left), left=left - min(acc, left), fill=False, hatch="//",
                edgecolor=FAMILY_COLOURS["acceptance"], label="acceptance (could save)")
    ax.barh(1, oracle["ideal_sd_ms_per_token"] * scale, fill=False, edgecolor="black", linewidth=1.5)
    ax.barh(0, oracle["ar_ms_per_token"] * scale, color="#bbbbbb")
    ax.set_yticks([0, 1, 2], ["AR", f"ceiling\n(oracle, {oracle['speedup']:.2f}x)",
                              "measured" if measured else "projected"])
    ax.set_xlabel("ms per generated token")
    d = report["deployment"]
    where = d["name"] if d["target"] in d["name"] else f"{d['name']}: {d['target']} on {d['hardware']}"
    title = f"{where}, k={d['draft_len']}, B={batch}"
    if "measured_speedup" in report:
        title += f" — measured {report['measured_speedup']:.2f}x vs ceiling {oracle['speedup']:.2f}x"
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="family", title_fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["FAMILIES", "build_report", "format_table", "plot_gaps", "validation"]
