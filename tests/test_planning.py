"""Planning a round is a pure function of the gaps, the explored families, the base config and the memory."""

from __future__ import annotations

from decoder.config import DecodeConfig
from workbench.agents.tuner import Candidate, compose, compositions
from workbench.planning import plan_directions, registry_mechanisms

BD = {"families": {"host-overhead": 5.0, "drafting": 2.7, "acceptance": 3.9, "kv": 0.0, "batching": 0.0},
      "gaps": [{"name": "framework overhead", "family": "host-overhead"}, {"name": "drafter", "family": "drafting"},
               {"name": "rejected drafts", "family": "acceptance"}]}


def _plan(memory=None, **kw):
    memory = memory or {}
    args = {"agents": 2, "agent": "tuner", "device": "cpu", "base_cfg": None, "transfer_tried": False,
            "memory_for": lambda fam: memory.get(fam, []), **kw}
    exhausted = args.pop("exhausted", set())
    return plan_directions(BD, exhausted, **args)


def test_largest_gaps_first_capped_at_the_agents_and_nothing_for_empty_families():
    dirs, tried = _plan()
    assert [d.family for d in dirs] == ["host-overhead", "acceptance"] and not tried
    assert "framework overhead" in dirs[0].summary and dirs[0].mechanisms == registry_mechanisms("host-overhead", "cpu")
    assert [d.family for d in _plan(exhausted={"host-overhead"})[0]] == ["acceptance", "drafting"]


def test_families_with_nothing_left_on_the_base_get_no_tuner():
    lean = DecodeConfig(lean_forward=True, matmul_t_rows=3, matmul_backend="onednn",  # host-overhead on a CPU: all on
                        fused_mlp_rows=128)
    assert [d.family for d in _plan(base_cfg=lean)[0]] == ["acceptance", "drafting"]
    assert [d.family for d in _plan(base_cfg=lean, agent="llm")[0]] == ["acceptance", "drafting"]


def test_memory_goes_first_and_the_first_agent_composes_what_was_accepted_elsewhere():
    mem = {"drafting": [{"name": "mtp", "config": {"drafter": "mtp"}}],
           "acceptance": [{"name": "tree", "config": {"verify": "tree"}}]}
    dirs, tried = _plan(memory=mem, agents=1)
    assert tried and [d.family for d in dirs] == ["acceptance"]
    assert "transfer" in dirs[0].summary and [m["name"] for m in dirs[0].memory] == ["tree", "mtp"]
    again, tried_again = _plan(memory=mem, agents=1, transfer_tried=True)
    assert not tried_again and [m["name"] for m in again[0].memory] == ["tree"]


