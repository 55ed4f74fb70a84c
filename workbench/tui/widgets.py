"""The tabs' content: gap bars, the speedup plot, round progress, branch table, forcing view, memory, log.

Widgets only show what they are given; reading the store and acting on the workspace is the app's
(in thread workers). Text from the store, models and agents is rendered as Rich `Text`, never as
markup: model output contains `[`.
"""

from __future__ import annotations

from datetime import datetime, timezone

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import DataTable, Input, Label, ProgressBar, RichLog, Select, Sparkline, Static

from costmodel.kernels import worst_per_group
from store import Event, Mechanism
from workbench.tui.data import BranchRow, RoundProgress, Snapshot

FAMILY_WIDTH = 14


def format_ts(ts: str) -> str:
    """An event's UTC timestamp as local HH:MM:SS."""
    try:
        t = datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)  # noqa: UP017
    except ValueError:
        return ts[11:19]
    return t.astimezone().strftime("%H:%M:%S")


def display_path(path: str) -> str:
    """How a workspace path is shown (tests replace this to keep snapshots independent of tmp paths)."""
    return path


# -- Overview --------------------------------------------------------------------------------------------


class GapBars(Static):
    """Milliseconds per generated token lost in each gap family, as horizontal bars."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.families: dict[str, float] = {}
        self.could_save: dict[str, float] = {}
        self.caption = ""

    def on_resize(self) -> None:
        self.refresh(layout=True)  # the bars are as wide as the widget: draw them again at the new width

    def show(self, families: dict[str, float], caption: str, could_save: dict[str, float] | None = None) -> None:
        self.families, self.caption, self.could_save = dict(families), caption, dict(could_save or {})
        self.refresh(layout=True)

    def render(self) -> Text:
        if not self.families:
            return Text("no gaps measured yet: a round profiles the base first (Branches: l launches an agent)",
                        style="dim")
        out = Text(self.caption + "\n", style="dim")
        top = max([*self.families.values(), *self.could_save.values()]) or 1.0
        width = max(4, self.size.width - FAMILY_WIDTH - 12)
        rows = [(fam, ms, False) for fam, ms in sorted(self.families.items(), key=lambda kv: -kv[1])]
        rows += [(fam, ms, True) for fam, ms in sorted(self.could_save.items(), key=lambda kv: -kv[1]) if ms > 0]
        for fam, ms, extra in rows:
            n = max(0, round(ms / top * width)) if ms > 0 else 0
            out.append(f"{fam + ('+' if extra else ''):<{FAMILY_WIDTH}}", style="bold")
            out.append(("░" if extra else "█") * n, style="grey50" if extra else
                       "dark_orange" if n == width else "orange3")
            out.append(" " * (width - n))
            out.append(f" {ms:7.3f} ms\n")
        if self.could_save:
            out.append(f"{'':<{FAMILY_WIDTH}}░ could save beyond the measured time (not in its total)\n", style="dim")
        out.rstrip()
        return out


class SpeedupPlot(Vertical):
    """Speedup over AR after each round, as a sparkline from AR (1.0x) with the figures under it."""

    def compose(self) -> ComposeResult:
        yield Sparkline([], id="speedup-spark")
        yield Label("", id="speedup-figures")

    def show(self, points: list[tuple[int, float]], stock: float | None, final: float | None = None) -> None:
        """`points`: each round's estimate (the base's speedup times the round's paired gain); `final`:
        the loop's own measurement of the final system against AR, which is what counts."""
        spark = self.query_one(Sparkline)
        values = ([stock] if stock is not None else []) + [v for _, v in points] + ([final] if final else [])
        spark.data = [1.0, *values]  # AR itself is the floor the plot rises from
        spark.display = bool(values)
        parts = ([f"stock {stock:.2f}x"] if stock is not None else []) + [f"r{n} ~{v:.2f}x" for n, v in points]
        parts = ["AR 1.00x", *parts] if parts else parts
        text = Text("  ".join(parts[-8:]) if parts else "no round finished yet", style="" if parts else "dim")
        if final:
            text.append(f"  final {final:.2f}x measured", style="bold")
            if points:
                text.append("  (r~: estimates, a product of paired gains)", style="dim")
        self.query_one("#speedup-figures", Label).update(text)


