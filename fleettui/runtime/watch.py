"""Provides the heartbeat watcher: pings every worker's control socket and watches its process;
declares loss.

A stage is lost when its process exited (at once), or it stopped answering for `detect_seconds`: its
process is stopped (SIGSTOP, a sleeping laptop), unknown (an SSH host: unreachable) or running but
stuck. Workers answer pings on their own I/O thread within milliseconds even during a long step, so
a silent worker is not merely busy. The decision is the pure function `verdict`; the `Watcher`
gathers its inputs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fleettui.runtime.transport import ClientKeys, secure

log = logging.getLogger(__name__)

ProcessKind = Literal["running", "stopped", "exited", "unknown"]


@dataclass(frozen=True)
class ProcessStatus:
    kind: ProcessKind
    detail: str = ""


@dataclass(frozen=True)
class WatchSettings:
    heartbeat_seconds: float = 0.5
    detect_seconds: float = 2.0


def verdict(
    silent: float,
    process: ProcessStatus,
    last_reply: dict[str, Any] | None,
    settings: WatchSettings,
) -> str | None:
    """Why a stage silent for `silent` seconds is lost, or None while it is not (pure)."""
    if process.kind == "exited":
        return f"process exited ({process.detail})" if process.detail else "process exited"
    if silent < settings.detect_seconds:
        return None
    if process.kind == "stopped":
        return f"stopped ({process.detail or 'SIGSTOP or asleep'}), silent for {silent:.1f} s"
    if process.kind == "running":
        return f"stuck: not answering for {silent:.1f} s although its process runs"
    return f"unreachable: no heartbeat for {silent:.1f} s"


def local_process_status(process: Any) -> ProcessStatus:
    """Status of a local worker from its `subprocess.Popen` (exit code) and psutil (stopped or
    running)."""
    import psutil

    code = process.poll()
    if code is not None:
        return ProcessStatus("exited", f"signal {-code}" if code < 0 else f"exit code {code}")
    try:
        status = psutil.Process(process.pid).status()
    except psutil.NoSuchProcess:
        return ProcessStatus("exited", "vanished")
    except psutil.Error:
        return ProcessStatus("unknown")
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return ProcessStatus("stopped", "SIGSTOP")
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        try:  # it died between the two looks: its exit code is there now (or within a moment)
            code = process.wait(0.2)
        except Exception:  # noqa: BLE001 - TimeoutExpired, or another waiter holds it: report without a code
            code = None
        if code is not None:
            return ProcessStatus("exited", f"signal {-code}" if code < 0 else f"exit code {code}")
        return ProcessStatus("exited", status)
    return ProcessStatus("running")


def recorded_process_status(pid: int, started: float | None) -> ProcessStatus:
    """Status of a local worker this process did not start (an attached fleet): by pid and start
    time."""
    import psutil

    try:
        process = psutil.Process(pid)
        if started is not None and abs(process.create_time() - started) >= 0.05:
            return ProcessStatus("exited", "pid reused")
        status = process.status()
    except psutil.NoSuchProcess:
        return ProcessStatus("exited", "vanished")
    except psutil.Error:
        return ProcessStatus("unknown")
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return ProcessStatus("stopped", "SIGSTOP")
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return ProcessStatus("exited", status)
    return ProcessStatus("running")


def unknown_process() -> ProcessStatus:
    return ProcessStatus("unknown")


@dataclass
class Target:
    """One worker to watch: its control socket and how to see its process."""

    name: str
    control_url: str
    server_key: str | None
    process: Callable[[], ProcessStatus] = unknown_process
    last_answer: float = field(default_factory=time.monotonic)
    last_reply: dict[str, Any] | None = None


STOP_ATTEMPTS = 3  # cancels sent to a watch task that is still running when stopped
STOP_WAIT_SECONDS = 2.0  # ... each followed by this long a wait


class Watcher:
    """Heartbeats every target; calls `on_lost(name, reason, silent_seconds)` once per loss.

    A lost target is dropped from the watch list; the recovery `watch()`es its replacement.
    """

    def __init__(
        self,
        keys: ClientKeys | None,
        settings: WatchSettings,
        on_lost: Callable[[str, str, float], None],
        on_reply: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.keys = keys
        self.settings = settings
        self.on_lost = on_lost
        self.on_reply = on_reply
        self.targets: dict[str, Target] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def watch(self, target: Target) -> None:
        self.forget(target.name)
        target.last_answer = time.monotonic()
        self.targets[target.name] = target
        self._tasks[target.name] = asyncio.get_running_loop().create_task(
            self._run(target), name=f"watch-{target.name}"
        )

    def forget(self, name: str) -> None:
        self.targets.pop(name, None)
        task = self._tasks.pop(name, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _run(self, target: Target) -> None:
        settings = self.settings
        pinger = _Pinger(target.control_url, self.keys, target.server_key)
        try:
            while True:
                started = time.monotonic()
                reply = None
                status = target.process()
                if status.kind != "exited":
                    try:
                        reply = await pinger.ping(settings.heartbeat_seconds)
                    except Exception as error:  # noqa: BLE001 - a broken socket must not end the watch
                        log.warning("%s: ping failed (%s); reconnecting", target.name, error)
                        pinger.close()
                        pinger = _Pinger(target.control_url, self.keys, target.server_key)
                    # a process that died during the ping is reported as such
                    status = target.process()
                if self._judge(target, status, reply):
                    return
                await asyncio.sleep(
                    max(0.0, settings.heartbeat_seconds - (time.monotonic() - started))
                )
        finally:
            pinger.close()

    def _judge(self, target: Target, status: ProcessStatus, reply: dict[str, Any] | None) -> bool:
        """Record an answer; declare the target lost (True) when the verdict says so."""
        now = time.monotonic()
        if reply is not None and "error" not in reply:
            target.last_answer, target.last_reply = now, reply
            if self.on_reply is not None:
                self.on_reply(target.name, reply)
        silent = now - target.last_answer
        reason = verdict(silent, status, target.last_reply, self.settings)
        if reason is None:
            return False
        log.warning("%s lost: %s", target.name, reason)
        self.forget(target.name)
        self.on_lost(target.name, reason, silent)
        return True

    async def stop(self) -> None:
        """Cancel every watch and wait for each to end; a watch that outlives its cancel (a library
        call that drops one) is cancelled again rather than waited on forever."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        self.targets.clear()
        pending = set(tasks)
        for _attempt in range(STOP_ATTEMPTS):
            for task in pending:
                task.cancel()
            if not pending:
                break
            _, pending = await asyncio.wait(pending, timeout=STOP_WAIT_SECONDS)
        if pending:
            log.error("%d watch task(s) did not stop when cancelled", len(pending))
        for task in tasks:
            if task.done() and not task.cancelled():
                with contextlib.suppress(Exception):  # stopping: its failure no longer matters
                    task.result()