def test_the_tuners_measured_schedule_is_keyed_by_the_live_requests_a_batch_reaches():
    """The engine looks a load schedule up by live requests; a batch of 8 whose prompts end at their first token
    has fewer. Rates are scripted (the timing is what cannot be asserted here); the keying is the tuner's own."""
    import threading
    from types import SimpleNamespace

    from decoder.mechanisms import contract_for
    from workbench.agents.base import AgentContext, Direction
    from workbench.agents.tuner import TunerAgent

    rates = {1: {0: 100.0, 1: 110.0, 2: 130.0, 3: 120.0, 4: 90.0},  # B = 1: draft 2 wins
             8: {0: 400.0, 1: 405.0, 2: 300.0, 3: 250.0, 4: 200.0}}  # B = 8: draft 1 is within 3% of AR: AR

    class Scripted(TunerAgent):
        def _score_load(self, sp, cfg, prompts, n, ref, threshold):
            k = int(cfg.load_schedule.split(":")[1])
            return {b: rates[b][k] for b in self.points}, ""

    ws = SimpleNamespace(config=SimpleNamespace(batch_sizes=[1, 8]), contract=contract_for("torch"))
    agent = Scripted(ws)
    p = [SimpleNamespace(id="long", ids=[1]), SimpleNamespace(id="eos", ids=[2])]
    ref = {"long": {"stock": [5, 6, 7, 8]}, "eos": {"stock": [0]}}  # "eos" ends at its first token
    ctx = AgentContext(branch="b", worktree=None, direction=Direction("batching", 1.0, "", [], []), gap_breakdown=[],
                       visible_prompts=[], smoke=lambda: None, log=lambda *a: None, stop=threading.Event())
    history: list = []
    cand = agent._measured_schedule(None, DecodeConfig(), p, 8, ref, 0.0, history, ctx)
    # the batch of 8 cycles the two prompts: 4 of its requests are ever live in a decode step, so B = 8's entry
    # starts after B = 1's reach (1): at 2 live requests
    assert cand is not None and cand.changes == {"load_schedule": "1:2,2:0"}

    # With more visible prompts, B = 8 is measured on 8 distinct ones (as the timed load sends them), B = 1 on two;
    # here 3 of the 8 end at their first token (B = 8 reaches 5 live requests; its entry starts past B = 1's reach).
    seen: dict[int, list[str]] = {}

    class Recording(Scripted):
        def _score_load(self, sp, cfg, prompts, n, ref, threshold):
            seen.setdefault(self.points[0], [q.id for q in prompts])
            return super()._score_load(sp, cfg, prompts, n, ref, threshold)

    many = [SimpleNamespace(id=f"p{i}", ids=[i]) for i in range(10)]
    ref = {f"p{i}": {"stock": [0] if i in (1, 4, 6) else [5, 6, 7]} for i in range(10)}
    cand = Recording(ws)._measured_schedule(None, DecodeConfig(), many, 8, ref, 0.0, [], ctx)
    assert seen == {1: ["p0", "p1"], 8: [f"p{i}" for i in range(8)]}
    assert cand is not None and cand.changes == {"load_schedule": "1:2,2:0"}

    # The base's own draft length is one of the choices: a k = 8 base fastest at one request keeps 8 there.
    rates[1][8], rates[8][8] = 150.0, 100.0
    ref = {"long": {"stock": [5, 6, 7, 8]}, "eos": {"stock": [0]}}
    cand = agent._measured_schedule(None, DecodeConfig(draft_len=8), p, 8, ref, 0.0, [], ctx)
    assert cand is not None and cand.changes == {"load_schedule": "1:8,2:0"}


def test_an_idle_agent_tries_the_knobs_of_a_family_measured_at_no_gain():
    """llama.cpp smollm2: the step is the forward, so host overhead measures ~0 (here below it), yet threads
    change the forward's own cost; a slot the positive gaps leave free goes to such a family, after them.
    A family with no measured part (batching at B = 1) gets nothing."""
    from decoder.engines.llamacpp_config import LlamaCppConfig
    from decoder.mechanisms import CONTRACTS

    bd = {"families": {"weights": 9.0, "drafting": 1.5, "host-overhead": -0.4, "batching": 0.0},
          "gaps": [{"name": "weight reads", "family": "weights"}, {"name": "drafter", "family": "drafting"},
                   {"name": "host/launch overhead", "family": "host-overhead"}]}
    llama = CONTRACTS["llama.cpp"]
    kw = {"agent": "tuner", "device": "cpu", "transfer_tried": False, "memory_for": lambda fam: [],
          "contract": llama}
    base = LlamaCppConfig(threads=1)
    dirs, _ = plan_directions(bd, set(), agents=3, base_cfg=base, **kw)
    assert [d.family for d in dirs] == ["drafting", "host-overhead"]  # weights: no config knob, no kernel
    assert "no measured gain" in dirs[1].summary and any(m["name"] == "llama-threads" for m in dirs[1].mechanisms)
    assert [d.family for d in plan_directions(bd, set(), agents=1, base_cfg=base, **kw)[0]] == ["drafting"]
    assert [d.family for d in plan_directions(bd, {"host-overhead"}, agents=3, base_cfg=base, **kw)[0]] == [
        "drafting"]  # explored on this base without a gain
    assert [d.family for d in plan_directions(bd, set(), agents=3, base_cfg=base, **{**kw, "agent": "llm"})[0]] == [
        "drafting"]  # an LLM agent goes where the cost model points