class RoundProgressView(Horizontal):
    def compose(self) -> ComposeResult:
        yield Label("", id="round-label")
        yield ProgressBar(total=1, show_eta=False, id="round-bar")

    def show(self, current: RoundProgress | None) -> None:
        label = self.query_one("#round-label", Label)
        bar = self.query_one(ProgressBar)
        if current is None:
            label.update(Text("no round running", style="dim"))
            bar.display = False
            return
        bar.display = True
        label.update(Text(f"round {current.number}: {current.phase} ({current.done}/{current.total or '?'})"))
        bar.update(total=max(current.total, 1), progress=current.done)


def kernel_lines(prof: dict, top: int = 3) -> Text:
    """Stock's worst kernels against their roofline (llama.cpp workspaces), and what a wide forward costs."""
    if not prof or not prof.get("kernels"):
        return Text("")
    ratio = prof.get("forward_ratio", {})
    text = Text.assemble(("Kernels against their roofline", "bold"),
                         (f"  (stock's; a forward's matmuls over 4 tokens: {ratio['4']:.2f}x one token's)"
                          if "4" in ratio else "", "dim"))
    for k in worst_per_group(prof["kernels"], top):
        text.append(f"\n  {k['type']} {k['k']}x{k['n']} x{k['count']} at width {k['width']}: ")
        text.append(f"{k['efficiency']:.0%} of roofline", style="yellow" if k["efficiency"] < 0.5 else "")
        text.append(f", {k['gap_ms']:.1f} ms lost per forward", style="dim")
    return text


class OverviewPane(VerticalScroll):
    def compose(self) -> ComposeResult:
        yield Static("", id="deployment")
        yield Label("Gap breakdown (ms per generated token)", classes="title")
        yield GapBars(id="gaps")
        yield Static("", id="kernels")
        yield Label("Speedup over AR across rounds", classes="title")
        yield SpeedupPlot(id="speedup")
        yield RoundProgressView(id="round")

    def show(self, snap: Snapshot, workspace: str, evaluations: str = "here (local executor)") -> None:
        d = snap.deployment
        t = Table.grid(padding=(0, 1))
        t.add_column(style="bold")
        t.add_column()
        t.add_column(style="bold")
        t.add_column()
        t.add_row("deployment", Text(d["name"]), "hardware", Text(f"{d['hardware']} ({d['device']}, {d['dtype']})"))
        t.add_row("target", Text(d["target"]), "drafter", Text(d["drafter"]))
        t.add_row("regime", Text(d["regime"]), "workspace", Text(display_path(workspace), overflow="ellipsis"))
        self.query_one("#deployment", Static).update(Group(t, Text.assemble(("evaluations ", "bold"), evaluations)))
        caption = ""
        if snap.gaps_label:
            caption = f"profiled by {snap.gaps_label}"
            if snap.measured_ms:
                caption += (f": measured {snap.measured_ms:.2f} ms/token, the solid bars add up to it "
                            f"({sum(snap.families.values()):.2f})")
        self.query_one(GapBars).show(snap.families, caption, snap.could_save)
        kern = self.query_one("#kernels", Static)
        kern.update(kernel_lines(snap.kernels))
        kern.display = bool(snap.kernels.get("kernels"))
        self.query_one(SpeedupPlot).show(snap.speedups, snap.stock_speedup, snap.final_speedup)
        self.query_one(RoundProgressView).show(snap.current)


# -- Branches --------------------------------------------------------------------------------------------


