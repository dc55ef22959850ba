"""Provides the log pane: worker log lines and the app's logging records, newest at the bottom."""

from __future__ import annotations

import logging
import time

from rich.text import Text
from textual.widgets import RichLog

LEVEL_COLOURS = {logging.WARNING: "warning", logging.ERROR: "error", logging.CRITICAL: "error"}


def timestamp() -> str:
    return time.strftime("%H:%M:%S ")


class LogPane(RichLog):
    """A RichLog with one formatted line per record; levels are coloured from the theme."""

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id, max_lines=2000, min_width=20, wrap=True, markup=False, highlight=False)
        self.border_title = "log"
        self.lines_written = 0

    def write_line(self, source: str, text: str, level: int = logging.INFO) -> None:
        colour = self.app.theme_variables.get(LEVEL_COLOURS.get(level, ""), "")
        muted = self.app.theme_variables.get("foreground-muted", "")
        line = Text()
        line.append(timestamp(), style=muted)
        line.append(f"{source}: ", style=muted)
        line.append(text, style=colour)
        self.write(line)
        self.lines_written += 1
