"""The deployment store: records round-trip, are private, are found by fleet file, and go stale
visibly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fleettui.config.fleet import load_fleet
from fleettui.control import store
from fleettui.control.deployment import build_deployment
from fleettui.control.store import ProcessId, Settings


def a_fleet(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(
        '[[hosts]]\nname = "a"\nbase_port = 7100\n[[hosts]]\nname = "b"\nbase_port = 7110\n'
    )
    return path


def a_record(
    path: Path, process: ProcessId | None, owner: int | None = None
) -> store.DeploymentRecord:
    fleet = load_fleet(path)
    deployment = build_deployment(fleet, [(0, 15), (15, 30)], lambda host: "/shards", "/draft")
    running = {"a": (deployment.stages[0].config, process)}
    return store.record_of(
        fleet, Settings(exact=True), deployment, running, "/shards", "/draft", owner
    )


def dead_process() -> ProcessId:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    record = ProcessId.of(child.pid)
    child.wait()
    return record


def test_a_record_round_trips_privately_and_is_found_by_its_fleet_file(tmp_path: Path) -> None:
    path = a_fleet(tmp_path)
    record = a_record(path, ProcessId.of(os.getpid()))
    saved = store.save(record)
    assert (
        oct(saved.stat().st_mode)[-3:] == "600" and oct(saved.parent.stat().st_mode)[-3:] == "700"
    )
    found = store.load(load_fleet(path))
    assert found == record and found.keys is not None and found.settings.exact
    assert [s.name for s in found.stages] == ["a", "b", "draft"] and found.pids() == {
        "a": os.getpid()
    }
    assert found.deployment(load_fleet(path)).draft is not None
    assert store.staleness(found, load_fleet(path)) is None


def test_stale_records_say_why_and_only_their_own_record_is_removed(tmp_path: Path) -> None:
    path = a_fleet(tmp_path)
    gone = a_record(path, dead_process())
    store.save(gone)
    assert "a no longer running" in (store.staleness(gone, load_fleet(path)) or "")
    orphaned = a_record(path, ProcessId.of(os.getpid()), owner=dead_process().pid)
    assert "exited" in (store.staleness(orphaned, load_fleet(path)) or "")
    alive = a_record(path, ProcessId.of(os.getpid()))
    path.write_text(path.read_text() + "\n# edited\n")
    assert "changed since it was deployed" in (store.staleness(alive, load_fleet(path)) or "")
    store.remove(alive)  # another deployment's id: the saved record stays
    assert store.load(load_fleet(path)) == gone
    store.remove(gone)
    assert store.load(load_fleet(path)) is None


def test_a_pid_reused_by_another_process_is_not_the_recorded_one() -> None:
    me = ProcessId.of(os.getpid())
    assert me.alive() and not ProcessId(os.getpid(), (me.started or 0) - 100).alive()


def test_a_dead_attached_process_frees_the_fleet_without_making_it_stale(tmp_path: Path) -> None:
    path = a_fleet(tmp_path)
    deployed = store.handed_over(a_record(path, ProcessId.of(os.getpid()), owner=os.getpid()))
    held = store.held_by(deployed, dead_process().pid)
    assert store.staleness(held, load_fleet(path)) is None and store.busy_owner(held) is None
    parent = store.held_by(deployed, os.getppid())
    assert store.busy_owner(parent) == ProcessId.of(os.getppid())


def test_the_last_stage_loops_back_to_stage_0_and_stage_0_lets_it_in(tmp_path: Path) -> None:
    """A run's tokens go from the last stage straight back to stage 0: its data endpoint and
    CURVE key."""
    from remote_worker.config import StageConfig

    fleet = load_fleet(a_fleet(tmp_path))
    deployment = build_deployment(fleet, [(0, 15), (15, 30)], lambda host: "/shards")
    first, last = deployment.stages[0].config, deployment.stages[-1].config
    assert last.loop is not None and last.loop.port == first.data_port and first.loop is None
    assert first.curve is not None and last.curve is not None
    assert last.curve.public_key in first.curve.allowed_clients
    assert last.curve.loop_server_key == first.curve.public_key
    # the loop survives the worker's config file
    assert StageConfig.from_json(last.to_json()) == last
    single = tmp_path / "single.toml"
    single.write_text('[[hosts]]\nname = "a"\nbase_port = 7100\n')
    alone = build_deployment(load_fleet(single), [(0, 30)], lambda host: "/shards")
    config = alone.stages[0].config  # one stage feeds its tokens back itself
    assert config.loop is None and config.curve is not None and config.curve.loop_server_key is None
