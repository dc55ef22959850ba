"""Provides the app-wide messages: controller events turned into Textual messages (telemetry
collapsed)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from textual.message import Message

from fleettui.control.states import ProvisionEvent, StageState, TelemetrySample


@dataclass
class StageStateChanged(Message):
    name: str
    state: StageState


@dataclass
class StageThrottled(Message):
    """A stage runs slower than its own baseline (`reason`), or is back to normal (`reason`
    empty)."""

    name: str
    reason: str


@dataclass
class TelemetrySampled(Message):
    """About one sample a second per stage; a newer sample of the same stage supersedes a queued
    one."""

    name: str
    sample: TelemetrySample

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, TelemetrySampled) and message.name == self.name


@dataclass
class DeployProgressed(Message):
    """One step of deploying a host; byte counts of a transfer can arrive many times a second."""

    event: ProvisionEvent

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, DeployProgressed) and (
            message.event.host,
            message.event.step,
        ) == (
            self.event.host,
            self.event.step,
        )


@dataclass
class LogWritten(Message):
    """A line for the log pane: a worker's log line or one of the app's logging records."""

    source: str
    text: str
    level: int = logging.INFO


class PaneLogHandler(logging.Handler):
    """Routes logging records to the app as `LogWritten` messages (post_message is thread-safe)."""

    def __init__(self, app: Any, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.app = app

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                text = f"{text}: {record.exc_info[1]!r}"
            self.app.post_message(LogWritten(record.name, text, record.levelno))
        except Exception:  # logging must never raise into the caller
            self.handleError(record)
