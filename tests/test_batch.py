"""Batched AR and SD (decoder/batch.py): per-request losslessness, the three batching mechanisms,
batched rejection sampling, and the bench's batch report."""

import itertools
import json
from dataclasses import replace

import pytest
import torch
from conftest import needs_demo, tiny_llama, write_jsonl

from decoder.batch import BatchEngine, BatchLM, Request, batch_generate, choose_draft_lens, ragged_index
from decoder.config import ConfigError, DecodeConfig
from decoder.generate import ar_generate
from decoder.lean import LeanLM
from decoder.mechanisms import REGISTRY, validate_change

MECHS = ("ragged_verify", "load_aware_draft", "continuous_batching")
COMBOS = [dict(zip(MECHS, bits, strict=True)) for bits in itertools.product((False, True), repeat=3)]


def _cut_at(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


# -- config and registry ----------------------------------------------------------------------------

def test_stock_defaults_off_and_toml_round_trip():
    stock = DecodeConfig()
    assert not stock.ragged_verify and not stock.load_aware_draft and not stock.continuous_batching
    cfg = DecodeConfig(ragged_verify=True, load_aware_draft=True, load_aware_fixed_rows=32, continuous_batching=True)
    assert DecodeConfig.from_toml(cfg.to_toml()) == cfg


@pytest.mark.parametrize("kwargs, needle", [
    ({"load_aware_fixed_rows": 0}, "load_aware_fixed_rows = 0"),
    ({"method": "ar", "load_aware_draft": True}, "load_aware_draft = True"),
])
def test_bad_batching_values_name_key_and_value(kwargs, needle):
    with pytest.raises(ConfigError) as e:
        DecodeConfig(**kwargs)
    assert needle in str(e.value)


def test_batching_mechanisms_in_registry_with_stock_values():
    batching = {n: m for n, m in REGISTRY.items() if m.family == "batching"}
    assert set(batching) == {"ragged-verify", "load-aware-drafting", "continuous-batching", "load-schedule"}
    stock = DecodeConfig()
    for m in batching.values():
        for key, value in m.stock.items():
            assert getattr(stock, key) == value, (m.name, key)
            assert value in m.keys[key]
    validate_change({"ragged_verify": True, "load_aware_fixed_rows": 128, "continuous_batching": True})
    with pytest.raises(ValueError, match="load_aware_fixed_rows = 3"):
        validate_change({"load_aware_fixed_rows": 3})


# -- pieces -----------------------------------------------------------------------------------------

def test_ragged_index_selects_real_rows():
    assert ragged_index([2, 0, 3], 4, torch.device("cpu")).tolist() == [0, 1, 8, 9, 10]


def test_load_aware_lengths_follow_load_and_acceptance():
    # One request on an idle machine with a free drafter (n-gram): verify rows are nearly free, draft to the cap.
    assert choose_draft_lens([6], [0.6], fixed_rows=64, draft_cost=0.0) == [6]
    # A full batch pays a row per draft token: only likely tokens survive, fewer than at batch 1.
    one = choose_draft_lens([6], [0.6], fixed_rows=64, draft_cost=0.1)[0]
    full = choose_draft_lens([6] * 16, [0.6] * 16, fixed_rows=64, draft_cost=0.1)
    assert 0 < max(full) < one
    # Within a batch, a request that accepts more drafts at least as far as one that accepts less.
    mixed = choose_draft_lens([6] * 16, [0.9] * 8 + [0.3] * 8, fixed_rows=16, draft_cost=0.0)
    assert min(mixed[:8]) > max(mixed[8:])
    # Caps (n-gram proposal length, tokens left) are never exceeded; no acceptance means no drafting.
    assert choose_draft_lens([2, 0, 5], [0.99, 0.99, 0.0], fixed_rows=64, draft_cost=0.0) == [2, 0, 0]


@needs_demo
@pytest.mark.parametrize("pair", ["demo_fp32", "demo_bf16"])
def test_packed_forward_matches_lean_per_request(pair, request, demo_prompts):
    """Three requests with different cache lengths and widths in one packed forward, against LeanLM."""
    target = request.getfixturevalue(pair)[0]
    lean, batch = LeanLM(target), BatchLM(target)
    prompts = [demo_prompts[0][:50], demo_prompts[1][:23], demo_prompts[2][:71]]
    cache = batch.new_cache(4, 128)
    slots = [2, 0, 3]
    flat = torch.tensor([t for p in prompts for t in p])
    batch.forward(flat, slots, [len(p) for p in prompts], cache)
    new = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    got = batch.forward(torch.tensor([t for n in new for t in n]), slots, [len(n) for n in new], cache)
    tol = 1e-4 if target.dtype == torch.float32 else 0.125
    row = 0
    for p, n in zip(prompts, new, strict=True):
        c = lean.new_cache()
        lean.forward(torch.tensor(p), c)
        ref = lean.forward(torch.tensor(n), c)
        assert (got[row : row + len(n)].float() - ref.float()).abs().max().item() <= tol
        row += len(n)
    assert [cache.lengths[s] for s in slots] == [len(p) + len(n) for p, n in zip(prompts, new, strict=True)]


# -- lossless against single-request greedy ---------------------------------------------------------

@pytest.fixture(scope="module")
def mixed_prompts(demo_prompts):
    # Mixed lengths: 17 to 160 tokens.
    return [demo_prompts[0][-40:], demo_prompts[1][-17:], demo_prompts[2], demo_prompts[0][-97:],
            demo_prompts[1][-63:]]


@needs_demo
@pytest.mark.parametrize("drafter", ["ar", "draft-model", "ngram"])
def test_batched_greedy_token_identical_fp32(demo_fp32, mixed_prompts, drafter):
    """Every mechanism combination, batch 2 over 5 requests (several batches / refilled slots), with an
    EOS that ends some requests early: each output equals its single-request greedy run."""
    target, draft_model = demo_fp32
    n_new = 20
    full = [ar_generate(target, p, DecodeConfig(method="ar", max_new_tokens=n_new, stop_at_eos=False)).tokens
            for p in mixed_prompts]
    eos = full[1][6]  # request 1 stops at position 6 (or earlier if the token occurs before)
    refs = [_cut_at(f, eos) for f in full]
    assert any(len(r) < n_new for r in refs)
    combos = COMBOS if drafter != "ar" else [c for c in COMBOS if not c["load_aware_draft"]]
    for mech in combos:
        cfg = DecodeConfig(method="ar" if drafter == "ar" else "sd", drafter="ngram" if drafter == "ngram" else
                           "draft-model", draft_len=6 if drafter == "ngram" else 3, max_new_tokens=n_new,
                           dtype="float32", **mech)
        run = batch_generate(cfg, target, mixed_prompts, 2, draft_model, eos_id=eos)
        assert [r.tokens for r in run.results] == refs, mech
        if drafter != "ar":
            assert run.stats.drafted > 0


@needs_demo
def test_batched_bf16_divergences_are_near_ties(demo_bf16, mixed_prompts):
    """bf16 batched SD (all mechanisms) against single-request greedy: any divergence sits where stock's
    top-2 margin is below twice the deployment's noise floor."""
    from decoder.lab.bench import first_divergence, noise_floor, top2_margin

    target, draft_model = demo_bf16
    cfg = DecodeConfig(max_new_tokens=24, ragged_verify=True, load_aware_draft=True, continuous_batching=True)
    refs = [ar_generate(target, p, DecodeConfig(method="ar", max_new_tokens=24)).tokens for p in mixed_prompts]
    floor = noise_floor(target, [(p, r) for p, r in zip(mixed_prompts[:2], refs[:2], strict=True)], (4, 16))
    run = batch_generate(cfg, target, mixed_prompts, 4, draft_model)
    for p, r, out in zip(mixed_prompts, refs, (x.tokens for x in run.results), strict=True):
        pos = first_divergence(out, r)
        if pos is not None:
            assert top2_margin(target, p + r[:pos]) < 2 * floor, pos


class FakeClock:
    """Deterministic time: each clock read advances `tick` seconds; sleep jumps ahead."""

    def __init__(self, tick: float) -> None:
        self.t, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


@needs_demo
@pytest.mark.slow
def test_continuous_stream_of_32_lossless(demo_fp32, demo_prompts):
    """32 requests arriving over time: continuous batching admits them between steps (while others run),
    every output equals its single-request run, and it needs fewer batched steps than static batching."""
    target, draft_model = demo_fp32
    prompts = [demo_prompts[i % 3][-(12 + 5 * i):] for i in range(32)]
    n_new = 12
    refs = [ar_generate(target, p, DecodeConfig(method="ar", max_new_tokens=n_new, stop_at_eos=False)).tokens
            for p in prompts]
    reqs = [Request(p, 0.05 * i, i) for i, p in enumerate(prompts)]
    steps = {}
    for cont in (False, True):
        cfg = DecodeConfig(max_new_tokens=n_new, stop_at_eos=False, dtype="float32", ragged_verify=True,
                           continuous_batching=cont)
        clock = FakeClock(0.01)
        run = BatchEngine(target, cfg, 4, draft_model).run(reqs, clock=clock, sleep=clock.sleep)
        assert [r.tokens for r in run.results] == refs, cont
        steps[cont] = run.steps
        joined_mid_flight = any(
            any(o.start_s < r.start_s < o.finish_s for o in run.results) for r in run.results)
        assert joined_mid_flight == cont
        assert all(r.start_s >= r.arrival_s for r in run.results)
    assert steps[True] < steps[False]


# -- sampling --------------------------------------------------------------------------------------

CHI2_001_15 = 37.70  # chi-square critical value, 15 degrees of freedom, p = 0.001


@torch.inference_mode()
@pytest.mark.parametrize("drafter, ragged, load_aware", [("draft-model", True, False), ("ngram", False, True),
                                                       ("ngram", True, True)])
def test_batched_rejection_sampling_matches_target(drafter, ragged, load_aware):
    """Batched speculative sampling (n-gram proposals and load-aware lengths differ per request) draws
    the third new token from the target's exact marginal p(t3 | prompt)."""
    target, small = tiny_llama(seed=0), tiny_llama(seed=1, layers=1)
    # The target tends to repeat 2 here, so n-gram drafts get accepted; temperature 3 spreads the rest.
    prompt, temp = [2] * 8, 3.0
    n = 3000
    cfg = DecodeConfig(drafter=drafter, draft_len=3, max_new_tokens=4, temperature=temp, stop_at_eos=False,
                       dtype="float32", seed=7, ragged_verify=ragged, load_aware_draft=load_aware)
    run = BatchEngine(target, cfg, 16, small if drafter == "draft-model" else None).run(
        [Request(prompt, 0.0, i) for i in range(n)])
    assert run.stats.drafted > 0 and run.stats.accepted > 0
    counts = torch.bincount(torch.tensor([r.tokens[2] for r in run.results]), minlength=16).float()

    def probs(ctx):
        return torch.softmax(target(input_ids=torch.tensor([ctx])).logits[0, -1].float() / temp, -1)

    p1 = probs(prompt)
    exact = torch.zeros(16)
    for a in range(16):
        p2 = probs(prompt + [a])
        ctx = torch.tensor([prompt + [a, b] for b in range(16)])
        p3 = torch.softmax(target(input_ids=ctx).logits[:, -1].float() / temp, -1)  # [16, 16]
        exact += p1[a] * (p2[:, None] * p3).sum(0)
    exp = exact * n
    keep = exp > 5
    chi2 = float((((counts - exp) ** 2)[keep] / exp[keep]).sum())
    assert chi2 < CHI2_001_15, chi2


def test_engine_rejects_bad_arguments():
    target = tiny_llama()
    with pytest.raises(ValueError, match="max_batch = 0"):
        BatchEngine(target, DecodeConfig(), 0, tiny_llama(seed=1))
    with pytest.raises(ValueError, match="needs a draft model"):
        BatchEngine(target, DecodeConfig(), 2)


def test_a_run_counts_the_live_requests_of_each_step():
    # What a batch point really measured: 3 requests decoding 6 tokens each are live in all 5 steps after the
    # prefill (its token is the first); requests done at the prefill (max_new_tokens 1) leave no step at all.
    target = tiny_llama()
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    run = batch_generate(DecodeConfig(method="ar", max_new_tokens=6, stop_at_eos=False), target, prompts, 4)
    assert (run.steps, run.live_steps, run.mean_live) == (5, 15, 3.0)
    run = batch_generate(DecodeConfig(method="ar", max_new_tokens=1, stop_at_eos=False), target, prompts, 4)
    assert (run.steps, run.mean_live) == (0, 0.0)


def test_a_run_keeps_each_live_count_s_steps_tokens_and_seconds():
    # What a load schedule is measured from (#21): an EOS ends requests at different steps, so the run's steps
    # fall at 3, 2 and 1 live requests; each count keeps its steps, the tokens they committed and their time.
    target = tiny_llama()
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    n_new = 8
    full = [ar_generate(target, p, DecodeConfig(method="ar", max_new_tokens=n_new, stop_at_eos=False)).tokens
            for p in prompts]
    eos = next(t for t in full[0][1:] if t != full[0][0])  # a token that ends request 0 after its first
    lens = [len(_cut_at(f, eos)) for f in full]
    assert len(set(lens)) > 1  # requests really finish at different steps
    # AR: step j (1, 2, ...) commits token j + 1 for every request with more than j tokens.
    want = {}
    for j in range(1, max(lens)):
        live = sum(n > j for n in lens)
        want[live] = (want.get(live, (0, 0))[0] + 1, want.get(live, (0, 0))[1] + live)
    clock = FakeClock(0.01)
    run = BatchEngine(target, DecodeConfig(method="ar", max_new_tokens=n_new), 4, eos_id=eos).run(
        [Request(p, 0.0, i) for i, p in enumerate(prompts)], clock=clock, sleep=clock.sleep)
    assert [len(r.tokens) for r in run.results] == lens
    assert {live: (at.steps, at.tokens) for live, at in run.by_live.items()} == want
    assert all(at.seconds == pytest.approx(0.01 * at.steps) for at in run.by_live.values())  # one tick per step
    assert sum(at.steps for at in run.by_live.values()) == run.steps
    assert sum(live * at.steps for live, at in run.by_live.items()) == run.live_steps
    assert sum(at.tokens for at in run.by_live.values()) == run.new_tokens - len(prompts)  # less the prefill's
    # SD: a step commits the accepted drafts too; the totals still add up per live count.
    cfg = DecodeConfig(method="sd", drafter="ngram", draft_len=4, max_new_tokens=n_new, dtype="float32")
    run = BatchEngine(target, cfg, 4, eos_id=eos).run([Request(p, 0.0, i) for i, p in enumerate(prompts)])
    assert [len(r.tokens) for r in run.results] == lens
    assert sum(at.tokens for at in run.by_live.values()) == run.new_tokens - len(prompts)
    assert sum(at.steps for at in run.by_live.values()) == run.steps


# -- the measured load schedule (#21) ---------------------------------------------------------------

def test_schedule_entries_start_at_the_live_counts_each_batch_size_reaches():
    from decoder.config import scheduled_draft_len
    from decoder.lab.batch_bench import choose_draft_len, entry_starts, schedule_text

    # The demo's code prompts: 6 of 16 end at their first token, so B = 16 reaches 10 live and B = 32 no more.
    starts = entry_starts({1: 1, 4: 4, 8: 8, 16: 10, 32: 10})
    assert starts == {1: 1, 4: 2, 8: 5, 16: 9}
    assert entry_starts({4: 4, 8: 8}) == {4: 1, 8: 5}  # the smallest batch size's entry serves from 1 on
    chosen = {1: 6, 4: 6, 8: 8, 16: 0}
    text = schedule_text({first: chosen[b] for b, first in starts.items()})
    assert text == "1:6,5:8,9:0"
    cfg = DecodeConfig(load_schedule=text)
    assert [scheduled_draft_len(cfg, n) for n in (1, 4, 5, 8, 9, 10)] == [6, 6, 8, 8, 0, 0]  # 10 live: AR steps
    # Speculation only where it beats AR steps by the margin; a close call goes to AR.
    assert choose_draft_len({0: 100.0, 2: 150.0, 4: 120.0}) == 2
    assert choose_draft_len({0: 100.0, 2: 102.0}, min_gain=1.03) == 0
    assert choose_draft_len({0: 100.0, 2: 102.0}, min_gain=1.0) == 2
    assert choose_draft_len({0: 100.0, 2: 90.0}) == 0


def _synthetic_run(b: int, k_at):
    """A run whose steps fall mostly below its batch size (as on the demo, where prompts end at their first
    token): phases at min(b, 6), min(b, 2) and 1 live requests, each committing 60 tokens per live request.
    A step at L live and draft k = k_at(L) commits L * (1 + min(k, 2) / 2) tokens in 1 + L * (k + 1) / 2
    seconds: speculation (k = 2) pays at 1 live, ties at 2 and loses above."""
    from decoder.batch import BatchRun, LiveSteps, RequestResult
    from decoder.profiler import DecodeStats

    by_live = {}
    for c in (6, 2, 1):
        live, k = min(b, c), k_at(min(b, c))
        at = by_live.setdefault(live, LiveSteps())
        n = round(60 / (1 + min(k, 2) / 2))
        at.steps += n
        at.tokens += 60 * live
        at.seconds += n * (1 + live * (k + 1) / 2)
    run = BatchRun([], sum(a.seconds for a in by_live.values()), sum(a.steps for a in by_live.values()),
                   live_steps=sum(live * a.steps for live, a in by_live.items()), by_live=by_live)
    run.results = [RequestResult([1] * sum(a.tokens for a in by_live.values()), DecodeStats(), 0.0, 0.0, 0.0)]
    return run


def test_measure_schedule_is_keyed_by_the_live_requests_it_is_looked_up_by():
    """Each batch size's choice sits at the live counts its runs reach (where the engine reads the schedule),
    not at the batch size: B = 8 and 16 reach 6 live here, so B = 8's choice (AR steps) serves from 2 live on
    and B = 16 adds no entry; the old keying ('8:0,16:0') left every step of a 'B = 8' run drafting."""
    from dataclasses import replace

    from decoder.config import scheduled_draft_len
    from decoder.lab.batch_bench import format_batch_table, measure_schedule

    calls = []

    def timed(cfg, b):
        calls.append((cfg.load_schedule, b))
        k_at = (lambda live: 0) if cfg.method == "ar" else (lambda live: scheduled_draft_len(cfg, live))
        return _synthetic_run(b, k_at), {"unexplained_mismatches": 0}

    sd = DecodeConfig(method="sd", drafter="ngram", draft_len=4, ragged_verify=True, continuous_batching=True)
    ar = replace(sd, method="ar", load_schedule="")
    row = measure_schedule(timed, sd, ar, (1, 8, 16), repeats=1, progress=False)
    assert row["load_schedule"] == "1:2,2:0"
    assert ("1:2,2:0", 16) in calls  # the scheduled system runs in runs of its own
    b1, b8, b16 = row["points"]
    assert (b1["draft_len"], b1["max_live"], b1["live_from"], b1["steps_by_draft_len"]) == (2, 1, 1, {"2": 90})
    assert (b8["draft_len"], b8["max_live"], b8["live_from"]) == (0, 6, 2)
    assert b8["steps_by_draft_len"] == {"0": 120, "2": 30}  # 6 and 2 live: AR steps; the last request alone: 2
    assert b8["mean_live"] == pytest.approx(3.4) and b8["speedup"] > 1.0 and b1["speedup"] > 1.0
    assert (b16["max_live"], b16["live_from"]) == (6, None)
    report = {"deployment": "tiny", "prompts": "p", "num_prompts": 16, "max_new_tokens": 8, "dtype": "float32",
              "device": "cpu", "noise_floor": 0.0, "batch": [], "schedule": [{"name": "ngram", **row}],
              "prompts_ending_at_first_token": 6}
    text = format_batch_table(report)
    assert "6 of 16 prompts end at their first token" in text
    assert "B=8: draft 0 from 2 live (steps per draft length: 0: 120, 2: 30)" in text


def test_drafter_prefill_waits_while_the_schedule_says_ar_steps(tiny_models):
    """A request admitted at a load the schedule runs as AR steps skips the draft model's prefill (ragged: its
    first draft round catches up on prompt and tokens at once); outputs stay token-identical either way."""
    target, drafter, _, prompts = tiny_models
    n_new = 16
    full = [ar_generate(target, p, DecodeConfig(method="ar", max_new_tokens=n_new, stop_at_eos=False)).tokens
            for p in prompts]
    eos = full[0][2]  # requests end at different steps, so the first batch of 4 drains to 2 live mid-run
    refs = [_cut_at(f, eos) for f in full]
    assert sorted(len(r) for r in refs[:4])[1] < n_new  # two of the 4 end early: the rest run on alone
    base = DecodeConfig(method="sd", drafter="draft-model", draft_len=3, max_new_tokens=n_new, dtype="float32",
                        continuous_batching=True)
    for ragged, sched, drafter_runs in ((True, "1:0", False), (False, "1:0", True), (True, "1:3,3:0", True)):
        engine = BatchEngine(target, replace(base, ragged_verify=ragged, load_schedule=sched), 4, drafter, eos)
        calls = []

        def counted(*a, calls=calls, forward=engine.drafter.forward, **kw):
            calls.append(1)
            return forward(*a, **kw)

        engine.drafter.forward = counted
        run = engine.run([Request(p, 0.0, i) for i, p in enumerate(prompts[:4])])
        assert [r.tokens for r in run.results] == refs[:4], (ragged, sched)
        assert bool(calls) == drafter_runs, (ragged, sched)
        if sched != "1:0":  # admitted at 4 live (no drafter prefill), drafting once 2 or fewer are: a catch-up
            assert run.stats.drafted > 0
        else:
            assert run.stats.drafted == 0


def test_measured_schedule_on_a_tiny_model_is_lossless(tiny_models):
    """The whole measurement through the engine: the chosen schedule (whatever the timings) is valid and every
    scheduled and AR run is token-identical to single-request greedy."""
    from dataclasses import replace

    from decoder.lab.batch_bench import measure_schedule

    target, _, _, prompts = tiny_models
    n_new = 12
    refs = [ar_generate(target, p, DecodeConfig(method="ar", max_new_tokens=n_new, stop_at_eos=False)).tokens
            for p in prompts]
    eos = refs[2][3]
    refs = [_cut_at(r, eos) for r in refs]
    bt = BatchLM(target)
    seen = []

    def timed(cfg, b):
        run = BatchEngine(bt, cfg, b, eos_id=eos).run([Request(p, 0.0, i) for i, p in enumerate(prompts)])
        seen.append(cfg.load_schedule)
        return run, {"unexplained_mismatches": sum(r.tokens != ref for r, ref in zip(run.results, refs, strict=True))}

    sd = DecodeConfig(method="sd", drafter="ngram", draft_len=3, max_new_tokens=n_new, dtype="float32",
                      ragged_verify=True, continuous_batching=True)
    row = measure_schedule(timed, sd, replace(sd, method="ar"), (1, 4), repeats=1, progress=False)
    DecodeConfig(load_schedule=row["load_schedule"])
    assert row["load_schedule"] in seen
    assert all(pt["unexplained_mismatches"] == 0 for pt in row["points"])
    for pt in row["points"]:
        assert 0 < pt["max_live"] <= pt["batch_size"] and pt["mean_live"] <= pt["max_live"]
        assert sum(pt["steps_by_draft_len"].values()) > 0
    assert row["points"][0]["live_from"] == 1


# -- bench ------------------------------------------------------------------------------------------

@needs_demo
def test_batch_bench_report_contract(tmp_path):
    from decoder.lab.batch_bench import format_batch_table, run_batch_bench
    from decoder.models import DEMO_DIR

    rows = [json.loads(x) for x in (DEMO_DIR / "prompts" / "code.jsonl").read_text().splitlines()[:3]]
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": r["id"], "text": r["text"][-300:]} for r in rows])
    report = run_batch_bench(DEMO_DIR / "target", DEMO_DIR / "drafter", str(path), 8, (1, 2),
                             drafters=("ngram",), noise_prompts=1, progress=False)
    assert len(report["batch"]) == 2 * 8
    assert 0 <= report["prompts_ending_at_first_token"] <= 3
    for r in report["batch"]:
        assert {"batch_size", "ar_tokens_per_s", "sd_tokens_per_s", "speedup", "mechanisms"} <= set(r)
        assert set(r["mechanisms"]) == set(MECHS)
        assert r["speedup"] == pytest.approx(r["sd_tokens_per_s"] / r["ar_tokens_per_s"], rel=1e-3)
        assert r["unexplained_mismatches"] == 0 and r["new_tokens"] > 0
    assert "B=2 ngram: best" in format_batch_table(report)


@needs_demo
def test_batch_methods_on_another_forward_get_that_forwards_ar(tmp_path):
    """A batched method on a non-stock forward (onednn-matmul) is also divided by batched AR on the same forward,
    and a schedule's AR shares the method's forward: the ratio names speculation's gain alone."""
    from decoder.lab.batch_bench import format_batch_table, run_batch_bench
    from decoder.models import DEMO_DIR

    rows = [json.loads(x) for x in (DEMO_DIR / "prompts" / "code.jsonl").read_text().splitlines()[:3]]
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": r["id"], "text": r["text"][-300:]} for r in rows])
    report = run_batch_bench(DEMO_DIR / "target", None, str(path), 8, (1, 2), drafters=(),
                             methods=("ar-lean-dnn", "sd-ngram-lean"), noise_prompts=1, progress=False,
                             dtype="float32")  # oneDNN packs float32 on every x86 CPU; bfloat16 needs AVX512
    by = {(r["name"], r["batch_size"]): r for r in report["batch_methods"]}
    for b in (1, 2):
        dnn, plain = by[("ar-lean-dnn", b)], by[("sd-ngram-lean", b)]
        assert dnn["forward"] == {"matmul_t_rows": 0, "matmul_backend": "onednn", "fused_mlp_rows": 0,
                                  "fused_layer": False, "bf16w_rows": 64}
        assert dnn["speedup_vs_same_forward_ar"] == pytest.approx(
            dnn["tokens_per_s"] / dnn["same_forward_ar_tokens_per_s"], rel=1e-3)
        assert dnn["unexplained_mismatches"] == dnn["same_forward_ar_unexplained_mismatches"] == 0
        assert "forward" not in plain and "speedup_vs_same_forward_ar" not in plain  # stock forward: plain AR only
    assert "x batched AR on its forward" in format_batch_table(report)
    sched = run_batch_bench(DEMO_DIR / "target", None, str(path), 8, (1, 2), drafters=(),
                            methods=("sd-ngram-lean-dnn",), noise_prompts=1, progress=False, schedule=True,
                            dtype="float32")
    sc = sched["schedule"][0]
    assert sc["name"] == "sd-ngram-lean-dnn" and sc["ar_forward"]["matmul_backend"] == "onednn"
    assert "against batched AR with ragged verify and continuous batching, matmul_t_rows = 0, matmul_backend = " \
           "'onednn', fused_mlp_rows = 0, fused_layer = False, bf16w_rows = 64:" in format_batch_table(sched)


def test_cli_bad_batch_sizes_one_line_error(capsys):
    from workbench.cli import main

    assert main(["bench", "--batch-sizes", "1,0"]) == 2
    err = capsys.readouterr().err
    assert "--batch-sizes 1,0" in err and len(err.strip().splitlines()) == 1


# -- every bench method in the batched engine -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models():
    """A tiny fp32 target, a drafter that agrees with it most of the time (so trees accept deep paths), and
    random feature drafters and a router on it: lossless holds whatever the drafts are."""
    import copy

    from decoder.featdraft import BlockDrafter, BlockDrafterConfig, DomainRouter, FeatureHeads, MTPConfig, MTPHeads

    target = tiny_llama(vocab=96, hidden=64, layers=2, seed=3)
    drafter = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.003)
    heads = FeatureHeads(None, target.config, torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    heads.set_model("block", BlockDrafter(BlockDrafterConfig(64, [0, 1], 96, num_heads=2, num_kv_heads=1,
                                                             intermediate=64, block_size=8, max_position=256)).eval())
    heads.set_model("mtp", MTPHeads(MTPConfig(64, [1], 96, num_heads=6), target.model.norm.weight).eval())
    heads.set_router(DomainRouter([0.0] * 96, 0.0, ("code", "prose")))
    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 96, (int(n),), generator=rng).tolist()
               for n in torch.randint(3, 30, (9,), generator=rng)]
    return target, drafter, heads, prompts


