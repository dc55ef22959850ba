"""Provides the quit dialog: stop the fleet, leave it running, or cancel."""

from __future__ import annotations

from typing import Literal

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label

QuitChoice = Literal["stop", "leave", "cancel"]


class QuitScreen(ModalScreen[QuitChoice]):
    """Returns "stop" (stop every worker, then exit), "leave" (exit, workers keep serving) or
    "cancel"."""

    BINDINGS = [
        Binding("escape", "choose('cancel')", "cancel"),
        Binding("s", "choose('stop')", "stop the fleet"),
        Binding("l", "choose('leave')", "leave it running"),
    ]

    def __init__(self, running: bool) -> None:
        super().__init__()
        self.running = running

    def compose(self) -> ComposeResult:
        with Vertical(id="quit-box"):
            question = "Quit fleettui. What about the fleet?" if self.running else "Quit fleettui?"
            yield Label(question, id="quit-question")
            with Horizontal(id="quit-buttons"):
                yield Button("Stop the fleet", id="stop", variant="error")
                yield Button(
                    "Leave it running", id="leave", variant="primary", disabled=not self.running
                )
                yield Button("Cancel", id="cancel")
            yield Label("s stop · l leave running · escape cancel", id="quit-hint")

    def on_mount(self) -> None:
        self.query_one("#stop", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.action_choose(event.button.id or "cancel")

    def action_choose(self, choice: str) -> None:
        if choice == "leave" and not self.running:
            return
        if choice in ("stop", "leave", "cancel"):
            self.dismiss(choice)  # type: ignore[arg-type]
