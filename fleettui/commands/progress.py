"""Provides the progress reporter of the headless commands: compile, wheelhouse, SFTP push and
worker start.

It consumes the controller's typed events (fleettui.control.states: `ProvisionEvent` for compile and
every provisioning step, `StageChanged` for worker start, `LogLine`): on a terminal it draws
rich.progress bars on stderr; otherwise (a pipe, a log file, CI) it prints plain lines, one when a
step starts, one when it ends, and at most one every `interval` seconds in between, so a long
compile is never silent and a log stays short."""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from fleettui.control.states import Failed, Loading, LogLine, ProvisionEvent, Ready, StageChanged

PLAIN_INTERVAL = 5.0  # seconds between two plain lines of one running step
_COMPILER_LINE = re.compile(r"^\[\s*(\d+(?:\.\d+)?)%\]\s*(.*)$")
TRANSFER_STEPS = ("wheelhouse", "shard")


def compiler_fraction(line: str) -> tuple[float | None, str]:
    """(fraction, text) of one shard_compiler progress line `[ 42.0%] stage 1 trace (layers
    ...)`."""
    match = _COMPILER_LINE.match(line.strip())
    if not match:
        return None, line.strip()
    return min(1.0, float(match.group(1)) / 100.0), match.group(2)


@dataclass
class _Task:
    """One step being reported: a compile, a transfer to a host, a wheelhouse build, the worker
    start."""

    label: str
    done: float = 0.0
    total: float | None = None  # None: no known size (a spinner / elapsed time)
    unit: str = ""  # "B" for transfers
    detail: str = ""
    finished: bool = False
    started: float = 0.0
    printed: float = -1.0
    handle: Any = None  # the rich task id
    extra: set[str] = field(default_factory=set)  # workers: names seen starting


def _size(value: float) -> str:
    return f"{value / 1e6:.1f} MB"