class FilterBox(Input):
    """A filter line over a table or log: hidden until `/`, every keystroke applies, escape clears."""

    BINDINGS = [Binding("escape", "close", "Clear filter", id="filter.close")]

    def __init__(self, placeholder: str, **kw) -> None:
        super().__init__(placeholder=placeholder, **kw)
        self.display = False

    class Changed(Input.Changed):
        pass

    def open(self) -> None:
        self.display = True
        self.focus()

    def action_close(self) -> None:
        self.value = ""
        self.display = False
        self.post_message(FilterBox.Changed(self, ""))
        self._focus_content()

    def _focus_content(self) -> None:
        """Back to what the filter filters (the table or the log beside it)."""
        for w in self.parent.query("DataTable, RichLog"):
            w.focus()
            return

    def on_input_changed(self, event: Input.Changed) -> None:
        if not isinstance(event, FilterBox.Changed):
            event.stop()
            self.post_message(FilterBox.Changed(self, event.value))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._focus_content()

# What decides come first: at 80 columns the agent and direction are what scrolls off.
BRANCH_COLUMNS = (("branch", "branch"), ("status", "status"), ("vs base", "speedup"), ("forcing", "forcing"),
                  ("now", "progress"), ("agent", "agent"), ("direction", "direction"))
STATUS_STYLE = {"kept": "green", "forced": "green", "running": "bold cyan", "evaluating": "cyan",
                "discarded": "yellow", "mismatch": "red", "crashed": "red", "rejected": "red", "error": "red",
                "interrupted": "magenta", "lost": "magenta", "merged": "green"}
PROGRESS_WIDTH = 44  # the "now" column: phase i/n · elapsed · ETA fits, a long detail is cut


def branch_cells(r: BranchRow, live: bool) -> list[Text]:
    status = f"{r.status} (no process)" if r.stale else r.status + (" *" if live else "")
    forcing = Text(r.forcing, style="green" if r.forcing == "clean" else "red" if "real" in r.forcing else "")
    now = r.progress if len(r.progress) <= PROGRESS_WIDTH else r.progress[:PROGRESS_WIDTH - 1] + "…"
    return [Text(r.name), Text(status, style="magenta" if r.stale else STATUS_STYLE.get(r.status, "")),
            Text(f"{r.speedup:.3f}x" if r.speedup is not None else "-", justify="right"), forcing,
            Text(now, style="magenta" if r.stale else "cyan"), Text(r.agent), Text(r.direction)]


