"""`specpilot-tui [--workspace PATH]`: the Textual workbench over one workspace.

Tabs: Overview (deployment, gap breakdown, speedup across rounds, round progress), Branches (launch,
steer, stop, merge, diff, forcing), Forcing (stock vs candidate tokens, n / p between mismatches),
Memory (search, accept / reject with a note, export) and Log (the store's events as they happen).

Every SQLite, git and process call runs in a thread worker that reports back with a message; the
store is polled about once a second, so the app shows the same whether the loop runs here, headless
(`specpilot-tui --auto`) or elsewhere. A failed worker becomes a notification, never a traceback.
`make_app` builds the app for the CLI and the tests alike.
"""

from __future__ import annotations

import os
import sys
import threading
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.containers import Vertical
from textual.message import Message
from textual.notifications import SeverityLevel
from textual.widgets import (
    DataTable,
    Footer,
    Header,
    Input,
    Label,
    ProgressBar,
    Select,
    TabbedContent,
    TabPane,
)
from textual.worker import Worker, WorkerState, get_current_worker

from workbench.cli_util import OneLineParser, fail
from workbench.executor import EXECUTORS, ExecutorError, ExecutorSettings, LocalEvaluator, make_evaluator
from workbench.harness import cancel_branch as kill_branch_systems
from workbench.tui import data
from workbench.tui.screens import ConfirmScreen, KeysScreen, LaunchScreen, TextInputScreen, TextViewScreen
from workbench.tui.widgets import BranchesPane, ForcingPane, LogPane, MemoryPane, OverviewPane
from workbench.workspace import DTYPE_AUTO, Workspace, default_demo_path, init_demo, resolve_dtype

TABS = (("overview", "Overview"), ("branches", "Branches"), ("forcing", "Forcing"), ("memory", "Memory"),
        ("log", "Log"))


# -- messages from workers -------------------------------------------------------------------------------


@dataclass
class Opened(Message):
    ws: Any


@dataclass
class Opening(Message):
    text: str


@dataclass
class Polled(Message):
    snap: data.Snapshot


@dataclass
class ForcingLoaded(Message):
    branch: str
    report: dict | None


@dataclass
class MechanismsLoaded(Message):
    mechanisms: list


@dataclass
class Done(Message):
    """An action finished: say so, and refresh what it changed."""

    text: str
    refresh: str = ""


@dataclass
class ShowText(Message):
    title: str
    text: str
    diff: bool = False


@dataclass
class LaunchChoices(Message):
    choices: list
    llm_unavailable: str | None


@dataclass
class LaunchFinished(Message):
    branch: str
    attempt: dict | None


def _follow(fn: Callable[[], Any], name: str, on_cancel: Callable[[], None] | None = None,
            on_error: Callable[[], None] | None = None) -> tuple[bool, Any]:
    """Run `fn` in a daemon thread and wait for it from the current thread worker, so quitting never
    waits for a long run: (True, its result), or (False, None) when the worker was cancelled first
    (`on_cancel` then runs). An exception in `fn` is raised here, after `on_error`, for the worker's
    error notification."""
    result: dict[str, Any] = {}

    def body() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised again below, in the worker
            result["error"] = e

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    worker = get_current_worker()
    while thread.is_alive():
        thread.join(0.2)
        if worker.is_cancelled:
            if on_cancel is not None:
                on_cancel()
            return False, None
    if "error" in result:
        if on_error is not None:
            on_error()
        raise result["error"]
    return True, result.get("value")


# -- the command palette ---------------------------------------------------------------------------------


