"""Shared test fixtures: no worker process outlives the test that started it."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import psutil
import pytest


def _worker_children() -> list[psutil.Process]:
    children = psutil.Process(os.getpid()).children(recursive=True)
    found = []
    for child in children:
        try:
            if "remote_worker" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


@pytest.fixture(autouse=True)
def no_leftover_workers() -> Iterator[None]:
    """Kill stage workers a failed test left behind, so they cannot hold ports for the next test."""
    yield
    for process in _worker_children():
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            process.kill()
    psutil.wait_procs(_worker_children(), timeout=5)


@pytest.fixture(autouse=True)
def private_state(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deployment records, run folders and worker logs of a test go to its own state folder, not the user's."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
