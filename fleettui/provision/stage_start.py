"""Provides the start of one stage on its SSH host: launch it, then await its handshake while
watching it.

A worker that dies before it is ready without saying why was killed (the OOM killer, a stray `kill`,
a crash in native code) and is started once more, as `LocalLauncher.handshake` does on this machine.
Over SSH the exit code of a process that outlived the launch is not known, but the worker always
says why it gives up (its one `remote_worker: ...` line, argparse's `error:`, or a Python
traceback): a dead worker whose log says nothing of the kind was killed. A reason (a bad shard, a
bad config), or a second death, fails the start at once with the end of the log, and nothing is left
running."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, Protocol

from fleettui.config.fleet import Host
from fleettui.errors import ProvisionError, signal_name
from fleettui.provision.events import RemotePaths, Step

RESTARTS = 1  # times a worker killed before it is ready is started again
WATCH_SECONDS = 2.0  # how often the process is looked at while the handshake is awaited
DIED = "the stage process exited while loading"


class StageExited(ProvisionError):
    """The launched process was gone when the launch looked (`status` as Popen gives it: -N for
    signal N)."""

    def __init__(self, host: str, status: int, tail: str) -> None:
        super().__init__(host, "launch", f"exited at once with status {status}: {tail}")
        self.status = status


class Session(Protocol):
    """What of `deploy.HostSession` a start uses."""

    host: Host
    log_start: int

    def emit(self, step: Step, message: str = "", done: int = 0, total: int = 0) -> None: ...

    async def launch(
        self, argv: Sequence[str], paths: RemotePaths, deployment: str, env: Mapping[str, str]
    ) -> int: ...

    async def status(self, pidfile: str) -> dict[str, Any]: ...

    async def tail(self, path: str, size: int = 65536, start: int = 0) -> str: ...

    async def stop(
        self, pidfiles: Sequence[str], deployment: str | None, timeout: float
    ) -> Any: ...


def said_why(log: str) -> bool:
    """Whether a dead worker's own output gives a reason for its exit (so starting it again
    cannot help)."""
    return any(
        line.startswith(("remote_worker: ", "Traceback (most recent call last)"))
        or ": error: " in line
        for line in log.splitlines()
    )


class StageStart:
    """One stage's start on one host: `launch` then `until_ready`, each starting it again once if
    killed."""

    def __init__(
        self,
        session: Session,
        argv: Sequence[str],
        paths: RemotePaths,
        deployment: str,
        stop_timeout: float,
    ) -> None:
        self.session, self.argv, self.paths = session, list(argv), paths
        self.deployment, self.stop_timeout = deployment, stop_timeout
        self.restarts = RESTARTS
        self.env: Mapping[str, str] = {}
        self.pid = 0

    async def launch(self, env: Mapping[str, str]) -> int:
        """Start the worker detached; one killed by a signal within the launch's look is started
        again."""
        self.env = env
        while True:
            try:
                self.pid = await self.session.launch(self.argv, self.paths, self.deployment, env)
                return self.pid
            except StageExited as error:
                if error.status >= 0 or not self._restart(
                    f"killed by {signal_name(-error.status)} at once"
                ):
                    raise

    async def until_ready(self, ready: Awaitable[None]) -> int:
        """Await the handshake `ready` while watching the process; returns the pid of the worker
        that is ready."""
        task = asyncio.ensure_future(ready)
        try:
            while True:
                failure = await self._watch(task)
                if failure is None:
                    return self.pid
                log = await self.session.tail(self.paths.log, 4000, self.session.log_start)
                if (
                    failure == DIED
                    and not said_why(log)
                    and self._restart("died without a reason (killed?)")
                ):
                    await self.launch(self.env)  # the handshake goes on pinging the same ports
                    continue
                tail = " | ".join(log.strip().splitlines()[-3:])
                await self.session.stop([self.paths.pidfile], self.deployment, self.stop_timeout)
                raise ProvisionError(self.session.host.name, "ready", f"{failure}; log: {tail}")
        finally:
            task.cancel()

    async def _watch(self, task: asyncio.Future[None]) -> str | None:
        """None once the handshake is done; why not when it failed or the process is gone."""
        while True:
            done, _ = await asyncio.wait({task}, timeout=WATCH_SECONDS)
            if task in done:
                error = task.exception()
                return None if error is None else str(error) or type(error).__name__
            if not (await self.session.status(self.paths.pidfile))["alive"]:
                return DIED

    def _restart(self, what: str) -> bool:
        if self.restarts <= 0:
            return False
        self.restarts -= 1
        self.session.emit(
            "launch", f"the stage process {what} before it was ready; starting it again"
        )
        return True
