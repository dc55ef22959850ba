"""Provides the launchers behind one interface: start a stage (local process or SSH host),
hand-shake, stop it.

`LocalLauncher` starts `python -m remote_worker` in its own session, with its config (0600) and pid
file in the deployment's run folder (`state/runs/<deployment>`) and its log in `log/<deployment>`;
both folders go when the fleet stops. `SshLauncher` deploys one SSH host (push, install, launch)
through `fleettui.provision.deploy`. Every stop checks the deployment id and the process start time
first."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from fleettui.config import paths
from fleettui.config.fleet import Fleet, Host
from fleettui.control.deployment import Deployment, Placement, write_config
from fleettui.control.store import ProcessId
from fleettui.errors import signal_name
from fleettui.provision.events import DeployReport, HostDeployment, ProvisionEvent, RemotePaths
from fleettui.runtime.transport import ClientKeys, LinkError, control_request, wait_until_ready
from remote_worker.replies import PingReply

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A worker that did not come up, or a port held by someone else; the message says which and
    why."""


@dataclass
class Launched:
    """A stage this process brought up: its placement (with the config it really runs) and its
    process."""

    placement: Placement
    process: ProcessId | None  # None on SSH hosts (their pid file lives there)
    popen: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    # the log's size when this process started (a relaunch appends to the stage's log)
    log_start: int = 0


class StageLauncher(Protocol):
    """Brings one stage up and down; the controller drives every stage through this."""

    async def start(self, placement: Placement) -> Launched: ...

    async def handshake(self, launched: Launched, timeout: float) -> PingReply: ...

    async def stop(self, launched: Launched) -> str: ...


async def handshake(
    placement: Placement,
    keys: ClientKeys | None,
    timeout: float,
    failure: Callable[[], str | None] = lambda: None,
) -> PingReply:
    """The one handshake: ping the stage's control socket until it says ready (CurveZMQ when
    keyed)."""
    try:
        return await wait_until_ready(
            placement.control_url, keys, placement.server_key, timeout, failure
        )
    except LinkError as error:
        raise LaunchError(f"{placement.config.name}: {error}") from None


def port_holder(port: int) -> str | None:
    """Who listens on TCP `port` here ("pid N (command)"), or None when nobody does."""
    import psutil

    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    for connection in connections:
        if (
            connection.status == psutil.CONN_LISTEN
            and connection.laddr
            and connection.laddr.port == port
        ):
            if connection.pid is None:
                return "another process"
            try:
                command = " ".join(psutil.Process(connection.pid).cmdline()[:6])
            except psutil.Error:
                command = "?"
            return f"pid {connection.pid} ({command})"
    return None


def check_ports(hosts: Sequence[Host]) -> None:
    """Fail at once, naming the port and its holder, when a port of a local stage is taken."""
    for host in hosts:
        for port in (host.data_port, host.control_port, host.telemetry_port, host.result_port):
            holder = port_holder(port)
            if holder is not None:
                raise LaunchError(f"port {port} of {host.name} is held by {holder}")


def run_folder(deployment: str) -> Path:
    return paths.private_dir(paths.state_dir() / "runs" / deployment)


def log_folder(deployment: str) -> Path:
    path = paths.log_dir() / deployment
    path.mkdir(parents=True, exist_ok=True)
    return path


def remove_folders(deployment: str) -> None:
    """The run and log folders of a stopped deployment (its configs hold secret keys)."""
    shutil.rmtree(paths.state_dir() / "runs" / deployment, ignore_errors=True)
    shutil.rmtree(paths.log_dir() / deployment, ignore_errors=True)


def log_tail(path: Path | None, lines: int = 8, start: int = 0) -> list[str]:
    """The last `lines` lines of the log, none written before offset `start`."""
    if path is None:
        return []
    try:
        with open(path, "rb") as stream:
            stream.seek(start)
            text = stream.read().decode("utf-8", "replace")
    except OSError:
        return []
    return text.strip().splitlines()[-lines:]


