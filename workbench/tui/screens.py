"""Modal screens: confirm, a note or message to type, launch an agent, a diff or report to read."""

from __future__ import annotations

from typing import TypeVar

from rich.table import Table
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, RadioButton, RadioSet, Static
from textual.widgets.option_list import Option

FormResult = TypeVar("FormResult")


class ConfirmScreen(ModalScreen[bool]):
    """Yes or no for a destructive action; y / n / escape."""

    BINDINGS = [Binding("y", "answer(True)", "Yes", id="confirm.yes"),
                Binding("n,escape", "answer(False)", "No", id="confirm.no")]

    def __init__(self, question: str, yes: str = "Yes") -> None:
        super().__init__(classes="dialog-screen")
        self.question, self.yes = question, yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(Text(self.question), classes="question")
            with Horizontal(classes="buttons"):
                yield Button(self.yes, variant="error", id="yes")
                yield Button("No", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, value: bool) -> None:
        self.dismiss(value)


class FormScreen(ModalScreen[FormResult]):
    """A dialog with an OK button (`ok`) and a Cancel button: OK submits (`_submit`), Cancel and escape
    (bound to `cancel` by each form) dismiss with None."""

    def _submit(self) -> None:
        raise NotImplementedError

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "ok":
            self._submit()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class TextInputScreen(FormScreen[str | None]):
    """One line of text (a steering message, a reviewer's note, a folder); enter submits, escape cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="input.cancel")]

    def __init__(self, title: str, placeholder: str = "", value: str = "", submit: str = "OK",
                 required: str = "") -> None:
        super().__init__(classes="dialog-screen")
        self.title_text, self.placeholder, self.value, self.submit = title, placeholder, value, submit
        self.required = required  # the message shown when submitted empty; "" allows empty

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(Text(self.title_text), classes="question")
            yield Input(value=self.value, placeholder=self.placeholder, id="text")
            yield Label("", id="why", classes="why")
            with Horizontal(classes="buttons"):
                yield Button(self.submit, variant="primary", id="ok")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def _submit(self) -> None:
        text = self.query_one(Input).value.strip()
        if not text and self.required:
            self.query_one("#why", Label).update(Text(self.required, style="red"))
            return
        self.dismiss(text)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._submit()



class LaunchScreen(FormScreen[tuple[str, str] | None]):
    """Choose the agent (tuner or LLM) and the direction (a gap family, largest measured gap first).

    A family the tuner has nothing left for is marked so and refused for the tuner; the LLM option is
    disabled, with the reason and the file to edit, when no endpoint is configured."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="launch.cancel")]

    def __init__(self, choices: list, llm_unavailable: str | None = None) -> None:
        super().__init__(classes="dialog-screen")
        self.choices = choices  # workbench.tui.data.LaunchChoice
        self.llm_unavailable = llm_unavailable

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Launch an agent on a direction", classes="question")
            with RadioSet(id="agent-kind"):
                yield RadioButton("tuner (registry mechanisms, no LLM)", value=True, id="kind-tuner")
                yield RadioButton("LLM (OpenAI-compatible endpoint)", id="kind-llm",
                                  disabled=self.llm_unavailable is not None)
            if self.llm_unavailable:
                yield Static(Text(f"LLM: {self.llm_unavailable}", style="dim"), id="llm-unavailable")
            options = []
            for c in self.choices:
                line = Text(f"{c.family:<13} ")
                line.append(f"{c.ms:7.3f} ms/token" if c.ms is not None else "  not profiled")
                line.append(f"  tuner: {c.tuner_left} configs" if c.tuner_left else "  tuner: nothing left",
                            style="dim")
                options.append(Option(line, id=c.family))
            yield OptionList(*options, id="direction")
            yield Static("", id="launch-problem")
            with Horizontal(classes="buttons"):
                yield Button("Launch", variant="primary", id="ok")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        ol = self.query_one(OptionList)
        ol.highlighted = 0
        ol.focus()
        self.on_resize()

    def on_resize(self, event: events.Resize | None = None) -> None:
        self.set_class(self.app.size.height < 30, "short")  # keep the buttons on an 80x24 terminal

    def result(self) -> tuple[str, str] | None:
        ol = self.query_one(OptionList)
        if ol.highlighted is None:
            return None
        kind = "llm" if self.query_one("#kind-llm", RadioButton).value else "tuner"
        return kind, self.choices[ol.highlighted].family

    def _submit(self) -> None:
        res = self.result()
        if res is not None and res[0] == "tuner":
            c = next(c for c in self.choices if c.family == res[1])
            if not c.tuner_left:
                self.query_one("#launch-problem", Static).update(Text(
                    f"the tuner has nothing left to try on {c.family} from the current base: pick another "
                    f"direction" + ("" if self.llm_unavailable else " or the LLM agent"), style="bold red"))
                return
        self.dismiss(res)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self._submit()



