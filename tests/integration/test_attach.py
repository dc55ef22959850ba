"""Deploy once, then ask, status, the TUI and stop all reach the same worker processes; signals
never orphan one."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import psutil
import pytest

from fleettui.config.fleet import load_fleet
from fleettui.control import store
from fleettui.control.deployment import free_port_block
from fleettui.runtime.generation import GenerationParams
from tests.tui.test_tui import wait_until

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 900.0
pytestmark = pytest.mark.slow


@pytest.fixture
def fleet_file(shard_cache: Path, tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "fleet.toml"
    ports = [free_port_block(), free_port_block()]
    path.write_text(
        f'[model]\nname = "smollm2-135m-instruct"\nprecision = "int4"\nshards = "{shard_cache}"\n'
        '[speculation]\ndraft = "self-int4"\nk = 2\n'
        f'[[hosts]]\nname = "a"\nbase_port = {ports[0]}\n[[hosts]]\nname = "b"\nbase_port = '
        f"{ports[1]}\n"
    )
    yield path
    # a test that failed after `deploy` left its workers running (a deployment outlives its
    # command): stop them through the record, and kill whatever of this test's is left, so no
    # failure leaves a process
    if our_workers():
        with contextlib.suppress(subprocess.SubprocessError):
            fleettui("stop", str(path), timeout=60)
    for pid in our_workers():
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


def fleettui(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleettui", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def our_workers() -> set[int]:
    """Worker processes started under this test's state folder (other tests' and helpers' are
    elsewhere)."""
    state = os.environ["XDG_STATE_HOME"]
    found = set()
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        if "remote_worker" in line and state in line:
            found.add(process.pid)
    return found


def eventually(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def no_orphan(fleet_file: Path) -> None:
    """Either nothing runs, or a record exists and `fleettui stop` ends every worker it names."""
    if our_workers():
        assert store.load(load_fleet(fleet_file)) is not None, f"orphans: {our_workers()}"
        assert fleettui("stop", str(fleet_file), timeout=120).returncode == 0
    eventually(lambda: not our_workers(), 30, "every worker to exit")
    runs = Path(os.environ["XDG_STATE_HOME"]) / "fleettui" / "runs"
    assert not runs.exists() or not list(runs.iterdir())


async def test_deploy_then_ask_status_tui_attach_and_stop_use_the_same_workers(
    fleet_file: Path,
) -> None:
    from textual.widgets import Input

    from fleettui.control.controller import FleetController
    from fleettui.ui.app import FleetApp
    from fleettui.ui.screens.quit import QuitScreen
    from fleettui.ui.widgets.chat import ChatPane

    deployed = fleettui("deploy", str(fleet_file), "--recheck")
    assert deployed.returncode == 0, deployed.stderr
    record = store.load(load_fleet(fleet_file))
    assert record is not None and record.owner is None and record.holder is None
    pids = set(record.pids().values())
    assert len(pids) == 3 and our_workers() == pids  # two stages and the draft
    run_dir = Path(record.run_dir or "")
    assert run_dir.is_dir() and oct(run_dir.stat().st_mode)[-3:] == "700"  # noqa: ASYNC240

    # two local stages on one machine: each on its own slice of the CPUs, like the PCs they stand
    # for
    from fleettui.config.local_cores import share_local_cores

    workers = record.pids()
    for host in share_local_cores(load_fleet(fleet_file)).hosts:
        wanted = sorted(host.cores or os.sched_getaffinity(0))
        assert psutil.Process(workers[host.name]).cpu_affinity() == wanted, host.name

    again = fleettui("deploy", str(fleet_file))
    assert again.returncode == 0 and "already deployed" in again.stdout and our_workers() == pids

    asked = fleettui(
        "ask", str(fleet_file), "What is the capital of France?", "--json", "--max-tokens", "12"
    )
    assert asked.returncode == 0, asked.stderr
    answer = json.loads(asked.stdout)
    assert answer["fleet"]["attached"] is True and "Paris" in answer["text"]
    assert our_workers() == pids  # answered by the running workers: no new worker process
    # a schema-constrained answer from the same workers: the JSON object, valid by construction
    schema = {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Lyon", "Rome"]},
            "is_capital": {"type": "boolean"},
        },
        "required": ["city", "is_capital"],
        "additionalProperties": False,
    }
    schema_file = fleet_file.parent / "capital.schema.json"
    schema_file.write_text(json.dumps(schema))  # noqa: ASYNC240
    shaped = fleettui(
        "ask",
        str(fleet_file),
        "--json-schema",
        str(schema_file),
        "--max-tokens",
        "48",
        "Which French city is the capital of France?",
    )
    assert shaped.returncode == 0, shaped.stderr
    jsonschema.validate(json.loads(shaped.stdout), schema)
    assert our_workers() == pids
    legacy = fleettui(str(fleet_file), "--ask", "Say hi.", "--max-tokens", "4")
    assert legacy.returncode == 0 and our_workers() == pids

    logs = fleettui("logs", str(fleet_file), "-n", "5")
    assert logs.returncode == 0
    # `--recheck`: every worker read all of its stage's files, trusting no stamp of the compiler's
    # checks
    verified = fleettui("logs", str(fleet_file), "-n", "1000").stdout
    checks = re.findall(r"files verified in .* \((\d+) of (\d+) hashed", verified)
    assert len(checks) == 3 and all(hashed == total != "0" for hashed, total in checks), checks
    assert {"[a]", "[b]", "[draft]"} <= {line.split(" ", 1)[0] for line in logs.stdout.splitlines()}
    status = fleettui("status", str(fleet_file), "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    listed = json.loads(status.stdout)
    assert listed["deployment"] == record.id and listed["alive"] is True
    assert {w["name"] for w in listed["workers"]} == {"a", "b", "draft"}
    assert {w["pid"] for w in listed["workers"]} == pids and {
        w["state"] for w in listed["workers"]
    } == {"ready"}
    assert all("warmed up in" in w["compiled"] for w in listed["workers"])  # before they said ready

    app = FleetApp(load_fleet(fleet_file), FleetController, GenerationParams(max_tokens=8))
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_until(pilot, lambda: app.ready or "failed" in app.sub_title, 120, "the attach")
        assert app.ready and app.controller.attached and app.sub_title == "attached"
        assert set(app.controller.worker_pids().values()) == pids
        # the TUI holds the fleet
        busy = fleettui("ask", str(fleet_file), "Hi", "--max-tokens", "2")
        assert busy.returncode == 1 and "in use by pid" in busy.stderr
        app.query_one("#prompt", Input).value = "Name a colour."
        await pilot.press("enter")
        session = app.query_one(ChatPane).active
        await wait_until(
            pilot, lambda: bool(session.replies) and session.replies[-1].done, 300, "the reply"
        )
        assert session.replies[-1].text and "failed" not in session.replies[-1].classes
        await pilot.press("ctrl+q")
        await wait_until(pilot, lambda: isinstance(app.screen, QuitScreen), 10, "the quit dialog")
        await pilot.click("#leave")
        await wait_until(
            pilot, lambda: app.return_code is not None, 60, "the app to detach and exit"
        )
    assert our_workers() == pids
    left = store.load(load_fleet(fleet_file))
    assert left is not None and left.owner is None and left.holder is None and left.id == record.id

    stopped = fleettui("stop", str(fleet_file))
    assert stopped.returncode == 0, stopped.stderr
    eventually(lambda: not our_workers(), 30, "every worker to exit")
    assert not any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids
    )
    assert store.load(load_fleet(fleet_file)) is None and not run_dir.exists()  # noqa: ASYNC240
    status = fleettui("status", str(fleet_file))
    assert status.returncode == 3 and "not deployed" in status.stdout


def start_ask(fleet_file: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fleettui",
            "ask",
            str(fleet_file),
            "Tell me a long story.",
            "--max-tokens",
            "400",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def test_sigterm_to_ask_and_two_quick_ctrl_c_leave_no_orphan(fleet_file: Path) -> None:
    for signals in ([signal.SIGTERM], [signal.SIGINT, signal.SIGINT]):
        process = start_ask(fleet_file)
        try:
            eventually(lambda: len(our_workers()) == 3, TIMEOUT, "the ask's workers")
            time.sleep(1.0)  # some still loading, some ready: the worst moment
            for number in signals:
                process.send_signal(number)
                time.sleep(0.05)
            process.wait(120)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert process.returncode in (128 + signals[0], 130, 1), (
            process.stderr.read() if process.stderr else ""
        )
        no_orphan(fleet_file)


def drain(terminal: int, condition: Callable[[], bool], timeout: float) -> None:
    """Read (and drop) the TUI's output until `condition()` holds, so it never blocks writing the
    screen."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        if select.select([terminal], [], [], 0.1)[0]:
            try:
                os.read(terminal, 65536)
            except OSError:
                time.sleep(0.1)


def test_sighup_to_the_tui_leaves_no_orphan(fleet_file: Path) -> None:
    parent, child = pty.openpty()
    environment = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}
    process = subprocess.Popen(
        [sys.executable, "-m", "fleettui", "tui", str(fleet_file)],
        stdin=child,
        stdout=child,
        stderr=child,
        cwd=ROOT,
        env=environment,
        start_new_session=True,
    )
    os.close(child)
    try:
        drain(parent, lambda: len(our_workers()) == 3, TIMEOUT)
        assert len(our_workers()) == 3
        process.send_signal(signal.SIGHUP)
        drain(parent, lambda: process.poll() is not None, 120)
        assert process.poll() is not None, "the TUI did not exit on SIGHUP"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(parent)
    no_orphan(fleet_file)
