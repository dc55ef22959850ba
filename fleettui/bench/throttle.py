"""Provides an injected slowdown of one worker: SIGSTOP / SIGCONT in a short duty cycle, like a
throttled CPU.

`Throttle(pid_of, share)` lets the process run `share` of every `period` (default 20 ms) and holds
it stopped for the rest, so its compute takes about 1 / share as long while it never stops long
enough to be declared lost. `pid_of()` is asked every cycle, so the slowdown follows the host's
stage through a relaunch or a new split (a hot PC stays hot whatever runs on it).

The duty cycle runs in a small helper process fed the current pid through a pipe: when this process
ends in any way (even SIGKILL) the pipe closes, and the helper continues the worker and exits. A
worker left stopped could not even run out its lease. Stopping always leaves the process running
(SIGCONT)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Callable

# The helper: reads pids (one per line, 0 = none) without blocking the cycle; on EOF continues the
# last one.
_HELPER = r"""
import os, select, signal, sys, time
running, stopped = float(sys.argv[1]), float(sys.argv[2])
pid, pending, stdin = 0, b"", sys.stdin.fileno()

def signal_pid(sig):
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False

try:
    while True:
        while select.select([stdin], [], [], 0)[0]:
            chunk = os.read(stdin, 4096)
            if not chunk:
                raise SystemExit(0)
            *lines, pending = (pending + chunk).split(b"\n")
            if lines:
                pid = int(lines[-1])
        if pid and stopped > 0 and signal_pid(signal.SIGSTOP):
            try:
                time.sleep(stopped)
            finally:
                signal_pid(signal.SIGCONT)
        time.sleep(running if pid else running + stopped)
finally:
    if pid:
        signal_pid(signal.SIGCONT)
"""


class Throttle:
    """Slows whichever process `pid_of()` names to `share` of the CPU time (a helper process does
    the cycle)."""

    def __init__(
        self, pid_of: Callable[[], int | None], share: float, period: float = 0.02
    ) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share {share} outside (0, 1]")
        self.pid_of = pid_of
        self.share = share
        self.period = period
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._helper: subprocess.Popen[bytes] | None = None

    def start(self) -> Throttle:
        running, stopped = self.period * self.share, self.period * (1.0 - self.share)
        self._helper = subprocess.Popen(
            [sys.executable, "-c", _HELPER, repr(running), repr(stopped)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._thread = threading.Thread(target=self._follow, name="throttle", daemon=True)
        self._thread.start()
        return self

    def _follow(self) -> None:
        """Tell the helper whenever the pid to throttle changes (asked every period)."""
        helper = self._helper
        assert helper is not None and helper.stdin is not None
        told: int | None = -1
        while not self._stop.is_set():
            pid = self.pid_of()
            if pid != told:
                try:
                    helper.stdin.write(f"{pid or 0}\n".encode())
                    helper.stdin.flush()
                except (BrokenPipeError, OSError):
                    return  # the helper is gone: nothing is held stopped by it
                told = pid
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        helper, self._helper = self._helper, None
        if helper is not None:
            if helper.stdin is not None:
                with contextlib.suppress(OSError):
                    helper.stdin.close()  # EOF: the helper continues the worker and exits
            try:
                helper.wait(5)
            except subprocess.TimeoutExpired:
                helper.kill()
                helper.wait()

    def __enter__(self) -> Throttle:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()
