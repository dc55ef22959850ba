"""Headless ``fleettui FLEET --deploy`` / ``--stop``: compile, start every stage detached (SSH and local), stop.

``--deploy`` compiles (or finds cached) shards for the plan, deploys every SSH host with
``deploy_fleet`` and starts local-transport stages (and the draft) detached on this machine through the
same launch operation, waits for each stage's control handshake, and saves the deployment (its id,
the coordinator's CurveZMQ key pair and every stage config) to a 0600 state file so that a later
process can attach (``saved_deployment``) and ``--stop`` can stop exactly what was started.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fleettui.config.fleet import Fleet, Host
from fleettui.errors import FleetError, ProvisionError
from fleettui.provision.events import DeployReport, HostStop, ProvisionEvent, StoppedProcess, StopReport
from fleettui.provision.remote import PosixShell, run_operation

logger = logging.getLogger(__name__)

STATE_DIR = Path("~/.cache/fleettui/deployments").expanduser()
READY_TIMEOUT = 600.0


def state_path(fleet: Fleet) -> Path:
    """Where the last deployment of this fleet file is recorded."""
    key = str(fleet.path.resolve()) if fleet.path else "unsaved"
    return STATE_DIR / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


class LocalRunner:
    """Runs the remote operations on this machine (same interface as an asyncssh connection's ``run``)."""

    async def run(self, command: str, *, input: str, check: bool = False) -> Any:  # noqa: A002
        process = await asyncio.create_subprocess_shell(
            command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await process.communicate(input.encode())
        return SimpleNamespace(stdout=stdout.decode(), stderr=stderr.decode(), exit_status=process.returncode)


def _local_files(host: Host) -> tuple[Path, Path, Path]:
    """(run folder, pid file, log) of a stage started on this machine."""
    run = Path(host.workdir).expanduser() / "run"
    return run, run / f"{host.name}.pid", run / f"{host.name}.log"


async def _local_operation(operation: str, payload: dict[str, Any], host: str) -> dict[str, Any]:
    return await run_operation(
        LocalRunner(), PosixShell(), sys.executable, operation, payload, host=host, step=operation
    )


def _print_event(event: ProvisionEvent) -> None:
    if event.step in ("shard", "wheelhouse") and event.bytes_total and event.bytes_done < event.bytes_total:
        return  # progress ticks: only the summary line is printed headless
    text = f" {event.message}" if event.message else ""
    print(f"[{event.host}] {event.step}{text}", file=sys.stderr, flush=True)


async def wait_handshake(placement: Any, keys: Any, timeout: float = READY_TIMEOUT) -> dict[str, Any]:
    """Ping the stage's control socket until it reports ready (CurveZMQ-authenticated when keys are set)."""
    from fleettui.runtime.transport import control_request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = await control_request(
            placement.control_url, {"op": "ping"}, keys, placement.server_key, timeout=1.0
        )
        if reply is not None and reply.get("state") == "ready":
            return reply
        await asyncio.sleep(0.2)
    raise ProvisionError(placement.config.name, "ready", f"no handshake within {timeout:.0f} s")


async def _launch_local(placement: Any, deployment: Any) -> tuple[str, int]:
    """Start one local stage (or the draft) detached, through the same launch operation as SSH hosts."""
    from fleettui.control.deployment import write_config

    run, pidfile, log = _local_files(placement.host)
    config = write_config(placement, run)
    print(f"[{placement.config.name}] launch local, log {log}", file=sys.stderr, flush=True)
    await _local_operation("stop", {"pidfiles": [str(pidfile)], "deployment": None}, placement.config.name)
    answer = await _local_operation(
        "launch",
        {
            "argv": [sys.executable, "-m", "remote_worker", "--config", str(config)],
            "cwd": str(run), "log": str(log), "pidfile": str(pidfile), "deployment": deployment.id,
            "env": {"PYTHONUNBUFFERED": "1"}, "cores": list(placement.host.cores),
        },
        placement.config.name,
    )  # fmt: skip
    if "exited" in answer:
        raise ProvisionError(
            placement.config.name, "launch", f"exited at once: {answer.get('log_tail', '')[-300:]}"
        )
    try:
        await wait_handshake(placement, deployment.keys)
    except ProvisionError:
        await _local_operation(
            "stop", {"pidfiles": [str(pidfile)], "deployment": deployment.id}, placement.config.name
        )
        raise
    print(f"[{placement.config.name}] ready (pid {answer['pid']})", file=sys.stderr, flush=True)
    return placement.config.name, int(answer["pid"])


async def deploy_placements(
    fleet: Fleet,
    deployment: Any,
    shard_dir: Path,
    on_event: Any = None,
    ready_timeout: float = READY_TIMEOUT,
    options: Any = None,
) -> DeployReport:
    """Deploy the SSH placements of a ``fleettui.control.deployment.Deployment`` and wait for their handshakes.

    Each SSH host gets the stage of ``shard_dir`` its placement names, its config with ``shard_dir``
    replaced by the remote copy, and is launched detached; it counts as deployed once its control socket
    answers the CurveZMQ ping with ``ready``. Local placements are left to the caller.
    """
    from fleettui.provision.deploy import DeployOptions, ShardAssignment, deploy_fleet

    remote = {p.host.name: p for p in deployment.stages if not p.host.is_local}
    shards = {name: ShardAssignment(shard_dir, p.config.stage_index) for name, p in remote.items()}
    configs = {
        name: (lambda paths, placement=placement: replace(placement.config, shard_dir=paths.shard).to_json())
        for name, placement in remote.items()
    }

    async def ready(host: Host, _result: Any) -> None:
        await wait_handshake(remote[host.name], deployment.keys, ready_timeout)

    options = replace(options or DeployOptions(), deployment=deployment.id)
    return await deploy_fleet(fleet, shards, configs, on_event, wait_ready=ready, options=options)


async def deploy_command(fleet: Fleet, args: Any) -> int:
    from fleettui.control.controller import FleetController, with_overrides
    from fleettui.control.deployment import build_deployment

    draft = "none" if getattr(args, "no_spec", False) else getattr(args, "draft", None)
    fleet = with_overrides(
        fleet, exact=getattr(args, "exact", False), draft=draft, k=getattr(args, "spec_k", None)
    )
    from fleettui.commands.progress import ProgressReporter

    with ProgressReporter() as reporter:  # bars on a terminal, periodic lines otherwise
        controller = FleetController(fleet, on_event=reporter)
        await controller.prepare()
        target = controller.target
        assert target is not None
        ranges = [(stage.layers.start, stage.layers.end) for stage in target.manifest.stages]
        draft_dir = str(controller.draft.directory) if controller.draft else None
        deployment = build_deployment(fleet, ranges, lambda host: str(target.directory), draft_dir)
        from fleettui.provision.deploy import DeployOptions

        options = DeployOptions(prune=bool(getattr(args, "prune", False)))
        report = await deploy_placements(
            fleet, deployment, target.directory, reporter.provision, options=options
        )
        local = [p for p in deployment.placements if p.host.is_local]
        outcomes = await asyncio.gather(
            *(_launch_local(p, deployment) for p in local), return_exceptions=True
        )
    failures = [f"{host.host}: {host.step}: {host.error}" for host in report.failed]
    local_pids = {}
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            failures.append(str(outcome))
        else:
            local_pids[outcome[0]] = outcome[1]
    _save_state(fleet, deployment, report, local_pids, target.directory, draft_dir)
    print(report.summary(), file=sys.stderr)
    if failures:
        print("fleettui: deploy incomplete:\n  " + "\n  ".join(failures), file=sys.stderr)
        print(f"fleettui: {rest_can_run(fleet, {host.host for host in report.failed})}", file=sys.stderr)
        print("fleettui: `--stop` stops the stages that did start", file=sys.stderr)
        return 1
    print(
        f"deployed {len(deployment.placements)} stage(s), deployment {deployment.id}; state {state_path(fleet)}"
    )
    return 0


def rest_can_run(fleet: Fleet, failed: set[str]) -> str:
    """Whether the hosts that did not fail could still hold the model, as one line."""
    from fleettui.errors import PlanError
    from fleettui.planning.planner import plan_fleet

    rest = tuple(host for host in fleet.hosts if host.name not in failed)
    if not rest:
        return "no host is left to run the model"
    try:
        plan = plan_fleet(replace(fleet, hosts=tuple(replace(host, layers=None) for host in rest), path=None))
    except PlanError as error:
        return f"without {', '.join(sorted(failed))} the model does not fit: {error}"
    ranges = ", ".join(f"{stage.host} [{stage.start}, {stage.end})" for stage in plan.stages)
    return f"without {', '.join(sorted(failed))} the rest can run it: {ranges} (remove the failed hosts and deploy again)"


def _save_state(
    fleet: Fleet,
    deployment: Any,
    report: DeployReport,
    local_pids: dict[str, int],
    target: Path,
    draft: str | None,
) -> None:
    placements = []
    for placement in deployment.placements:
        config = placement.config
        if not placement.host.is_local and placement.host.name in {h.host for h in report.hosts if h.paths}:
            config = replace(config, shard_dir=report.host(placement.host.name).paths.shard)  # type: ignore[union-attr]
        placements.append(
            {
                "host": placement.host.name,
                "connect_address": placement.connect_address,
                "config": config.to_json(),
            }
        )
    keys = deployment.keys
    state = {
        "deployment": deployment.id,
        "fleet": str(fleet.path) if fleet.path else None,
        "created": time.time(),
        "target": str(target),
        "draft": draft,
        "coordinator": {"public_key": keys.public_key, "secret_key": keys.secret_key} if keys else None,
        "placements": placements,
        "ssh": {host.host: {"pid": host.pid, "ok": host.ok, "error": host.error} for host in report.hosts},
        "local": local_pids,
    }
    path = state_path(fleet)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)  # it holds the coordinator's secret key
    path.write_text(json.dumps(state, indent=2))


def saved_deployment(fleet: Fleet) -> Any:
    """The deployment recorded by the last ``--deploy`` of this fleet file (a fleettui.control.deployment.Deployment)."""
    from fleettui.control.deployment import Deployment, Placement
    from fleettui.runtime.transport import ClientKeys
    from remote_worker.config import StageConfig

    path = state_path(fleet)
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    hosts = {host.name: host for host in fleet.hosts}
    stages, draft = [], None
    for item in state["placements"]:
        config = StageConfig.from_json(item["config"])
        host = hosts.get(item["host"]) or Host(name=item["host"], base_port=config.data_port)
        placement = Placement(host, config, item["connect_address"])
        if config.role == "draft":
            draft = placement
        else:
            stages.append(placement)
    keys = ClientKeys(**state["coordinator"]) if state.get("coordinator") else None
    return Deployment(state["deployment"], tuple(stages), draft, keys)


async def stop_command(fleet: Fleet, args: Any) -> int:
    from fleettui.provision.deploy import stop_fleet

    report = await stop_fleet(fleet, None, _print_event)
    local_hosts = [host for host in fleet.hosts if host.is_local] + [Host(name="draft")]
    local: list[HostStop] = []
    for host in local_hosts:
        _, pidfile, _ = _local_files(host)
        answer = await _local_operation("stop", {"pidfiles": [str(pidfile)], "deployment": None}, host.name)
        processes = tuple(
            StoppedProcess(name, item["pid"], item["action"], item["detail"])
            for name, item in answer["stopped"].items()
            if item["pid"] is not None
        )
        if processes or host.name != "draft":
            local.append(HostStop(host.name, True, processes))
    combined = StopReport(report.hosts + tuple(local))
    print(combined.summary())
    state_path(fleet).unlink(missing_ok=True)
    return 0 if combined.ok else 1


def run_provision_cli(fleet: Fleet, args: Any) -> int:
    """Entry point of ``--deploy`` / ``--stop`` (exit 0 when every host did what was asked)."""
    from fleettui.control.controller import ControllerError

    try:
        return asyncio.run(
            deploy_command(fleet, args) if getattr(args, "deploy", False) else stop_command(fleet, args)
        )
    except (ProvisionError, ControllerError) as error:
        raise FleetError(str(error)) from None
