"""What the loop measures about a deployment through the harness and prices with the cost model: the
hardware profile, the plausibility ceiling, the gap breakdown of a commit, and a commit's paired speedup
over the AR reference. Functions of the workspace; the loop (`workbench/loop.py`) and the TUI call them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import numpy as np

from costmodel.deployment import MAX_ORACLE_DRAFT_LEN, CostDeployment
from costmodel.gaps import measured_gaps
from costmodel.hardware import (
    LOCAL,
    MAX_PROFILE_SPREAD,
    PROFILE_DTYPES,
    HardwareError,
    HardwareProfile,
    get_profile,
    load_profile,
    local_profile_path,
    profile_spread,
    save_profile,
)
from costmodel.kernels import KernelBenchError, local_roofline, source_digest, worst_per_group
from costmodel.kernels import profile as kernel_profile_of
from costmodel.model_profile import load_model_profile
from costmodel.step import Drafter
from costmodel.widths import WidthProfile, measured_profile, width_gaps
from decoder.config import ConfigError
from decoder.engines import EngineError
from decoder.engines.llamacpp import bench_widths
from decoder.engines.llamacpp_config import LlamaCppConfig
from decoder.stats import DecodeStats, MethodEntry
from workbench.cascade import paired_load
from workbench.engine_source import changed_engine_files
from workbench.forcing import fixed_server_flags, run_system
from workbench.measure import load_prompts, measurement_lock, profile_entry
from workbench.workspace import Workspace, WorkspaceError

Say = Callable[..., None]  # say(message, kind="loop", payload=None): progress line and ledger event


def width_profile(ws: Workspace, say: Say, threads: int | None = None) -> WidthProfile:
    """A llama.cpp workspace's cost model: the engine's forward cost at each verify width at `threads` (default
    stock's), measured with llama-bench at the prompts' mean context, cached in `.specpilot/widths.json` per
    (model, threads, fixed flags, depth)."""
    if threads is None:
        threads = _threads_of(ws, ws.stock_commit)
    prompts = load_prompts(ws)
    depth = int(sum(len(p.ids) for p in prompts) / max(len(prompts), 1)) + ws.config.forcing_max_new_tokens // 2
    fixed = fixed_server_flags(ws)
    key = {"model": str(ws.config.target), "threads": threads, "fixed": fixed, "depth": depth}
    path = ws.state / "widths.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = {}
    kept = [p for p in saved.get("profiles", [saved] if "key" in saved else []) if isinstance(p, dict)]
    for entry in kept:
        if entry.get("key") == key and "profile" in entry:
            return WidthProfile.from_dict(entry["profile"])
    say(f"measuring llama.cpp's forward cost per verify width for the cost model (llama-bench, {threads} thread(s), "
        f"context {depth})")
    bench = (ws.config.engine_bin / "llama-bench") if ws.config.engine_bin else None
    try:  # under the measurement lock: no other SpecPilot timing (a paired benchmark, a tuner) runs beside it
        with measurement_lock():
            mean, std = bench_widths(ws.config.target, threads=threads, depth=depth, extra=fixed, bench=bench)
    except EngineError as e:
        raise WorkspaceError(f"the llama.cpp cost model: {e}") from None
    bandwidth, how = _memory_bandwidth()
    roofline = ws.config.target.stat().st_size / (bandwidth * 1e9) * 1e3
    prof = measured_profile(f"llama.cpp {ws.config.target.name}, {threads} thread(s)", mean, roofline, threads=threads,
                            depth=depth, stddev_ms={str(w): round(v, 4) for w, v in std.items()},
                            bandwidth_GBps=round(bandwidth, 3), bandwidth_source=how)
    kept = [e for e in kept if e.get("key") != key] + [{"key": key, "profile": prof.as_dict()}]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"profiles": kept}))
    os.replace(tmp, path)
    return prof


def _threads_of(ws: Workspace, commit: str) -> int:
    """The CPU threads llama-server runs with at `commit` (its config's, else every CPU this process may use)."""
    try:
        cfg = LlamaCppConfig.from_table(ws.config_at(commit), known_only=True)
    except (WorkspaceError, ConfigError):
        cfg = LlamaCppConfig()
    return cfg.threads or len(os.sched_getaffinity(0))


def kernel_profile(ws: Workspace, say: Say) -> dict | None:
    """Stock's matmul kernels ranked against their roofline (`costmodel.kernels`, #24), measured once per model,
    threads and bench version and cached in `.specpilot/kernels.json` (the Overview shows the worst); None,
    said in one line, when they cannot be measured here (no engine build folder, no cpu-local profile)."""
    cfg = LlamaCppConfig.from_table(ws.config_at(ws.stock_commit), known_only=True)
    threads = cfg.threads or 1
    key = {"model": str(ws.config.target), "threads": threads, "bench": source_digest()}
    path = ws.state / "kernels.json"
    try:
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved["profile"]
    except (OSError, ValueError, KeyError):
        pass
    try:
        roof = local_roofline(threads)  # first: without this machine's profile nothing is measured
        say(f"measuring llama.cpp's matmul kernels per width against their roofline ({threads} thread(s))")
        with measurement_lock():
            prof = kernel_profile_of(ws.config.target, threads=threads, roofline=roof)
    except KernelBenchError as e:
        say(f"the kernel profile is not measured: {e}")
        return None
    top = worst_per_group(prof["kernels"], 3)
    say("largest kernel gaps (ms per forward): " + "; ".join(
        f"{k['type']} {k['k']}x{k['n']} x{k['count']} at width {k['width']}: {k['us']:.0f} us against a roofline of "
        f"{k['roofline_us']:.0f} ({k['efficiency']:.0%}), {k['gap_ms']:.1f}" for k in top)
        + "; a forward's matmuls over 4 tokens cost "
        + f"{prof['forward_ratio'].get('4', float('nan')):.2f}x one token's", "loop.kernels",
        {"kernels": top, "forward_ms": prof["forward_ms"]})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "profile": prof}))
    os.replace(tmp, path)
    return prof


