"""Load profiles (#21): the per-load speculation schedule in both decode loops, the batched request of the
serve protocol and the harness, paired benchmarks and forcing under load, and the workspace's `load` table."""

import json
import sys
from pathlib import Path

import pytest

from decoder.batch import BatchEngine, Request
from decoder.config import ConfigError, DecodeConfig, parse_load_schedule, scheduled_draft_len
from decoder.generate import ar_generate, generate
from decoder.mechanisms import REGISTRY
from tests.conftest import fake_system
from workbench.forcing import _force_batched
from workbench.harness import SystemCrash, SystemProcess
from workbench.measure import (
    LOAD_FLOOR,
    MIN_BATCH_UNITS,
    PASS_PROMPTS,
    LoadResult,
    PairResult,
    Prompt,
    _epochs,
    paired_bench,
    warm_prompt,
)
from workbench.workspace import WorkspaceError, load_points

# -- the schedule ----------------------------------------------------------------------------------


def test_schedule_parses_and_picks_the_entry_for_each_load():
    assert parse_load_schedule("") == ()
    assert parse_load_schedule("1:4, 8:2,16:0") == ((1, 4), (8, 2), (16, 0))
    cfg = DecodeConfig(load_schedule="1:4,8:2,16:0")
    assert [scheduled_draft_len(cfg, b) for b in (0, 1, 7, 8, 15, 16, 64)] == [4, 4, 4, 2, 2, 0, 0]
    assert scheduled_draft_len(DecodeConfig(), 8) is None
    assert DecodeConfig.from_toml(cfg.to_toml()) == cfg


@pytest.mark.parametrize("text, needle", [
    ("8:2", "start at 1"), ("1:4,1:2", "rise strictly"), ("1:x", "'1:x' is not BATCH:DRAFT_LEN"),
    ("1:33", "draft lengths 0 to 32"), ("1:4,8", "'8' is not BATCH:DRAFT_LEN"),
])
def test_bad_schedules_are_one_line_naming_the_value(text, needle):
    with pytest.raises(ConfigError) as e:
        DecodeConfig(load_schedule=text)
    msg = str(e.value)
    assert f"load_schedule = {text!r}" in msg and needle in msg and "\n" not in msg


def test_schedule_is_a_registered_batching_mechanism_off_in_stock():
    m = REGISTRY["load-schedule"]
    assert m.family == "batching" and m.stock == {"load_schedule": ""} and DecodeConfig().load_schedule == ""
    for value in m.keys["load_schedule"]:
        DecodeConfig(load_schedule=value)  # every grid value is valid


@pytest.fixture(scope="module")
def models(tiny_fp32):
    return tiny_fp32  # a tiny fp32 target and a drafter that mostly agrees with it (conftest)


PROMPTS = [[1, 5, 9, 2, 7], [3, 3, 8], [10, 20, 30, 40, 50, 60], [4, 11], [7, 7, 7, 1], [2, 9, 4, 6]]


def _refs(target, n):
    return [ar_generate(target, p, DecodeConfig(method="ar", max_new_tokens=n, dtype="float32",
                                                 stop_at_eos=False)).tokens for p in PROMPTS]


@pytest.mark.parametrize("drafter", ["draft-model", "ngram"])
def test_batched_engine_follows_the_schedule_and_stays_lossless(models, drafter):
    """fp32: every request token-identical to its single-request greedy run, whatever the schedule; a load
    of 4 live requests under '1:3,4:0' drafts nothing while 4 are live, and drafts once fewer remain."""
    target, dm = models
    n = 24
    refs = _refs(target, n)
    base = dict(max_new_tokens=n, dtype="float32", stop_at_eos=False, drafter=drafter, draft_len=3)
    for sched in ("", "1:0", "1:3,4:0", "1:2,2:4,6:1"):
        cfg = DecodeConfig(**base, load_schedule=sched)
        run = BatchEngine(target, cfg, 4, dm if drafter == "draft-model" else None).run(
            [Request(p, 0.0, i) for i, p in enumerate(PROMPTS)])
        assert [r.tokens for r in run.results] == refs, sched
        if sched == "1:0":
            assert run.stats.drafted == 0
    # 4 requests of equal length under "1:3,4:0": all four stay live together, so no step drafts.
    cfg = DecodeConfig(**base, load_schedule="1:3,4:0")
    four = BatchEngine(target, cfg, 4, dm if drafter == "draft-model" else None).run(
        [Request(PROMPTS[0], 0.0, i) for i in range(4)])
    assert four.stats.drafted == 0 and four.stats.target_forwards >= 4 * (n - 1)
    three = BatchEngine(target, cfg, 3, dm if drafter == "draft-model" else None).run(
        [Request(PROMPTS[0], 0.0, i) for i in range(3)])
    assert three.stats.drafted > 0