class SpecPilotCommands(Provider):
    """The actions that fit the current state: selected branch, running agents, selected mechanism."""

    def commands(self) -> list[tuple[str, Callable[[], Any], str]]:
        app = self.app
        assert isinstance(app, SpecPilotApp)
        out: list[tuple[str, Callable[[], Any], str]] = [
            (f"Go to {label}", partial(app.show_tab, tab), f"show the {label} tab") for tab, label in TABS]
        if app.ws is None:
            return out
        out.append(("Launch an agent on a direction", app.action_launch, "tuner or LLM agent, one gap family"))
        for b, launch in app.launches.items():
            if b in app.live and launch.kind == "llm":
                out.append((f"Steer {b}", partial(app.steer_branch, b), "send the running LLM agent a message"))
            if b in app.live:
                out.append((f"Stop {b}", partial(app.stop_branch, b), "stop the running agent (asks first)"))
        sel = app.selected_branch()
        if sel:
            out += [(f"Merge {sel} into base", partial(app.merge_branch, sel), "git merge, asks first"),
                    (f"Diff of {sel} against its base", partial(app.diff_branch, sel), "what the branch changed"),
                    (f"Forcing report of {sel}", partial(app.open_forcing, sel), "stock vs candidate tokens"),
                    (f"Run forcing on {sel}", partial(app.run_forcing, sel), "every position against stock"),
                    (f"Re-evaluate {sel}", partial(app.reevaluate, sel), "the whole cascade; resumes one"),
                    (f"Cancel the work on {sel}", partial(app.cancel_branch, sel), "kills its systems at once")]
        out.append(("Run one loop round", app.action_round, "as specpilot-tui --auto would, one more round"))
        mid = app.selected_mechanism()
        if mid is not None:
            m = app.mechanisms.get(mid)
            name = f"{mid} ({m.name})" if m else str(mid)
            if m is None or m.status != "accepted":
                out.append((f"Accept mechanism {name}", partial(app.verdict, mid, "accepted"), "with a note"))
            if m is None or m.status != "rejected":
                out.append((f"Reject mechanism {name}", partial(app.verdict, mid, "rejected"), "with a note"))
        if any(m.status == "accepted" for m in app.mechanisms.values()):
            out.append(("Export accepted mechanisms", app.action_export, "a git format-patch series to a folder"))
        return out

    async def discover(self) -> Hits:
        for name, cb, help_text in self.commands():
            yield DiscoveryHit(name, cb, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, cb, help_text in self.commands():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), cb, help=help_text)


# -- the app ---------------------------------------------------------------------------------------------