def _memory_bandwidth() -> tuple[float, str]:
    """This machine's memory bandwidth in GB/s: the stored cpu-local profile's, else a copy measured now (the
    best of 5 copies of 256 MiB, bytes read plus written)."""
    try:
        hw = get_profile(LOCAL)
        return hw.mem_bandwidth_GBps, f"the {LOCAL} profile ({hw.source})"
    except HardwareError:
        pass
    a = np.ones(2**25, dtype=np.float64)  # 256 MiB
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best / 1e9, "a 256 MiB copy measured now"


def hardware_profile(ws: Workspace, say: Say) -> HardwareProfile | WidthProfile:
    """The deployment's hardware profile. This machine's (`cpu-local`) is measured (3 runs, the quietest
    kept) with the model in the workspace's dtype, and kept per dtype (`local_profile_path`), when it never
    was, or was measured once or on a loaded machine (runs differing by more than MAX_PROFILE_SPREAD). Only a
    profile within that spread is saved; after two wide tries the quietest run serves, and the ceiling's
    announcement says it is unreliable. A llama.cpp workspace's is its width profile (`width_profile`)."""
    if ws.config.engine == "llama.cpp":
        prof = width_profile(ws, say)
        kernel_profile(ws, say)
        return prof
    from decoder.lab.hardware import measure_cpu_local_repeated  # torch: only when a measurement is due

    dtype = ws.config.dtype if ws.config.dtype in PROFILE_DTYPES else "bfloat16"
    stored = local_profile_path(dtype)
    if ws.config.hardware != LOCAL:
        return get_profile(ws.config.hardware)
    hw = load_profile(stored) if stored.is_file() else None
    if hw is not None and hw.measured.get("dtype", "bfloat16") == dtype \
            and (profile_spread(hw) or 9.9) <= MAX_PROFILE_SPREAD:
        return hw
    runs = []
    for attempt in (1, 2):
        say(f"measuring this machine for the cost model ({'again: ' if attempt > 1 else ''}3 runs, the quietest "
            f"kept, {dtype})")
        runs.append(measure_cpu_local_repeated(ws.config.target, seconds_budget=9.0, dtype=dtype,
                                               threads=ws.config.limits.get("threads")))  # as systems run
        if (profile_spread(runs[-1]) or 0.0) <= MAX_PROFILE_SPREAD:
            save_profile(runs[-1], stored)
            break
    return min(runs, key=lambda p: (profile_spread(p) or 0.0))


def oracle_ceiling(ws: Workspace, hw: HardwareProfile | WidthProfile, draft_len: int) -> float:
    """The highest lossless speedup over AR the cost model allows at `draft_len` (every draft accepted)."""
    if isinstance(hw, WidthProfile):
        return hw.ceiling(draft_len + 1)
    c = ws.config
    drafter = Drafter("model", load_model_profile(c.drafter)) if c.drafter else Drafter("ngram", None)
    k = max(1, min(draft_len, MAX_ORACLE_DRAFT_LEN))
    return CostDeployment(c.name, hw, load_model_profile(c.target), drafter, draft_len=k).oracle_ceiling()