class ProgressReporter:
    """Shows long steps while a command runs; use as a context manager, pass it as the `on_event`
    callback."""

    def __init__(
        self,
        stream: TextIO | None = None,
        tty: bool | None = None,
        interval: float = PLAIN_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval = interval
        self.clock = clock
        self.tasks: dict[str, _Task] = {}
        self._rich: Any = None
        self._compiles = 0
        self.closed = False
        # events arrive on the event loop, the heartbeat ticks on its thread
        self._lock = threading.RLock()
        self._stopped = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # -- lifecycle
    # ----------------------------------------------------------------------------------
    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop drawing (before the answer is printed); later events are ignored."""
        if self.closed:
            return
        self.closed = True
        self._stopped.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        if self._rich is not None:
            self._rich.stop()
            self._rich = None

    # -- inputs
    # -------------------------------------------------------------------------------------
    def __call__(self, event: Any) -> None:
        """A controller event (other kinds are ignored)."""
        with self._lock:
            if not self.closed:
                self._event(event)

    def _event(self, event: Any) -> None:
        if isinstance(event, ProvisionEvent):
            self._progress(
                event.host, event.step, event.bytes_done, event.bytes_total, event.message
            )
        elif isinstance(event, StageChanged):
            self._stage(event.name, event.state)
        elif isinstance(event, LogLine) and event.source == "shard_compiler":
            pass  # the same lines arrive as ProvisionEvent("compiler", "compile", ...)

    def provision(self, event: ProvisionEvent) -> None:
        """A provisioning event straight from fleettui.provision (e.g. `init`'s probes): the same
        as a call."""
        self(event)

    def compiler_line(self, line: str) -> None:
        """One stderr line of `python -m shard_compiler`."""
        with self._lock:
            if not self.closed:
                self._progress("compiler", "compile", 0.0, 0.0, line)

    def _beat(self) -> None:
        """Plain mode: a running step that reports nothing still gets a line every `interval`
        seconds."""
        while not self._stopped.wait(self.interval / 2):
            with self._lock:
                now = self.clock()
                for task in self.tasks.values():
                    if not task.finished and now - task.printed >= self.interval:
                        task.printed = now
                        self._line(self._plain(task))

    # -- mapping events to tasks
    # --------------------------------------------------------------------
    def _progress(self, name: str, step: str, done: float, total: float, message: str) -> None:
        if step == "compile":
            fraction, text = compiler_fraction(message)
            key = f"compile{self._compiles}"
            if (
                key in self.tasks and self.tasks[key].finished
            ):  # the next model (the draft) compiles
                self._compiles += 1
                key = f"compile{self._compiles}"
            label = "compile shards" if self._compiles == 0 else "compile draft"
            task = self._task(key, label, total=1.0)
            finished = text.startswith(("done", "cached"))
            self._update(key, fraction if fraction is not None else task.done, text, finished)
            return
        if step in TRANSFER_STEPS and total:
            key = f"{name}:{step}"
            label = f"{name} {'push shard' if step == 'shard' else 'push wheelhouse'}"
            task = self._task(key, label, total=float(total), unit="B")
            task.total = float(total)
            self._update(key, float(done), message, finished=done >= total)
            return
        if step == "wheelhouse":  # building (pip) before the push: no size known
            self._update(self._key(name, "build", f"{name} build wheelhouse"), None, message, False)
            return
        self._finish_open(name, step)
        if step in ("failed",):
            self._line(f"[{name}] failed: {message}")
        elif step == "ready" and message:
            self._update(self._key(name, "ready", f"{name} start worker"), None, message, False)
        elif step == "done":
            self._finish_key(f"{name}:ready", message)
        elif message and step not in ("connect", "skipped"):
            self._line(f"[{name}] {step}: {message}")

    def _key(self, name: str, step: str, label: str) -> str:
        key = f"{name}:{step}"
        self._task(key, label)
        return key

    def _finish_open(self, name: str, step: str) -> None:
        """A host moved on: its wheelhouse build is over once the install starts."""
        if step in ("install", "devices", "shard", "config", "launch", "ready", "done", "failed"):
            self._finish_key(f"{name}:build", "")

    def _stage(self, name: str, state: Any) -> None:
        """Local worker start: one task counting the stages that answered their handshake."""
        task = self.tasks.get("workers")
        if isinstance(state, Loading):
            task = self._task("workers", "start workers", total=0.0)
            if name not in task.extra:
                task.extra.add(name)
                task.total = float(len(task.extra))
                self._update("workers", task.done, f"waiting for {name}", False)
        elif (
            isinstance(state, Ready)
            and task is not None
            and name in task.extra
            and not task.finished
        ):
            done = task.done + 1
            self._update("workers", done, f"{name} ready", finished=done >= (task.total or 0))
        elif isinstance(state, Failed) and task is not None and name in task.extra:
            # the reason itself is the command's error line (or a provision event's)
            self._finish_key("workers", f"{name} failed", failed=True)

    # -- drawing
    # ------------------------------------------------------------------------------------
    def _task(self, key: str, label: str, total: float | None = None, unit: str = "") -> _Task:
        task = self.tasks.get(key)
        if task is None:
            task = _Task(label, total=total, unit=unit, started=self.clock())
            self.tasks[key] = task
            if self.tty:
                task.handle = self._bars().add_task(label, total=total or None, detail="")
            elif self._heartbeat is None and self.interval > 0:
                self._heartbeat = threading.Thread(
                    target=self._beat, name="progress-heartbeat", daemon=True
                )
                self._heartbeat.start()
        return task

    def _update(
        self, key: str, done: float | None, detail: str, finished: bool, failed: bool = False
    ) -> None:
        task = self.tasks[key]
        if task.finished:
            return
        if done is not None:
            task.done = done
        task.detail = detail or task.detail
        if finished:
            task.finished = True
            if task.total and not failed:
                task.done = task.total
        if self.tty:
            bars = self._bars()
            bars.update(
                task.handle,
                completed=task.done,
                total=task.total or None,
                detail=self._detail(task),
            )
            if finished:
                bars.stop_task(task.handle)
            return
        now = self.clock()
        if finished or task.printed < 0 or now - task.printed >= self.interval:
            task.printed = now
            self._line(self._plain(task))

    def _finish_key(self, key: str, detail: str, failed: bool = False) -> None:
        if key in self.tasks and not self.tasks[key].finished:
            self._update(key, None, detail, finished=True, failed=failed)

    def _detail(self, task: _Task) -> str:
        if task.unit == "B" and task.total:
            return f"{_size(task.done)}/{_size(task.total)} {task.detail}".strip()
        if task.total and task.label == "start workers":
            return f"{task.done:.0f}/{task.total:.0f} {task.detail}".strip()
        return task.detail

    def _plain(self, task: _Task) -> str:
        elapsed = self.clock() - task.started
        if task.finished:
            state = "done" if not task.total or task.done >= task.total else "stopped"
        elif task.total and task.unit != "B" and task.label != "start workers":
            state = f"{task.done / task.total:4.0%}"
        else:
            state = "..."
        detail = self._detail(task)
        return f"{task.label}: {state}{f' {detail}' if detail else ''} ({elapsed:.0f} s)"

    def _line(self, text: str) -> None:
        if self.tty and self._rich is not None:
            self._rich.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def _bars(self) -> Any:
        if self._rich is None:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            console = Console(file=self.stream, force_terminal=True)
            self._rich = Progress(
                SpinnerColumn(),
                TextColumn("{task.description:<28}"),
                BarColumn(bar_width=30),
                TextColumn("{task.percentage:>3.0f}%"),
                TimeElapsedColumn(),
                TextColumn("{task.fields[detail]}"),
                console=console,
                transient=False,
                redirect_stdout=False,
                redirect_stderr=self.stream
                is sys.stderr,  # other stderr lines print above the bars
            )
            self._rich.start()
        return self._rich
