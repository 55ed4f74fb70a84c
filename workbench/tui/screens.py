"""Modal screens: confirm, a note or message to type, launch an agent, a diff or report to read."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, RadioButton, RadioSet, Static
from textual.widgets.option_list import Option


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


class TextInputScreen(ModalScreen[str | None]):
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

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "ok":
            self._submit()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class LaunchScreen(ModalScreen[tuple[str, str] | None]):
    """Choose the agent (tuner or LLM) and the direction (a gap family, largest measured gap first)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="launch.cancel")]

    def __init__(self, directions: list[tuple[str, float | None]]) -> None:
        super().__init__(classes="dialog-screen")
        self.directions = directions

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Launch an agent on a direction", classes="question")
            with RadioSet(id="agent-kind"):
                yield RadioButton("tuner (registry mechanisms, no LLM)", value=True, id="kind-tuner")
                yield RadioButton("LLM (OpenAI-compatible endpoint)", id="kind-llm")
            options = [Option(Text(f"{fam:<13} " + (f"{ms:7.3f} ms/token" if ms is not None else "not profiled")),
                              id=fam) for fam, ms in self.directions]
            yield OptionList(*options, id="direction")
            with Horizontal(classes="buttons"):
                yield Button("Launch", variant="primary", id="ok")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        ol = self.query_one(OptionList)
        ol.highlighted = 0
        ol.focus()

    def result(self) -> tuple[str, str] | None:
        ol = self.query_one(OptionList)
        if ol.highlighted is None:
            return None
        kind = "llm" if self.query_one("#kind-llm", RadioButton).value else "tuner"
        return kind, self.directions[ol.highlighted][0]

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.result())

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(self.result() if event.button.id == "ok" else None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class TextViewScreen(ModalScreen[None]):
    """A diff or a report to read; diff lines are coloured."""

    BINDINGS = [Binding("escape,q", "close", "Close", id="view.close")]

    def __init__(self, title: str, text: str, diff: bool = False) -> None:
        super().__init__(classes="dialog-screen")
        self.title_text, self.text, self.diff = title, text, diff

    def compose(self) -> ComposeResult:
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
        with Vertical(classes="dialog wide"):
            yield Label(Text(self.title_text), classes="question")
            with VerticalScroll(id="view-body"):
                yield Static(body, id="view-text")
            yield Label("escape closes", classes="why")

    def on_mount(self) -> None:
        self.query_one("#view-body").focus()

    def action_close(self) -> None:
        self.dismiss(None)
