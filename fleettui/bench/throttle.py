"""Provides an injected slowdown of one worker: SIGSTOP / SIGCONT in a short duty cycle, like a throttled CPU.

`Throttle(pid_of, share)` lets the process run `share` of every `period` (default 20 ms) and holds it
stopped for the rest, so its compute takes about 1 / share as long while it never stops long enough to be
declared lost. `pid_of()` is asked every cycle, so the slowdown follows the host's stage through a
relaunch or a new split (a hot PC stays hot whatever runs on it). Stopping always leaves the process
running (SIGCONT).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable


class Throttle:
    """A background thread that slows whichever process `pid_of()` names to `share` of the CPU time."""

    def __init__(self, pid_of: Callable[[], int | None], share: float, period: float = 0.02) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share {share} outside (0, 1]")
        self.pid_of = pid_of
        self.share = share
        self.period = period
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Throttle:
        self._thread = threading.Thread(target=self._run, name="throttle", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        running, stopped = self.period * self.share, self.period * (1.0 - self.share)
        while not self._stop.is_set():
            pid = self.pid_of()
            if pid is None or stopped <= 0:
                self._stop.wait(self.period)
                continue
            try:
                os.kill(pid, signal.SIGSTOP)
                self._stop.wait(stopped)
            except (ProcessLookupError, PermissionError):
                continue  # gone (a relaunch): the next cycle asks for the new one
            finally:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGCONT)
            self._stop.wait(running)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Throttle:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()
