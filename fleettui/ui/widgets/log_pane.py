"""Provides the log pane: worker log lines and the app's logging records, newest at the bottom
(and on disk)."""

from __future__ import annotations

import logging
import logging.handlers
import time
from pathlib import Path

from rich.text import Text
from textual.widgets import RichLog

LEVEL_COLOURS = {logging.WARNING: "warning", logging.ERROR: "error", logging.CRITICAL: "error"}


LOG_FILE_BYTES = 2 << 20  # a rotating file: tui.log plus three older ones
LOG_FILE_BACKUPS = 3


def timestamp() -> str:
    return time.strftime("%H:%M:%S ")


def log_file_handler(path: Path) -> logging.Handler:
    """A rotating file handler for the pane's persistent copy (`paths.log_dir() / "tui.log"` in
    the app)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(
        path, maxBytes=LOG_FILE_BYTES, backupCount=LOG_FILE_BACKUPS, encoding="utf-8"
    )
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    return handler


class LogPane(RichLog):
    """A RichLog with one formatted line per record; levels are coloured from the theme."""

    def __init__(self, *, id: str | None = None, log_file: Path | None = None) -> None:  # noqa: A002
        super().__init__(
            id=id, max_lines=2000, min_width=20, wrap=True, markup=False, highlight=False
        )
        self.border_title = "log"
        self.lines_written = 0
        self.log_file = log_file
        self._file_handler = log_file_handler(log_file) if log_file is not None else None

    def on_unmount(self) -> None:
        if self._file_handler is not None:
            self._file_handler.close()
            self._file_handler = None

    def write_line(self, source: str, text: str, level: int = logging.INFO) -> None:
        colour = self.app.theme_variables.get(LEVEL_COLOURS.get(level, ""), "")
        muted = self.app.theme_variables.get("foreground-muted", "")
        line = Text()
        line.append(timestamp(), style=muted)
        line.append(f"{source}: ", style=muted)
        line.append(text, style=colour)
        self.write(line)
        self.lines_written += 1
        if self._file_handler is not None:  # every line the pane shows is kept on disk too
            record = logging.LogRecord(source, level, "", 0, text, None, None)
            self._file_handler.handle(record)