class SpecPilotApp(App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "SpecPilot"
    COMMANDS = App.COMMANDS | {SpecPilotCommands}
    BINDINGS = [
        Binding("question_mark", "toggle_keys", "Keys", id="app.keys", tooltip="show the keys that work here"),
        Binding("ctrl+p", "command_palette", "Commands", id="app.commands", show=False,
                tooltip="the actions that fit now"),
        Binding("q", "quit", "Quit", id="app.quit", tooltip="quit (running agents are stopped)"),
        *[Binding(str(i + 1), f"show_tab('{tab}')", label, id=f"app.tab.{tab}", show=False,
                  tooltip=f"the {label} tab") for i, (tab, label) in enumerate(TABS)],
    ]

    def __init__(self, workspace: Path, *, create_demo: bool = False, demo_options: dict | None = None,
                 poll_s: float = 1.0, blink: bool = True, evaluator: Any = None) -> None:
        super().__init__()
        self.workspace_path = workspace
        # Where launches, re-evaluations and loop rounds evaluate (workbench.executor): here, or a Ray cluster.
        self.evaluator = evaluator or LocalEvaluator()
        self.evaluations = executor_summary(self.evaluator)
        self.running_evaluations = ""  # the Ray cluster's running evaluations per node, from its board
        if hasattr(self.evaluator, "progress"):
            self.evaluator.progress = self.executor_progress
        self.create_demo = create_demo
        self.demo_options = demo_options or {}
        self.poll_s = poll_s
        self.blink = blink
        self.ws: Any = None  # workbench.workspace.Workspace, opened in a worker
        self.last_event_id: int | None = None
        self.snapshot: data.Snapshot | None = None
        self.launches: dict[str, data.Launch] = {}
        self.live: set[str] = set()
        self.mechanisms: dict[int, Any] = {}
        self.forcing_branch: str | None = None
        self.polls = 0  # completed polls (tests wait on this)
        self.abandoned: list[str] = []  # branches whose work was still running when the app quit
        self._polling = False
        self._forcing_seq = 0

    def notify(self, message: str, *, title: str = "", severity: SeverityLevel = "information",
               timeout: float | None = None, markup: bool = False) -> None:
        """A toast of plain text: branch names, reasons and model output are never read as markup, and
        a Rich `Text` (which crashes the toast when it renders) is flattened to its string."""
        text = message.plain if isinstance(message, Text) else str(message)
        super().notify(text, title=str(title), severity=severity, timeout=timeout, markup=markup)

    # -- layout ----------------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        # Kept as attributes: App.query_one looks at the active screen, which may be a modal.
        self.opening = Vertical(id="opening")
        self.opening_label = Label(Text(f"opening {self.workspace_path} ..."), id="opening-label")
        self.tabs = TabbedContent(id="tabs")
        self.overview = OverviewPane(id="overview-pane")
        self.branches = BranchesPane(id="branches-pane")
        self.forcing = ForcingPane(id="forcing-pane")
        self.memory = MemoryPane(id="memory-pane")
        self.log_pane = LogPane(id="log-pane")
        yield Header()
        with self.opening:
            yield self.opening_label
            yield ProgressBar(total=None, show_eta=False, show_percentage=False, id="opening-bar")
        with self.tabs:
            for (tab, label), pane in zip(TABS, (self.overview, self.branches, self.forcing, self.memory,
                                                 self.log_pane), strict=True):
                with TabPane(label, id=tab):
                    yield pane
        yield Footer(compact=True)

    def executor_progress(self, msg: str) -> None:
        """The executor's lines (its watcher thread): the per-node running evaluations are kept for the
        Overview; the nodes' cascade lines are in the Log tab through the store already."""
        prefix = "ray: running evaluations: "
        if msg.startswith(prefix):
            self.running_evaluations = msg[len(prefix):]

    def evaluations_line(self) -> str:
        running = self.running_evaluations
        return self.evaluations + (f"; running: {running}" if running and self.evaluator.kind == "ray" else "")

    def ui_alive(self) -> bool:
        """False while the app shuts down: a worker's late message then has nothing to update."""
        return self.is_running and self.overview.is_attached

    def search_text(self) -> str:
        return self.memory.query_one("#memory-search", Input).value

    def on_mount(self) -> None:
        if not self.blink:
            for inp in self.memory.query(Input):
                inp.cursor_blink = False
        self.open_workspace()

    # -- workers ---------------------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="open", exit_on_error=False, name="open workspace")
    def open_workspace(self) -> None:

        path = self.workspace_path
        if self.create_demo and not (path / "specpilot.toml").exists():
            opts = {"dtype": DTYPE_AUTO, **self.demo_options}
            opts["dtype"], note = resolve_dtype(opts["dtype"])  # the CPU decides: float32 without native bf16
            why = f"{opts['dtype']}, no native bfloat16 on this CPU" if note else opts["dtype"]
            self.post_message(Opening(f"creating the demo workspace at {path} ({why}; first run) ..."))
            ws = init_demo(path, **opts)
        else:
            ws = Workspace(path)
        ws.deployment_id()
        self.post_message(Opened(ws))

    @work(thread=True, group="poll", exit_on_error=False, name="poll store")
    def poll_store(self) -> None:
        try:
            self.post_message(Polled(data.read_snapshot(self.ws, self.last_event_id)))
        finally:
            self._polling = False

    @work(thread=True, exclusive=True, group="forcing", exit_on_error=False, name="load forcing report")
    def load_forcing(self, branch: str) -> None:
        self.post_message(ForcingLoaded(branch, data.forcing_view(self.ws, branch)))

    @work(thread=True, exclusive=True, group="mechanisms", exit_on_error=False, name="load mechanisms")
    def load_mechanisms(self, query: str = "") -> None:
        self.post_message(MechanismsLoaded(data.list_mechanisms(self.ws, query)))

    @work(thread=True, group="action", exit_on_error=False, name="merge")
    def _merge(self, branch: str) -> None:
        self.post_message(Done(data.merge_into_base(self.ws, branch), "branches"))

    @work(thread=True, group="action", exit_on_error=False, name="diff")
    def _diff(self, branch: str) -> None:
        self.post_message(ShowText(*data.branch_diff(self.ws, branch), diff=True))

    @work(thread=True, group="action", exit_on_error=False, name="verdict")
    def _verdict(self, mechanism_id: int, status: str, note: str) -> None:
        m, shared = data.set_verdict(self.ws, mechanism_id, status, note)
        self.post_message(Done(f"mechanism {m.id} ({m.name}) is now {m.status}"
                               + (" and carried to the global memory" if shared else ""), "memory"))

    @work(thread=True, group="action", exit_on_error=False, name="export")
    def _export(self, folder: str) -> None:
        written = data.export_accepted(self.ws, Path(folder).expanduser())
        self.post_message(Done(f"exported {len(written)} patch(es) to {folder}", "memory"))

    @work(thread=True, group="action", exit_on_error=False, name="launch choices")
    def _launch_choices(self) -> None:
        self.post_message(LaunchChoices(*data.directions_for_launch(self.ws)))

    @work(thread=True, group="background", exit_on_error=False, name="background work")
    def _background(self, what: str, branch: str | None, fn: Callable[[], str]) -> None:
        """`fn` (forcing, a re-evaluation, a loop round) followed in a daemon thread; its branch counts
        as live meanwhile (quit marks it interrupted, c cancels it)."""
        if branch:
            self.call_from_thread(self._set_live, branch, True)
        try:
            done, text = _follow(fn, f"{what}-{branch}")
        finally:
            if branch:
                self.call_from_thread(self._set_live, branch, False)
        if done:
            self.post_message(Done(text or f"{what} done", "memory"))

    @work(thread=True, group="launch", exit_on_error=False, name="launch")
    def _launch(self, kind: str, family: str) -> None:
        """Runs the agent in a daemon thread and follows it, so quitting never waits for a long run: the
        worker ends on cancel, the agent's harness processes die with the app (`recover` sorts the rest)."""
        branch = data.free_branch_name(self.ws, kind, family)
        launch = data.Launch(self.ws, kind, family, branch, evaluator=self.evaluator)
        self.call_from_thread(self._register_launch, branch, launch)
        done, attempt = _follow(launch.run, f"agent-{branch}", on_cancel=launch.stop,
                                on_error=lambda: self.post_message(LaunchFinished(branch, None)))
        if done:
            self.post_message(LaunchFinished(branch, attempt))

    def _set_live(self, branch: str, live: bool) -> None:
        (self.live.add if live else self.live.discard)(branch)

    def _register_launch(self, branch: str, launch: data.Launch) -> None:
        self.launches[branch] = launch
        self.live.add(branch)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """Any worker's failure is one line in a notification."""
        if event.state != WorkerState.ERROR:
            return
        err = event.worker.error
        first = (str(err).strip().splitlines() or [""])[0][:300]
        name = event.worker.name
        self.notify(f"{type(err).__name__}: {first}" if first else type(err).__name__,
                    title=f"{name} failed", severity="error", timeout=10)
        if name == "open workspace" and self.ui_alive():
            self.opening_label.update(Text(f"could not open {self.workspace_path}: {first}", style="bold red"))
            self.opening.query_one("#opening-bar").display = False
        elif name == "launch":
            self.refresh_bindings()

    # -- worker results --------------------------------------------------------------------------------

    def on_opening(self, msg: Opening) -> None:
        if self.ui_alive():
            self.opening_label.update(Text(msg.text))

    def on_opened(self, msg: Opened) -> None:
        self.ws = msg.ws
        self.sub_title = msg.ws.config.name
        if not self.ui_alive():
            return
        self.opening.display = False
        self.poll()
        self.load_mechanisms()
        self.set_interval(self.poll_s, self.poll)

    def poll(self) -> None:
        if self.ws is None or self._polling:
            return
        self._polling = True
        self.poll_store()

    def on_polled(self, msg: Polled) -> None:
        if not self.ui_alive():
            return
        snap = msg.snap
        first = self.snapshot is None
        self.snapshot = snap
        self.last_event_id = snap.last_event_id
        ws_path = str(self.ws.path)
        self.overview.show(snap, ws_path, self.evaluations_line())
        self.branches.show(snap.branches, self.live)
        self.log_pane.add(snap.events, ws_path)
        forced = [b.name for b in snap.branches if b.forcing_report_id is not None]
        self.forcing.set_branches(forced, self.forcing_branch)
        if first and self.forcing_branch is None and forced:
            self.open_forcing(forced[-1], switch=False)
        if any(e.kind.startswith("mechanism") for e in snap.events) and not first:
            self.load_mechanisms(self.search_text())
        rep = next((b for b in snap.branches if b.name == self.forcing_branch), None)
        if rep is not None and rep.forcing_report_id != getattr(self, "_forcing_report_id", None) and not first:
            self.load_forcing(rep.name)
        self._forcing_report_id = rep.forcing_report_id if rep else None
        self.polls += 1

    def on_forcing_loaded(self, msg: ForcingLoaded) -> None:
        if msg.branch == self.forcing_branch and self.ui_alive():
            self.forcing.show(msg.report)

    def on_mechanisms_loaded(self, msg: MechanismsLoaded) -> None:
        if not self.ui_alive():
            return
        self.mechanisms = {m.id: m for m in msg.mechanisms}
        self.memory.show(msg.mechanisms)

    def on_done(self, msg: Done) -> None:
        if not self.ui_alive():
            return
        self.notify(msg.text, title="done")
        if msg.refresh == "memory":
            self.load_mechanisms(self.search_text())
        self.poll()

    def on_show_text(self, msg: ShowText) -> None:
        if self.ui_alive():
            self.push_screen(TextViewScreen(msg.title, msg.text, diff=msg.diff))

    def on_launch_choices(self, msg: LaunchChoices) -> None:
        if not self.ui_alive():
            return

        def chosen(result: tuple[str, str] | None) -> None:
            if result is not None:
                kind, family = result
                who = "an LLM" if kind == "llm" else "a tuner"
                self.notify(f"launching {who} agent on {family}", title="launch")
                self._launch(kind, family)

        self.push_screen(LaunchScreen(msg.choices, msg.llm_unavailable), chosen)

    def on_launch_finished(self, msg: LaunchFinished) -> None:
        self.live.discard(msg.branch)
        a = msg.attempt
        if a is None:  # failed: the worker's error notification says why
            self.poll()
            return
        self.notify(f"{msg.branch}: {a.get('status')}: {a.get('reason')}", title="agent finished",
                    severity="information" if a.get("status") == "keep" else "warning", timeout=8)
        self.poll()

    # -- navigation ------------------------------------------------------------------------------------

    def active_tab(self) -> str:
        return self.tabs.active

    def action_show_tab(self, tab: str) -> None:
        self.show_tab(tab)

    def show_tab(self, tab: str) -> None:
        self.tabs.active = tab
        focus = {"branches": "#branches-table", "forcing": "#mismatches", "memory": "#mechanisms", "log": "#event-log"}
        if tab in focus:
            self.tabs.query_one(focus[tab]).focus()

    @on(TabbedContent.TabActivated)
    def _tab_activated(self, event: TabbedContent.TabActivated) -> None:
        if event.pane.id == "memory" and self.ws is not None:
            self.load_mechanisms(self.search_text())

    def action_toggle_keys(self) -> None:
        """The keys of the app, then of the tab in front (its table's cursor keys are the usual ones)."""
        rows = [("anywhere", "1-5", "tabs: " + ", ".join(label for _, label in TABS)),
                ("anywhere", "?", "these keys"), ("anywhere", "ctrl+p", "the actions that fit the selection"),
                ("anywhere", "q", "quit (running agents are stopped, their branches marked interrupted)")]
        pane = {"branches": self.branches, "forcing": self.forcing, "memory": self.memory,
                "log": self.log_pane}.get(self.active_tab())
        label = dict(TABS).get(self.active_tab(), "")
        for b in getattr(pane, "BINDINGS", []):
            key = {"slash": "/"}.get(b.key, b.key)
            rows.append((label, key, f"{b.description}: {b.tooltip}" if b.tooltip else b.description))
        if self.active_tab() == "branches":
            rows.append((label, "enter", "the branch's forcing report"))
        self.push_screen(KeysScreen(rows))

    def selected_branch(self) -> str | None:
        return self.branches.selected()

    def selected_mechanism(self) -> int | None:
        key = self.memory.selected()
        return int(key) if key else None

    def _need_ws(self) -> bool:
        if self.ws is None:
            self.notify("the workspace is still opening", severity="warning")
            return False
        return True

    def _need_branch(self, what: str) -> str | None:
        b = self.selected_branch() if self._need_ws() else None
        if b is None and self.ws is not None:
            self.notify(f"{what}: no branch selected (Branches tab: pick a row)", severity="warning")
        return b

    def _with_branch(self, what: str, act: Callable[[str], None]) -> None:
        """A branch action on the selected row (a warning when none is selected)."""
        b = self._need_branch(what)
        if b:
            act(b)

    def _busy(self, what: str, branch: str) -> bool:
        """True (with a warning) when something of this app runs on `branch`."""
        if branch in self.live:
            self.notify(f"{what}: {branch} is busy; wait or cancel it (c)", severity="warning")
            return True
        return False

    def _start_on(self, branch: str, action: str, note: str, fn: Callable[[], str], title: str = "",
                  what: str = "") -> None:
        """Background work on a branch that is not busy, announced in a toast."""
        if not self._busy(action, branch):
            self.notify(note, title=title or action)
            self._background(what or action, branch, fn)

    def _confirm(self, question: str, yes: str, then: Callable[[], object]) -> None:
        """Ask first; `then` runs only on yes."""
        self.push_screen(ConfirmScreen(question, yes=yes), lambda answer: then() if answer else None)

    # -- branch actions --------------------------------------------------------------------------------

    def action_launch(self) -> None:
        if self._need_ws():
            self._launch_choices()

    def action_steer(self) -> None:
        self._with_branch("steer", self.steer_branch)

    def steer_branch(self, branch: str) -> None:
        launch = self.launches.get(branch)
        if launch is None or branch not in self.live or launch.kind != "llm":
            self.notify(f"steer: {branch} is not an LLM agent running in this app (steering reaches LLM agents "
                        f"launched here with l)", severity="warning")
            return

        def send(text: str | None) -> None:
            if text:
                launch.steer(text)
                self.notify(f"sent to {branch}: {text}", title="steer")

        self.push_screen(TextInputScreen(f"Message to the agent on {branch}", "e.g. try a shorter draft length",
                                         submit="Send", required="type a message, or escape to cancel"), send)

    def action_stop(self) -> None:
        self._with_branch("stop", self.stop_branch)

    def stop_branch(self, branch: str) -> None:
        launch = self.launches.get(branch)
        if launch is None or branch not in self.live:
            self.notify(f"stop: no agent of this app is running on {branch}", severity="warning")
            return

        def stop() -> None:
            launch.stop()
            self.notify(f"stop sent to {branch}: it ends at its next turn", title="stop")

        self._confirm(f"Stop the {launch.kind} agent on {branch}? Its work so far is evaluated if it committed "
                      f"anything.", "Stop", stop)

    def action_merge(self) -> None:
        self._with_branch("merge", self.merge_branch)

    def merge_branch(self, branch: str) -> None:
        if branch in self.live:
            self.notify(f"merge: the agent on {branch} is still running; stop it or wait", severity="warning")
            return

        self._confirm(f"Merge {branch} into base? (git merge --no-ff; system.toml merged key by key)", "Merge",
                      partial(self._merge, branch))

    def action_diff(self) -> None:
        self._with_branch("diff", self.diff_branch)

    def diff_branch(self, branch: str) -> None:
        self._diff(branch)

    def action_run_forcing(self) -> None:
        self._with_branch("forcing", self.run_forcing)

    def run_forcing(self, branch: str) -> None:
        self._start_on(branch, "forcing", f"forcing {branch} against stock", partial(data.run_forcing, self.ws, branch))

    def action_reevaluate(self) -> None:
        self._with_branch("re-evaluate", self.reevaluate)

    def reevaluate(self, branch: str) -> None:
        def run() -> str:
            a = data.reevaluate(self.ws, branch, self.evaluator)
            return f"{branch}: {a.get('status')}: {a.get('reason')}"

        self._start_on(branch, "re-evaluate", f"re-evaluating {branch} (guard, smoke, forcing, paired benchmark)", run,
                       title="evaluate", what="evaluation")

    def action_cancel(self) -> None:
        self._with_branch("cancel", self.cancel_branch)

    def cancel_branch(self, branch: str) -> None:
        if branch not in self.live:
            self.notify(f"cancel: nothing of this app runs on {branch}", severity="warning")
            return
        if branch in self.launches:
            self.launches[branch].stop()
        n = kill_branch_systems(branch)
        self.notify(f"cancelled {branch}: {n} system(s) killed" + ("; the agent stops at its next turn"
                                                                    if branch in self.launches else ""),
                    title="cancel", severity="warning")

    def action_round(self) -> None:
        if not self._need_ws():
            return
        if "loop" in self.live:
            self.notify("a loop round is already running", severity="warning")
            return

        def run() -> str:
            s = data.run_loop_round(self.ws, evaluator=self.evaluator)
            r = s["rounds"][-1] if s["rounds"] else None
            return (f"round {r['index']} done: final {s['final_speedup']:.2f}x over AR" if r and s["final_speedup"]
                    else f"loop: {s['status']}")

        self.notify("one loop round: profile, agents on the largest gaps, cascade, integration", title="round")
        self._background("round", "loop", run)

    def action_delete(self) -> None:
        b = self._need_branch("delete")
        if not b:
            return
        if self._busy("delete", b):
            return

        self._confirm(f"Delete branch {b} and its worktree? Its evaluations stay in the store.", "Delete",
                      partial(self._background, "delete", None, partial(self._delete_branch, b)))

    def _delete_branch(self, branch: str) -> str:
        self.ws.remove_branch(branch)
        return f"deleted {branch}"

    def action_recover(self) -> None:
        if not self._need_ws():
            return

        def run() -> str:
            done = self.ws.recover()
            return "recover: " + ("; ".join(done) if done else "nothing to do: git and the store agree")

        self._background("recover", None, run)

    def action_forcing(self) -> None:
        self._with_branch("forcing", self.open_forcing)

    def open_forcing(self, branch: str, switch: bool = True) -> None:
        self.forcing_branch = branch
        # The report loaded now is the latest: the next poll must not load it again (and reset the cursor).
        row = next((b for b in self.snapshot.branches if b.name == branch), None) if self.snapshot else None
        self._forcing_report_id = row.forcing_report_id if row else None
        pane = self.forcing
        sel = pane.query_one(Select)
        if branch in getattr(pane, "_names", []) and sel.value != branch:
            with sel.prevent(Select.Changed):
                sel.value = branch
        if switch:
            self.show_tab("forcing")
        self.load_forcing(branch)

    @on(Select.Changed, "#forcing-branch")
    def _forcing_branch_chosen(self, event: Select.Changed) -> None:
        if isinstance(event.value, str) and event.value != self.forcing_branch:
            self.open_forcing(event.value, switch=False)

    # -- memory actions --------------------------------------------------------------------------------

    @on(Input.Submitted, "#memory-search")
    def _search(self, event: Input.Submitted) -> None:
        if self._need_ws():
            self.load_mechanisms(event.value)
            self.memory.query_one("#mechanisms", DataTable).focus()

    def action_accept(self) -> None:
        self._verdict_selected("accepted")

    def action_reject(self) -> None:
        self._verdict_selected("rejected")

    def _verdict_selected(self, status: str) -> None:
        mid = self.selected_mechanism() if self._need_ws() else None
        if mid is None:
            if self.ws is not None:
                self.notify(f"{status[:-2]}: no mechanism selected (Memory tab: pick a row)", severity="warning")
            return
        self.verdict(mid, status)

    def verdict(self, mechanism_id: int, status: str) -> None:
        verb = "Accept" if status == "accepted" else "Reject"
        m = self.mechanisms.get(mechanism_id)
        name = f"{mechanism_id} ({m.name})" if m else str(mechanism_id)

        def with_note(note: str | None) -> None:
            if note:
                self._verdict(mechanism_id, status, note)

        self.push_screen(TextInputScreen(f"{verb} mechanism {name}? The reviewer's note says why:",
                                         "e.g. lossless on all prompts, 1.3x on demo", submit=verb,
                                         required=f"a note is required to {verb.lower()}"), with_note)

    def action_export(self) -> None:
        if not self._need_ws():
            return
        if not self.ws.memory.list_mechanisms(status="accepted"):
            self.notify("export: no mechanism is accepted yet (Memory tab: pick one, press a)", severity="warning")
            return
        default = str(Path.cwd() / f"{self.ws.config.name}-patches")

        def to(folder: str | None) -> None:
            self.memory.query_one("#mechanisms", DataTable).focus()  # not the search box behind the dialog
            if folder:
                self._export(folder)

        self.push_screen(TextInputScreen("Export accepted mechanisms (git format-patch series) to folder:",
                                         value=default, submit="Export", required="give a folder"), to)

    async def action_quit(self) -> None:
        """Quit at once, also with agents running: they are told to stop, their branches marked
        interrupted (E resumes one), and the process ends without waiting for them (`main` leaves with
        os._exit; their systems die with it)."""
        live = sorted(self.live)
        if live:
            self.notify(f"stopping {len(live)} agent(s): {', '.join(live)}", title="quit")
            for b in live:
                if b in self.launches:
                    self.launches[b].stop()
                kill_branch_systems(b)
            if self.ws is not None:
                data.mark_interrupted(self.ws, live)
            self.abandoned = live
        self.exit(0)


def executor_summary(evaluator: Any) -> str:
    """Where the app's evaluations run, in one line for the Overview."""
    if evaluator.kind != "ray":
        return "here (local executor)"
    st = evaluator.settings
    return (f"Ray cluster at {st.address or 'auto'}: {evaluator.nodes} evaluation node(s) ({st.resource}), "
            f"{st.per_node} at once on each")


def make_app(workspace: str | Path | None = None, *, demo_options: dict | None = None, poll_s: float = 1.0,
             blink: bool = True, evaluator: Any = None) -> SpecPilotApp:
    """The app for a workspace; with none, the demo workspace (created on first run). `evaluator`:
    where its evaluations run (default: here)."""
    if workspace is None:

        return SpecPilotApp(default_demo_path(), create_demo=True, demo_options=demo_options, poll_s=poll_s,
                            blink=blink, evaluator=evaluator)
    return SpecPilotApp(Path(workspace).expanduser().resolve(), poll_s=poll_s, blink=blink, evaluator=evaluator)


def _executor_table(workspace: Path) -> dict | None:
    """The workspace's `[executor]` table (None when it has none or does not exist yet)."""
    toml = workspace / "specpilot.toml"
    if not toml.exists():
        return None
    try:
        return tomllib.loads(toml.read_text()).get("executor")
    except (OSError, tomllib.TOMLDecodeError):
        return None  # the workspace's own error is reported when the app opens it


def main(argv: list[str] | None = None) -> int:
    """`specpilot-tui [--workspace PATH] [--executor local|ray] [--ray-address ADDR]` (the interactive app;
    `--auto` is handled before this is imported). Exit 2: a usage error; 6: the executor could not start."""
    p = OneLineParser(prog="specpilot-tui", description="The SpecPilot workbench (Textual).")
    p.add_argument("--workspace", help="a workspace folder (default: the demo workspace, created on first run)")
    p.add_argument("--executor", choices=EXECUTORS, help="where launches, re-evaluations and rounds evaluate "
                                                         "candidates; default: [executor] kind, else local")
    p.add_argument("--ray-address", help="the Ray cluster (host:port, auto or local); with --executor ray")
    args = p.parse_args(argv)
    if args.workspace and not (Path(args.workspace) / "specpilot.toml").exists():
        print(f"error: {args.workspace} is not a SpecPilot workspace (no specpilot.toml); create one with "
              f"`specpilot init demo PATH` or omit --workspace for the demo", file=sys.stderr)
        return 2
    where = Path(args.workspace).expanduser() if args.workspace else default_demo_path()
    try:
        settings = ExecutorSettings.resolve(args.executor, args.ray_address, _executor_table(where),
                                            f"{where / 'specpilot.toml'}: [executor]")
    except ExecutorError as e:
        return fail(str(e))
    if settings.kind == "local" and settings.address:
        return fail(f"--ray-address {settings.address}: only with --executor ray (or [executor] kind = \"ray\")")
    if settings.kind == "ray":
        print(f"connecting to the Ray cluster at {settings.address or 'auto'} ...", file=sys.stderr)
    try:
        evaluator = make_evaluator(settings)
    except ExecutorError as e:
        print(f"error: {e}", file=sys.stderr)
        return 6
    app = make_app(args.workspace, evaluator=evaluator)
    try:
        app.run()
    finally:
        if not app.abandoned:
            evaluator.shutdown()
    code = app.return_code or 0
    if app.abandoned:  # work still running in threads: do not wait for it (its systems die with us)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