BATCHED_METHODS = ("ar-lean", "sd-draft-model-lean", "sd-ngram-lean", "sd-tree", "sd-two-level", "sd-dcut",
                   "sd-block", "sd-mtp", "sd-routed", "ar-lean-t", "sd-draft-model-lean-t", "ar-lean-dnn",
                   "sd-draft-model-lean-dnn", "sd-mtp-dnn")


@pytest.mark.parametrize("name", BATCHED_METHODS)
def test_every_bench_method_is_lossless_batched(name, tiny_models):
    """Each bench preset runs in the batched engine (per-request proposers for trees, D-cut and feature
    drafters) token-identical to its single-request run, with the same tau, at B = 1, 4, 8, ragged or not."""
    from decoder.generate import generate
    from decoder.presets import preset_config

    target, drafter, heads, prompts = tiny_models
    base = DecodeConfig(max_new_tokens=24, dtype="float32", stop_at_eos=False)
    single = [generate(preset_config(name, base), target, p, drafter, heads=heads) for p in prompts]
    ref = [g.tokens for g in single]
    forwards = sum(g.stats.target_forwards for g in single)
    for b, ragged in itertools.product((1, 4, 8), (False, True)):
        cfg = preset_config(name, base, ragged_verify=ragged)
        eng = BatchEngine(target, cfg, b, drafter, heads=heads)
        run = eng.run([Request(p, 0.0, i) for i, p in enumerate(prompts)])
        assert eng.target.lean.t_rows == cfg.matmul_t_rows  # mechanism transposed-matmul reaches the engine
        assert eng.target.lean.matmul_backend == cfg.matmul_backend  # and onednn-matmul
        assert [r.tokens for r in run.results] == ref, (name, b, ragged)
        assert sum(r.stats.target_forwards for r in run.results) == forwards, (name, b, ragged)
    if name in ("sd-tree", "sd-two-level"):
        assert sum(g.stats.accepted for g in single) > 2 * len(prompts)  # deep paths were accepted and compacted


