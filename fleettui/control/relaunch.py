"""Provides the worker side of a recovery: stop a lost worker, start it again (or a new split)
through the launchers.

Every worker brought up here replaces its entry in the controller's `launched` list, and the
deployment record (control/store.py) is rewritten with the new pid and start time, so `fleettui
stop` and a later attach find the relaunched workers. Works for an attached fleet too: the record's
configs are relaunched."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fleettui.config.fleet import Fleet, Host
from fleettui.control import store
from fleettui.control.deployment import Deployment, Placement
from fleettui.control.launcher import Launched, LocalLauncher, SshLauncher, kill_now, stop_remote
from fleettui.control.store import ProcessId
from fleettui.runtime.watch import (
    ProcessStatus,
    local_process_status,
    recorded_process_status,
    unknown_process,
)

if TYPE_CHECKING:
    from fleettui.control.owner import FleetOwner

READY_TIMEOUT = 300.0


def local_worker(
    controller: FleetOwner, name: str
) -> tuple[ProcessId | None, subprocess.Popen[bytes] | None]:
    """The local process of stage `name`: launched here (with its Popen) or recorded by who
    launched it."""
    for each in controller.launched:
        if each.placement.config.name == name and each.process is not None:
            return each.process, each.popen
    record = controller.record
    for stage in record.stages if record is not None else ():
        if stage.name == name and stage.local:
            return stage.process, None
    return None, None


def process_status(controller: FleetOwner, placement: Placement) -> ProcessStatus:
    """What the watcher sees of a stage's process (unknown on SSH hosts)."""
    if not placement.host.is_local:
        return unknown_process()
    process, popen = local_worker(controller, placement.config.name)
    if popen is not None:
        return local_process_status(popen)
    if process is not None:
        return recorded_process_status(process.pid, process.started)
    return unknown_process()


async def kill_local(controller: FleetOwner, name: str) -> None:
    """SIGKILL the stage's old worker (stopped or hung: it must let go of its ports) and wait for
    it."""
    process, popen = local_worker(controller, name)
    if process is not None and process.alive():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    if popen is not None:
        await asyncio.to_thread(popen.wait)
    elif process is not None:
        for _ in range(50):
            if not process.alive():
                break
            await asyncio.sleep(0.1)


def track(
    controller: FleetOwner, launched: Sequence[Launched], deployment: Deployment | None = None
) -> None:
    """Replace the controller's entries of `launched` (all stages for a new split) and rewrite
    the record."""
    if deployment is not None:  # a new split replaces every stage (the draft stays)
        controller.deployment = deployment
        controller.launched = [e for e in controller.launched if e.placement.config.role == "draft"]
    names = {each.placement.config.name for each in launched}
    kept = [each for each in controller.launched if each.placement.config.name not in names]
    controller.launched = kept + list(launched)
    if (
        controller.record is not None
        and controller.target is not None
        and controller.deployment is not None
    ):
        running = {
            e.placement.config.name: (e.placement.config, e.process) for e in controller.launched
        }
        directory = str(controller.target.directory)
        controller.record = store.restaged(
            controller.record, controller.deployment, running, directory
        )
        store.save(controller.record)


async def relaunch_local(
    controller: FleetOwner, placement: Placement, python: str = sys.executable
) -> None:
    """Kill what is left of the stage's worker, start it again from its config, hand-shake, track
    it."""
    deployment = controller.deployment
    assert deployment is not None, "relaunch before a deployment"
    await kill_local(controller, placement.config.name)
    launcher = LocalLauncher(deployment.keys, python, controller.worker_lease)
    launched = await launcher.start(placement)
    try:
        await launcher.handshake(launched, READY_TIMEOUT)
    except BaseException:
        kill_now([launched])
        raise
    track(controller, [launched])


def ssh_launcher(controller: FleetOwner, fleet: Fleet, deployment: Deployment) -> SshLauncher:
    assert controller.target is not None, "an SSH launch before the compile"
    return SshLauncher(
        fleet,
        controller.target.directory,
        deployment.keys,
        controller.emit,
        READY_TIMEOUT,
        lease=controller.worker_lease,
    )


async def relaunch_remote(controller: FleetOwner, placement: Placement) -> None:
    """Stop a stale worker of this deployment on the SSH host, deploy the stage again (re-push
    only changes)."""
    deployment = controller.deployment
    assert deployment is not None, "relaunch before a deployment"
    await stop_remote(controller.fleet, placement)
    launched = await ssh_launcher(controller, controller.fleet, deployment).start(placement)
    track(controller, [launched])


async def launch_split(
    controller: FleetOwner, fleet: Fleet, old: Deployment, deployment: Deployment
) -> None:
    """Stop every stage worker of `old`, start `deployment`'s (local and SSH) and track them."""
    for placement in old.stages:
        if placement.host.is_local:
            await kill_local(controller, placement.config.name)
        else:
            await stop_remote(controller.fleet, placement)
    launcher = LocalLauncher(deployment.keys, lease=controller.worker_lease)
    local = [await launcher.start(p) for p in deployment.stages if p.host.is_local]
    # tracked before the handshakes: a failure leaves no orphan
    track(controller, local, deployment)
    remote = ssh_launcher(controller, fleet, deployment)
    outcomes = await asyncio.gather(
        *(launcher.handshake(each, READY_TIMEOUT) for each in local),
        *(remote.start(p) for p in deployment.stages if not p.host.is_local),
    )
    track(controller, [each for each in outcomes if isinstance(each, Launched)])


async def host_back(host: Host, timeout: float = 5.0) -> bool:
    """Whether a host the fleet was planned around could run a stage again: an SSH host that accepts
    a connection, a local one whose ports are free."""
    from fleettui.control.launcher import LaunchError, check_ports
    from fleettui.provision.deploy import HostSession

    if host.is_local:
        try:
            check_ports([host])
        except LaunchError:
            return False
        return True
    session = HostSession(host, None)
    try:
        await session.open(timeout)
    except Exception:  # asleep, rebooting, refused: not back yet
        return False
    finally:
        await session.close()
    return True