@dataclass
class LocalLauncher:
    """Starts workers on this machine, each in its own session so a terminal's signals do not
    reach them."""

    keys: ClientKeys | None
    python: str = sys.executable
    lease: float = 0.0  # > 0: the worker exits by itself this long after its last control request
    # the worker reads every file of its stage, trusting no stamp (deploy --recheck)
    recheck: bool = False

    async def start(self, placement: Placement) -> Launched:
        # the worker hashes its files itself: a stamp another process writes meanwhile cannot stand
        # in
        if self.recheck:
            placement = replace(placement, config=replace(placement.config, trust_stamps=False))
        return spawn(leased(placement, self.lease), self.python)

    async def handshake(self, launched: Launched, timeout: float, restarts: int = 1) -> PingReply:
        """Wait until the worker is ready. One killed by a signal before that (the OOM killer, a
        stray `kill`, a crash) is started again, `restarts` times, within `timeout`; one that exits
        with an error code (a bad shard, a bad config) fails at once with the end of its log."""
        deadline = asyncio.get_running_loop().time() + timeout

        def exited() -> str | None:
            code = None if launched.popen is None else launched.popen.poll()
            if code is None:
                return None
            # (a Popen: -N)
            return f"exited with code {code}" if code >= 0 else f"killed by {signal_name(-code)}"

        while True:
            left = max(deadline - asyncio.get_running_loop().time(), 0.1)
            try:
                return await handshake(launched.placement, self.keys, left, exited)
            except LaunchError as error:
                killed = launched.popen is not None and (launched.popen.returncode or 0) < 0
                if not (
                    killed and restarts > 0 and deadline - asyncio.get_running_loop().time() > 1.0
                ):
                    tail = " | ".join(
                        dict.fromkeys(log_tail(launched.log_path, 4, launched.log_start))
                    )
                    raise LaunchError(f"{error}: {tail}" if tail else str(error)) from None
            restarts -= 1
            log.warning(
                "%s: %s before it was ready; starting it again",
                launched.placement.config.name,
                exited(),
            )
            again = await self.start(launched.placement)
            launched.process, launched.popen, launched.log_start = (
                again.process,
                again.popen,
                again.log_start,
            )

    async def stop(self, launched: Launched, grace: float = 5.0) -> str:
        """Shut the worker down (control request, then TERM, then KILL) if it is still the one
        started."""
        return await stop_local(
            launched.placement, launched.process, self.keys, grace, launched.popen
        )


def leased(placement: Placement, seconds: float) -> Placement:
    """The placement whose worker starts on a lease of `seconds` (0: none), counted from when it is
    ready.

    A controller that dies while launching (or relaunching) must not leave workers forever: its
    renewals stop, and each worker it started exits `seconds` after the last renewal, even one it
    never received."""
    if placement.config.lease_seconds == seconds:
        return placement
    return replace(placement, config=replace(placement.config, lease_seconds=seconds))


def spawn(placement: Placement, python: str = sys.executable) -> Launched:
    """Start one worker process now (config and pid in the deployment's run folder, output to its
    log)."""
    deployment = placement.config.deployment
    config_path = write_config(placement, run_folder(deployment))
    log_path = log_folder(deployment) / f"{placement.config.name}.log"
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as output:
        start = output.tell()
        process = subprocess.Popen(
            [python, "-m", "remote_worker", "--config", str(config_path)],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=environment,
        )
    log.info("started %s (pid %d), log %s", placement.config.name, process.pid, log_path)
    return Launched(placement, ProcessId.of(process.pid), process, log_path, start)


async def stop_local(
    placement: Placement,
    process: ProcessId | None,
    keys: ClientKeys | None,
    grace: float = 5.0,
    popen: subprocess.Popen[bytes] | None = None,
) -> str:
    """Stop one local worker of a deployment; never signals a process that is not exactly that
    worker."""
    import psutil

    name = placement.config.name
    if process is None:
        return f"{name}: no process recorded"
    if not process.alive():
        _reap(popen)
        return f"{name}: pid {process.pid} already exited"
    try:
        command = " ".join(psutil.Process(process.pid).cmdline())
    except psutil.Error:
        command = ""
    if f"{os.sep}runs{os.sep}{placement.config.deployment}{os.sep}" not in command:
        return (
            f"{name}: pid {process.pid} is not a worker of deployment "
            f"{placement.config.deployment}; left alone"
        )
    await control_request(
        placement.control_url, {"op": "shutdown"}, keys, placement.server_key, timeout=1.0
    )
    how = "exited"
    for sig, action in (
        (None, "exited"),
        (signal.SIGTERM, "terminated"),
        (signal.SIGKILL, "killed"),
    ):
        if sig is not None:
            how = action
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)
        if await asyncio.to_thread(_wait_gone, process, grace):
            break
    _reap(popen)
    return f"{name}: pid {process.pid} {how}"


def _wait_gone(process: ProcessId, timeout: float) -> bool:
    import psutil

    try:
        psutil.Process(process.pid).wait(timeout)
    except psutil.TimeoutExpired:
        return not process.alive()
    except psutil.Error:
        pass
    return True


