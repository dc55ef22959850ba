"""A deploy calibrates hosts whose costs are unknown before it plans (`[resilience] calibrate =
"auto"`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest

from fleettui.config.fleet import DEFAULT_FLEET, Fleet, Host, load_fleet
from fleettui.config.resilience import ResilienceSettings
from fleettui.control.calibration import calibrate_fleet, wants_calibration
from fleettui.errors import PlanError
from fleettui.planning.planner import plan_fleet
from fleettui.planning.profiles import fleet_costs


def tiny_fleet(tmp_path: Path, calibrate: str = "auto", layers: bool = False) -> Fleet:
    """Two local stages of the synthetic tiny Llama (4 layers), threads pinned so no test shares
    its key."""
    base = load_fleet(DEFAULT_FLEET)
    hosts = (
        Host(name="a", threads=1, base_port=7750, layers=(0, 2) if layers else None),
        Host(name="b", threads=1, base_port=7760, layers=(2, 4) if layers else None),
    )
    return replace(
        base,
        hosts=hosts,
        model=replace(base.model, name="synthetic:llama-tiny", shards=tmp_path / "shards"),
        speculation=replace(base.speculation, draft="none", k=0),
        resilience=ResilienceSettings(calibrate=calibrate),
        path=None,
    )


def test_a_deploy_calibrates_only_when_asked_unpinned_and_unmeasured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert wants_calibration(tiny_fleet(tmp_path))
    assert not wants_calibration(tiny_fleet(tmp_path, calibrate="off"))
    assert not wants_calibration(tiny_fleet(tmp_path, layers=True))  # a manual split plans nothing


@pytest.mark.slow
async def test_the_first_deploy_measures_its_hosts_and_plans_from_their_costs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real shards, real timing: `prepare` (what every deploy runs) calibrates a fleet with no
    profile, its shards follow the measured plan, and the next deploy reads the cache instead of
    measuring again."""
    from fleettui.control.controller import FleetController
    from fleettui.control.states import Progress

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # no profile from any other test
    fleet = tiny_fleet(tmp_path)
    assert fleet_costs(fleet) is None and plan_fleet(fleet).costs is None

    async def prepared(fleet: Fleet) -> tuple[FleetController, list[str]]:
        events: list[object] = []
        controller = FleetController(fleet, events.append)
        await controller.prepare()
        return controller, [
            e.message for e in events if isinstance(e, Progress) and e.step == "calibrate"
        ]

    controller, said = await prepared(fleet)
    assert any("timing the three calibration stages" in line for line in said), said
    planned = plan_fleet(controller.fleet)
    assert planned.costs is not None  # the plan now comes from measured costs
    assert controller.target is not None
    built = [(s.layers.start, s.layers.end) for s in controller.target.manifest.stages]
    assert built == list(planned.ranges)
    again, said = await prepared(fleet)
    assert said == [] and again.target is not None  # cached: measured once per settings

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-off"))
    _, said = await prepared(tiny_fleet(tmp_path, calibrate="off"))
    assert said == [] and plan_fleet(tiny_fleet(tmp_path)).costs is None


@pytest.mark.slow
async def test_an_unreachable_ssh_host_is_reported_and_the_byte_count_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host that cannot be calibrated costs one line, not the deploy: it is planned from
    parameter bytes."""
    import socket

    from fleettui.provision.calibrate_remote import time_remote

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    away = Host(
        name="gone", transport="ssh", address="127.0.0.1", ssh_port=port, host_key_policy="tofu"
    )
    started = time.monotonic()
    with pytest.raises(PlanError, match=r"^profile of gone: connect: "):
        await time_remote(away, tmp_path, [0, 1, 2], [])
    assert time.monotonic() - started < 10

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    fleet = replace(tiny_fleet(tmp_path), hosts=(tiny_fleet(tmp_path).hosts[0], away))
    said: list[str] = []
    assert not await asyncio.wait_for(calibrate_fleet(fleet, said.append), 300)
    assert [
        line for line in said if line.startswith("calibration skipped: profile of gone: connect:")
    ], said
    assert plan_fleet(fleet).costs is None
