"""Provides the calibration of a fleet's hosts before it is planned: local hosts timed here, SSH
hosts on themselves (`fleettui.provision.calibrate_remote`), cached per host and settings
(`planning.profiles`).

A deploy calibrates the hosts that have no profile for its settings yet (`[resilience] calibrate =
"auto"`), so even the first deploy of a fleet splits its layers by measured costs, after dropping
the profiles of SSH hosts that another PC now answers for (`forget_replaced`); `fleettui plan
--profile` and the bench measure again."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleettui.config.fleet import Fleet, Host
from fleettui.errors import PlanError
from fleettui.planning.profiles import Children, RemoteTimer, calibrate, fleet_costs


def remote_timer(children: Children, progress: Callable[[str], None]) -> RemoteTimer:
    """Times stages on SSH hosts, all at once, from a thread with no event loop of its own (the
    calibration's). `children.stop()` cancels it: each remote timing's SSH channel closes and its
    process ends."""

    def run(
        jobs: list[tuple[Host, list[str]]], shard_dir: Path, stages: list[int]
    ) -> list[dict[str, Any]]:
        from fleettui.provision.calibrate_remote import time_remote
        from fleettui.provision.events import ProvisionEvent

        def shown(event: ProvisionEvent) -> None:
            if event.message and (not event.bytes_total or event.bytes_done == event.bytes_total):
                progress(f"{event.host}: {event.step}: {event.message}")

        async def all_hosts() -> list[dict[str, Any]]:
            task = asyncio.current_task()
            assert task is not None
            loop = asyncio.get_running_loop()

            def cancel() -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed: the timing has ended
                    loop.call_soon_threadsafe(task.cancel)

            children.on_stop(cancel)
            timings = (
                time_remote(host, shard_dir, stages, arguments, None, shown)
                for host, arguments in jobs
            )
            return list(await asyncio.gather(*timings))

        try:
            return asyncio.run(all_hosts())
        except asyncio.CancelledError:
            raise PlanError("calibration stopped") from None

    return run


async def calibrate_fleet(
    fleet: Fleet,
    progress: Callable[[str], None],
    force: bool = False,
    measured: set[Path] | None = None,
) -> bool:
    """Calibrate FLEET's hosts as it runs (local stages on their own cores: `share_local_cores`) in
    a thread, cancellable; `force` measures again (once per settings named in `measured`). True when
    every host then has a profile; a calibration that cannot run (too few layers, a host
    unreachable) is reported through PROGRESS and the byte-count estimate plans."""
    from fleettui.config.local_cores import share_local_cores
    from fleettui.planning.planner import plan_fleet

    children = Children()
    fleet = share_local_cores(fleet)
    try:
        layers = plan_fleet(fleet, use_profile=False).shape.num_layers
        remote = remote_timer(children, progress)
        await asyncio.to_thread(
            calibrate, fleet, layers, None, progress, force, measured, children, remote
        )
    except (
        asyncio.CancelledError
    ):  # (a SIGTERM): the thread ends at once, not after the timing children
        children.stop()
        raise
    except PlanError as error:
        progress(f"calibration skipped: {error}")
    return fleet_costs(fleet) is not None


async def calibrate_on_deploy(fleet: Fleet, progress: Callable[[str], None]) -> None:
    """A deploy's calibration (`[resilience] calibrate = "auto"`, no manual split): SSH hosts that
    are another PC than the one their profile measured lose that profile (`forget_replaced`), then
    every host without a profile for the deploy's settings is calibrated."""
    if not _auto(fleet):
        return
    await forget_replaced(fleet, progress)
    if wants_calibration(fleet):
        await calibrate_fleet(fleet, progress)


async def forget_replaced(
    fleet: Fleet, progress: Callable[[str], None], timeout: float = 10.0
) -> list[str]:
    """Ask each SSH host with a cached profile which PC it is (the preflight: machine-id, CPU,
    cores, memory) and drop the profiles another PC measured at its address; the names of the hosts
    whose profiles went. A host that does not answer keeps its profile (the deploy then reports
    it)."""
    from fleettui.planning.profiles import nearest_costs, replaced_profiles
    from fleettui.provision.deploy import HostSession

    async def check(host: Host) -> str | None:
        session = HostSession(host, None)
        try:
            await session.open(timeout)
            identity = (await session.run_preflight()).identity()
        except Exception:  # unreachable or refused: the deploy's own preflight says why
            return None
        finally:
            await session.close()
        stale, change = replaced_profiles(host.address, identity)
        for path in stale:
            path.unlink(missing_ok=True)
        if not stale:
            return None
        progress(
            f"{host.name}: another PC answers at {host.address} than the one calibrated "
            f"({change}): measuring it again"
        )
        return host.name

    hosts = [
        host for host in fleet.hosts if not host.is_local and nearest_costs(fleet, host) is not None
    ]
    return [
        name for name in await asyncio.gather(*(check(host) for host in hosts)) if name is not None
    ]


def _auto(fleet: Fleet) -> bool:
    return fleet.resilience.calibrate == "auto" and all(host.layers is None for host in fleet.hosts)


def wants_calibration(fleet: Fleet) -> bool:
    """Whether a deploy of FLEET calibrates first: `calibrate = "auto"`, no manual split, a
    profile missing."""
    if not _auto(fleet):
        return False
    from fleettui.config.local_cores import share_local_cores

    return fleet_costs(share_local_cores(fleet), nearest=False) is None  # this stage count's own
