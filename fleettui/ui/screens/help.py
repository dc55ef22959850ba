"""Provides the help screen: every key of the app, generated from the bindings so it cannot go
stale."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label

EXTRA_KEYS = (  # keys handled by widgets rather than app bindings
    ("enter", "send the prompt to the current session"),
    ("tab / shift+tab", "move the focus between panels"),
    ("page up / page down", "scroll the chat (it follows the stream at the end)"),
)


def key_rows(bindings: list[BindingType]) -> list[tuple[str, str]]:
    """(keys, description) per described binding; bindings sharing a description share a row.

    A binding's `key_display` stands for the whole group (e.g. "1…9" for the nine session keys).
    """
    rows: dict[str, list[str]] = {}
    for entry in bindings:
        binding = entry if isinstance(entry, Binding) else Binding(*entry)
        description = binding.description or binding.action
        keys = rows.setdefault(description, [])
        shown = (
            [binding.key_display]
            if binding.key_display
            else [k.strip() for k in binding.key.split(",")]
        )
        keys.extend(key for key in shown if key not in keys)
    return [(" / ".join(keys), description) for description, keys in rows.items()]


class HelpScreen(ModalScreen[None]):
    """The key list; any of escape / q / ? / f1 closes it."""

    BINDINGS = [Binding("escape,q,question_mark,f1", "dismiss", "close help")]

    def __init__(self, bindings: list[BindingType]) -> None:
        super().__init__()
        self.rows = key_rows(bindings) + list(EXTRA_KEYS)

    def compose(self) -> ComposeResult:
        with Vertical(id="help-box"):
            yield Label("fleettui — keys", id="help-title")
            table: DataTable[str] = DataTable(id="help-keys", show_cursor=False, cursor_type="none")
            table.add_columns("key", "what it does")
            table.add_rows(self.rows)
            yield table
            yield Label("escape closes this screen", id="help-hint")

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)