class BranchesPane(Vertical):
    BINDINGS = [
        Binding("l", "app.launch", "Launch", id="branches.launch", tooltip="launch a tuner or LLM agent on a gap"),
        Binding("s", "app.steer", "Steer", id="branches.steer", tooltip="send a message to the running LLM agent"),
        Binding("x", "app.stop", "Stop", id="branches.stop", tooltip="stop the running agent (asks first)"),
        Binding("m", "app.merge", "Merge", id="branches.merge", tooltip="merge the branch into base (asks first)"),
        Binding("d", "app.diff", "Diff", id="branches.diff", tooltip="what the branch changed against its base"),
        Binding("f", "app.forcing", "Forcing", id="branches.forcing", tooltip="the branch's latest forcing report"),
        Binding("F", "app.run_forcing", "Force", id="branches.force", tooltip="run forcing on the branch now"),
        Binding("E", "app.reevaluate", "Re-evaluate", id="branches.reevaluate",
                tooltip="the whole cascade on the branch again (resumes an interrupted one)"),
        Binding("c", "app.cancel", "Cancel", id="branches.cancel",
                tooltip="cancel the branch's work: kills its systems"),
        Binding("L", "app.round", "Loop round", id="branches.round", tooltip="one more loop round, as --auto runs it"),
        Binding("D", "app.delete", "Delete", id="branches.delete", tooltip="delete the branch and its worktree (asks)"),
        Binding("R", "app.recover", "Recover", id="branches.recover",
                tooltip="reconcile git and the store after a crash (stale states, lost worktrees)"),
        Binding("slash", "filter", "Filter", id="branches.filter", tooltip="show only rows containing a text"),
    ]

    def compose(self) -> ComposeResult:
        yield FilterBox("filter branches (name, status, agent, direction); escape clears", id="branches-filter")
        table: DataTable = DataTable(id="branches-table", cursor_type="row", zebra_stripes=True)
        for label, key in BRANCH_COLUMNS:
            table.add_column(label, key=key)
        yield table
        yield Static("", id="branch-hint")

    def action_filter(self) -> None:
        self.query_one(FilterBox).open()

    def on_filter_box_changed(self, event: FilterBox.Changed) -> None:
        self.show(list(getattr(self, "all_rows", [])), getattr(self, "live", set()))

    def show(self, rows: list[BranchRow], live: set[str]) -> None:
        """Update the table in place: changed cells, new rows appended, gone rows removed."""
        self.all_rows, self.live = rows, live
        needle = self.query_one(FilterBox).value.strip().lower()
        if needle:
            rows = [r for r in rows if needle in " ".join((r.name, r.status, r.agent, r.direction)).lower()]
        table = self.query_one(DataTable)
        keys = [k for _, k in BRANCH_COLUMNS]
        seen = set()
        for r in rows:
            seen.add(r.name)
            cells = branch_cells(r, r.name in live)
            if r.name in table.rows:
                for key, cell in zip(keys, cells, strict=True):
                    if table.get_cell(r.name, key) != cell:
                        table.update_cell(r.name, key, cell, update_width=True)  # columns grow, never clip
            else:
                table.add_row(*cells, key=r.name)
        for key in [k.value for k in table.rows if k.value not in seen]:
            table.remove_row(key)
        self.rows = {r.name: r for r in rows}
        self.show_hint()

    def show_hint(self) -> None:
        hint = self.query_one("#branch-hint", Static)
        row = getattr(self, "rows", {}).get(self.selected() or "")
        if row is None:
            hint.update(Text("no branch yet: l launches an agent on a gap", style="dim"))
        else:
            hint.update(Text(f"{row.name}: {row.reason}", style="dim", overflow="ellipsis", no_wrap=True))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.show_hint()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """Enter on a branch: its forcing report."""
        if event.row_key.value:
            self.app.open_forcing(event.row_key.value)

    def selected(self) -> str | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value


# -- Forcing ---------------------------------------------------------------------------------------------


def short_id(prompt_id: str, width: int = 24) -> str:
    """A prompt id cut from the left: the file name end is the part that tells prompts apart."""
    return prompt_id if len(prompt_id) <= width else "…" + prompt_id[-(width - 1):]


def visible_token(text: str) -> str:
    """A mismatched token as it shows in the side-by-side view: whitespace control characters visible."""
    return text.replace("\n", "↵").replace("\t", "→").replace("\r", "␍") or "∅"