def test_single_request_loop_reads_the_schedule_at_one_request(models):
    target, dm = models
    n = 20
    ref = _refs(target, n)[0]
    common = dict(max_new_tokens=n, dtype="float32", stop_at_eos=False)
    off = generate(DecodeConfig(**common, load_schedule="1:0,4:3"), target, PROMPTS[0], dm)
    assert off.tokens == ref and off.stats.drafted == 0  # plain AR at one request
    on = generate(DecodeConfig(**common, load_schedule="1:5,4:0"), target, PROMPTS[0], dm)
    assert on.tokens == ref and on.stats.drafted > 0 and max(on.stats.accept_hist) <= 5


# -- the serve protocol and the harness ---------------------------------------------------------------

ECHO_BATCH = fake_system(r'''
n = req["max_new_tokens"]
if "batch" in req:
    mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
    outs = [[(p[0] + 1) % 50] * n for p in req["batch"]]  # a model that reads the first token only
    if mode == "short":
        outs = outs[:-1]
    if mode == "wrong" and len(outs) > 1 and n > 2:
        outs[1][2] = 49
    print(json.dumps({"id": req["id"], "outputs": outs}), flush=True)
else:
    print(json.dumps({"id": req["id"], "tokens": [(req["prompt_ids"][0] + 1) % 50] * n}), flush=True)
''')


def _echo(tmp_path: Path, mode: str = "ok") -> SystemProcess:
    wt = tmp_path / f"wt-{mode}"  # a folder the sandbox's uid can read (tmp_path itself is 0700)
    wt.mkdir(exist_ok=True)
    (wt / "echo.py").write_text(ECHO_BATCH)
    return SystemProcess(wt, [sys.executable, "-I", str(wt / "echo.py"), mode])


def test_generate_batch_returns_outputs_in_order_and_checks_their_shape(tmp_path):
    with _echo(tmp_path) as sp:
        r = sp.generate_batch([[1], [2, 3], [9]], 4)
        assert r.outputs == [[2] * 4, [3] * 4, [10] * 4] and r.seconds > 0
    with _echo(tmp_path, "short") as sp, pytest.raises(SystemCrash) as e:
        sp.generate_batch([[1], [2]], 3)
    assert e.value.kind == "protocol" and "2 integer token lists" in e.value.reason


def test_paired_bench_under_load_times_batches_and_checks_every_output(tmp_path):
    prompts = [Prompt(f"p{i}", [i]) for i in range(6)]
    calls = []

    def check(pid, toks):
        calls.append(pid)
        return None

    with _echo(tmp_path) as a, _echo(tmp_path) as b:
        res = paired_bench(a, b, prompts, 3, min_passes=2, max_passes=2, batch=4, check_b=check)
    # MIN_BATCH_UNITS units of 4 prompts a pass (in epochs: a batch of 4 fits 6 prompts once): every output checked.
    assert res.passes == 2 and len(calls) == 2 * MIN_BATCH_UNITS * 4 and set(calls) == {f"p{i}" for i in range(6)}
    assert res.a_tokens_per_s > 0 and not res.mismatched_prompts


# An adversary's system, as a cache of answers would see it: a prompt this process answered before (in an
# earlier request, the warm-up's included, or earlier in the same batch), or whose reverse it answered (the
# warm-up prompt was the first prompt reversed: a system could precompute that prompt's answer while warming
# up), gets a wrong answer, which the benchmark's check of every timed output then reports.
RECORDER = fake_system(r'''
n = req["max_new_tokens"]
outs = []
for p in req.get("batch") or [req["prompt_ids"]]:
    outs.append([49] * n if tuple(p) in seen else [(p[0] + 1) % 50] * n)
    seen.update((tuple(p), tuple(reversed(p))))
print(json.dumps({"id": req["id"], **({"outputs": outs} if "batch" in req else {"tokens": outs[0]})}), flush=True)
''', setup=r'''
seen = set()
''')


