"""Provides the calibration of a fleet's hosts before it is planned: local hosts timed here, SSH hosts on
themselves (`fleettui.provision.calibrate_remote`), cached per host and settings (`planning.profiles`).

A deploy calibrates the hosts that have no profile for its settings yet (`[resilience] calibrate = "auto"`),
so even the first deploy of a fleet splits its layers by measured costs; `fleettui plan --profile` and the
bench measure again.
"""

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
    """Times stages on SSH hosts, all at once, from a thread with no event loop of its own (the calibration's).
    `children.stop()` cancels it: each remote timing's SSH channel closes and its process ends."""

    def run(
        jobs: list[tuple[Host, list[str]]], shard_dir: Path, stages: list[int]
    ) -> list[list[dict[str, Any]]]:
        from fleettui.provision.calibrate_remote import time_remote
        from fleettui.provision.events import ProvisionEvent

        def shown(event: ProvisionEvent) -> None:
            if event.message and (not event.bytes_total or event.bytes_done == event.bytes_total):
                progress(f"{event.host}: {event.step}: {event.message}")

        async def all_hosts() -> list[list[dict[str, Any]]]:
            task = asyncio.current_task()
            assert task is not None
            loop = asyncio.get_running_loop()

            def cancel() -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed: the timing has ended
                    loop.call_soon_threadsafe(task.cancel)

            children.on_stop(cancel)
            timings = (
                time_remote(host, shard_dir, stages, arguments, None, shown) for host, arguments in jobs
            )
            return list(await asyncio.gather(*timings))

        try:
            return asyncio.run(all_hosts())
        except asyncio.CancelledError:
            raise PlanError("calibration stopped") from None

    return run


async def calibrate_fleet(
    fleet: Fleet, progress: Callable[[str], None], force: bool = False, measured: set[Path] | None = None
) -> bool:
    """Calibrate FLEET's hosts as it runs (local stages on their own cores: `share_local_cores`) in a thread,
    cancellable; `force` measures again (once per settings named in `measured`). True when every host then
    has a profile; a calibration that cannot run (too few layers, a host unreachable) is reported through
    PROGRESS and the byte-count estimate plans."""
    from fleettui.config.local_cores import share_local_cores
    from fleettui.planning.planner import plan_fleet

    children = Children()
    fleet = share_local_cores(fleet)
    try:
        layers = plan_fleet(fleet, use_profile=False).shape.num_layers
        remote = remote_timer(children, progress)
        await asyncio.to_thread(calibrate, fleet, layers, None, progress, force, measured, children, remote)
    except asyncio.CancelledError:  # (a SIGTERM): the thread ends at once, not after the timing children
        children.stop()
        raise
    except PlanError as error:
        progress(f"calibration skipped: {error}")
    return fleet_costs(fleet) is not None


def wants_calibration(fleet: Fleet) -> bool:
    """Whether a deploy of FLEET calibrates first: `calibrate = "auto"`, no manual split, a profile missing."""
    if fleet.resilience.calibrate != "auto" or any(host.layers is not None for host in fleet.hosts):
        return False
    from fleettui.config.local_cores import share_local_cores

    return fleet_costs(share_local_cores(fleet)) is None