class ForcingPane(Vertical):
    BINDINGS = [
        Binding("n", "next_mismatch", "Next mismatch", id="forcing.next", tooltip="jump to the next mismatch"),
        Binding("p", "prev_mismatch", "Prev mismatch", id="forcing.prev", tooltip="jump to the previous mismatch"),
        Binding("N", "next_real", "Next real", id="forcing.next_real",
                tooltip="jump to the next real mismatch (near ties skipped)"),
        Binding("P", "prev_real", "Prev real", id="forcing.prev_real", tooltip="jump to the previous real mismatch"),
    ]

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.report: dict | None = None
        self.caption = ""  # the current mismatch, in words

    def compose(self) -> ComposeResult:
        with Horizontal(id="forcing-top"):
            yield Select([], prompt="branch", allow_blank=True, id="forcing-branch")
            yield Static("", id="forcing-summary")
        yield Static("", id="forcing-side")
        table: DataTable = DataTable(id="mismatches", cursor_type="row")
        for label in ("prompt", "pos", "stock", "candidate", "margin", "kind"):
            table.add_column(label, key=label)
        yield table

    def set_branches(self, names: list[str], current: str | None) -> None:
        sel = self.query_one(Select)
        options = [(n, n) for n in names]
        if [o[1] for o in options] != list(getattr(self, "_names", [])):
            self._names = [o[1] for o in options]
            with self.prevent(Select.Changed):
                sel.set_options(options)
                if current in self._names:
                    sel.value = current

    def show(self, report: dict | None) -> None:
        """`report`: {branch, status, reason, match_rate, positions_checked, threshold, prompts: {id: {...}},
        mismatches: [...]} as the app's worker builds it, or None. The same report shown again keeps the
        mismatch the engineer is on."""
        same = (self.report is not None and report is not None and self.report.get("branch") == report.get("branch")
                and self.report.get("mismatches") == report.get("mismatches"))
        keep = self.current() if same else 0
        self.report = report
        table = self.query_one("#mismatches", DataTable)
        table.clear()
        summary = self.query_one("#forcing-summary", Static)
        if report is None:
            summary.update(Text("no forcing report for this branch yet", style="dim"))
            self.query_one("#forcing-side", Static).update("")
            return
        real = sum(1 for m in report["mismatches"] if not m.get("near_tie"))
        s = Text()
        s.append(f"{report['status'].upper()} ", style="bold green" if report["status"] == "keep" else "bold red")
        s.append(f"match {report['match_rate']:.4f} over {report['positions_checked']} positions; "
                 f"{real} real, {len(report['mismatches']) - real} near tie(s)")
        if report.get("threshold") is not None:
            s.append(f"; near tie: margin < {report['threshold']:.3g}", style="dim")
        summary.update(s)
        for i, m in enumerate(report["mismatches"]):
            margin = f"{m['margin']:.3f}" if m.get("margin") is not None else "-"
            kind = Text("near tie", style="yellow") if m.get("near_tie") else Text("REAL", style="bold red")
            table.add_row(Text(short_id(m["prompt_id"])), Text(str(m["position"]), justify="right"),
                          Text(repr(m["stock_text"])), Text(repr(m["candidate_text"])),
                          Text(margin, justify="right"), kind, key=str(i))
        self.show_mismatch(max(0, keep))

    def current(self) -> int:
        table = self.query_one("#mismatches", DataTable)
        return table.cursor_row if table.row_count else -1

    def show_mismatch(self, index: int) -> None:
        """Stock and candidate tokens of the mismatch's prompt side by side, that mismatch emphasised."""
        side = self.query_one("#forcing-side", Static)
        if self.report is None:
            return
        mm = self.report["mismatches"]
        if not mm:
            side.update(Text(f"token-identical to stock on {self.report['positions_checked']} positions",
                             style="green"))
            return
        index = max(0, min(index, len(mm) - 1))
        table = self.query_one("#mismatches", DataTable)
        if table.cursor_row != index:
            table.move_cursor(row=index)
        cur = mm[index]
        prompt = self.report["prompts"].get(cur["prompt_id"])
        grid = Table.grid(expand=True, padding=(0, 1))
        grid.add_column(ratio=1)
        grid.add_column(ratio=1)
        grid.add_row(Text("stock", style="bold"), Text("candidate", style="bold"))
        if prompt is None:
            grid.add_row(Text(repr(cur["stock_text"])), Text(repr(cur["candidate_text"])))
        else:
            here = {m["position"]: m for m in mm if m["prompt_id"] == cur["prompt_id"]}
            stock, cand = Text(), Text()
            for pos, tok in enumerate(prompt["stock_texts"]):
                m = here.get(pos)
                if m is None:
                    stock.append(tok)
                    cand.append(tok, style="dim" if pos >= prompt["checked"] else "")
                    continue
                emph = " reverse" if m is cur else ""
                tie = "yellow" if m.get("near_tie") else "red"
                # Both sides the same width, newlines shown, not taken: the columns stay line for line.
                a, b = visible_token(tok), visible_token(m["candidate_text"])
                w = max(len(a), len(b))
                stock.append(a.ljust(w), style=f"bold {tie} underline{emph}")
                cand.append(b.ljust(w), style=f"bold white on {'dark_orange' if m.get('near_tie') else 'red'}"
                                               f"{emph}")
            for t in (stock, cand):
                t.no_wrap, t.overflow = True, "fold"  # folded at the same column on both sides
            grid.add_row(stock, cand)
        margin = f"{cur['margin']:.4f}" if cur.get("margin") is not None else "unknown"
        kind = "near tie (below the noise threshold)" if cur.get("near_tie") else "REAL change"
        caption = Text(f"mismatch {index + 1}/{len(mm)}: {cur['prompt_id']} ({cur['split']}) position "
                       f"{cur['position']}, stock margin {margin}: ", style="dim")
        caption.append(kind, style="yellow" if cur.get("near_tie") else "bold red")
        self.caption = caption.plain
        side.update(Group(caption, grid))

    def action_next_mismatch(self) -> None:
        if self.report and self.report["mismatches"]:
            self.show_mismatch((self.current() + 1) % len(self.report["mismatches"]))

    def action_prev_mismatch(self) -> None:
        if self.report and self.report["mismatches"]:
            self.show_mismatch((self.current() - 1) % len(self.report["mismatches"]))

    def _jump_real(self, direction: int) -> None:
        mm = self.report["mismatches"] if self.report else []
        real = [i for i, m in enumerate(mm) if not m.get("near_tie")]
        if not real:
            self.app.notify("no real mismatch in this report: every one is a near tie", severity="information")
            return
        cur = self.current()
        later = [i for i in real if (i - cur) * direction > 0]
        self.show_mismatch(later[0 if direction > 0 else -1] if later else real[0 if direction > 0 else -1])

    def action_next_real(self) -> None:
        self._jump_real(+1)

    def action_prev_real(self) -> None:
        self._jump_real(-1)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.cursor_row != event.data_table.cursor_row:
            return  # an older highlight, delivered after a jump moved the cursor on
        if event.data_table.id == "mismatches" and self.report and event.cursor_row >= 0:
            self.show_mismatch(event.cursor_row)


