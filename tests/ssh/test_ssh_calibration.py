"""SSH hosts calibrated on themselves (real sshd hosts in network namespaces): the worker installed
as a deploy installs it, the calibration split pushed, `remote_worker.profile` run there, its costs
cached per address."""

# The test hosts share this machine's filesystem and process table: the tests look at them directly.
# ruff: noqa: ASYNC110, ASYNC220, ASYNC221, ASYNC230, ASYNC240
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import psutil
import pytest

from fleettui.config.fleet import Fleet, load_fleet
from fleettui.control.calibration import (
    calibrate_fleet,
    calibrate_on_deploy,
    forget_replaced,
    remote_timer,
)
from fleettui.planning.planner import plan_fleet
from fleettui.planning.profiles import Children, calibrate, compile_split, profile_path
from tests.support.netns import SshHosts

pytestmark = [pytest.mark.ssh, pytest.mark.slow]


def ssh_fleet(ssh_hosts: SshHosts, tmp_path: Path) -> Fleet:
    path = tmp_path / "ssh.toml"
    path.write_text(
        f'[model]\nname = "synthetic:llama-tiny"\nshards = "{tmp_path / "shards"}"\n\n'
        '[speculation]\ndraft = "none"\n\n' + ssh_hosts.fleet_toml(memory_gb=4.0)
    )
    return load_fleet(path)


def profiles_running(workdirs: list[str]) -> list[int]:
    """Calibration processes of the test hosts (they run on this machine, in the hosts'
    namespaces)."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(process.info["cmdline"] or ())
        if "remote_worker.profile" in line and any(workdir in line for workdir in workdirs):
            found.append(process.info["pid"])
    return found


async def test_ssh_hosts_are_timed_on_themselves_and_plan_from_their_own_profiles(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    fleet = ssh_fleet(ssh_hosts, tmp_path)
    said: list[str] = []
    children = Children()
    timer = remote_timer(children, said.append)
    found = await asyncio.to_thread(
        calibrate, fleet, 4, None, said.append, True, None, children, timer
    )
    assert set(found) == {host.name for host in fleet.hosts}
    for host in fleet.hosts:
        record = json.loads(profile_path(fleet, host).read_text())
        assert record["settings"]["machine"] == host.address  # keyed by the host, not this machine
        assert [stage["layers"] for stage in record["stages"]] == [[0, 1], [1, 3], [3, 4]]
        assert all(stage["decode_ms"] > 0 and stage["prefill_ms"] > 0 for stage in record["stages"])
        assert found[host.name].layer_ms > 0
        identity = record["identity"]  # which PC was timed: a swapped one is measured again
        assert identity["machine_id"] == Path("/etc/machine-id").read_text().strip()
        assert identity["cpu_count"] > 0 and identity["memory_gb"] > 0 and identity["cpu"]
        pushed = sorted(Path(host.workdir).glob("shards/*/stage_*/openvino_model.xml"))
        assert [path.parent.name for path in pushed] == ["stage_0", "stage_1", "stage_2"]
    assert any(": calibrate: timing stages 0, 1, 2" in line for line in said), said
    # every host measured: the plan balances measured times
    assert plan_fleet(fleet).costs is not None
    assert profiles_running([host.workdir for host in fleet.hosts]) == []


async def test_a_stopped_remote_calibration_leaves_no_process_on_the_host(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    """Cancelling the calibration (a Ctrl-C, a deploy stopped) closes the SSH channel, and the
    remote timing ends with it (`--until-stdin-closes`) instead of computing on for nobody."""
    from fleettui.provision.calibrate_remote import time_remote

    fleet = ssh_fleet(ssh_hosts, tmp_path)
    host = fleet.hosts[0]
    shard_dir = await asyncio.to_thread(compile_split, fleet, [0, 1, 3, 4])
    endless = ["--device", "CPU", "--tokens", "10000000"]  # a timing that would run for hours
    task = asyncio.create_task(time_remote(host, shard_dir, [0, 1, 2], endless))
    deadline = time.monotonic() + 300
    while not profiles_running([host.workdir]):
        assert not task.done(), task.exception() if task.done() else None
        assert time.monotonic() < deadline, "the remote calibration never started"
        await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 30  # (ends within a second here; CI's two cores may be busy)
    while profiles_running([host.workdir]) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert profiles_running([host.workdir]) == []


async def test_a_pc_swapped_behind_its_address_is_measured_again_on_the_next_deploy(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    """The profile of pc-a says another CPU measured it: the deploy's calibration asks both hosts
    which PC they are, drops that profile alone with one line saying what changed, and measures pc-a
    again."""
    fleet = ssh_fleet(ssh_hosts, tmp_path)
    said: list[str] = []
    assert await asyncio.wait_for(calibrate_fleet(fleet, said.append), 600)
    swapped, kept = (profile_path(fleet, host) for host in fleet.hosts)
    # the same PCs answer: nothing measured again
    assert await forget_replaced(fleet, said.append) == []
    record = json.loads(swapped.read_text())
    record["identity"]["cpu"] = "Intel(R) Core(TM) i5-8250U CPU @ 1.60GHz"
    record["measured_at"] = "2026-01-01T00:00:00Z"
    swapped.write_text(json.dumps(record))
    kept_before = kept.read_text()
    said.clear()
    await asyncio.wait_for(calibrate_on_deploy(fleet, said.append), 600)
    name, address = fleet.hosts[0].name, fleet.hosts[0].address
    lines = [line for line in said if "another PC answers" in line]
    assert lines == [
        f"{name}: another PC answers at {address} than the one calibrated "
        f"(cpu: Intel(R) Core(TM) i5-8250U CPU @ 1.60GHz -> {_cpu()}): "
        "measuring it again"
    ], said
    again = json.loads(swapped.read_text())
    assert again["measured_at"] != "2026-01-01T00:00:00Z" and again["identity"]["cpu"] == _cpu()
    assert kept.read_text() == kept_before  # the other host was not measured again
    assert profiles_running([host.workdir for host in fleet.hosts]) == []


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    raise AssertionError("no model name in /proc/cpuinfo")