def test_mtp_comb_tree_is_lossless_single_and_batched(tiny_models):
    """Mechanism mtp-tree: the MTP heads' comb tree (each head's next tokens beside the chain) gives AR's tokens
    through `generate` and through the batched engine (per-request trees from one batched heads forward), and
    drafts trees of 1 + k * (1 + alts) positions."""
    from decoder.generate import generate
    from decoder.presets import preset_config

    target, drafter, heads, prompts = tiny_models
    base = DecodeConfig(max_new_tokens=24, dtype="float32", stop_at_eos=False)
    ref = [ar_generate(target, p, replace(base, method="ar")).tokens for p in prompts]
    accepted = {}
    for alts in (0, 1, 3):
        cfg = preset_config("sd-mtp", base, mtp_tree_alts=alts, draft_len=4)
        single = [generate(cfg, target, p, drafter, heads=heads) for p in prompts]
        assert [g.tokens for g in single] == ref, alts
        accepted[alts] = sum(g.stats.accepted for g in single)
        for b in (1, 4):
            run = BatchEngine(target, cfg, b, drafter, heads=heads).run([Request(p, 0.0, i) for i, p in
                                                                         enumerate(prompts)])
            assert [r.tokens for r in run.results] == ref, (alts, b)
    assert accepted[3] > accepted[0]  # alternatives were accepted (deterministic: fixed seeds; 59 against 50)
    pr = heads.new_state("mtp", LeanLM(target), 0, 3)
    pr.h = torch.zeros(target.config.hidden_size)
    d = pr.propose(prompts[0], 4)  # 4 heads' top-1 chain, 3 alternatives beside each chain node
    assert d.tree is not None and d.size == 4 * (1 + 3) and d.tree.parents[:4].tolist() == [-1, 0, 1, 2]
    with pytest.raises(ConfigError, match="mtp_tree_alts = 2 is invalid: only the MTP heads draft a comb tree"):
        DecodeConfig(mtp_tree_alts=2, lean_forward=True)
    pr.trees(False)  # mechanism load-tree: the same heads' chain, then the tree again
    assert pr.propose(prompts[0], 4).tree is None
    pr.trees(True)
    assert pr.propose(prompts[0], 4).size == 16
    cfg = preset_config("sd-mtp", base, mtp_tree_alts=3, draft_len=4, tree_max_live=1)
    run = BatchEngine(target, cfg, 4, drafter, heads=heads).run([Request(p, 0.0, i) for i, p in enumerate(prompts)])
    assert [r.tokens for r in run.results] == ref


