"""Shared test fixtures: no worker process outlives the test that started it."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support.netns import SshHosts, available
from tests.support.processes import worker_children

_FRESH_FOLDERS: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """The user's cache (shards, wheelhouse, measured cost profiles) stays out of the tests: a fresh
    one per run, removed at the end, so no test passes only because a cache exists.
    FLEETTUI_TEST_CACHE_HOME names a reusable one instead (a developer's speed-up; CI never sets
    it)."""
    signal.signal(signal.SIGTERM, _terminated)
    if not os.environ.get(
        "PYTEST_XDIST_WORKER"
    ):  # a pytest-xdist worker inherits its controller's cache
        reuse = os.environ.get("FLEETTUI_TEST_CACHE_HOME")
        if not reuse:
            _FRESH_FOLDERS.append(tempfile.mkdtemp(prefix="fleettui-test-cache-"))
        os.environ["XDG_CACHE_HOME"] = reuse or _FRESH_FOLDERS[0]
    # The state folder too (deployment records, run folders, worker logs): each test gets its own
    # (below), and what runs outside a test (a module's fleet fixture) gets this process's, never
    # the user's: two pytest-xdist workers would otherwise meet in ~/.local/state as "in use by pid
    # ..." over the same fleet file.
    _FRESH_FOLDERS.append(tempfile.mkdtemp(prefix="fleettui-test-state-"))
    os.environ["XDG_STATE_HOME"] = _FRESH_FOLDERS[-1]
    from tests.support.shards import session_cache_root

    session_cache_root()  # pinned now, before any test points XDG_CACHE_HOME at a folder of its own


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (--dist loadgroup), tests that share a machine-wide resource run on one
    worker: the real-sshd hosts (network namespaces, installed once) and the bench (fixed ports of
    fleets/local.toml, pinned cores, and a test that counts every mono process on the machine); the
    Gemma tests share one tokenizer."""
    for item in items:
        # tests/unit, tests/integration, tests/ssh, tests/tui: a marker each
        folder = item.path.parent.name
        if folder in ("unit", "integration", "ssh", "tui"):
            item.add_marker(getattr(pytest.mark, folder))
        if item.get_closest_marker("ssh") or "ssh_hosts" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("ssh"))
        elif item.path.name == "test_bench.py":
            item.add_marker(pytest.mark.xdist_group("bench"))
        elif item.path.name.startswith(
            "test_gemma_"
        ):  # one worker loads the 262k-token GGUF tokenizer once
            item.add_marker(pytest.mark.xdist_group("gemma"))


def _terminated(signum: int, frame: object) -> None:
    """A SIGTERM (a cancelled CI job, `timeout`) ends the run as Ctrl-C does, so the fixtures still
    tear down (no worker is left) and the fresh cache folder is removed; by default SIGTERM skipped
    both."""
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _FRESH_FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_leftover_workers() -> Iterator[None]:
    """Kill stage workers a failed test left behind, so they cannot hold ports for the next test."""
    yield
    for process in worker_children():
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            process.kill()
    psutil.wait_procs(worker_children(), timeout=5)


@pytest.fixture(autouse=True)
def private_state(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deployment records, run folders and worker logs of a test go to its own state folder, not
    the user's."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))


@pytest.fixture(scope="session")
def shard_cache() -> Path:
    """One compiled-shard cache root for the whole test run: the run's fresh user cache folder,
    which fleets that name no `shards` (fleets/local.toml, the bench) and the `shards.compiled`
    helper use too, so each shard is compiled once per run."""
    from tests.support.shards import session_cache_root

    return session_cache_root()


@pytest.fixture(scope="session")
def recovery_reference(shard_cache: Path) -> list[list[int]]:
    """The uninterrupted answers of the recovery tests (exact mode: every pipeline gives these
    tokens)."""
    import asyncio

    from tests.support.faults import PROMPTS, make_fleet, run_with_fault

    tokens, _, reports = asyncio.run(run_with_fault(make_fleet(shard_cache, 2), PROMPTS, None))
    assert reports == []
    return tokens


@pytest.fixture(scope="session")
def ssh_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    """Two real sshd hosts (network namespaces when root), shared by the SSH test files:
    installed once."""
    reason = available()
    if reason and os.environ.get("CI"):
        # .ci/test installs openssh-server as root
        pytest.fail(f"CI must run the real-sshd tests: {reason}")
    if reason:
        pytest.skip(reason)
    with SshHosts(2, tmp_path_factory.mktemp("sshd")) as hosts:
        print(f"ssh test hosts ({hosts.mode}):", [(h.address, h.port) for h in hosts.hosts])
        yield hosts