def test_the_tuner_composes_a_rungs_winners_of_different_mechanisms():
    """Winners that each beat the base join best first when they set keys the composition has not; two settings of
    one mechanism do not; a combination the config refuses or the deployment cannot run is left out."""
    base = DecodeConfig(method="sd", drafter="corpus", lean_forward=True)

    def cand(source: str, **changes) -> Candidate:
        return Candidate(changes, source, DecodeConfig(**{**base.as_dict(), **changes}))

    cont = cand("continuous-batching", continuous_batching=True)
    ragged = cand("ragged-verify", ragged_verify=True)
    rows = cand("load-aware-drafting", load_aware_draft=True, load_aware_fixed_rows=256)
    rows2 = cand("load-aware-drafting", load_aware_draft=True, load_aware_fixed_rows=8)
    both = compose([cont, rows2, ragged, rows], base)
    assert both is not None and both.source == "composed:continuous-batching+load-aware-drafting+ragged-verify"
    assert both.changes == {"continuous_batching": True, "load_aware_draft": True, "load_aware_fixed_rows": 8,
                            "ragged_verify": True}
    assert both.cfg.continuous_batching and both.cfg.ragged_verify and both.cfg.load_aware_fixed_rows == 8
    assert compose([cont], base) is None and compose([rows, rows2], base) is None
    pairs = compositions([cont, rows2, ragged, rows], base)
    assert [c.source for c in pairs] == ["composed:continuous-batching+load-aware-drafting",
                                         "composed:continuous-batching+ragged-verify",
                                         "composed:load-aware-drafting+ragged-verify", both.source]
    no_ragged = compose([cont, ragged, rows], base, refuse=lambda c: "no" if c.ragged_verify else None)
    assert no_ragged is not None and "ragged_verify" not in no_ragged.changes


def test_a_family_that_just_came_up_empty_ranks_after_one_never_tried():
    """Acceptance (3.9) outranks drafting (2.7) until an earlier direction of it kept nothing; the explored-and-
    empty family still runs when a slot is free, and memory still goes first."""
    assert [d.family for d in _plan()[0]] == ["host-overhead", "acceptance"]
    assert [d.family for d in _plan(fruitless={"acceptance"})[0]] == ["host-overhead", "drafting"]
    assert [d.family for d in _plan(fruitless={"acceptance"}, agents=3)[0]] == ["host-overhead", "drafting",
                                                                                 "acceptance"]
    assert [d.family for d in _plan(fruitless={"host-overhead", "acceptance"})[0]] == ["drafting", "host-overhead"]
    mem = {"acceptance": [{"name": "tree", "config": {"verify": "tree"}}]}
    assert _plan(memory=mem, fruitless={"acceptance"}, transfer_tried=True)[0][0].family == "acceptance"


def test_a_compute_gap_on_a_cpu_gets_a_tuner_with_the_bf16w_kernel():
    """Session 33's loop: after round 1 the compute gap was the largest (5.5 ms/token: the profile prices few-row
    matmuls at F.linear's measured rate) and no tuner mechanism addressed it, so the round went to acceptance and
    batching and the bf16w kernel (2.3x over stock in one process) was never tried. bf16w-matmul is the compute
    family's mechanism on a CPU; a GPU has none (no compute direction for the tuner there)."""
    from workbench.agents.tuner import candidates

    bd = {"families": {"compute": 5.5, "acceptance": 3.2, "batching": 1.6, "host-overhead": 0.5},
          "gaps": [{"name": "compute", "family": "compute"}, {"name": "acceptance gap", "family": "acceptance"},
                   {"name": "rejected verify rows", "family": "batching"}]}
    base = DecodeConfig(lean_forward=True, drafter="corpus", corpus_tree_alts=2, dtype="float32")
    args = {"agents": 2, "agent": "tuner", "base_cfg": base, "transfer_tried": False, "memory_for": lambda fam: []}
    dirs, _ = plan_directions(bd, set(), device="cpu", **args)
    assert [d.family for d in dirs] == ["compute", "acceptance"]
    assert "bf16w-matmul" in [m["name"] for m in dirs[0].mechanisms]
    assert {"matmul_backend": "bf16w"} in [c.changes for c in candidates(base, "compute", [])]
    cuda = DecodeConfig(lean_forward=True, drafter="corpus", device="cuda")
    assert [d.family for d in plan_directions(bd, set(), device="cuda", **{**args, "base_cfg": cuda})[0]] == \
        ["acceptance", "batching"]