def ceiling_for(ws: Workspace, hw: HardwareProfile | WidthProfile, commit: str, floor: float) -> float:
    """The plausibility ceiling of the system at `commit`: the oracle at the verify width its own config sets
    (a tree or a longer draft may legitimately go beyond the base's), never below `floor`."""
    try:
        width = ws.contract.verify_width(ws.config_at(commit))
    except WorkspaceError:
        return floor
    if isinstance(hw, WidthProfile) and ws.config.engine_source and changed_engine_files(ws, commit):
        return max(floor, hw.physical_ceiling(width))  # its own engine: width costs measured on stock do not bind it
    return max(floor, oracle_ceiling(ws, hw, width - 1))


def plausibility_ceiling(ws: Workspace, hw: HardwareProfile | WidthProfile, say: Say) -> float:
    """The oracle ceiling that flags implausible speedups at stock's verify width (a candidate's own width
    raises its own: `ceiling_for`), announced with the profile it came from."""
    k = max(1, ws.contract.verify_width(ws.config_at(ws.stock_commit)) - 1)
    value = oracle_ceiling(ws, hw, k)
    if isinstance(hw, WidthProfile):
        costs = ", ".join(f"w{w} {v:.1f}" for w, v in sorted(hw.ms.items()))
        roof = f"{hw.roofline_ms:.1f}" if hw.roofline_ms else "unknown"
        say(f"plausibility ceiling {value:.2f}x over AR at width {k + 1}: the oracle on llama.cpp's measured forward "
            f"costs (ms: {costs}; load {hw.measured.get('load_avg')}) times one forward's room down to its roofline "
            f"({roof} ms)", "loop.ceiling",
            {"ceiling": value, "draft_len": k, "hardware": hw.name, "source": hw.source, **hw.measured,
             "width_ms": hw.as_dict()["ms"], "reliable": True})
        return value
    m = hw.measured
    reliable = hw.name != LOCAL or (profile_spread(hw) or 9.9) <= MAX_PROFILE_SPREAD
    evidence = {"ceiling": value, "draft_len": k, "hardware": hw.name, "source": hw.source,
                "measured_at": m.get("measured_at"), "spread": m.get("spread"), "load_avg": m.get("load_avg"),
                "repeats": m.get("repeats"), "reliable": reliable}
    how = (f"{len(m['repeats'])} runs at {m.get('measured_at')}, spread {m['spread']:.0%}, load "
           f"{m.get('load_avg')}" if m.get("repeats") else hw.source)
    say(f"plausibility ceiling {value:.1f}x over AR, from the {hw.name} profile ({how})"
        + ("" if reliable else f"; UNRELIABLE: the machine was loaded (spread over {MAX_PROFILE_SPREAD:.0%}), "
                               f"not saved, measured again next time"), "loop.ceiling", evidence)
    return value


def commit_gaps(ws: Workspace, dep_id: int, commit: str, label: str,
                hardware: Callable[[], HardwareProfile | WidthProfile], say: Say | None = None) -> dict:
    """Profile `commit` through the harness and break its time per token into ranked gaps. Saved per commit
    (`.specpilot/gaps/<commit>.json`, with `label` and the time): a later launch on the same base reuses it
    (or a round's profile of it), and the TUI's Overview shows whichever ran last."""
    path = ws.state / "gaps" / f"{commit}.json"
    try:
        saved = json.loads(path.read_text())
        if saved.get("commit") == commit and saved.get("breakdown"):
            return {"entry": MethodEntry.from_dict(saved.get("entry")).as_dict(), "breakdown": saved["breakdown"]}
    except (OSError, ValueError):
        pass
    earlier = [r.summary["gaps"] for r in ws.memory.list_rounds(dep_id)
               if r.base_commit == commit and (r.summary.get("gaps") or {}).get("breakdown")]
    out = earlier[-1] if earlier else _profile_gaps(ws, commit, hardware(), say)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"commit": commit, "label": label, "measured_at": time.time(), **out}))
    os.replace(tmp, path)
    return out


def _quiet(*_args, **_kw) -> None:
    return None


