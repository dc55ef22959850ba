"""Deploy stages to SSH hosts: connect, preflight, install offline, push shards, write config,
launch, stop.

``HostSession`` does each step for one host over one asyncssh connection; ``deploy_fleet`` and
``stop_fleet`` run it for every SSH host of a fleet concurrently and report per host (a host that
fails does not stop the others). Local-transport hosts are skipped here: they run on this machine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import asyncssh

from fleettui.config.fleet import Fleet, Host
from fleettui.errors import ProvisionError
from fleettui.provision.events import (
    DeployReport,
    HostDeployment,
    HostStop,
    Preflight,
    ProvisionEvent,
    PushResult,
    RemotePaths,
    Step,
    StoppedProcess,
    StopReport,
    run_file,
)
from fleettui.provision.remote import PosixShell, RemoteShell, run_operation
from fleettui.provision.ssh import connect
from fleettui.provision.stage_files import ShardAssignment, shard_bytes, stage_push
from fleettui.provision.stage_start import StageExited, StageStart
from fleettui.provision.transfer import RemoteStamp, push_files, tree_files
from fleettui.provision.wheelhouse import Target, Wheelhouse, build_wheelhouse
from remote_worker.manifest import ManifestError

logger = logging.getLogger(__name__)

EventHandler = Callable[[ProvisionEvent], None]
ConfigSource = str | Callable[[RemotePaths], str]
ReadyHook = Callable[[Host, HostDeployment], Awaitable[None]]
MIN_PYTHON = (3, 10)
VENV_BYTES = 700 << 20  # room a venv with openvino needs


@dataclass(frozen=True)
class DeployOptions:
    """Knobs of a deployment; the defaults are what ``fleettui --deploy`` uses."""

    wheelhouse_cache: Path | None = None  # None: wheelhouse.default_cache()
    # remote_worker folder to package (default: the installed one)
    worker_source: Path | None = None
    # default: openvino/numpy/pyzmq/psutil matching ours
    requirements: tuple[str, ...] | None = None
    # False: the host's `python` already has the worker (pre-provisioned hosts)
    install: bool = True
    argv: tuple[str, ...] = ("{python}", "-m", "remote_worker", "--config", "{config}")
    env: Mapping[str, str] = field(default_factory=dict)
    connect_timeout: float = 10.0
    stop_timeout: float = 10.0
    # identifies the processes this deployment starts (default: random)
    deployment: str | None = None
    # remove the host's other shard folders once this one is pushed (deploy --prune)
    prune: bool = False
    # read every stage file on both sides, trusting no stamp (deploy --recheck)
    recheck: bool = False


def _emit(handler: EventHandler | None, event: ProvisionEvent) -> None:
    logger.debug("%s", event)
    if handler is None:
        return
    try:
        handler(event)
    except Exception:  # a broken progress display must not break a deployment
        logger.exception("event handler failed on %s", event)


class HostSession:
    """One SSH host during a deployment: the steps, in order, over one connection."""

    def __init__(
        self, host: Host, on_event: EventHandler | None = None, shell: RemoteShell | None = None
    ) -> None:
        self.host = host
        self.on_event = on_event
        self.shell = shell or PosixShell()
        self.connection: Any = None
        self.sftp: Any = None
        self.preflight: Preflight | None = None
        self.log_start = 0  # where the last launch's output begins in its (appended) log

    async def __aenter__(self) -> HostSession:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def emit(self, step: Step, message: str = "", done: int = 0, total: int = 0) -> None:
        _emit(self.on_event, ProvisionEvent(self.host.name, step, done, total, message))

    async def open(self, timeout: float = 10.0) -> None:
        self.emit("connect", f"{self.host.address}:{self.host.ssh_port}")
        self.connection = await connect(self.host, timeout)
        self.sftp = await self.connection.start_sftp_client()

    async def close(self) -> None:
        if self.sftp is not None:
            self.sftp.exit()
            self.sftp = None
        if self.connection is not None:
            self.connection.close()
            await self.connection.wait_closed()
            self.connection = None

    async def operation(
        self, operation: str, payload: dict[str, Any], step: str, python: str | None = None
    ) -> Any:
        return await run_operation(
            self.connection,
            self.shell,
            python or self.host.python,
            operation,
            payload,
            host=self.host.name,
            step=step,
        )

    # --- paths
    # -------------------------------------------------------------------------------------

    @property
    def workdir(self) -> str:
        if self.preflight is None:
            raise ProvisionError(self.host.name, "preflight", "run the preflight first")
        return self.preflight.workdir

    def venv_python(self) -> str:
        assert self.preflight is not None
        layout = "Scripts/python.exe" if self.preflight.os_name == "nt" else "bin/python"
        return f"{self.workdir}/venv/{layout}"

    def paths(self, shard_key: str = "", wheelhouse: str = "") -> RemotePaths:
        host = self.host
        return RemotePaths(
            workdir=self.workdir,
            venv_python=self.venv_python(),
            wheelhouse=f"{self.workdir}/wheelhouse/{wheelhouse}".rstrip("/"),
            shard=f"{self.workdir}/shards/{shard_key}".rstrip("/"),
            config=run_file(self.workdir, host.name, host.base_port, ".json"),
            log=run_file(self.workdir, host.name, host.base_port, ".log"),
            pidfile=run_file(self.workdir, host.name, host.base_port, ".pid"),
        )

    # --- steps
    # -------------------------------------------------------------------------------------

    async def run_preflight(self, needed_disk: int = 0) -> Preflight:
        """OS, CPU, Python, disk and memory of the host; ProvisionError when it cannot run a
        stage."""
        self.emit("preflight")
        answer = await self.operation(
            "preflight",
            {"workdir": self.host.workdir, "venv": f"{self.host.workdir}/venv"},
            "preflight",
        )
        preflight = Preflight.from_answer(answer)
        self.preflight = preflight
        if preflight.python[:2] < MIN_PYTHON:
            version = ".".join(map(str, preflight.python))
            raise ProvisionError(
                self.host.name, "preflight", f"{self.host.python} is Python {version}; need >= 3.10"
            )
        if preflight.disk_free < needed_disk:
            raise ProvisionError(
                self.host.name,
                "preflight",
                f"{preflight.disk_free / 2**30:.1f} GB free in {preflight.workdir}, need "
                f"{needed_disk / 2**30:.1f} GB",
            )
        if preflight.memory_total and preflight.memory_total < self.host.memory_gb * 2**30 * 0.95:
            raise ProvisionError(
                self.host.name,
                "preflight",
                f"memory_gb = {self.host.memory_gb:g} in the fleet file but the host has "
                f"{preflight.memory_total / 2**30:.1f} GB in total: lower memory_gb and re-plan",
            )
        self.emit("preflight", preflight.summary())
        return preflight

    async def push(
        self, files: Sequence[Any], step: Step, stamp: RemoteStamp | None = None
    ) -> PushResult:
        def progress(done: int, total: int, name: str) -> None:
            self.emit(step, name, done, total)

        result = await push_files(
            self.sftp,
            self.connection,
            self.shell,
            self.host.python,
            files,
            host=self.host.name,
            step=step,
            progress=progress,
            stamp=stamp,
        )
        self.emit(
            step,
            f"{result.bytes_sent / 1e6:.1f} MB sent ({result.files_sent}/{result.files} files) "
            f"at {result.megabytes_per_second:.1f} MB/s",
            result.bytes_total,
            result.bytes_total,
        )
        return result

    async def install(self, wheelhouse: Wheelhouse) -> tuple[bool, PushResult | None]:
        """Push the wheelhouse and install the worker into the venv, unless that exact one is
        installed."""
        assert self.preflight is not None
        if self.preflight.installed == wheelhouse.digest:
            self.emit("install", "worker already installed from this wheelhouse")
            return False, None
        remote = self.paths(wheelhouse=wheelhouse.directory.name).wheelhouse
        pushed = await self.push(tree_files(wheelhouse.directory, remote), "wheelhouse")
        self.emit("install", f"pip install --no-index {wheelhouse.requirement}")
        payload = {
            "venv": f"{self.workdir}/venv",
            "wheelhouse": remote,
            "digest": wheelhouse.digest,
            "requirement": wheelhouse.requirement,
        }
        answer = await self.operation("install", payload, "install")
        return bool(answer["installed"]), pushed

    async def install_worker(self, options: DeployOptions) -> tuple[str, bool, PushResult | None]:
        """Build (or reuse) the offline wheelhouse for this host, install the worker from it unless
        that exact one is installed, and check the host's device: (wheelhouse digest, installed now,
        its push)."""
        assert self.preflight is not None
        self.emit("wheelhouse", "preparing the offline wheelhouse")
        wheelhouse = await build_wheelhouse(
            Target.from_preflight(self.preflight),
            options.wheelhouse_cache,
            options.worker_source,
            list(options.requirements) if options.requirements is not None else None,
            lambda text: self.emit("wheelhouse", text),
        )
        installed, pushed = await self.install(wheelhouse)
        await self.probe_devices()
        return wheelhouse.digest, installed, pushed

    async def probe_devices(self) -> Preflight:
        """OpenVINO devices through the worker's interpreter; the host's device must be among
        them."""
        assert self.preflight is not None
        answer = await self.operation("devices", {}, "devices", python=self.venv_python())
        devices = tuple(answer["devices"])
        self.preflight = replace(
            self.preflight,
            devices=devices,
            device_names=dict(answer["names"]),
            openvino=answer["openvino"],
        )
        wanted = self.host.device
        if wanted != "AUTO" and not any(device.split(".")[0] == wanted for device in devices):
            raise ProvisionError(
                self.host.name,
                "devices",
                f"device = {wanted!r} but OpenVINO sees only {', '.join(devices) or 'none'}",
            )
        self.emit("devices", ", ".join(f"{name}: {full}" for name, full in answer["names"].items()))
        return self.preflight

    async def push_shard(
        self, shard: ShardAssignment, recheck: bool = False
    ) -> tuple[str, PushResult]:
        """Push the stage's files into a content-addressed folder; returns (remote folder, result).
        `recheck`: read every file of the stage on both sides, trusting no stamp."""
        try:
            remote, files, stamp = await asyncio.to_thread(
                stage_push, shard, self.paths().shard, recheck
            )
        except ManifestError as error:
            raise ProvisionError(
                self.host.name, "shard", f"local shard {shard.directory}: {error}"
            ) from None
        return remote, await self.push(files, "shard", stamp)

    async def write_config(self, path: str, text: str) -> None:
        """Write the stage config with mode 0600 (it holds the stage's secret CurveZMQ key)."""
        self.emit("config", path)
        directory = path.rsplit("/", 1)[0]
        await self.sftp.makedirs(
            directory, attrs=asyncssh.SFTPAttrs(permissions=0o700), exist_ok=True
        )
        temporary = path + ".tmp"
        async with self.sftp.open(temporary, "w", asyncssh.SFTPAttrs(permissions=0o600)) as stream:
            await stream.write(text)
        await self.sftp.chmod(temporary, 0o600)
        await self.sftp.posix_rename(temporary, path)

    async def launch(
        self, argv: Sequence[str], paths: RemotePaths, deployment: str, env: Mapping[str, str]
    ) -> int:
        """Start the stage detached with a pid file and a log; returns its pid."""
        self.emit("launch", " ".join(argv))
        payload = {
            "argv": list(argv),
            "cwd": paths.workdir,
            "log": paths.log,
            "pidfile": paths.pidfile,
            "deployment": deployment,
            "env": dict(env),
            "cores": list(self.host.cores),
        }
        answer = await self.operation("launch", payload, "launch")
        if "exited" in answer:
            tail = " | ".join(answer.get("log_tail", "").strip().splitlines()[-3:])
            raise StageExited(self.host.name, int(answer["exited"]), tail)
        self.log_start = int(answer.get("log_start", 0))
        self.emit("launch", f"pid {answer['pid']}, log {paths.log}")
        return int(answer["pid"])

    async def stop(
        self, pidfiles: Sequence[str], deployment: str | None, timeout: float
    ) -> tuple[StoppedProcess, ...]:
        """Stop exactly the processes recorded in these pid files (and, if given, by this
        deployment)."""
        payload = {"pidfiles": list(pidfiles), "deployment": deployment, "timeout": timeout}
        answer = await self.operation("stop", payload, "stop")
        stopped = tuple(
            StoppedProcess(name, item["pid"], item["action"], item["detail"])
            for name, item in answer["stopped"].items()
        )
        for process in stopped:
            if process.pid is not None:
                self.emit("stop", f"pid {process.pid}: {process.action} ({process.detail})")
        return stopped

    async def prune_shards(self, keep: Sequence[str]) -> dict[str, Any]:
        """Remove the host's shard folders other than `keep` (remote folder paths or names)."""
        names = [str(path).rstrip("/").rsplit("/", 1)[-1] for path in keep]
        answer = await self.operation(
            "prune", {"folder": f"{self.workdir}/shards", "keep": names}, "prune"
        )
        removed, size = len(answer["removed"]), answer["bytes"] / 1e6
        if removed:
            self.emit("prune", f"removed {removed} old shard folder(s), {size:.1f} MB")
        return dict(answer)

    async def status(self, pidfile: str) -> dict[str, Any]:
        return dict(
            (await self.operation("status", {"pidfiles": [pidfile]}, "status"))["status"][pidfile]
        )

    async def tail(self, path: str, size: int = 65536, start: int = 0) -> str:
        """The end of a remote file (`size` bytes at most, none before offset `start`)."""
        payload = {"path": path, "bytes": size, "start": start}
        return str((await self.operation("tail", payload, "logs"))["text"])


def _stage_pidfile(host: Host) -> str:
    return run_file(host.workdir, host.name, host.base_port, ".pid")


async def deploy_host(
    host: Host,
    shard: ShardAssignment,
    config: ConfigSource,
    deployment: str,
    options: DeployOptions,
    on_event: EventHandler | None = None,
    wait_ready: ReadyHook | None = None,
) -> HostDeployment:
    """All steps for one host; never raises, the outcome says where it stopped and why."""
    result = HostDeployment(host.name, False, "connect", stage=shard.stage)
    session = HostSession(host, on_event)
    try:
        await session.open(options.connect_timeout)
        result = replace(result, step="preflight")
        preflight = await session.run_preflight(
            needed_disk=shard_bytes(shard) + (VENV_BYTES if options.install else 0)
        )
        result = replace(result, preflight=preflight)
        python = host.python
        if options.install:
            result = replace(result, step="wheelhouse")
            digest, installed, pushed = await session.install_worker(options)
            result = replace(result, installed=installed, wheelhouse_push=pushed, wheelhouse=digest)
            result = replace(result, preflight=session.preflight)
            python = session.venv_python()
        result = replace(result, step="shard")
        shard_dir, pushed = await session.push_shard(shard, options.recheck)
        if options.prune:
            await session.prune_shards([shard_dir])
        paths = replace(session.paths(), shard=shard_dir)
        result = replace(result, shard_push=pushed, paths=paths, step="config")
        text = config(paths) if callable(config) else config
        await session.write_config(paths.config, text)
        result = replace(result, step="launch")
        # a previous run of this stage
        await session.stop([paths.pidfile], None, options.stop_timeout)
        argv = [
            part.format(python=python, config=paths.config, shard=paths.shard)
            for part in options.argv
        ]
        starting = StageStart(session, argv, paths, deployment, options.stop_timeout)
        pid = await starting.launch({"PYTHONUNBUFFERED": "1", **options.env})
        result = replace(result, pid=pid, step="ready")
        if wait_ready is not None:
            session.emit("ready", "waiting for the stage's handshake")
            pid = await starting.until_ready(wait_ready(host, replace(result, ok=True)))
        result = replace(result, ok=True, step="done", pid=pid)
        session.emit("done", f"stage {shard.stage} running as pid {pid}")
    except ProvisionError as error:
        result = replace(result, ok=False, error=error.reason, step=error.step)
        _emit(on_event, ProvisionEvent(host.name, "failed", message=str(error)))
    except (OSError, asyncssh.Error) as error:
        reason = getattr(error, "reason", None) or str(error) or type(error).__name__
        result = replace(result, ok=False, error=reason)
        _emit(
            on_event,
            ProvisionEvent(host.name, "failed", message=f"{host.name}: {result.step}: {reason}"),
        )
    finally:
        await session.close()
    return result


async def deploy_fleet(
    fleet: Fleet,
    shards: Mapping[str, ShardAssignment],
    configs: Mapping[str, ConfigSource],
    on_event: EventHandler | None = None,
    *,
    wait_ready: ReadyHook | None = None,
    options: DeployOptions | None = None,
) -> DeployReport:
    """Deploy every SSH host of ``fleet`` concurrently; local hosts are skipped (launched
    locally)."""
    options = options or DeployOptions()
    deployment = options.deployment or uuid.uuid4().hex[:12]
    jobs, names = [], []
    for host in fleet.hosts:
        if host.is_local:
            _emit(
                on_event,
                ProvisionEvent(
                    host.name, "skipped", message="local transport: launched on this machine"
                ),
            )
            continue
        if host.name not in shards or host.name not in configs:
            missing = "shard" if host.name not in shards else "config"
            raise ProvisionError(host.name, "plan", f"no {missing} was given for this host")
        names.append(host)
        jobs.append(
            deploy_host(
                host,
                shards[host.name],
                configs[host.name],
                deployment,
                options,
                on_event,
                wait_ready,
            )
        )
    outcomes = await asyncio.gather(*jobs, return_exceptions=True)
    results = []
    for host, outcome in zip(names, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            if not isinstance(outcome, Exception):
                raise outcome
            outcome = HostDeployment(
                host.name, False, "unknown", error=f"{type(outcome).__name__}: {outcome}"
            )
        results.append(outcome)
    report = DeployReport(deployment, tuple(results))
    _remember(fleet, report)
    return report


async def stop_host(
    host: Host, deployment: str | None, options: DeployOptions, on_event: EventHandler | None = None
) -> HostStop:
    session = HostSession(host, on_event)
    try:
        await session.open(options.connect_timeout)
        session.emit("stop", _stage_pidfile(host))
        processes = await session.stop([_stage_pidfile(host)], deployment, options.stop_timeout)
        return HostStop(host.name, True, tuple(p for p in processes if p.pid is not None))
    except ProvisionError as error:
        _emit(on_event, ProvisionEvent(host.name, "failed", message=str(error)))
        return HostStop(host.name, False, error=error.reason)
    except (OSError, asyncssh.Error) as error:
        return HostStop(host.name, False, error=getattr(error, "reason", None) or str(error))
    finally:
        await session.close()


async def stop_fleet(
    fleet: Fleet,
    deployment: str | None = None,
    on_event: EventHandler | None = None,
    options: DeployOptions | None = None,
) -> StopReport:
    """Stop the stage processes fleettui started on every SSH host (only those of ``deployment``
    if given)."""
    options = options or DeployOptions()
    hosts = [host for host in fleet.hosts if not host.is_local]
    outcomes = await asyncio.gather(
        *(stop_host(h, deployment, options, on_event) for h in hosts), return_exceptions=True
    )
    results = []
    for host, outcome in zip(hosts, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            if not isinstance(outcome, Exception):
                raise outcome
            outcome = HostStop(host.name, False, error=f"{type(outcome).__name__}: {outcome}")
        results.append(outcome)
    return StopReport(tuple(results))


async def fetch_log(host: Host, size: int = 65536, timeout: float = 10.0) -> str:
    """The end of the stage's remote log (for the TUI's log pane)."""
    async with HostSession(host) as session:
        return await session.tail(run_file(host.workdir, host.name, host.base_port, ".log"), size)


def _remember(fleet: Fleet, report: DeployReport) -> None:
    """Log the deployment id and pids (``stop_fleet`` works without it: pid files live on the
    hosts)."""
    pids = {host.host: host.pid for host in report.hosts if host.ok}
    logger.info("deployment %s of %s: %s", report.deployment, fleet.path, json.dumps(pids))
