"""A controller killed (SIGKILL) at any point leaves no worker behind for longer than its lease.

Real parts: a controller process launching a real two-stage fleet, killed while its workers load
(before any handshake finished), or while the recovery relaunches a killed stage. Its workers are
orphans then; each was launched on the lease and must exit by itself once nobody renews it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.support.netns import alive
from tests.support.processes import worker_children

ROOT = Path(__file__).resolve().parents[2]
LEASE = 3.0

SCRIPT = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from pathlib import Path

    sys.path.insert(0, {tests!r})
    from tests.support.faults import make_fleet
    from fleettui.control.controller import FleetController

    async def main() -> None:
        controller = FleetController(make_fleet(Path(sys.argv[1]), 2), lease={lease})
        await controller.start(record=False)
        print("ready", flush=True)
        os.kill(controller.worker_pids()["stage-1"], signal.SIGKILL)  # the recovery relaunches it
        await asyncio.sleep(600)

    asyncio.run(main())
    """
)


def workers_of(process: psutil.Process) -> set[int]:
    return {child.pid for child in worker_children(process)}


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["launch", "relaunch"])
def test_a_controller_killed_mid_launch_leaves_no_worker_beyond_its_lease(
    shard_cache: Path, moment: str
) -> None:
    controller = subprocess.Popen(
        [sys.executable, "-c", SCRIPT.format(tests=str(ROOT), lease=LEASE), str(shard_cache)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    handle = psutil.Process(controller.pid)
    seen: set[int] = set()
    try:
        if (
            moment == "launch"
        ):  # both workers exist and load their shards; no handshake has finished yet

            def started() -> bool:
                seen.update(workers_of(handle))
                return len(seen) >= 2

            wait_for(started, 600, "two workers")
        else:
            assert controller.stdout is not None
            assert controller.stdout.readline().strip() == "ready"
            first = workers_of(handle)
            seen.update(first)

            def relaunched() -> bool:
                seen.update(workers_of(handle))
                return bool(seen - first)

            wait_for(relaunched, 120, "the relaunched worker")
        controller.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        left, _ = controller.communicate()
        if moment == "launch":
            assert "ready" not in left  # killed while launching, as meant
        wait_for(
            lambda: not any(alive(pid) for pid in seen), 120, f"the orphans {sorted(seen)} to exit"
        )
        print(
            f"{moment}: {len(seen)} orphaned workers exited {time.monotonic() - killed:.1f} s "
            "after the kill"
        )
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait()
        for pid in seen:  # (only after a failure: a leftover must not outlive the test)
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)


def test_a_throttle_whose_process_is_killed_leaves_its_victim_running() -> None:
    """The bench's injected slowdown (SIGSTOP/SIGCONT duty cycle) must not leave a worker stopped
    forever when the process throttling it is killed: a stopped worker could not even run out its
    lease."""
    victim = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    throttling = subprocess.Popen(
        [sys.executable, "-c", THROTTLING.format(root=str(ROOT), pid=victim.pid)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert (
            throttling.stdout is not None and throttling.stdout.readline().strip() == "throttling"
        )
        handle = psutil.Process(victim.pid)

        def states(seconds: float) -> set[str]:
            seen, deadline = set(), time.monotonic() + seconds
            while time.monotonic() < deadline:
                seen.add(handle.status())
                time.sleep(0.002)
            return seen

        assert psutil.STATUS_STOPPED in states(1.0)  # (held stopped 90 % of the time)
        throttling.send_signal(signal.SIGKILL)
        throttling.wait()
        # the helper may be past its check for the closed pipe when the kill comes: one more cycle
        # (18 ms stopped) may follow, so "running again" is a whole 0.3 s seen running (a single
        # "running" sample could fall in that cycle's 2 ms running window, as it did once on a
        # loaded CI machine)
        wait_for(lambda: states(0.3) == {psutil.STATUS_RUNNING}, 5, "the victim to run again")
        assert states(0.5) == {psutil.STATUS_RUNNING}
    finally:
        throttling.kill()
        throttling.wait()
        victim.kill()
        victim.wait()


THROTTLING = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {root!r})
    from fleettui.bench.throttle import Throttle

    Throttle(lambda: {pid}, 0.1).start()
    print("throttling", flush=True)
    time.sleep(600)
    """
)