def test_batched_feature_proposers_get_the_accepted_positions_hidden_states(tiny_models):
    """A feature proposer under batching receives, after each step, the target's hidden states of exactly
    the positions it accepted: checked with an oracle that drafts the reference continuation."""
    from decoder.featdraft import FeatureHeads
    from decoder.proposer import Draft, Proposer

    target, _, _, prompts = tiny_models
    cfg = DecodeConfig(max_new_tokens=20, dtype="float32", stop_at_eos=False, lean_forward=True, drafter="mtp",
                       draft_len=4)
    refs = {tuple(p): ar_generate(target, p, DecodeConfig(method="ar", max_new_tokens=20, dtype="float32",
                                                          stop_at_eos=False)).tokens for p in prompts}
    seen: dict[tuple, list] = {}

    class Oracle(Proposer):
        capture = (1,)

        def reset(self, prompt, hidden=None):
            self.key, self.feats = tuple(prompt), [hidden]
            seen[self.key] = self.feats

        def propose(self, tokens, k):
            ref = refs[self.key]
            done = len(tokens) - len(self.key)
            return Draft(torch.tensor(ref[done : done + k], dtype=torch.long))

        def accepted(self, tokens, verdict):
            assert verdict.hidden.shape[0] == verdict.n + 1
            self.feats.append(verdict.hidden)

    heads = FeatureHeads(None, target.config, torch.float32, torch.device("cpu"))
    heads.model = lambda kind: type("M", (), {"c": type("C", (), {"target_layers": [1]})})()
    heads.new_state = lambda kind, lean, draft_vocab=0, alts=0: Oracle()
    run = BatchEngine(target, cfg, 4, heads=heads).run([Request(p, 0.0, i) for i, p in enumerate(prompts)])
    lean = LeanLM(target)
    for p, r in zip(prompts, run.results, strict=True):
        assert r.tokens == refs[tuple(p)]
        assert r.stats.accepted == r.stats.drafted  # the oracle is always right
        got = torch.cat(seen[tuple(p)])  # [positions, F]: prompt, then every accepted position in order
        _, want = lean.forward(torch.tensor(p + r.tokens[:-1]), lean.new_cache(), capture=(1,))
        assert got.shape == want[: got.shape[0]].shape and got.shape[0] >= len(p) + len(r.tokens) - 4
        assert torch.allclose(got, want[: got.shape[0]], atol=1e-4)