class _Pinger:
    """One long-lived REQ socket per worker (relaxed: a ping that timed out is simply sent again).

    A socket per ping would churn through ephemeral ports twice a second per worker; this one
    reconnects by itself when a relaunched worker binds the same port."""

    def __init__(self, url: str, keys: ClientKeys | None, server_key: str | None) -> None:
        import zmq
        import zmq.asyncio

        self._socket = zmq.asyncio.Context.instance().socket(zmq.REQ)
        self._socket.linger = 0
        self._socket.setsockopt(zmq.REQ_RELAXED, 1)
        self._socket.setsockopt(zmq.REQ_CORRELATE, 1)
        secure(self._socket, keys, server_key)
        self._socket.connect(url)

    async def ping(self, timeout: float) -> dict[str, Any] | None:
        """The worker's answer, or None within `timeout` (a REQ with no live peer blocks even on
        send).

        `asyncio.timeout`, not `wait_for`: on Python 3.11 `wait_for` returns the answer and drops a
        cancel that arrives as the answer does, and a watcher that survives its cancel hangs
        `stop()` forever."""
        try:
            async with asyncio.timeout(timeout):
                return await self._exchange()
        except TimeoutError:
            return None

    async def _exchange(self) -> dict[str, Any] | None:
        await self._socket.send(json.dumps({"op": "ping"}).encode())
        try:
            reply = json.loads(await self._socket.recv())
        except ValueError:
            return None
        return reply if isinstance(reply, dict) else None

    def close(self) -> None:
        self._socket.close(0)
