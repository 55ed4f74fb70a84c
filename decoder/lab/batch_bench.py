"""`specpilot bench --batch-sizes ...`: batched AR against batched SD, each batching mechanism on and off,
and a stream of requests arriving over time under continuous against static batching.

Every request's output is checked against its single-request greedy run (our `ar_generate` on the
stock Hugging Face target); a divergence is explained when stock's top-2 logit margin there is below
twice the noise floor (decoder/lab/bench.py), measured here with verify widths up to the widest batched
forward, since a batched bf16 matmul may round differently from a batch-1 one.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from decoder.batch import BatchEngine, BatchLM, BatchRun, Request, poisson_arrivals
from decoder.capabilities import refusal
from decoder.config import (
    FEATURE_DRAFTERS,
    SCHEDULE_MIN_GAIN,
    DecodeConfig,
    choose_draft_len,
    entry_starts,
    schedule_text,
    scheduled_draft_len,
    verify_width,
)
from decoder.contract import first_divergence, near_tie
from decoder.featdraft import FeatureDrafterError, FeatureHeads, drafters_dir
from decoder.generate import ar_generate
from decoder.lab.bench import (
    BenchError,
    check_known,
    load_bench_inputs,
    load_prompts,
    noise_floor,
    top2_margin,
)
from decoder.models import check_same_tokenizer, load_causal_lm, load_tokenizer
from decoder.presets import PRESETS, preset_config

MECHANISMS = ("ragged_verify", "load_aware_draft", "continuous_batching")
# The forward's own mechanisms (transposed-matmul, onednn-matmul, fused-mlp, bf16w-fused-layer): a method's "same
# forward" AR shares them, so its ratio to that AR is speculation's gain alone (the ratio to plain batched AR also
# holds the forward's).
FORWARD_KEYS = ("matmul_t_rows", "matmul_backend", "fused_mlp_rows", "fused_layer", "bf16w_rows")


def forward_of(cfg: DecodeConfig) -> dict:
    """The forward mechanisms' keys of `cfg` (plus lean_forward, which they require; the batched engine always
    runs the lean forward)."""
    return {"lean_forward": True, **{k: getattr(cfg, k) for k in FORWARD_KEYS}}


def _stock_forward(cfg: DecodeConfig) -> bool:
    return all(getattr(cfg, k) == getattr(DecodeConfig(), k) for k in FORWARD_KEYS)
BATCH_DRAFTERS = ("draft-model", "ngram")


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """'1,4,8,16' -> (1, 4, 8, 16); names the bad value otherwise."""
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise BenchError(f"--batch-sizes {text}: use comma-separated positive integers, e.g. 1,4,8,16") from None
    if not sizes or any(b < 1 or b > 256 for b in sizes):
        raise BenchError(f"--batch-sizes {text}: use comma-separated integers from 1 to 256, e.g. 1,4,8,16")
    return sizes


class _Checker:
    """Single-request greedy references and the margin test for divergences."""

    def __init__(self, target, encoded: list[list[int]], max_new_tokens: int, widths: tuple[int, ...],
                 noise_prompts: int = 4) -> None:
        self.target = target
        cfg = DecodeConfig(method="ar", max_new_tokens=max_new_tokens)
        self.refs = [ar_generate(target, ids, cfg).tokens for ids in encoded]
        self.encoded = encoded
        pairs = [(ids, ref[:64]) for ids, ref in zip(encoded[:noise_prompts], self.refs[:noise_prompts], strict=True)]
        self.floor = noise_floor(target, pairs, widths)
        self._margins: dict[tuple[int, int], float] = {}

    def check(self, outputs: list[list[int]], which: list[int]) -> dict:
        mismatched, unexplained, divergences = 0, 0, []
        for out, i in zip(outputs, which, strict=True):
            ref = self.refs[i]
            pos = first_divergence(out, ref)
            if pos is None:
                continue
            mismatched += 1
            if (i, pos) not in self._margins:
                self._margins[(i, pos)] = (top2_margin(self.target, self.encoded[i] + ref[:pos])
                                           if pos < len(ref) else float("inf"))
            margin = self._margins[(i, pos)]
            explained = near_tie(margin, self.floor)
            unexplained += not explained
            divergences.append({"request": i, "position": pos, "margin": round(margin, 5), "explained": explained})
        return {"mismatched_requests": mismatched, "unexplained_mismatches": unexplained, "divergences": divergences}


def _combos(names: tuple[str, ...]) -> list[dict[str, bool]]:
    return [dict(zip(names, bits, strict=True)) for bits in itertools.product((False, True), repeat=len(names))]


def run_batch_bench(target_dir: Path, drafter_dir: Path | None, prompts_spec: str, max_new_tokens: int,
                    batch_sizes: tuple[int, ...], deployment: str = "custom", prompt_dir: Path | None = None,
                    drafters: tuple[str, ...] = BATCH_DRAFTERS, draft_len: int = 3, ngram_draft_len: int = 8,
                    ngram_max: int = 4, ngram_min: int = 1, dtype: str = "bfloat16", device: str = "cpu",
                    limit: int | None = None, noise_prompts: int = 4, progress: bool = True,
                    repeats: int = 1, methods: tuple[str, ...] = (), drafters_root: Path | None = None,
                    schedule: bool = False) -> dict:
    """Per batch size: batched AR and batched SD tokens/s for every on/off combination of the three
    batching mechanisms (AR with the same ragged/continuous setting: load-aware drafting has no AR twin);
    and each bench method named in `methods` (a DecodeConfig preset: tree, two-level, D-cut, feature
    drafters...) run by the batched engine, against plain batched AR. `schedule`: per drafter, the load
    schedule chosen from measurements (`measure_schedule`) and the scheduled system against batched AR."""
    if max_new_tokens < 1:
        raise BenchError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    if repeats < 1:
        raise BenchError(f"--repeats {repeats}: must be at least 1")
    check_known("--batch-drafters", drafters, BATCH_DRAFTERS)
    if "draft-model" in drafters and drafter_dir is None:
        raise BenchError("--batch-drafters draft-model needs --drafter DIR (or use --batch-drafters ngram)")
    check_known("--batch-methods", methods, tuple(m for m in PRESETS if "w12" not in m))
    base0 = DecodeConfig(draft_len=draft_len)
    method_cfgs = {m: preset_config(m, base0) for m in methods}
    needs_model = "draft-model" in drafters or any(
        c.method == "sd" and c.drafter in ("draft-model", "routed") for c in method_cfgs.values())
    if needs_model and drafter_dir is None:
        raise BenchError(f"--batch-methods {','.join(methods)} need --drafter DIR")
    prompts_name, prompts, tok, target, drafter = load_bench_inputs(
        target_dir, drafter_dir, needs_model, prompts_spec, prompt_dir, limit, dtype, device)
    for m, c in method_cfgs.items():  # what this model or this CPU cannot run is a usage error, not a crash mid-bench
        why = refusal(replace(c, dtype=dtype, device=device), target.config,
                      drafter.config if drafter is not None else None, dtype)
        if why:
            raise BenchError(f"--batch-methods {m}: {why}")
    heads = None
    if any(c.drafter in (*FEATURE_DRAFTERS, "corpus") for c in method_cfgs.values()):
        heads = FeatureHeads(drafters_root or drafters_dir(target_dir), target.config, target.dtype, target.device)
        try:  # load now: a missing drafter is a usage error, not a crash mid-bench
            for c in method_cfgs.values():
                if c.drafter == "routed":
                    heads.router()
                for kind in ({c.route_code, c.route_prose} if c.drafter == "routed" else {c.drafter}):
                    if kind in FEATURE_DRAFTERS:
                        heads.model(kind)
                    elif kind == "corpus":
                        heads.corpus()
        except FeatureDrafterError as e:
            raise BenchError(f"{e} (or drop the feature methods from --batch-methods)") from e
    eos = tok.eos_token_id if tok.eos_token_id is not None else target.config.eos_token_id
    encoded = [tok(p.text, add_special_tokens=False)["input_ids"] for p in prompts]
    bt, bd = BatchLM(target), (BatchLM(drafter) if drafter is not None else None)
    base = DecodeConfig(max_new_tokens=max_new_tokens, ngram_max=ngram_max, ngram_min=ngram_min, dtype=dtype,
                        device=device)
    sd_cfgs = {d: replace(base, method="sd", drafter=d, draft_len=draft_len if d == "draft-model" else ngram_draft_len)
               for d in drafters}
    widest = max(batch_sizes) * max(draft_len + 1, ngram_draft_len + 1, *map(verify_width, method_cfgs.values()))
    widths = tuple(sorted({draft_len + 1, ngram_draft_len + 1, min(widest, 64),
                           *(verify_width(c) for c in method_cfgs.values() if verify_width(c) > 1)}))
    checker = _Checker(target, encoded, max_new_tokens, widths, noise_prompts)
    reqs = [Request(ids, 0.0, i) for i, ids in enumerate(encoded)]

    def timed(cfg: DecodeConfig, b: int) -> tuple[BatchRun, dict]:
        run = BatchEngine(bt, cfg, b, bd if cfg.method == "sd" and cfg.drafter in ("draft-model", "routed") else None,
                          eos, heads=heads).run(reqs)
        return run, checker.check([r.tokens for r in run.results], list(range(len(reqs))))

    # Warm-up: one-time allocator and kernel costs, on a short run of each kind.
    for cfg in (replace(base, method="ar"), *sd_cfgs.values()):
        BatchEngine(bt, replace(cfg, max_new_tokens=8), 2, bd if cfg.drafter == "draft-model" else None,
                    eos).run(reqs[:2])

    combos = _combos(MECHANISMS)
    ar_keys = list(itertools.product((False, True), repeat=2))  # (ragged_verify, continuous_batching)
    sd_keys = [(d, i) for d in sd_cfgs for i in range(len(combos))] if not schedule else []  # schedule: no grid
    m_keys = [("method", m) for m in method_cfgs]
    # AR on each non-stock forward a method runs: its "same forward" AR.
    f_keys = sorted({("forward", *(getattr(c, k) for k in FORWARD_KEYS)) for c in method_cfgs.values()
                     if not _stock_forward(c)})
    if schedule:  # no grid to pair AR with: plain batched AR only where the methods divide by it
        ar_keys = [(False, False)] if m_keys else []
    if schedule:
        f_keys = []  # the schedule runs its own same-forward AR
    total = len(batch_sizes) * repeats * (len(ar_keys) + len(sd_keys) + len(m_keys) + len(f_keys))
    bar = tqdm(total=total, desc="batch bench", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    rows, method_rows = [], []
    for b in batch_sizes:
        # Every configuration runs `repeats` times, interleaved, and keeps its fastest run: load from
        # other processes on a shared machine only ever slows a run down.
        best: dict = {}
        for _ in range(repeats):
            for key in ar_keys + sd_keys + m_keys + f_keys:
                if key in ar_keys:
                    cfg = replace(base, method="ar", ragged_verify=key[0], continuous_batching=key[1])
                elif key in f_keys:
                    cfg = replace(base, method="ar", lean_forward=True, **dict(zip(FORWARD_KEYS, key[1:], strict=True)))
                elif key in m_keys:
                    cfg = replace(method_cfgs[key[1]], max_new_tokens=max_new_tokens, dtype=dtype, device=device,
                                  ngram_max=ngram_max, ngram_min=ngram_min)
                else:
                    cfg = replace(sd_cfgs[key[0]], **combos[key[1]])
                run, chk = timed(cfg, b)
                bar.update(1)
                if key not in best or run.wall_s < best[key][0].wall_s:
                    unexplained = max(chk["unexplained_mismatches"], best[key][1]["unexplained_mismatches"]
                                      if key in best else 0)
                    best[key] = (run, {**chk, "unexplained_mismatches": unexplained})
        plain_ar = best[(False, False)][0].tokens_per_s if (False, False) in best else None
        for _, m in m_keys:
            run, chk = best[("method", m)]
            same = best.get(("forward", *(getattr(method_cfgs[m], k) for k in FORWARD_KEYS)))
            method_rows.append({
                "name": m, "batch_size": b, "tokens_per_s": round(run.tokens_per_s, 2),
                "mean_live": round(run.mean_live, 2),
                "batched_ar_tokens_per_s": round(plain_ar, 2),
                "speedup_vs_batched_ar": round(run.tokens_per_s / plain_ar, 4),
                "tau": round(run.stats.tau, 4), "acceptance_rate": round(run.stats.acceptance_rate, 4),
                "draft_len": method_cfgs[m].draft_len, "new_tokens": run.new_tokens, **chk,
                # Extra fields: batched AR on the method's own forward (transposed / oneDNN matmuls), when not stock.
                **({"forward": {k: getattr(method_cfgs[m], k) for k in FORWARD_KEYS},
                    "same_forward_ar_tokens_per_s": round(same[0].tokens_per_s, 2),
                    "speedup_vs_same_forward_ar": round(run.tokens_per_s / same[0].tokens_per_s, 4),
                    "same_forward_ar_unexplained_mismatches": same[1]["unexplained_mismatches"]} if same else {}),
            })
        for d, i in sd_keys:
            mech = combos[i]
            run, chk = best[(d, i)]
            ar, ar_chk = best[(mech["ragged_verify"], mech["continuous_batching"])]
            rows.append({
                "batch_size": b,
                "ar_tokens_per_s": round(ar.tokens_per_s, 2),
                "sd_tokens_per_s": round(run.tokens_per_s, 2),
                "speedup": round(run.tokens_per_s / ar.tokens_per_s, 4),
                "mechanisms": mech,
                # Extra fields.
                "drafter": d,
                "draft_len": sd_cfgs[d].draft_len,
                "speedup_vs_plain_ar": round(run.tokens_per_s / plain_ar, 4),
                "tau": round(run.stats.tau, 4),
                "acceptance_rate": round(run.stats.acceptance_rate, 4),
                "mean_draft_len": round(run.stats.drafted / max(1, run.stats.draft_steps), 3),
                "sd_steps": run.steps,
                "ar_steps": ar.steps,
                "new_tokens": run.new_tokens,
                "phase_ms_per_token": {k: round(1000 * v / max(1, run.new_tokens), 4)
                                       for k, v in run.stats.phase_s.items()},
                **chk,
                "ar_unexplained_mismatches": ar_chk["unexplained_mismatches"],
            })
    bar.close()
    sched_rows = []
    if schedule:
        scheduled = {**sd_cfgs, **{m: replace(c, max_new_tokens=max_new_tokens, dtype=dtype, device=device,
                                              ngram_max=ngram_max, ngram_min=ngram_min)
                                   for m, c in method_cfgs.items() if c.method == "sd" and c.verify == "chain"}}
        for name, c in scheduled.items():
            row = measure_schedule(timed, replace(c, ragged_verify=True, continuous_batching=True),
                                   replace(base, method="ar", ragged_verify=True, continuous_batching=True,
                                           **forward_of(c)),
                                   batch_sizes, repeats, progress)
            sched_rows.append({"name": name, **row})
    return {
        "deployment": deployment,
        "prompts": prompts_name,
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "dtype": dtype,
        "device": device,
        "noise_floor": round(checker.floor, 6),
        "noise_widths": list(widths),
        # Requests whose greedy run ends at its first token (EOS): they never reach a step, so a batch point's
        # live requests stay below its batch size (each point's mean_live says how far).
        "prompts_ending_at_first_token": sum(len(r) == 1 and r[0] == eos for r in checker.refs),
        "batch": rows,
        "batch_methods": method_rows,
        "schedule": sched_rows,
        "config": {"draft_len": draft_len, "ngram_draft_len": ngram_draft_len, "ngram_max": ngram_max,
                   "ngram_min": ngram_min, "load_aware_fixed_rows": base.load_aware_fixed_rows,
                   "threads": torch.get_num_threads(), "repeats": repeats},
        "torch": torch.__version__,
    }


SCHEDULE_LENS = (0, 1, 2, 3, 4, 6, 8)  # draft lengths a measured schedule chooses from (0 = AR steps)
def measure_schedule(timed, sd: DecodeConfig, ar: DecodeConfig, batch_sizes: tuple[int, ...], repeats: int,
                     progress: bool, min_gain: float = SCHEDULE_MIN_GAIN) -> dict:
    """The load schedule of `sd` chosen from measurements: at each batch size every draft length of SCHEDULE_LENS
    (up to sd's own) runs and the fastest is kept (`choose_draft_len`); then each choice is keyed by the live
    requests its runs had (`entry_starts`): the engine looks the schedule up by live requests, and a batch
    of B has fewer live when requests end at their first token. Then the scheduled system, in runs of its own,
    against batched AR (`ar`, the same batching) at every batch size. `timed(cfg, b)` -> (BatchRun, check).

    Whole runs decide, not steps at one live count: speculation spreads requests' finishing times, so a batch
    drains into a tail of few live requests that AR steps (all requests one token a step) do not have."""
    lens = [k for k in SCHEDULE_LENS if k <= sd.draft_len]
    per_b: dict[int, dict[int, float]] = {}
    reach: dict[int, int] = {}
    bar = tqdm(total=len(batch_sizes) * len(lens) * repeats, desc=f"schedule {sd.drafter}", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    for b in batch_sizes:
        for _ in range(repeats):
            for k in lens:
                run, chk = timed(replace(sd, load_schedule=f"1:{k}"), b)
                bar.update(1)
                reach[b] = max(reach.get(b, 0), max(run.by_live, default=0))
                if chk["unexplained_mismatches"] == 0:
                    per_b.setdefault(b, {})[k] = max(per_b.get(b, {}).get(k, 0.0), run.tokens_per_s)
    bar.close()
    chosen = {b: choose_draft_len(v, min_gain) for b, v in per_b.items()}
    live_from = entry_starts({b: reach[b] for b in chosen})
    text = schedule_text({first: chosen[b] for b, first in live_from.items()})
    cfg = replace(sd, load_schedule=text)
    points = []
    for b in batch_sizes:  # fresh runs: the choice above is not scored on its own (best-of) timings
        best_ar = best_sd = None
        for _ in range(max(1, repeats)):
            for which, c in (("ar", ar), ("sd", cfg)):
                run, chk = timed(c, b)
                if which == "ar" and (best_ar is None or run.wall_s < best_ar[0].wall_s):
                    best_ar = (run, chk)
                if which == "sd" and (best_sd is None or run.wall_s < best_sd[0].wall_s):
                    best_sd = (run, chk)
        used: dict[int, int] = {}  # steps the scheduled run took at each draft length
        for live, at in best_sd[0].by_live.items():
            used[scheduled_draft_len(cfg, live)] = used.get(scheduled_draft_len(cfg, live), 0) + at.steps
        points.append({"batch_size": b, "ar_tokens_per_s": round(best_ar[0].tokens_per_s, 2),
                       "sd_tokens_per_s": round(best_sd[0].tokens_per_s, 2),
                       "speedup": round(best_sd[0].tokens_per_s / best_ar[0].tokens_per_s, 4),
                       "draft_len": chosen.get(b), "tau": round(best_sd[0].stats.tau, 4),
                       "mean_live": round(best_sd[0].mean_live, 2),
                       "ar_mean_live": round(best_ar[0].mean_live, 2),
                       "max_live": reach.get(b, 0),  # the most live requests its runs had in a step
                       "live_from": live_from.get(b),  # its entry's first live count (None: no entry of its own)
                       "steps_by_draft_len": {str(k): n for k, n in sorted(used.items())},
                       "tokens_per_s_by_draft_len": {str(k): round(v, 2) for k, v in per_b.get(b, {}).items()},
                       "unexplained_mismatches": best_sd[1]["unexplained_mismatches"]})
    fwd = "" if _stock_forward(sd) else ", " + ", ".join(f"{k} = {getattr(sd, k)!r}" for k in FORWARD_KEYS)
    return {"drafter": sd.drafter, "load_schedule": text, "mechanisms": ["ragged_verify", "continuous_batching"],
            "ar": "batched AR with ragged verify and continuous batching" + fwd,
            "ar_forward": {k: getattr(ar, k) for k in FORWARD_KEYS},
            "keyed_by": "live requests per step: each batch size's choice from the live counts only its runs reach",
            "min_gain": min_gain, "points": points}


def _mech_label(mech: dict[str, bool]) -> str:
    short = {"ragged_verify": "ragged", "load_aware_draft": "load-aware", "continuous_batching": "continuous"}
    on = [short[k] for k, v in mech.items() if v]
    return "+".join(on) if on else "plain"


def format_batch_table(report: dict) -> str:
    head = (f"deployment {report['deployment']} · prompts {report['prompts']} ({report['num_prompts']}) · "
            f"{report['max_new_tokens']} new tokens · {report['dtype']} on {report['device']} · "
            f"noise floor {report['noise_floor']:.4f}")
    cols = ("B", "drafter", "mechanisms", "AR tok/s", "SD tok/s", "speedup", "vs plain AR", "tau", "k mean",
            "unexplained")
    rows = [(str(r["batch_size"]), r["drafter"], _mech_label(r["mechanisms"]), f"{r['ar_tokens_per_s']:.1f}",
             f"{r['sd_tokens_per_s']:.1f}", f"{r['speedup']:.2f}x", f"{r['speedup_vs_plain_ar']:.2f}x",
             f"{r['tau']:.2f}", f"{r['mean_draft_len']:.2f}", str(r["unexplained_mismatches"]))
            for r in report["batch"]]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]
    lines = [head]
    if report.get("prompts_ending_at_first_token"):
        early = report["prompts_ending_at_first_token"]
        lines.append(f"{early} of {report['num_prompts']} prompts end at their first token (EOS): a batch point "
                     f"decodes at most {report['num_prompts'] - early} live requests")
    if rows:  # the drafter x mechanism grid (absent when only --batch-methods ran)
        lines += ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)), "  ".join("-" * w for w in widths)]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    for b in sorted({r["batch_size"] for r in report["batch"]}):
        at = [r for r in report["batch"] if r["batch_size"] == b]
        for d in sorted({r["drafter"] for r in at}):
            mine = [r for r in at if r["drafter"] == d]
            plain = next(r for r in mine if not any(r["mechanisms"].values()))
            best = max(mine, key=lambda r: r["sd_tokens_per_s"])
            lines.append(f"B={b} {d}: best {_mech_label(best['mechanisms'])} {best['sd_tokens_per_s']:.1f} tok/s "
                         f"({best['speedup_vs_plain_ar']:.2f}x plain AR) vs plain SD {plain['sd_tokens_per_s']:.1f} "
                         f"tok/s ({plain['speedup']:.2f}x)")
    for r in report.get("batch_methods", []):
        lines.append(f"B={r['batch_size']} {r['name']}: {r['tokens_per_s']:.1f} tok/s "
                     f"({r['speedup_vs_batched_ar']:.2f}x batched AR"
                     + (f", {r['speedup_vs_same_forward_ar']:.2f}x batched AR on its forward "
                        f"{r['same_forward_ar_tokens_per_s']:.1f}" if "speedup_vs_same_forward_ar" in r else "")
                     + f"), tau {r['tau']:.2f}, "
                     + (f"{r['mean_live']:.1f} live requests per step, " if "mean_live" in r else "") +
                     f"{r['unexplained_mismatches']} unexplained")
    for sc in report.get("schedule", []):
        lines.append(f"scheduled {sc.get('name', sc['drafter'])} (load_schedule = \"{sc['load_schedule']}\", "
                     f"ragged+continuous) against {sc.get('ar', 'batched AR')}:")
        lines += [f"  B={pt['batch_size']}: draft {pt['draft_len']}"
                  + (f" from {pt['live_from']} live" if pt.get("live_from") else "")
                  + (" (steps per draft length: " + ", ".join(f"{k}: {n}" for k, n in pt["steps_by_draft_len"].items())
                     + ")" if "steps_by_draft_len" in pt else "")
                  + f", {pt['sd_tokens_per_s']:.1f} vs "
                  f"{pt['ar_tokens_per_s']:.1f} tok/s = {pt['speedup']:.2f}x, "
                  + (f"{pt['mean_live']:.1f} live requests per step, " if "mean_live" in pt else "")
                  + f"{pt['unexplained_mismatches']} unexplained"
                  for pt in sc["points"]]
    lossless = all(r["unexplained_mismatches"] == 0 and r["ar_unexplained_mismatches"] == 0 for r in report["batch"])
    lossless = lossless and all(pt["unexplained_mismatches"] == 0 for sc in report.get("schedule", [])
                                for pt in sc["points"])
    lossless = lossless and all(r["unexplained_mismatches"] == 0 and r.get("same_forward_ar_unexplained_mismatches", 0)
                                == 0 for r in report.get("batch_methods", []))
    lines.append("every request lossless against its single-request run (no unexplained mismatch)" if lossless
                 else "LOSSLESS CHECK FAILED: see unexplained mismatches above")
    return "\n".join(lines)


def run_stream_bench(target_dir: Path, drafter_dir: Path | None, prompt_specs: list[str], max_new_tokens: int,
                     batch_size: int, n_requests: int, rate_per_s: float, prompt_dir: Path | None = None,
                     drafter: str = "draft-model", draft_len: int = 3, ngram_draft_len: int = 8,
                     mechanisms: dict[str, bool] | None = None, dtype: str = "bfloat16", device: str = "cpu",
                     seed: int = 0, noise_prompts: int = 4) -> dict:
    """A stream of n requests with Poisson arrivals, decoded by batched SD under static and under
    continuous batching (same arrivals, same other mechanisms); throughput, latency and losslessness."""
    if n_requests < 1:
        raise BenchError(f"--requests {n_requests}: must be at least 1")
    prompts = [p for spec in prompt_specs for p in load_prompts(spec, prompt_dir)[1]]
    prompts = [prompts[i % len(prompts)] for i in range(n_requests)]
    if drafter == "draft-model":
        if drafter_dir is None:
            raise BenchError("--drafter draft-model needs a draft model directory")
        check_same_tokenizer(target_dir, drafter_dir)
    tok = load_tokenizer(target_dir, "target")
    target = load_causal_lm(target_dir, "target", dtype, device)
    dm = load_causal_lm(drafter_dir, "drafter", dtype, device) if drafter == "draft-model" else None
    eos = tok.eos_token_id if tok.eos_token_id is not None else target.config.eos_token_id
    encoded = [tok(p.text, add_special_tokens=False)["input_ids"] for p in prompts]
    bt, bd = BatchLM(target), (BatchLM(dm) if dm is not None else None)
    k = draft_len if drafter == "draft-model" else ngram_draft_len
    checker = _Checker(target, encoded, max_new_tokens, tuple(sorted({k + 1, 64})), noise_prompts)
    arrivals = poisson_arrivals(n_requests, rate_per_s, seed)
    reqs = [Request(ids, t, i) for i, (ids, t) in enumerate(zip(encoded, arrivals, strict=True))]
    base = DecodeConfig(method="sd", drafter=drafter, draft_len=k, max_new_tokens=max_new_tokens, dtype=dtype,
                        device=device, **(mechanisms or {}))
    BatchEngine(bt, replace(base, max_new_tokens=8), 2, bd, eos).run(
        [Request(r.prompt, 0.0, r.id) for r in reqs[:2]])  # warm-up
    modes = {}
    for name, cont in (("static", False), ("continuous", True)):
        run = BatchEngine(bt, replace(base, continuous_batching=cont), batch_size, bd, eos).run(reqs)
        lat = sorted(r.finish_s - r.arrival_s for r in run.results)
        modes[name] = {
            "tokens_per_s": round(run.tokens_per_s, 2),
            "makespan_s": round(run.wall_s, 3),
            "mean_latency_s": round(sum(lat) / len(lat), 3),
            "p90_latency_s": round(lat[min(len(lat) - 1, int(0.9 * len(lat)))], 3),
            "mean_wait_s": round(sum(r.start_s - r.arrival_s for r in run.results) / len(run.results), 3),
            "steps": run.steps,
            "tau": round(run.stats.tau, 4),
            "new_tokens": run.new_tokens,
            **checker.check([r.tokens for r in run.results], list(range(len(reqs)))),
        }
    return {
        "requests": n_requests, "rate_per_s": rate_per_s, "batch_size": batch_size, "drafter": drafter,
        "draft_len": k, "max_new_tokens": max_new_tokens, "dtype": dtype, "seed": seed,
        "last_arrival_s": round(arrivals[-1], 3), "noise_floor": round(checker.floor, 6),
        "mechanisms": {m: getattr(base, m) for m in MECHANISMS if m != "continuous_batching"},
        "static": modes["static"], "continuous": modes["continuous"],
        "throughput_gain": round(modes["continuous"]["tokens_per_s"] / modes["static"]["tokens_per_s"], 4),
    }


def format_stream_table(report: dict) -> str:
    cols = ("batching", "tok/s", "makespan s", "mean latency s", "p90 latency s", "mean wait s", "steps", "tau",
            "unexplained")
    rows = []
    for name in ("static", "continuous"):
        m = report[name]
        rows.append((name, f"{m['tokens_per_s']:.1f}", f"{m['makespan_s']:.2f}", f"{m['mean_latency_s']:.2f}",
                     f"{m['p90_latency_s']:.2f}", f"{m['mean_wait_s']:.2f}", str(m["steps"]), f"{m['tau']:.2f}",
                     str(m["unexplained_mismatches"])))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    mech = _mech_label(report["mechanisms"])
    lines = [f"{report['requests']} requests, Poisson arrivals at {report['rate_per_s']}/s (last at "
             f"{report['last_arrival_s']:.2f} s), batch {report['batch_size']}, SD {report['drafter']} "
             f"k={report['draft_len']} ({mech}), {report['max_new_tokens']} new tokens, {report['dtype']}",
             "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    lines.append(f"continuous / static throughput: {report['throughput_gain']:.2f}x")
    return "\n".join(lines)