# -- Memory ----------------------------------------------------------------------------------------------


def best_speedup(m: Mechanism) -> float | None:
    s = [e["speedup"] for e in m.evidence if isinstance(e.get("speedup"), int | float)]
    return max(s) if s else None


NAME_WIDTH = 40  # the Memory table's name column (the full name is in the detail below the table)


class MemoryPane(Vertical):
    BINDINGS = [
        Binding("a", "app.accept", "Accept", id="memory.accept", tooltip="accept the mechanism, with a note"),
        Binding("r", "app.reject", "Reject", id="memory.reject", tooltip="reject the mechanism, with a note"),
        Binding("e", "app.export", "Export", id="memory.export", tooltip="export accepted mechanisms as patches"),
        Binding("slash", "focus_search", "Search", id="memory.search", tooltip="full-text search"),
    ]

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.mechanisms: dict[str, Mechanism] = {}

    def compose(self) -> ComposeResult:
        yield Input(placeholder="search mechanisms (name, summary, notes); enter to search", id="memory-search")
        table: DataTable = DataTable(id="mechanisms", cursor_type="row", zebra_stripes=True)
        for label in ("id", "status", "family", "name", "best", "deployments"):
            # A tuner's mechanism name lists every knob it set: cut, so best and deployments stay in view.
            table.add_column(label, key=label, width=NAME_WIDTH if label == "name" else None)
        yield table
        yield Static("", id="mechanism-detail")

    def show(self, mechanisms: list[Mechanism]) -> None:
        table = self.query_one("#mechanisms", DataTable)
        keep = self.selected()
        table.clear()
        self.mechanisms = {str(m.id): m for m in mechanisms}
        style = {"accepted": "green", "rejected": "red", "candidate": "cyan"}
        for m in mechanisms:
            best = best_speedup(m)
            deps = sorted({e.get("deployment", "?") for e in m.evidence})
            table.add_row(Text(str(m.id), justify="right"), Text(m.status, style=style.get(m.status, "")),
                          Text(m.gap_family), Text(m.name, overflow="ellipsis", no_wrap=True),
                          Text(f"{best:.2f}x" if best is not None else "-", justify="right"),
                          Text(", ".join(deps) or "-"), key=str(m.id))
        if keep in self.mechanisms:
            table.move_cursor(row=table.get_row_index(keep))
        self.show_detail()

    def selected(self) -> str | None:
        table = self.query_one("#mechanisms", DataTable)
        if not table.row_count:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    def show_detail(self) -> None:
        detail = self.query_one("#mechanism-detail", Static)
        key = self.selected()
        m = self.mechanisms.get(key) if key else None
        if m is None:
            detail.update(Text("no mechanism here yet: kept branches become mechanisms", style="dim"))
            return
        t = Text()
        t.append(f"{m.name}", style="bold")
        t.append(f" ({m.status}{': ' + m.reviewer_note if m.reviewer_note else ''})\n")
        t.append(m.summary or "(no summary)")
        for e in m.evidence:
            bits = [f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in e.items()
                    if k in ("speedup", "speedup_over_ar", "match_rate", "forcing", "unexplained", "round")]
            t.append(f"\n  {e.get('deployment', '?')}: {', '.join(bits) or 'no figures'}", style="dim")
        t.append(f"\n  patch: {len(m.patch.splitlines())} lines", style="dim")
        detail.update(t)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.show_detail()

    def action_focus_search(self) -> None:
        self.query_one(Input).focus()