def _profile_gaps(ws: Workspace, commit: str, hw: HardwareProfile | WidthProfile, say: Say | None = None) -> dict:
    wt = ws.detached_worktree("_measure", commit)
    prompts = load_prompts(ws)
    draft_len = ws.contract.verify_width(ws.config_at(commit)) - 1  # a candidate's own keys pass through
    with run_system(ws, wt, "profile") as sp:
        sp.generate(prompts[0].ids, 4)
        entry = profile_entry(sp, prompts, ws.config.forcing_max_new_tokens, draft_len)
        loads = {bs: _load_profile(sp, prompts, bs, ws.config.forcing_max_new_tokens)
                 for bs in ws.config.batch_sizes if bs > 1}
    if isinstance(hw, WidthProfile):
        threads = _threads_of(ws, commit)
        if hw.measured.get("threads") not in (None, threads):  # the forward costs at the threads this commit runs
            hw = width_profile(ws, say or _quiet, threads)
        return {"entry": entry.as_dict(), "breakdown": width_gaps(entry.as_dict(), hw, len(prompts)).as_dict()}
    context = int(sum(len(p.ids) for p in prompts) / len(prompts))
    bd = measured_gaps(entry, hw, load_model_profile(ws.config.target), context, num_prompts=len(prompts))
    out = bd.as_dict()
    for bs, lp in loads.items():  # what speculation costs under each batched point of the load
        # Ranked in the B = 1 profile's units: the share of that point's time, times B = 1's time per token (the
        # loop's objective is the geometric mean of the points' speedups, so equal shares weigh the same).
        # The drafter's time under load is the drafting family's (a cheaper drafter cuts it at every point, and
        # the loop reaches it before the batching knobs that are tuned on whichever drafter the base has); the
        # verify rows the batch rejects are the batching family's (schedule, load-aware drafting, ragged rows).
        scale = bd.measured_ms_per_token / lp["ms_per_token"] if lp["ms_per_token"] > 0 else 1.0
        for name, fam, raw in ((f"drafting under load (B = {bs})", "drafting", lp["draft_ms_per_token"]),
                               (f"rejected verify rows under load (B = {bs})", "batching",
                                lp["rejected_rows_ms_per_token"])):
            ms = raw * scale
            out["gaps"].append({"name": name, "family": fam, "ms_per_token": round(ms, 6),
                                "could_save": True, "ms_per_token_at_load": round(raw, 6)})
            out["families"][fam] = round(out["families"].get(fam, 0.0) + ms, 6)
    if loads:
        out["gaps"].sort(key=lambda g: -g["ms_per_token"])
        out["load"] = {str(bs): lp for bs, lp in loads.items()}
        out["notes"] = [*out.get("notes", []), "gaps under load come from a batched profile of "
                        "the system at each batch size > 1 of the load, scaled to B = 1's time per token by the share "
                        "of that point's time they take; they are not part of the B = 1 total"]
    return {"entry": entry.as_dict(), "breakdown": out}


def _load_profile(sp, prompts: list, bs: int, n: int) -> dict:
    """One batch of `bs` prompts through the system's batched engine, timed by the harness: its time per
    token and the system's phases (scaled to that time): drafting, and the verify time spent on rows that
    were rejected (verify time x rejected rows / verified rows)."""
    batch = [prompts[j % len(prompts)].ids for j in range(bs)]
    sp.generate_batch(batch, 4)  # warm the batched engine (its lean forward is built on first use)
    r = sp.generate_batch(batch, n, profile=True)
    st = DecodeStats.from_dict(r.stats or {})
    tokens = sum(len(o) for o in r.outputs)
    phases = dict(st.phase_s)
    scale = r.seconds / sum(phases.values()) if sum(phases.values()) > 0 else 1.0
    ms = {k: 1000.0 * v * scale / max(tokens, 1) for k, v in phases.items()}
    rows = st.drafted + st.target_forwards
    rejected = (st.drafted - st.accepted) / rows if rows else 0.0
    return {"ms_per_token": 1000.0 * r.seconds / max(tokens, 1), "tokens": tokens, "seconds": r.seconds,
            "draft_ms_per_token": ms.get("draft", 0.0),
            "rejected_rows_ms_per_token": ms.get("verify", 0.0) * rejected,
            "acceptance_rate": st.accepted / st.drafted if st.drafted else None, "drafted": st.drafted}


def speedup_over_ar(ws: Workspace, ar_commit: str, commit: str, label: str, say: Say) -> dict:
    """A paired benchmark of `commit` against the AR reference `ar_commit`, on the prompts the cascade times."""
    ar_wt = ws.detached_worktree("_ar", ar_commit)
    wt = ws.detached_worktree("_measure", commit)
    res = paired_load(ws, ar_wt, "ar", wt, label, label=label)
    out = {"commit": commit, **res.as_dict(), "ar": ar_name(1)}
    if len(res.points) > 1:  # each point divides by the same engine's AR at that load
        for bs, d in out["points"].items():
            d["ar"] = ar_name(int(bs))
    rates = "; ".join(f"B={bs} {r.b_tokens_per_s:.1f} vs {r.a_tokens_per_s:.1f} tok/s"
                      for bs, r in sorted(res.points.items()))
    say(f"{label}: {res.line()} over AR ({rates})", "loop.measure", {"label": label, **out})
    return out


def ar_name(batch: int) -> str:
    """What a speedup over AR at this batch size divides by."""
    if batch == 1:
        return "AR: stock's system with method = ar, one request at a time (the loop's reference-ar branch)"
    return (f"batched AR: stock's system with method = ar, {batch} requests at once in its batched engine "
            f"(the loop's reference-ar branch)")
