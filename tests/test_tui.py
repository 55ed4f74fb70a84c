"""specpilot-tui: Pilot tests of every flow against a real workspace, and snapshots of every tab.

The flows run on one small demo workspace (3 prompts: 2 visible, 1 hidden; 8 forced tokens) with real
git, SQLite and harness runs: a branch that switches to the n-gram drafter (forcing clean), one with a
wrong acceptance rule (forcing finds real mismatches), mechanisms recorded from them, and a round with
the gap breakdown the loop recorded on the demo. The snapshots use a second workspace whose store
holds fixed records, so the pictures do not move with timings.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from pathlib import Path

import git
import pytest

from tests.conftest import needs_demo

pytestmark = needs_demo

# A base's gap breakdown as `Loop.gaps` recorded it on the demo workspace (ms per generated token).
GAPS = {
    "entry": {"name": "base", "tokens_per_s": 35.6, "tau": 2.667, "draft_len": 3, "new_tokens": 16,
              "phase_ms_per_token": {"prefill": 12.478, "draft": 6.150, "verify": 8.808, "accept": 0.351}},
    "breakdown": {
        "method": "base", "modelled": False, "measured_ms_per_token": 28.080797, "tau": 2.6667, "oracle_tau": 4.0,
        "gaps": [{"name": "prefill", "family": "compute", "ms_per_token": 12.478469},
                 {"name": "host/launch overhead", "family": "host-overhead", "ms_per_token": 8.63292},
                 {"name": "drafting", "family": "drafting", "ms_per_token": 6.150353},
                 {"name": "acceptance gap", "family": "acceptance", "ms_per_token": 5.103323, "could_save": True},
                 {"name": "bookkeeping", "family": "host-overhead", "ms_per_token": 0.351133},
                 {"name": "other host time", "family": "host-overhead", "ms_per_token": 0.292358},
                 {"name": "compute", "family": "compute", "ms_per_token": 0.133349},
                 {"name": "weight reads", "family": "weights", "ms_per_token": 0.040664},
                 {"name": "KV reads", "family": "kv", "ms_per_token": 0.001551}],
        "families": {"compute": 12.611818, "host-overhead": 9.276411, "drafting": 6.150353, "acceptance": 5.103323,
                     "weights": 0.040664, "kv": 0.001551, "batching": 0.0},
        "notes": []},
}
WRONG_ACCEPT = ("n = (draft == pred[:k]).to(torch.int64).cumprod(0).sum().view(1)",
                "n = ((draft == pred[:k]).to(torch.int64).cumprod(0).sum() + 1).clamp(max=k).view(1)")


def run(coro):
    return asyncio.run(coro)


async def until(pilot, cond, timeout: float = 60.0, what: str = "condition") -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            notes = [f"{n.title}: {n.message}" for n in pilot.app._notifications]
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; notifications: {notes}")
        await pilot.pause(0.05)


async def opened(pilot) -> None:
    app = pilot.app
    await until(pilot, lambda: app.polls >= 1 and app.ws is not None, 30, "the workspace to open")


def make_branch(ws, name: str, rel: str, old: str, new: str) -> None:
    ws.create_branch(name)
    f = ws.worktree_path(name) / rel
    text = f.read_text()
    assert old in text, f"{rel}: {old!r} not found"
    f.write_text(text.replace(old, new, 1))
    r = git.Repo(ws.worktree_path(name))
    r.git.add("-A")
    r.index.commit(f"{name}: {rel}")


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    from workbench.export import record_mechanism
    from workbench.forcing import force
    from workbench.workspace import init_demo

    w = init_demo(tmp_path_factory.mktemp("tui") / "demo", forcing_max_new_tokens=16, prompt_limit=3, hidden=1,
                  limits={"threads": 1, "start_s": 90, "request_s": 30, "memory_mb": 1536}, bench={"noise_pairs": 1})
    make_branch(w, "ngram", "system.toml", 'drafter = "draft-model"', 'drafter = "ngram"')
    assert force(w, "ngram", progress=False)["status"] == "keep"
    make_branch(w, "bad-verify", "decoder/verify.py", *WRONG_ACCEPT)
    rep = force(w, "bad-verify", progress=False)
    assert rep["status"] == "discard" and len(rep["mismatches"]) >= 2
    record_mechanism(w, "ngram", "ngram-drafter", "drafting", "prompt lookup drafter instead of the draft model")
    record_mechanism(w, "ngram", "ngram-short", "drafting", "prompt lookup with short suffixes")
    w.memory.add_round(w.deployment_id(), status="done", base_commit=w.stock_commit,
                       summary={"index": 1, "gaps": GAPS, "attempts": [], "best_speedup_over_ar": 1.31})
    yield w
    w.close()


def app_for(ws, **kw):
    from workbench.tui.app import make_app

    return make_app(ws.path, poll_s=0.3, blink=False, **kw)


async def open_launch(pilot, app, llm: bool = False):
    """The TUI opened, the Branches tab shown and its Launch dialog up (LLM agent chosen when `llm`)."""
    from workbench.tui.screens import LaunchScreen

    await opened(pilot)
    await pilot.press("2", "l")
    await until(pilot, lambda: isinstance(app.screen, LaunchScreen), 20, "the launch dialog")
    if llm:
        app.screen.query_one("#kind-llm").value = True
    return app.screen


def select_row(app, table_id: str, key: str) -> None:
    from textual.widgets import DataTable

    table = app.query_one(table_id, DataTable)
    table.move_cursor(row=table.get_row_index(key))


@pytest.fixture
def llm_stub(monkeypatch):
    """An OpenAI-protocol server on loopback (the test double for a hosted LLM) whose model keeps
    exploring (list_files each turn, a turn a second, never the same folder twice in a row: two identical
    replies end a run) until stopped; the environment points at it."""
    from tests.openai_stub import OpenAIStub, call

    turns = itertools.count()

    def keep_looking(body):
        time.sleep(1.0)
        return call("list_files", path=("." if next(turns) % 2 == 0 else "decoder"))

    with OpenAIStub([], after=keep_looking) as stub:
        monkeypatch.setenv("OPENAI_BASE_URL", stub.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        monkeypatch.setenv("SPECPILOT_LLM_MODEL", "stub")
        yield stub


# -- flows -----------------------------------------------------------------------------------------------


def test_overview_shows_deployment_gaps_and_rounds(ws):
    async def go():
        app = app_for(ws)
        async with app.run_test(notifications=True, size=(120, 40)) as pilot:
            await opened(pilot)
            snap = app.snapshot
            assert snap.deployment["name"] == "demo" and snap.deployment["drafter"].endswith("drafter")
            assert snap.families["compute"] == pytest.approx(12.611818) and snap.gaps_label == "round 1"
            # The solid bars are the parts of the measured time and add up to it; acceptance is beyond it.
            assert sum(snap.families.values()) == pytest.approx(snap.measured_ms, abs=1e-4)
            assert snap.could_save == {"acceptance": pytest.approx(5.103323)}
            assert snap.speedups == [(1, 1.31)]
            bars = str(app.query_one("#gaps").render())
            assert "compute" in bars and "12.612 ms" in bars and "█" in bars
            rows = {b.name: b for b in snap.branches}
            assert rows["ngram"].forcing == "clean" and rows["bad-verify"].forcing.endswith("real")

    run(go())


def test_toasts_of_rich_text_and_markup_characters_render_without_crashing(ws):
    """Every notification path ends in App.notify: a Rich Text, model output full of '[' and a title
    with markup characters all render as plain text, and the app keeps running."""
    from rich.text import Text

    async def go():
        app = app_for(ws)
        async with app.run_test(notifications=True, size=(80, 24)) as pilot:
            await opened(pilot)
            app.notify(Text("a Rich Text toast"), title="done")
            app.notify("model said [/] and [red]x[/red] and [link=file:///etc]", title="[b]steer")
            app.notify("an error toast", severity="error")
            await pilot.pause(0.5)
            assert app.is_running
            shown = [n.message for n in app._notifications]
            assert "a Rich Text toast" in shown and "model said [/] and [red]x[/red] and [link=file:///etc]" in shown

    run(go())


def test_the_launch_dialog_keeps_its_buttons_on_an_80x24_terminal(ws, monkeypatch):
    """With the LLM note at its longest (no endpoint configured) the dialog still shows Launch and Cancel on
    an 80x24 terminal: the note and the direction list give up rows first, and get them back when taller."""
    monkeypatch.delenv("SPECPILOT_LLM_BASE_URL", raising=False)

    async def go():
        app = app_for(ws)
        async with app.run_test(notifications=True, size=(80, 24)) as pilot:
            screen = await open_launch(pilot, app)
            await pilot.pause(0.3)
            assert screen.has_class("short")
            for button in ("#ok", "#cancel"):
                region = screen.query_one(button).region
                assert region.height > 0 and region.bottom <= 24, (button, region)
            await pilot.resize_terminal(120, 40)
            await pilot.pause(0.3)
            assert not screen.has_class("short")

    run(go())


def test_forcing_navigation_between_mismatches(ws):
    from workbench.tui.widgets import ForcingPane

    async def go():
        app = app_for(ws)
        async with app.run_test(notifications=True, size=(80, 24)) as pilot:
            await opened(pilot)
            await pilot.press("2")
            select_row(app, "#branches-table", "bad-verify")
            await pilot.press("f")
            pane = app.query_one(ForcingPane)
            await until(pilot, lambda: pane.report is not None and pane.report["branch"] == "bad-verify", 30,
                        "the forcing report")
            assert app.active_tab() == "forcing"
            mm = pane.report["mismatches"]
            assert len(mm) >= 2 and pane.current() == 0 and pane.report["prompts"]
            assert f"position {mm[0]['position']}" in pane.caption
            await pilot.press("n")
            assert pane.current() == 1
            assert f"mismatch 2/{len(mm)}" in pane.caption
            for _ in range(len(mm) - 1):
                await pilot.press("n")
            assert pane.current() == 0  # wraps around
            await pilot.press("p")
            assert pane.current() == len(mm) - 1
            assert f"mismatch {len(mm)}/{len(mm)}" in pane.caption and "margin" in pane.caption

    run(go())


def test_diff_and_help_and_palette(ws):
    from workbench.tui.app import SpecPilotCommands
    from workbench.tui.screens import KeysScreen, TextViewScreen

    async def go():
        app = app_for(ws)
        async with app.run_test(notifications=True, size=(120, 40)) as pilot:
            await opened(pilot)
            await pilot.press("2")
            select_row(app, "#branches-table", "ngram")
            await pilot.press("d")
            await until(pilot, lambda: isinstance(app.screen, TextViewScreen), 20, "the diff")
            assert 'drafter = "ngram"' in app.screen.text
            await pilot.press("escape")
            assert not isinstance(app.screen, TextViewScreen)
            await pilot.press("question_mark")
            await pilot.pause()
            assert isinstance(app.screen, KeysScreen)
            keys = [(sec, key) for sec, key, _ in app.screen.rows]
            assert keys[:4] == [("anywhere", "1-5"), ("anywhere", "?"), ("anywhere", "ctrl+p"), ("anywhere", "q")]
            assert ("Branches", "F") in keys and ("Branches", "/") in keys
            await pilot.press("question_mark")
            await pilot.pause()
            assert not isinstance(app.screen, KeysScreen)
            names = [c[0] for c in SpecPilotCommands(app.screen).commands()]
            assert "Merge ngram into base" in names and "Diff of ngram against its base" in names
            assert not any(n.startswith("Steer") for n in names)  # no agent running
            app.diff_branch("no-such-branch")  # a failure is a notification, not a traceback
            await until(pilot, lambda: any("diff failed" in (n.title or "") for n in app._notifications), 20,
                        "the failure notification")
            assert app.is_running

    run(go())


def test_merge_into_base_asks_then_merges(ws):
    from workbench.tui.screens import ConfirmScreen

    async def go():
        app = app_for(ws)
        async with app.run_test(notifications=True, size=(80, 24)) as pilot:
            await opened(pilot)
            await pilot.press("2")
            select_row(app, "#branches-table", "ngram")
            await pilot.press("m")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("n")  # declined: nothing happens
            await pilot.pause(0.3)
            assert "base" not in git.Repo(ws.path).heads or not git.Repo(ws.path).is_ancestor("ngram", "base")
            await pilot.press("m")
            await pilot.press("y")
            await until(pilot, lambda: any(e.kind == "tui.merge" for e in ws.memory.list_events()), 30, "the merge")
        repo = git.Repo(ws.path)
        assert repo.is_ancestor(repo.commit("ngram"), repo.commit("base"))
        assert 'drafter = "ngram"' in repo.git.show("base:system.toml")
        assert repo.head.ref.name == "main"  # the workspace's own checkout is untouched
        assert ws.branch("ngram").status == "merged"  # no longer reads "kept"

    run(go())


def test_accept_with_a_note_then_export(ws, tmp_path):
    from store import Memory, global_memory_path
    from workbench.tui.screens import TextInputScreen

    m1 = next(m for m in ws.memory.list_mechanisms() if m.name == "ngram-drafter")

    async def go():
        app = app_for(ws)
        async with app.run_test(notifications=True, size=(120, 40)) as pilot:
            await opened(pilot)
            await pilot.press("4")
            await until(pilot, lambda: m1.id in app.mechanisms, 20, "the mechanisms")
            select_row(app, "#mechanisms", str(m1.id))
            await pilot.press("a")
            assert isinstance(app.screen, TextInputScreen)
            await pilot.press("enter")  # an empty note is refused, the dialog stays
            assert isinstance(app.screen, TextInputScreen)
            assert "note is required" in str(app.screen.query_one("#why").content)
            await pilot.press(*"lossless, 8 positions clean")
            await pilot.press("enter")
            await until(pilot, lambda: ws.memory.get_mechanism(m1.id).status == "accepted", 20, "the verdict")
            await until(pilot, lambda: app.mechanisms[m1.id].status == "accepted", 20, "the table to follow")
            await pilot.press("e")
            assert isinstance(app.screen, TextInputScreen)
            app.screen.query_one("#text").value = str(tmp_path / "patches")
            await pilot.press("enter")
            await until(pilot, lambda: any((tmp_path / "patches").glob("*.patch")), 30, "the exported patches")
        m = ws.memory.get_mechanism(m1.id)
        assert m.reviewer_note == "lossless, 8 positions clean"
        with Memory(global_memory_path()) as g:  # publish_verdict carried it to the global memory
            assert [x.uid for x in g.list_mechanisms(status="accepted")] == [m.uid]
        patch = next((tmp_path / "patches").glob("*.patch")).read_text()
        assert 'drafter = "ngram"' in patch

    run(go())


def test_reject_and_search(ws):
    m2 = next(m for m in ws.memory.list_mechanisms() if m.name == "ngram-short")

    async def go():
        app = app_for(ws)
        async with app.run_test(notifications=True, size=(80, 24)) as pilot:
            await opened(pilot)
            await pilot.press("4")
            await until(pilot, lambda: m2.id in app.mechanisms, 20, "the mechanisms")
            app.query_one("#memory-search").focus()
            await pilot.press(*"suffixes", "enter")
            await until(pilot, lambda: list(app.mechanisms) == [m2.id], 20, "the search result")
            await pilot.press("r")
            await pilot.press("escape")  # cancelled: nothing changes
            await pilot.pause(0.3)
            assert ws.memory.get_mechanism(m2.id).status == "candidate"
            await pilot.press("r")
            await pilot.press(*"slower than the plain ngram", "enter")
            await until(pilot, lambda: ws.memory.get_mechanism(m2.id).status == "rejected", 20, "the verdict")
            assert ws.memory.get_mechanism(m2.id).reviewer_note == "slower than the plain ngram"

    run(go())


def test_real_mismatches_only_with_shift_n_and_p(ws):
    from workbench.tui.widgets import ForcingPane

    async def go():
        app = app_for(ws)
        async with app.run_test(notifications=True, size=(120, 40)) as pilot:
            await opened(pilot)
            app.open_forcing("bad-verify")
            pane = app.query_one(ForcingPane)
            await until(pilot, lambda: pane.report is not None and pane.report["branch"] == "bad-verify", 30,
                        "the forcing report")
            mm = pane.report["mismatches"]
            real = [i for i, m in enumerate(mm) if not m.get("near_tie")]
            assert real
            for want in [*real[1:], real[0]] if real[0] == 0 else [*real, real[0]]:
                await pilot.press("N")
                assert pane.current() == want and "REAL" in pane.caption
            await pilot.press("P")
            assert pane.current() == real[-1]
            assert app.is_running

    run(go())


def test_stale_and_live_branches_say_so(ws):
    """A branch marked running with no process behind it reads "running (no process)"; one whose work
    reports progress shows the phase, count and elapsed time in the "now" column."""
    from workbench.progress import step, tracking

    ws.create_branch("orphan")
    b = ws.branch("orphan")
    ws.memory.update_branch(b.id, status="running")  # as a killed agent leaves it; no lock, no process
    ws.create_branch("busy")
    ws.begin_evaluation(ws.branch("busy"))  # this process evaluates it
    try:
        with tracking(ws.state, "busy"):
            step("forcing", 3, 8, "0 mismatches")

            async def go():
                app = app_for(ws)
                async with app.run_test(notifications=True, size=(120, 40)) as pilot:
                    await opened(pilot)
                    await pilot.press("2")
                    table = app.query_one("#branches-table")
                    assert str(table.get_cell("orphan", "status")) == "running (no process)"
                    assert "E resumes" in str(table.get_cell("orphan", "progress"))
                    now = str(table.get_cell("busy", "progress"))
                    assert now.startswith("forcing 3/8 · ") and "0 mismatches" in now
                    assert str(table.get_cell("busy", "status")) == "evaluating"

            run(go())
    finally:
        ws.end_evaluation(ws.branch("busy"), "created")
        ws.memory.update_branch(b.id, status="created")


def test_the_launch_dialog_says_what_cannot_run(ws, monkeypatch):
    """No LLM endpoint: the LLM option is disabled with the file to edit; a family the tuner has
    nothing left for is refused for the tuner with a reason, and the dialog stays."""
    from workbench.tui.screens import LaunchScreen

    for var in ("OPENAI_BASE_URL", "SPECPILOT_LLM_BASE_URL"):
        monkeypatch.delenv(var, raising=False)

    async def go():
        app = app_for(ws)
        async with app.run_test(notifications=True, size=(120, 40)) as pilot:
            screen = await open_launch(pilot, app)
            assert screen.query_one("#kind-llm").disabled
            assert str(ws.path / "specpilot.toml") in str(screen.query_one("#llm-unavailable").render())
            empty = [i for i, c in enumerate(screen.choices) if not c.tuner_left]
            assert empty and any(c.tuner_left for c in screen.choices)
            screen.query_one("#direction").highlighted = empty[0]
            await pilot.press("enter")
            assert isinstance(app.screen, LaunchScreen)  # refused, not launched
            assert "nothing left" in str(screen.query_one("#launch-problem").render())
            await pilot.press("escape")
            assert not app.live and app.is_running

    run(go())


def test_filter_then_delete_a_branch(ws):
    ws.create_branch("doomed")

    async def go():
        app = app_for(ws)
        async with app.run_test(notifications=True, size=(80, 24)) as pilot:
            await opened(pilot)
            await pilot.press("2")
            table = app.query_one("#branches-table")
            assert {"ngram", "bad-verify", "doomed"} <= {k.value for k in table.rows}
            await pilot.press("slash", *"verify")
            assert [k.value for k in table.rows] == ["bad-verify"]
            await pilot.press("escape")
            assert "doomed" in {k.value for k in table.rows}
            select_row(app, "#branches-table", "doomed")
            await pilot.press("D", "y")
            await until(pilot, lambda: "doomed" not in {k.value for k in table.rows}, 20, "the row to go")
            assert "doomed" not in git.Repo(ws.path).heads and ws.find_branch("doomed") is None
            assert app.is_running

    run(go())


def test_force_cancel_reevaluate_recover_from_the_keyboard(ws):
    """F runs forcing (its toast renders, the app runs on); c cancels a run at once (its systems are
    killed, the evaluation records the cancel); E on a branch with nothing committed says so; R
    reconciles git and the store."""
    from workbench.harness import _LIVE

    ws.create_branch("empty")
    machine_profiled_before()  # E on a committed branch needs the plausibility ceiling: no machine measurement
    make_branch(ws, "protected", "specpilot.toml", "[deployment]", "[deployment]\n# edited by the candidate")
    make_branch(ws, "stuck", "decoder/generate.py", '    if cfg.method == "sd" and cfg.drafter == "routed":\n',
                '    time.sleep(600)\n    if cfg.method == "sd" and cfg.drafter == "routed":\n')

    def toasts(app) -> list[str]:
        return [n.message for n in app._notifications]

    async def go():
        app = app_for(ws)
        async with app.run_test(notifications=True, size=(120, 40)) as pilot:
            await opened(pilot)
            await pilot.press("2")
            select_row(app, "#branches-table", "ngram")
            await pilot.press("F")
            await until(pilot, lambda: any(t.startswith("ngram: forcing keep") for t in toasts(app)), 120,
                        "the forcing result")
            await pilot.pause(0.3)  # the toast rendered
            assert app.is_running
            select_row(app, "#branches-table", "stuck")
            await pilot.press("F")
            await until(pilot, lambda: _LIVE.get("stuck"), 60, "its system to run")
            await pilot.press("c")
            await until(pilot, lambda: any(t.startswith("cancelled stuck: 1 system") for t in toasts(app)), 10,
                        "the cancel")
            await until(pilot, lambda: "stuck" not in app.live, 10, "the run to end at once")
            last = ws.memory.list_evaluations(ws.branch("stuck").id)[-1]
            assert last.status == "crash" and "cancelled by the engineer" in last.reason, last.reason
            select_row(app, "#branches-table", "empty")
            await pilot.press("E")
            await until(pilot, lambda: any("empty: discard" in t for t in toasts(app)), 60, "the re-evaluation")
            # A committed branch goes through the loop's own attempt (the ceiling and the base's ratio from the
            # store): here the guard rejects it before anything runs.
            await until(pilot, lambda: "protected" in app.query_one("#branches-table").rows, 10, "its row")
            select_row(app, "#branches-table", "protected")
            await pilot.press("E")
            await until(pilot, lambda: any(t.startswith("protected: rejected") for t in toasts(app)), 60,
                        "the guard's verdict")
            assert not [n for n in app._notifications if n.severity == "error"], toasts(app)
            await pilot.press("R")
            await until(pilot, lambda: any(t.startswith("recover:") for t in toasts(app)), 30, "recover")
            await pilot.pause(0.3)
            assert app.is_running

    run(go())


def test_enter_on_a_branch_opens_its_forcing_report(ws):
    async def go():
        app = app_for(ws)
        async with app.run_test(notifications=True, size=(80, 24)) as pilot:
            await opened(pilot)
            await pilot.press("2")
            select_row(app, "#branches-table", "bad-verify")
            await pilot.press("enter")
            await until(pilot, lambda: app.active_tab() == "forcing" and app.forcing_branch == "bad-verify", 10,
                        "the forcing tab")

    run(go())


def test_log_follows_the_store(ws):
    async def go():
        app = app_for(ws)
        async with app.run_test(notifications=True, size=(80, 24)) as pilot:
            await opened(pilot)
            await pilot.press("5")
            log = app.query_one("#event-log")
            n = len(log.lines)
            assert n > 0
            ws.memory.record_event("test.note", "a line written by another process")
            await until(pilot, lambda: any("another process" in line.text for line in log.lines), 10,
                        "the new event")

    run(go())


def machine_profiled_before() -> None:
    """A quiet cpu-local profile in this test's data dir, as a machine that was profiled before has one: a
    launch then profiles the base (in file order the merge test has moved it past stock: the fast tier's run
    of `_profile_gaps`) without measuring the machine first (9 s, twice on a loaded one; measuring is
    test_loop's ceiling test)."""
    from costmodel.hardware import LOCAL, HardwareProfile, save_profile

    save_profile(HardwareProfile(LOCAL, mem_bandwidth_GBps=20.0, bf16_tflops=0.2, fp8_tflops=None, l2_MB=2.0,
                                 fp32_tflops=0.3, source="a test's stand-in for an earlier measurement",
                                 fixed_overhead_ms=0.5, per_layer_overhead_ms=0.05, measured={"spread": 0.1}))


def test_launch_steer_stop_an_llm_agent(ws, llm_stub):
    from workbench.tui.screens import ConfirmScreen, TextInputScreen

    machine_profiled_before()

    async def go():
        app = app_for(ws)
        async with app.run_test(notifications=True, size=(120, 40)) as pilot:
            screen = await open_launch(pilot, app, llm=True)
            families = [c.family for c in screen.choices]
            assert families[0] == "compute"  # the largest gap first
            screen.query_one("#direction").highlighted = families.index("drafting")
            await pilot.press("enter")
            await until(pilot, lambda: app.live, 20, "the launch")
            branch = next(iter(app.live))
            assert branch == "tui-llm-drafting-1"
            await until(pilot, lambda: len(llm_stub.requests) >= 1, 60, "the agent's first request")
            await until(pilot, lambda: branch in app.query_one("#branches-table").rows, 10, "the branch row")
            select_row(app, "#branches-table", branch)
            await pilot.press("s")
            assert isinstance(app.screen, TextInputScreen)
            await pilot.press(*"try draft_len 2", "enter")
            await until(pilot, lambda: any("Engineer: try draft_len 2" in json.dumps(r["body"])
                                           for r in llm_stub.requests), 20, "the steering message to reach the model")
            await pilot.press("x")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("y")
            await until(pilot, lambda: not app.live, 30, "the agent to stop")
            await until(pilot, lambda: ws.branch(branch).status == "discarded", 10, "the attempt")
            kinds = [e.kind for e in ws.memory.list_events()]
            assert "llm.steering" in kinds and "tui.launch" in kinds
            evals = ws.memory.list_evaluations(ws.branch(branch).id)
            assert evals[-1].status == "discard"

    run(go())


def test_quit_with_an_agent_running_marks_it_interrupted(ws, llm_stub):

    async def go():
        app = app_for(ws)
        async with app.run_test(notifications=True, size=(120, 40)) as pilot:
            await open_launch(pilot, app, llm=True)
            await pilot.press("enter")
            await until(pilot, lambda: len(llm_stub.requests) >= 1, 60, "the agent's first request")
            branch = next(iter(app.live))
            await pilot.press("q")
            await until(pilot, lambda: not app.is_running, 10, "the app to quit")
        assert app.abandoned == [branch]
        ev = [e for e in ws.memory.list_events() if e.kind == "tui.interrupted"]
        assert ev and branch in ev[-1].message and "E re-evaluates" in ev[-1].message

    run(go())


@pytest.mark.slow
def test_launch_a_tuner_runs_the_cascade(ws):

    async def go():
        app = app_for(ws)
        async with app.run_test(notifications=True, size=(120, 40)) as pilot:
            screen = await open_launch(pilot, app)
            screen.query_one("#direction").highlighted = [f for f, _ in screen.directions].index("drafting")
            await pilot.press("enter")
            await until(pilot, lambda: app.live, 20, "the launch")
            branch = next(iter(app.live))
            await until(pilot, lambda: not app.live, 1500, "the tuner and its cascade")
            assert ws.memory.list_evaluations(ws.branch(branch).id)

    run(go())


@pytest.mark.slow
def test_a_loop_round_from_the_keyboard_is_the_auto_round(tmp_path):
    """L runs one round through `Loop.run`, as `--auto` does: a round is recorded done, the toast says
    so, and the app keeps running."""
    from workbench.tui.app import make_app
    from workbench.workspace import init_demo

    w = init_demo(tmp_path / "demo", forcing_max_new_tokens=16, prompt_limit=4, hidden=1,
                  limits={"request_s": 60, "start_s": 120}, bench={"noise_pairs": 1})

    async def go():
        app = make_app(w.path, poll_s=0.3, blink=False)
        async with app.run_test(notifications=True, size=(120, 40)) as pilot:
            await opened(pilot)
            await pilot.press("2", "L")
            await until(pilot, lambda: "loop" in app.live, 10, "the round to start")
            await until(pilot, lambda: "loop" not in app.live, 1500, "the round to end")
            await until(pilot, lambda: any(n.message.startswith(("round 1 done", "loop:"))
                                           for n in app._notifications), 10, "the toast")
            await pilot.pause(0.3)
            assert app.is_running
        rounds = [r for r in w.memory.list_rounds(w.deployment_id()) if r.status == "done"]
        assert [r.summary["index"] for r in rounds] == [1]

    run(go())
    w.close()


def test_the_first_paint_does_not_wait_for_the_workspace(ws):
    async def go():
        from workbench.tui.app import make_app

        t0 = time.perf_counter()
        app = make_app(ws.path, blink=False)
        async with app.run_test(notifications=True, size=(120, 40)) as pilot:
            painted = time.perf_counter() - t0
            await opened(pilot)
            loaded = time.perf_counter() - t0
        print(f"\nspecpilot-tui startup: first paint {painted:.2f} s, store shown {loaded:.2f} s")
        # The frame comes before the workspace is read (opening runs in a worker): never a blank wait.
        # Times are printed, not asserted (shared machines); the tmux journey reports them too.
        assert painted < loaded

    run(go())


def test_main_refuses_a_folder_that_is_not_a_workspace(tmp_path, capsys):
    from workbench.tui.app import main

    assert main(["--workspace", str(tmp_path)]) == 2
    assert "not a SpecPilot workspace" in capsys.readouterr().err


def test_demo_workspace_is_created_on_first_run(monkeypatch, tmp_path):
    from workbench.tui.app import make_app
    from workbench.workspace import default_demo_path

    monkeypatch.setenv("SPECPILOT_DATA_DIR", str(tmp_path / "data"))
    path = default_demo_path()  # where a first run creates the demo: under the user's data directory
    assert path == tmp_path / "data" / "workspaces" / "demo"

    # The demo is built in a worker thread; on a loaded machine it could finish before the first look. The real
    # init_demo runs, but only once the test has seen the opening screen saying what is happening.
    import workbench.tui.app as tui_app

    seen = threading.Event()
    real_init_demo = tui_app.init_demo

    def init_demo_after_the_first_look(*args, **kwargs):
        assert seen.wait(60), "the test never looked at the opening screen"
        return real_init_demo(*args, **kwargs)

    monkeypatch.setattr(tui_app, "init_demo", init_demo_after_the_first_look)

    async def go():
        app = make_app(demo_options={"prompt_limit": 3, "hidden": 1, "forcing_max_new_tokens": 8}, blink=False)
        async with app.run_test(notifications=True, size=(80, 24)) as pilot:
            assert app.query_one("#opening").display
            label = app.query_one("#opening-label")
            await until(pilot, lambda: "creating the demo workspace" in str(label.render()), 30, "the demo notice")
            seen.set()
            await opened(pilot)
            assert not app.query_one("#opening").display
            assert app.snapshot.deployment["name"] == "demo"
        assert (path / "specpilot.toml").exists()

    run(go())


# -- snapshots -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def snap_ws(tmp_path_factory):
    """A real workspace whose store holds fixed records (no timings), for pictures that do not move."""
    from tokenizers import Tokenizer

    from workbench.forcing import forcing_prompt_texts
    from workbench.workspace import init_demo

    w = init_demo(tmp_path_factory.mktemp("snap") / "demo", forcing_max_new_tokens=8, prompt_limit=3, hidden=1)
    mem, dep = w.memory, w.deployment_id()
    mem.add_round(dep, status="done", base_commit=w.stock_commit,
                  summary={"index": 1, "gaps": GAPS, "attempts": [], "best_speedup_over_ar": 1.18})
    mem.add_round(dep, status="done", base_commit=w.stock_commit,
                  summary={"index": 2, "gaps": GAPS, "attempts": [], "best_speedup_over_ar": 1.34})
    directions = [{"family": "compute"}, {"family": "drafting"}]
    mem.add_round(dep, status="running", base_commit=w.stock_commit,
                  summary={"index": 3, "gaps": GAPS, "directions": directions, "attempts": [{"branch": "x"}]})
    tok = Tokenizer.from_file(str(Path(w.config.tokenizer) / "tokenizer.json"))
    prompts = []
    for pid, split, _ in forcing_prompt_texts(w):
        stock = tok.encode("    return self._value\n").ids[:8]
        prompts.append({"id": pid, "split": split, "prompt_ids": [1, 2], "stock": stock, "margins": [3.0] * 8})
    ref = {"stock_commit": w.stock_commit, "max_new_tokens": 8, "noise_floor": 0.0625, "prompts": prompts}
    (w.state / "stock" / "fixed.json").write_text(json.dumps(ref))
    rows = [("r3-compute-tuner", "tuner", "compute"), ("r3-drafting-llm", "llm", "drafting")]
    for name, agent, fam in rows:
        w.create_branch(name, agent=agent, direction=fam)
    b1, b2 = w.branch(rows[0][0]), w.branch(rows[1][0])
    mem.add_evaluation(b1.id, "forcing", "keep", "token-identical to stock on 24 positions",
                       forcing={"match_rate": 1.0, "positions_checked": 24, "mismatches": [], "unexplained": 0})
    mem.add_evaluation(b1.id, "bench", "keep", "1.142x [1.10, 1.19] over 6 passes", metrics={"speedup": 1.142})
    mem.update_branch(b1.id, status="kept")
    p0 = prompts[0]
    mism = [{"prompt_id": p0["id"], "split": p0["split"], "position": pos, "stock_token": p0["stock"][pos],
             "candidate_token": 7, "stock_text": tok.decode([p0["stock"][pos]]), "candidate_text": "[x]",
             "margin": margin, "near_tie": margin < 0.125} for pos, margin in ((2, 1.72), (5, 0.09))]
    mem.add_evaluation(b2.id, "forcing", "discard", "1 unexplained mismatch(es) in 24 positions",
                       forcing={"match_rate": 22 / 24, "positions_checked": 24, "mismatches": mism, "unexplained": 1,
                                "near_ties": 1, "near_tie_threshold": 0.125, "status": "discard"})
    mem.update_branch(b2.id, status="mismatch")
    mem.add_mechanism("ngram-drafter", "drafting", "prompt lookup drafter instead of the draft model",
                      evidence=[{"deployment": "demo", "speedup": 1.142, "forcing": "clean"}], patch="x\n")
    mem.add_mechanism("lean-forward", "host-overhead", "fused QKV and gate/up, preallocated KV",
                      evidence=[{"deployment": "demo", "speedup": 1.27}, {"deployment": "gpu-a", "speedup": 1.4}],
                      status="accepted", patch="y\n")
    yield w
    w.close()


@pytest.fixture
def frozen(monkeypatch):
    from workbench.tui import widgets

    monkeypatch.setattr(widgets, "display_path", lambda p: "…/demo")
    monkeypatch.setattr(widgets, "format_ts", lambda ts: "12:00:00")


def snapshot_app(snap_ws, tab: str):
    from workbench.tui.app import make_app
    from workbench.tui.widgets import ForcingPane

    app = make_app(snap_ws.path, poll_s=3600, blink=False)

    async def ready(pilot):
        await until(pilot, lambda: app.polls >= 1 and app.mechanisms, 30, "the store")
        await until(pilot, lambda: app.query_one(ForcingPane).report is not None, 30, "the forcing report")
        app.show_tab(tab)
        await pilot.pause()
        await app.workers.wait_for_complete()
        await pilot.pause()

    return app, ready


@pytest.mark.parametrize("size", [(120, 40), (80, 24)], ids=["120x40", "80x24"])
@pytest.mark.parametrize("tab", ["overview", "branches", "forcing", "memory", "log"])
def test_snapshot(snap_ws, frozen, snap_compare, tab, size):
    app, ready = snapshot_app(snap_ws, tab)
    assert snap_compare(app, terminal_size=size, run_before=ready)


def test_a_confirmed_branch_shows_the_speedup_it_is_credited_with(ws):
    """A kept bench stage holds its first run and its confirmation in fresh processes: the cascade credits the
    lower of the two, and so does the Branches tab's `vs base`."""
    from workbench.tui import data

    ws.create_branch("confirmed")
    b = ws.branch("confirmed")
    ws.memory.add_evaluation(b.id, "bench", "keep", "1.43x over the base, reproduced",
                             metrics={"speedup": 1.547, "confirm": {"speedup": 1.429}})
    rows = {r.name: r for r in data.read_snapshot(ws, None).branches}
    assert rows["confirmed"].speedup == pytest.approx(1.429)


def test_overview_shows_stocks_worst_kernels_when_profiled(ws):
    """A llama.cpp workspace's kernel profile (`.specpilot/kernels.json`, costing.kernel_profile) puts its worst
    kernels against their roofline on the Overview, at 120x40 and 80x24; without one the line takes no row."""
    async def go(size):
        app = app_for(ws)
        async with app.run_test(notifications=True, size=size) as pilot:
            await opened(pilot)
            assert not app.query_one("#kernels").display  # the demo workspace was never kernel-profiled
            prof = {"forward_ratio": {"1": 1.0, "4": 3.05}, "forward_ms": {"1": 20.0, "4": 61.0},
                    "kernels": [{"type": "q4_1", "k": 576, "n": 1536, "count": 60, "width": 16, "us": 1118.4,
                                 "roofline_us": 92.6, "efficiency": 0.083, "gap_ms": 61.54}]}
            (ws.state / "kernels.json").write_text(json.dumps({"key": {}, "profile": prof}))
            try:
                await pilot.pause(1.0)  # the store is polled every 0.3 s
                w = app.query_one("#kernels")
                text = str(w.render())
                assert w.display and "q4_1 576x1536 x60 at width 16: 8% of roofline" in text and "3.05x" in text
                assert app.is_running
            finally:
                (ws.state / "kernels.json").unlink()

    run(go((120, 40)))
    run(go((80, 24)))
