"""The exception tree of fleettui: every error a user can cause is a FleetError with one clear
line."""

from __future__ import annotations

import signal
from pathlib import Path


def one_line(message: str) -> str:
    """MESSAGE as one printable line: control characters (line breaks included) and unencodable
    surrogates shown as escapes, so a file name or argument the user typed cannot break the line or
    the terminal."""
    shown = "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in message)
    return shown.encode("utf-8", "backslashreplace").decode("utf-8")


class FleetError(Exception):
    """Base of every error fleettui reports to the user as one line (no traceback)."""


class FleetConfigError(FleetError):
    """A fleet file is unreadable or invalid; ``str()`` is ``path:line: key: reason``."""

    def __init__(self, path: Path | str, line: int, key: str, reason: str) -> None:
        self.path = Path(path)
        self.line = line
        self.key = key
        self.reason = reason
        super().__init__(str(self))

    def __str__(self) -> str:
        location = f"{self.path}:{self.line}" if self.line > 0 else str(self.path)
        return f"{location}: {self.key}: {self.reason}"


class PlanError(FleetError):
    """The model does not fit the fleet, or a manual split is impossible.

    ``host`` and ``key`` name the host and its key the problem is about, when there is one;
    ``located(path, line, label)`` gives the same error pointing at the fleet file (``path:line:
    label: ...``)."""

    def __init__(self, message: str, host: str | None = None, key: str | None = None) -> None:
        self.message = message
        self.host = host
        self.key = key
        self.path: Path | None = None
        self.line = 0
        self.label: str | None = None
        super().__init__(message)

    def located(self, path: Path | str, line: int, label: str) -> PlanError:
        error = PlanError(self.message, self.host, self.key)
        error.path, error.line, error.label = Path(path), line, label
        return error

    def __str__(self) -> str:
        if self.path is None:
            return self.message
        location = f"{self.path}:{self.line}" if self.line > 0 else str(self.path)
        return f"{location}: {self.label}: {self.message}"


class ProvisionError(FleetError):
    """A step of deploying to one host failed; ``str()`` names the host and the step."""

    def __init__(self, host: str, step: str, reason: str) -> None:
        self.host = host
        self.step = step
        self.reason = reason
        super().__init__(f"{host}: {step}: {reason}")


class Interrupted(Exception):
    """The command was stopped by a signal; `code` is the shell's 128 + signal number."""

    def __init__(self, number: int) -> None:
        super().__init__(signal.Signals(number).name)
        self.code = 128 + number


def signal_name(number: int) -> str:
    """ "signal 9 (SIGKILL)"; just the number for one Python does not name."""
    try:
        return f"signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"


def child_failure(stderr: str, returncode: int) -> str:
    """Why a child process failed, in one line: the last line it wrote to stderr, else its exit
    code."""
    lines = stderr.strip().splitlines()
    return lines[-1] if lines else f"exit code {returncode}"