def _reap(popen: subprocess.Popen[bytes] | None) -> None:
    if popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired, ChildProcessError):
            popen.wait(1)


def kill_now(launched: list[Launched]) -> None:
    """Synchronous last resort (a crash, a signal during the shutdown): SIGKILL every worker
    started here."""
    for each in launched:
        if each.process is not None and each.process.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(each.process.pid, signal.SIGKILL)
        _reap(each.popen)


@dataclass
class SshLauncher:
    """Deploys one SSH host per stage: push the shard (and the worker), write the config, launch,
    hand-shake."""

    fleet: Fleet
    shard_dir: Path
    keys: ClientKeys | None
    on_event: Callable[[ProvisionEvent], None] | None = None
    ready_timeout: float = 600.0
    # remove the host's other shard folders once this one is pushed (`deploy --prune`)
    prune: bool = False
    recheck: bool = False  # as LocalLauncher.recheck, on both sides of the push
    lease: float = 0.0  # as LocalLauncher.lease
    reports: dict[str, HostDeployment] = field(default_factory=dict)

    async def start(self, placement: Placement) -> Launched:
        from fleettui.errors import ProvisionError
        from fleettui.provision.deploy import DeployOptions, ShardAssignment, deploy_host

        host = placement.host
        placement = leased(placement, self.lease)
        configured: dict[str, Placement] = {}

        def config(remote: RemotePaths) -> str:
            configured["placement"] = replace(
                placement, config=replace(placement.config, shard_dir=remote.shard)
            )
            return configured["placement"].config.to_json()

        async def ready(_host: object, _result: object) -> None:
            await handshake(placement, self.keys, self.ready_timeout)

        result = await deploy_host(
            host,
            ShardAssignment(self.shard_dir, placement.config.stage_index),
            config,
            placement.config.deployment,
            DeployOptions(
                deployment=placement.config.deployment, prune=self.prune, recheck=self.recheck
            ),
            self.on_event,
            ready,
        )
        self.reports[host.name] = result
        if not result.ok:
            raise LaunchError(str(ProvisionError(host.name, result.step, result.error or "failed")))
        return Launched(configured.get("placement", placement), None)

    async def handshake(self, launched: Launched, timeout: float) -> PingReply:
        return await handshake(launched.placement, self.keys, timeout)

    async def stop(self, launched: Launched) -> str:
        return await stop_remote(self.fleet, launched.placement)

    async def deploy_all(self, deployment: Deployment) -> DeployReport:
        """Every SSH stage of the deployment at once; the report says per host how far it got."""
        remote = [p for p in deployment.stages if not p.host.is_local]
        await asyncio.gather(*(self.start(p) for p in remote), return_exceptions=True)
        missing = HostDeployment("?", False, "unknown", error="no outcome")
        return DeployReport(
            deployment.id, tuple(self.reports.get(p.host.name, missing) for p in remote)
        )


async def stop_remote(fleet: Fleet, placement: Placement) -> str:
    """Stop the stage of this deployment on its SSH host (the host's pid file names the
    deployment)."""
    from fleettui.provision.deploy import DeployOptions, stop_host

    outcome = await stop_host(placement.host, placement.config.deployment, DeployOptions())
    if not outcome.ok:
        return f"{placement.config.name}: cannot stop: {outcome.error}"
    done = ", ".join(f"pid {p.pid} {p.action}" for p in outcome.processes) or "nothing running"
    return f"{placement.config.name}: {done}"


async def fetch_logs(fleet: Fleet, deployment: Deployment, lines: int = 20) -> dict[str, list[str]]:
    """The last lines of every worker's log: local files of the deployment, and remote logs over
    SSH."""
    logs: dict[str, list[str]] = {}
    for placement in deployment.placements:
        if placement.host.is_local:
            path = paths.log_dir() / deployment.id / f"{placement.config.name}.log"
            logs[placement.config.name] = log_tail(path, lines)
    remote = [host for host in fleet.hosts if not host.is_local]
    if remote:
        from fleettui.provision.deploy import fetch_log

        texts = await asyncio.gather(*(fetch_log(host) for host in remote), return_exceptions=True)
        for host, text in zip(remote, texts, strict=False):
            message = (
                f"cannot fetch the log: {text}" if isinstance(text, BaseException) else str(text)
            )
            logs[host.name] = message.splitlines()[-lines:]
    return logs
