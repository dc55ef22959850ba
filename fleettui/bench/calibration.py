"""Provides the bench's calibration of its fleets' hosts: per-layer and head costs measured
before planning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fleettui.config.fleet import Fleet


async def calibrate_hosts(fleet: Fleet, progress: Any, measured: set[Path]) -> None:
    """Measure the per-layer and head costs of the fleet's hosts before it is planned, so its split
    comes from measured costs (as `fleettui plan --profile`), not from byte counts. Measured afresh
    once per bench run and host settings (`measured`): a profile cached hours ago under other load
    can misplace a layer.

    The hosts are calibrated as they will run: local stages on their own cores (`share_local_cores`,
    as the controller starts them); calibrated unshared, the profiles would not be the ones the plan
    looks up."""
    from fleettui.control.calibration import calibrate_fleet

    await calibrate_fleet(fleet, progress, force=True, measured=measured)