class KeysScreen(ModalScreen[None]):
    """The keys that work here, the app's own first (Textual's help panel lists the focused table's
    cursor keys first and pushes these below the fold at 80x24). `rows`: (section, key, what)."""

    BINDINGS = [Binding("escape,question_mark,q", "close", "Close", id="keys.close")]

    def __init__(self, rows: list[tuple[str, str, str]]) -> None:
        super().__init__(classes="dialog-screen")
        self.rows = rows

    def compose(self) -> ComposeResult:
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="bold", no_wrap=True, justify="right")
        grid.add_column()
        section = None
        for sec, key, what in self.rows:
            if sec != section:
                grid.add_row(Text(""), Text(sec, style="bold underline"))
                section = sec
            grid.add_row(Text(key), Text(what))
        with Vertical(classes="dialog"):
            with VerticalScroll(id="keys-body"):
                yield Static(grid, id="keys-text")
            yield Label("escape or ? closes", classes="why")

    def on_mount(self) -> None:
        self.query_one("#keys-body").focus()

    def action_close(self) -> None:
        self.dismiss(None)


SIDE_BY_SIDE_MIN_WIDTH = 140  # terminal columns from which a diff is shown before | after


def side_by_side(diff: str) -> Table:
    """A unified diff as two columns: each hunk's removed lines beside the added ones, context on both."""
    grid = Table.grid(expand=True, padding=(0, 1))
    grid.add_column(ratio=1)
    grid.add_column(ratio=1)
    old: list[str] = []
    new: list[str] = []

    def flush() -> None:
        for i in range(max(len(old), len(new))):
            grid.add_row(Text(old[i], style="red") if i < len(old) else Text(""),
                         Text(new[i], style="green") if i < len(new) else Text(""))
        old.clear()
        new.clear()

    for line in diff.splitlines():
        if line.startswith(("diff --git", "index ", "--- ", "+++ ")):
            flush()
            if line.startswith("+++ "):
                grid.add_row(Text(line[4:], style="bold"), Text(""))
        elif line.startswith("@@"):
            flush()
            grid.add_row(Text(line, style="cyan"), Text(line, style="cyan"))
        elif line.startswith("-"):
            old.append(line[1:])
        elif line.startswith("+"):
            new.append(line[1:])
        else:
            flush()
            grid.add_row(Text(line[1:]), Text(line[1:]))
    flush()
    return grid


class TextViewScreen(ModalScreen[None]):
    """A diff or a report to read; diff lines are coloured."""

    BINDINGS = [Binding("escape,q", "close", "Close", id="view.close")]

    def __init__(self, title: str, text: str, diff: bool = False) -> None:
        super().__init__(classes="dialog-screen")
        self.title_text, self.text, self.diff = title, text, diff

    def compose(self) -> ComposeResult:
        wide = self.diff and self.app.size.width >= SIDE_BY_SIDE_MIN_WIDTH
        body = side_by_side(self.text) if wide else self._unified()
        with Vertical(classes="dialog wide"):
            yield Label(Text(self.title_text + ("  (side by side: before | after)" if wide else "")),
                        classes="question")
            with VerticalScroll(id="view-body"):
                yield Static(body, id="view-text")
            yield Label("escape closes", classes="why")

    def _unified(self) -> Text:
        body = Text()
        for line in self.text.splitlines():
            style = ""
            if self.diff:
                if line.startswith(("+++", "---")):
                    style = "bold"
                elif line.startswith("+"):
                    style = "green"
                elif line.startswith("-"):
                    style = "red"
                elif line.startswith("@@"):
                    style = "cyan"
            body.append(line + "\n", style=style)
        return body

    def on_mount(self) -> None:
        self.query_one("#view-body").focus()

    def action_close(self) -> None:
        self.dismiss(None)