def _recorder(tmp_path: Path, side: str) -> SystemProcess:
    wt = tmp_path / f"wt-rec-{side}"
    wt.mkdir(exist_ok=True)
    (wt / "rec.py").write_text(RECORDER)
    return SystemProcess(wt, [sys.executable, "-I", str(wt / "rec.py")])


@pytest.mark.parametrize("count,batch", [(6, 4), (7, 1), (20, 1), (9, 4), (32, 8), (40, 2)])
def test_no_process_is_timed_twice_on_a_prompt_and_no_batch_repeats_one(tmp_path, count, batch):
    """With fewer prompts than a pass's batches need (6 prompts, 4 units of 4), a pass runs in epochs and both
    sides start afresh between them; each batch holds distinct prompts; the warm-up is none of them."""
    prompts = [Prompt(f"p{i}", [i, 40 + i, 7, 8, 9, 10, 11, 12]) for i in range(count)]
    checked = []

    def check(pid, toks):
        checked.append(pid)
        want = (int(pid[1:]) + 1) % 50
        return None if toks == [want] * len(toks) else f"{pid}: the answer of a prompt the process had seen"

    with _recorder(tmp_path, "a") as a, _recorder(tmp_path, "b") as b:
        res = paired_bench(a, b, prompts, 3, min_passes=2, max_passes=2, batch=batch, check_b=check)
    use = min(count, max(PASS_PROMPTS, MIN_BATCH_UNITS * batch))  # the prompts a pass times
    units = max(MIN_BATCH_UNITS, -(-use // batch)) if batch > 1 else use
    assert res.passes == 2 and len(checked) == 2 * units * batch and not res.mismatched_prompts
    assert set(checked) == {p.id for p in prompts[:max(PASS_PROMPTS, MIN_BATCH_UNITS * batch)]}


def test_epochs_time_each_prompt_about_equally_and_refuse_fewer_prompts_than_a_batch(tmp_path):
    prompts = [Prompt(f"p{i}", [i]) for i in range(6)]
    epochs = _epochs(prompts, 4)  # one batch of 4 fits 6 prompts: 4 epochs, the 2 left over go first next time
    assert [len(e) for e in epochs] == [1] * MIN_BATCH_UNITS
    counts = {p.id: 0 for p in prompts}
    for e in epochs:
        ids = [p.id for unit in e for p in unit]
        assert len(ids) == len(set(ids)) == 4
        for i in ids:
            counts[i] += 1
    assert sorted(counts.values()) == [2, 2, 3, 3, 3, 3]
    one = _epochs([Prompt(f"p{i}", [i]) for i in range(40)], 8)  # a pass at B = 8: the first 32, each once
    assert len(one) == 1 and {p.id for unit in one[0] for p in unit} == {f"p{i}" for i in range(32)}
    single = _epochs([Prompt(f"p{i}", [i]) for i in range(40)], 1)  # at one request: the first PASS_PROMPTS
    assert len(single) == 1 and sorted(int(u[0].id[1:]) for u in single[0]) == list(range(PASS_PROMPTS))
    with _echo(tmp_path) as a, _echo(tmp_path) as b, pytest.raises(ValueError, match="at least 8 distinct prompts"):
        paired_bench(a, b, prompts, 3, min_passes=1, max_passes=1, batch=8)
    warm = warm_prompt(prompts)  # drawn from the prompts' tokens, as long as the first unless it is one of them
    assert set(warm.ids) <= set(range(6)) and len(warm.ids) == 2 and warm.ids not in [p.ids for p in prompts]
    assert all(warm_prompt([Prompt("a", [3, 4]), Prompt("b", [4, 3])]).ids not in ([3, 4], [4, 3]) for _ in range(50))


def test_load_result_aggregates_by_geometric_mean_and_names_the_worst_point():
    def pr(x):
        return PairResult(x, x - 0.01, x + 0.01, 3, 1.0, x)

    one = LoadResult({1: pr(1.5)})
    assert one.speedup == 1.5 and one.as_dict() == pr(1.5).as_dict() and "points" not in one.as_dict()
    two = LoadResult({1: pr(2.0), 8: pr(0.5)})
    assert two.speedup == pytest.approx(1.0) and two.worst == (8, 0.5) and two.first.speedup == 2.0
    d = two.as_dict()
    assert d["points"]["8"]["speedup"] == 0.5 and d["speedup"] == pytest.approx(1.0)
    assert "B=8 0.500x" in two.line() and 0.5 < LOAD_FLOOR


def test_forcing_under_load_finds_the_position_and_keeps_the_load(tmp_path):
    stock = {i: [(i + 1) % 50] * 5 for i in range(3)}
    prompts = [{"id": f"p{i}", "split": "visible", "prompt_ids": [i], "stock": stock[i], "margins": [9.0] * 5}
               for i in range(3)]

    class Tok:
        def decode(self, ids):
            return str(ids)

    with _echo(tmp_path) as sp:
        mm, checked = _force_batched(sp, prompts, 2, 16, Tok())
    assert mm == [] and checked == 15
    with _echo(tmp_path, "wrong") as sp:
        mm, checked = _force_batched(sp, prompts, 2, 16, Tok())
    # The second request of each batch is wrong at its third token: p1 in the first batch, and the filler
    # (unused) in the second; p1 is asked again from stock's tokens through position 2 and then matches.
    assert [(m["prompt_id"], m["position"], m["batch"]) for m in mm] == [("p1", 2, 2)]
    assert checked == 15


# -- the workspace's load table -----------------------------------------------------------------------

def test_load_points_read_the_table_and_the_older_key():
    p = Path("specpilot.toml")
    assert load_points({}, p) == [1]
    assert load_points({"load": {"batch_sizes": [1, 8]}}, p) == [1, 8]
    assert load_points({"batch_sizes": [1, 4]}, p) == [1, 4]


@pytest.mark.parametrize("dep, needle", [
    ({"load": {"batch_sizes": [8, 1]}}, "[8, 1] is invalid"),
    ({"load": {"batch_sizes": [0]}}, "[0] is invalid"),
    ({"load": {"batch_sizes": []}}, "[] is invalid"),
    ({"load": {"rate": 4}}, "unknown key(s) rate"),
    ({"load": 8}, "must be a table"),
])
def test_bad_load_tables_are_one_line(dep, needle):
    with pytest.raises(WorkspaceError) as e:
        load_points(dep, Path("ws/specpilot.toml"))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_workspace_with_a_load_round_trips(tmp_path):
    from workbench.workspace import WorkspaceConfig

    cfg = WorkspaceConfig(name="x", target=tmp_path, drafter=None, tokenizer=tmp_path, batch_sizes=[1, 8],
                          entry=["python"])
    path = tmp_path / "specpilot.toml"
    path.write_text(cfg.to_toml())
    assert "load = {batch_sizes = [1, 8]}" in path.read_text()
    assert WorkspaceConfig.load(path).batch_sizes == [1, 8]
    assert json.loads(json.dumps(cfg.batch_sizes)) == [1, 8]


def test_the_demo_hides_enough_distinct_prompts_for_a_pass_at_b8_and_a_small_one_is_refused(tmp_path):
    """The demo's hidden split holds its 6 held-out prompts plus the 26 timing prompts: a B = 8 pass times 32
    distinct prompts, none visible and none repeated. A workspace with fewer prompts than its largest batch is
    refused at init, in one line, and nothing is created."""
    from decoder.models import DEMO_DIR
    from workbench.cascade import timing_prompts
    from workbench.workspace import init_demo

    ws = init_demo(tmp_path / "demo", batch_sizes=[1, 8], dtype="float32")
    hidden = [json.loads(ln) for ln in ws.hidden_prompts_path().read_text().splitlines()]
    visible = [json.loads(ln) for ln in (ws.path / "prompts" / "visible.jsonl").read_text().splitlines()]
    timing = [json.loads(ln) for ln in (DEMO_DIR / "prompts" / "code-timing.jsonl").read_text().splitlines()]
    assert len(hidden) == 6 + len(timing) == MIN_BATCH_UNITS * 8 and len(visible) == 10
    assert len({r["id"] for r in hidden + visible}) == 42
    assert not {r["text"] for r in hidden} & {r["text"] for r in visible}
    assert [p.id for p in timing_prompts(ws)] == [r["id"] for r in hidden]
    assert len(_epochs(timing_prompts(ws), 8)) == 1  # one epoch a pass: one fresh process per side
    with pytest.raises(WorkspaceError) as e:
        init_demo(tmp_path / "small", batch_sizes=[1, 8], prompt_limit=4, dtype="float32")
    assert "load batch size 8 needs at least 8 distinct prompts" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "small").exists()


def test_the_loop_refuses_a_load_batch_larger_than_its_prompts_in_one_line(tmp_path, capsys):
    """A workspace edited after init to a batch its prompts cannot fill: `specpilot-tui --auto` says so in one
    line (exit 2) before measuring anything."""
    from workbench.tui_entry import main as tui_main
    from workbench.workspace import init_demo

    ws = init_demo(tmp_path / "demo", forcing_max_new_tokens=8, prompt_limit=4, hidden=1, dtype="float32")
    ws.close()
    toml = ws.path / "specpilot.toml"
    toml.write_text(toml.read_text().replace("load = {batch_sizes = [1]}", "load = {batch_sizes = [1, 8]}"))
    rc = tui_main(["--auto", "--workspace", str(ws.path), "--rounds", "1", "--no-global-memory"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: ") and len([ln for ln in err if ln.startswith("error")]) == 1
    assert "load batch size 8 needs at least 8 distinct prompts and the workspace has 4" in err[-1]
    assert not (ws.path / ".specpilot" / "stock").exists() or not any((ws.path / ".specpilot" / "stock").iterdir())


def test_serve_answers_a_batch_with_each_request_s_greedy_tokens(tmp_path, models):
    """The system's batched request: fp32, every output token-identical to that prompt's single-request AR,
    under stock SD, a schedule and AR; a bad batch is a one-line error and the server keeps serving."""
    import subprocess

    target, dm = models
    target.save_pretrained(tmp_path / "t")
    dm.save_pretrained(tmp_path / "d")
    n = 12
    refs = _refs(target, n)
    (tmp_path / "system.toml").write_text(DecodeConfig(dtype="float32", stop_at_eos=False).to_toml())
    reqs = [{"id": 1, "batch": PROMPTS, "max_new_tokens": n},
            {"id": 2, "batch": PROMPTS[:3], "max_new_tokens": n, "config": {"load_schedule": "1:4,3:0"},
             "profile": True},
            {"id": 3, "batch": PROMPTS[:2], "max_new_tokens": n, "config": {"method": "ar"}},
            {"id": 4, "batch": [], "max_new_tokens": n},
            {"id": 5, "batch": [[1, "x"]], "max_new_tokens": n},
            {"id": 6, "prompt_ids": PROMPTS[0], "max_new_tokens": n}]
    out = subprocess.run([sys.executable, "-m", "decoder.serve", "--target", str(tmp_path / "t"), "--drafter",
                          str(tmp_path / "d"), "--config", str(tmp_path / "system.toml")],
                         input="".join(json.dumps(r) + "\n" for r in reqs), capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert lines[0]["ready"] is True, out.stderr[-2000:]
    ans = {a["id"]: a for a in lines[1:]}
    assert ans[1]["outputs"] == refs
    assert ans[2]["outputs"] == refs[:3] and ans[2]["stats"]["drafted"] == 0  # 3 live: the schedule's AR steps
    assert ans[3]["outputs"] == refs[:2]
    assert "batch must be a list of 1 to 256 prompts" in ans[4]["error"]
    assert ans[5]["error"].startswith("bad request:") and "\n" not in ans[5]["error"]
    assert ans[6]["tokens"] == refs[0]


def test_mtp_heads_draft_for_every_request_in_one_batched_forward(models, monkeypatch):
    """MTPState.propose_many gives each request the draft its own `propose` gives, from one call of the
    heads for all of them; the batched engine drafts that way (one heads call per step, not one per request)."""
    import torch

    from decoder.featdraft import FeatureHeads, MTPConfig, MTPHeads, MTPState
    from decoder.lean import LeanLM

    target, _ = models
    torch.manual_seed(0)
    heads = FeatureHeads(None, target.config, torch.float32, torch.device("cpu"))
    heads.set_model("mtp", MTPHeads(MTPConfig(64, [1], 96, num_heads=4), target.model.norm.weight).eval())
    lean = LeanLM(target)
    states = []
    for i in range(5):
        st = heads.new_state("mtp", lean)
        st.reset(PROMPTS[i], torch.randn(3, 64, generator=torch.Generator().manual_seed(i)))
        states.append(st)
    tokens, ks = [PROMPTS[i] for i in range(5)], [4, 2, 3, 4, 1]
    one_by_one = [st.propose(t, k).tokens.tolist() for st, t, k in zip(states, tokens, ks, strict=True)]
    assert [d.tokens.tolist() for d in MTPState.propose_many(states, tokens, ks)] == one_by_one
    calls = []
    real = MTPHeads.hidden
    monkeypatch.setattr(MTPHeads, "hidden", lambda self, h, e: calls.append(h.shape) or real(self, h, e))
    cfg = DecodeConfig(max_new_tokens=12, dtype="float32", stop_at_eos=False, lean_forward=True, drafter="mtp",
                       draft_len=3)
    run = BatchEngine(target, cfg, 4, heads=heads).run([Request(p, 0.0, i) for i, p in enumerate(PROMPTS[:4])])
    assert [r.tokens for r in run.results] == [t[:12] for t in _refs(target, 12)[:4]]
    assert calls and calls[0] == (4, 64) and len(calls) == run.steps


def test_a_pruned_mtp_head_drafts_only_frequent_tokens_and_stays_lossless(models):
    """draft_vocab: the heads score only the ranking's top tokens; every draft token lies in them, and the
    output is the target's greedy one, alone and batched; a missing ranking is a one-line error with the fix."""
    import torch

    from decoder.featdraft import FeatureDrafterError, FeatureHeads, MTPConfig, MTPHeads
    from decoder.lean import LeanLM

    target, _ = models
    torch.manual_seed(0)
    heads = FeatureHeads(None, target.config, torch.float32, torch.device("cpu"))
    heads.set_model("mtp", MTPHeads(MTPConfig(64, [1], 96, num_heads=4), target.model.norm.weight).eval())
    cfg = DecodeConfig(max_new_tokens=16, dtype="float32", stop_at_eos=False, lean_forward=True, drafter="mtp",
                       draft_len=4, draft_vocab=64)
    with pytest.raises(FeatureDrafterError, match="train drafter --kind vocab"):
        generate(cfg, target, PROMPTS[0], heads=heads)
    rank = list(range(95, -1, -1))  # "most frequent" = the highest ids
    heads.set_vocab_rank(rank)
    st = heads.new_state("mtp", LeanLM(target), 64)
    st.reset(PROMPTS[0], torch.randn(2, 64))
    assert set(st.propose(PROMPTS[0], 4).tokens.tolist()) <= set(rank[:64])
    refs = _refs(target, 16)
    assert [generate(cfg, target, p, heads=heads).tokens for p in PROMPTS] == refs
    run = BatchEngine(target, cfg, 4, heads=heads).run([Request(p, 0.0, i) for i, p in enumerate(PROMPTS)])
    assert [r.tokens for r in run.results] == refs
    with pytest.raises(ConfigError, match="draft_vocab = 10"):
        DecodeConfig(drafter="mtp", lean_forward=True, draft_vocab=10)


def test_the_noise_is_the_largest_deviation_over_runs_and_points():
    from workbench.cascade import noise_of

    assert noise_of([{"speedup": 1.03}]) == pytest.approx(0.03)  # one point: the runs' speedups only
    assert noise_of([{"speedup": 0.96}, {"speedup": 1.01}]) == pytest.approx(0.04)
    runs = [{"speedup": 1.01, "points": {"1": 1.05, "8": 0.9}}, {"speedup": 0.99, "points": {"1": 1.0, "8": 1.02}}]
    assert noise_of(runs) == pytest.approx(0.1)  # B = 8's 0.9 in the first run, hidden by its aggregate