# -- Log -------------------------------------------------------------------------------------------------


KIND_STYLE = {"evaluation": "cyan", "loop": "bold", "mechanism": "green", "llm": "magenta", "tui": "blue",
              "workspace": "dim"}


class LogPane(Vertical):
    """The store's events. Lines that arrive before the tab was ever shown wait: a RichLog that has no
    width yet would wrap them at its minimum width, not the terminal's. `/` filters them."""

    BINDINGS = [Binding("slash", "filter", "Filter", id="log.filter", tooltip="show only lines containing a text")]
    KEEP = 5000

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.pending: list[tuple[list[Event], str]] = []
        self.events: list[Event] = []
        self.workspace = ""

    def compose(self) -> ComposeResult:
        yield FilterBox("filter the log (kind or text); escape clears", id="log-filter")
        yield RichLog(id="event-log", wrap=True, markup=False, highlight=False, max_lines=self.KEEP)

    def action_filter(self) -> None:
        self.query_one(FilterBox).open()

    def on_filter_box_changed(self, event: FilterBox.Changed) -> None:
        log = self.query_one(RichLog)
        log.clear()
        self._write([e for e in self.events if self._matches(e)])

    def _matches(self, e: Event) -> bool:
        needle = self.query_one(FilterBox).value.strip().lower()
        return not needle or needle in f"{e.kind} {e.message}".lower()

    def on_show(self) -> None:
        self.call_after_refresh(self._flush)

    def _flush(self) -> None:
        pending, self.pending = self.pending, []
        for events, workspace in pending:
            self.add(events, workspace)

    def add(self, events: list[Event], workspace: str) -> None:
        log = self.query_one(RichLog)
        self.workspace = workspace
        if log.size.width == 0:
            if events:
                self.pending.append((events, workspace))
            return
        self.events = (self.events + events)[-self.KEEP:]
        self._write([e for e in events if self._matches(e)])

    def _write(self, events: list[Event]) -> None:
        log = self.query_one(RichLog)
        workspace = self.workspace
        for e in events:
            line = Text(f"{format_ts(e.ts)} ", style="dim")
            line.append(f"{e.kind:<18} ", style=KIND_STYLE.get(e.kind.split(".")[0], ""))
            line.append(e.message.replace(workspace, display_path(workspace)))
            log.write(line)
