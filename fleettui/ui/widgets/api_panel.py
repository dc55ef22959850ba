"""Provides the API panel: the HTTP requests the built-in server is answering, one row each,
live."""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import DataTable

from fleettui.serve.live import LiveRequest

COLUMNS = (
    ("id", "#"),
    ("client", "client"),
    ("endpoint", "endpoint"),
    ("state", "state"),
    ("what", "asked"),
    ("output", "output"),
    ("tokens", "tokens"),
    ("rate", "tok/s"),
)


def output_cell(request: LiveRequest) -> str:
    """What the answer is held to: free text, or the grammar's label, then the functions called
    so far."""
    shown = request.constraint or "text"
    if request.tool_calls:
        shown += " → " + ", ".join(request.tool_calls)
    return shown


def request_cells(request: LiveRequest, now: float) -> dict[str, str]:
    """The table cells of one request (pure: tested without a screen)."""
    return {
        "id": str(request.id),
        "client": request.client,
        "endpoint": request.endpoint,
        "state": request.state,
        "what": request.preview,
        "output": output_cell(request),
        "tokens": f"{request.tokens}/{request.prompt_tokens}p",
        "rate": f"{request.tokens_per_second(now):.1f}" if request.tokens > 1 else "-",
    }


class ApiPanel(DataTable[Text]):
    """Live API sessions beside the chat (and those just ended); `show()` redraws from the
    server's registry."""

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id, cursor_type="row", zebra_stripes=True, show_cursor=False)
        self.border_title = "API"
        self.url = ""

    def on_mount(self) -> None:
        for key, label in COLUMNS:
            self.add_column(label, key=key)
        self.border_subtitle = "not serving"

    def show(self, requests: list[LiveRequest], finished: int) -> None:
        now = time.monotonic()
        wanted = {str(request.id): request for request in requests}
        for key in [str(row.value) for row in self.rows if str(row.value) not in wanted]:
            self.remove_row(key)
        for key, request in wanted.items():
            cells = request_cells(request, now)
            if key in self.rows:
                for column, _ in COLUMNS:
                    self.update_cell(key, column, Text(cells[column]), update_width=True)
            else:
                self.add_row(*(Text(cells[column]) for column, _ in COLUMNS), key=key)
        active = sum(request.active for request in requests)
        self.border_subtitle = f"{self.url} · {active} active · {finished} answered"
