"""Recovery on real SSH hosts (sshd in network namespaces): a stage killed, or its host cut off and
back.

The fleet's two stages run on two namespace hosts, deployed over SSH like an office fleet.
Mid-answer a worker is killed with SIGKILL, or its host's link is set down for longer than the
detection time and then up again; every interleaved answer must complete and equal the uninterrupted
local run token for token (exact settings), and the worker must have been relaunched over SSH."""
# The namespace hosts share this machine's filesystem: the test reads their pid files directly.
# ruff: noqa: ASYNC230

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from fleettui.config.fleet import Fleet, ResilienceSettings, load_fleet
from fleettui.control.controller import FleetController, with_overrides
from fleettui.provision.events import run_file
from tests.support.faults import PROMPTS, print_reports, run_with_fault
from tests.support.netns import SshHosts, alive

pytestmark = [pytest.mark.ssh, pytest.mark.slow]
asyncssh = pytest.importorskip("asyncssh")
# longer than detection (2 s): the stage is declared lost while its host is away
LINK_DOWN_SECONDS = 6.0


def ssh_fleet(ssh_hosts: SshHosts, cache: Path, tmp_path: Path) -> Fleet:
    path = tmp_path / "office.toml"
    path.write_text(ssh_hosts.fleet_toml(memory_gb=4.0))
    fleet = with_overrides(load_fleet(path), exact=True, draft="none")
    fleet = replace(fleet, model=replace(fleet.model, shards=cache))
    resilience = ResilienceSettings(detect_seconds=2.0, grace_seconds=90.0)
    return replace(fleet, resilience=resilience, speculation=replace(fleet.speculation, k="auto"))


def remote_pid(fleet: Fleet, name: str) -> int:
    """The pid of the worker of `name` on its SSH host, from the pid file the deployment wrote
    there."""
    host = next(h for h in fleet.hosts if h.name == name)
    return int(
        json.loads(Path(run_file(host.workdir, host.name, host.base_port, ".pid")).read_text())[
            "pid"
        ]
    )


def workers_left(ssh_hosts: SshHosts) -> list[int]:
    found = []
    for host in ssh_hosts.hosts:
        for pid in ssh_hosts.namespace_pids(host):
            try:
                if b"remote_worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
            except OSError:
                continue
    return found


def test_kill_9_of_a_stage_on_an_ssh_host_completes_exactly(
    ssh_hosts: SshHosts, shard_cache: Path, recovery_reference: list[list[int]], tmp_path: Path
) -> None:
    """SIGKILL of host1's worker while three sessions stream: relaunched over SSH, replayed,
    answers equal."""
    fleet = ssh_fleet(ssh_hosts, shard_cache, tmp_path)
    victims: list[int] = []

    def kill_remote(_controller: FleetController) -> None:
        victims.append(remote_pid(fleet, "host1"))
        os.kill(victims[0], signal.SIGKILL)

    tokens, _controller, reports = asyncio.run(run_with_fault(fleet, PROMPTS, kill_remote))
    print_reports(reports)
    assert tokens == recovery_reference
    assert [r.action for r in reports] == ["relaunch"] and reports[0].stages == ("host1",)
    assert reports[0].detect <= 3.0 and reports[0].sessions == len(PROMPTS)
    assert not alive(victims[0])
    assert not workers_left(ssh_hosts), "a worker outlived the fleet's stop"


def test_a_host_cut_off_then_back_completes_exactly(
    ssh_hosts: SshHosts, shard_cache: Path, recovery_reference: list[list[int]], tmp_path: Path
) -> None:
    """host0's link goes down for 6 s mid-answer (a laptop off the Wi-Fi): lost, relaunched when
    back, equal."""
    if ssh_hosts.mode != "netns":
        if os.environ.get("CI"):
            pytest.fail("CI must cut links of network-namespace hosts (runs as root)")
        pytest.skip("cutting a host's link needs network namespaces (root)")
    fleet = ssh_fleet(ssh_hosts, shard_cache, tmp_path)
    timers: list[threading.Timer] = []
    before: list[int] = []

    def cut_off(_controller: FleetController) -> None:
        before.append(remote_pid(fleet, "host0"))
        ssh_hosts.set_link(0, up=False)
        timers.append(threading.Timer(LINK_DOWN_SECONDS, ssh_hosts.set_link, (0, True)))
        timers[0].start()

    try:
        tokens, _controller, reports = asyncio.run(run_with_fault(fleet, PROMPTS[:2], cut_off))
    finally:
        for timer in timers:
            timer.join()
        ssh_hosts.set_link(0, up=True)
    print_reports(reports)
    assert tokens == recovery_reference[:2]
    assert reports and all(r.action == "relaunch" for r in reports)
    assert reports[0].stages == ("host0",) and "host0" in reports[0].stages
    assert reports[0].relaunch >= LINK_DOWN_SECONDS - reports[0].detect - 1.0  # waited for the host
    assert not alive(before[0])  # the worker that was cut off was stopped when its host came back
    assert not workers_left(ssh_hosts), "a worker outlived the fleet's stop"


def test_a_stage_killed_while_it_loads_on_an_ssh_host_is_started_again_and_the_answer_is_exact(
    ssh_hosts: SshHosts, shard_cache: Path, recovery_reference: list[list[int]], tmp_path: Path
) -> None:
    """host1's worker is frozen the moment its pid file names it and SIGKILLed 0.6 s later, before
    it can be ready (the OOM killer while it loads): the deploy starts it once more over SSH, and
    the answer is exact."""
    fleet = ssh_fleet(ssh_hosts, shard_cache, tmp_path)
    host = next(h for h in fleet.hosts if h.name == "host1")
    pidfile = Path(run_file(host.workdir, host.name, host.base_port, ".pid"))
    pidfile.unlink(missing_ok=True)
    killed: list[int] = []
    done = threading.Event()

    def kill_while_loading() -> None:
        while not done.is_set():
            try:
                pid = int(json.loads(pidfile.read_text())["pid"])
            except (OSError, ValueError, KeyError):
                time.sleep(0.005)
                continue
            if alive(pid):
                # frozen within milliseconds of its start: it cannot be ready
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.6)  # past the launch's own look at it
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_while_loading)
    killer.start()
    events: list[object] = []
    try:
        tokens, _controller, reports = asyncio.run(run_with_fault(fleet, PROMPTS[:1], None, events))
    finally:
        done.set()
        killer.join()
    said = [str(e) for e in events if "starting it again" in str(e)]
    assert killed and not alive(killed[0])
    assert tokens == recovery_reference[:1] and reports == []
    assert said and "host1" in said[0] and "died without a reason (killed?)" in said[0], said
    assert not workers_left(ssh_hosts), "a worker outlived the fleet's stop"
