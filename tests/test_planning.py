"""Planning a round is a pure function of the gaps, the explored families, the base config and the memory."""

from __future__ import annotations

from decoder.config import DecodeConfig
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
    lean = DecodeConfig(lean_forward=True)  # the only host-overhead mechanism on a CPU is on
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
