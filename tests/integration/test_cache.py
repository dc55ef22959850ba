"""`fleettui cache ls|prune` on a local shard cache, and pruning old shard folders on a real sshd
host."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleettui.cli import main
from tests.support.netns import SshHosts, available


def shard(
    root: Path, key: str, age_hours: float, precision: str = "int4", split=(0, 23, 30)
) -> Path:
    folder = root / "shards" / key
    (folder / "stage_0").mkdir(parents=True)
    (folder / "stage_0" / "openvino_model.bin").write_bytes(b"\0" * 1_000_000)
    stages = [{"layers": {"start": a, "end": b}} for a, b in zip(split, split[1:], strict=False)]
    manifest = folder / "manifest.json"
    manifest.write_text(
        json.dumps(
            {"model_name": "smollm2-135m-instruct", "precision": precision, "stages": stages}
        )
    )
    stamp = time.time() - age_hours * 3600
    os.utime(manifest, (stamp, stamp))
    return folder


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    root = tmp_path / "cache" / "fleettui"
    shard(root, "newest", 1)
    shard(root, "older", 5, "fp32", (0, 30))
    deployed = shard(root, "deployed", 48)
    shard(root, "oldest", 72)
    (root / "shards" / "broken").mkdir()  # an interrupted compile: no manifest, 60 h old
    stamp = time.time() - 60 * 3600
    os.utime(root / "shards" / "broken", (stamp, stamp))
    (root / "shards" / "compiling.tmp-x").mkdir()  # a compile in progress: left alone
    (root / "shards" / ".used").mkdir()
    (
        root / "shards" / ".used" / "oldest"
    ).touch()  # a cache hit: the oldest is the most recently used
    os.utime(root / "shards" / ".used" / "oldest", (time.time() + 60, time.time() + 60))
    from fleettui.config.fleet import load_fleet
    from fleettui.control import store
    from fleettui.control.deployment import build_deployment

    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text('[[hosts]]\nname = "a"\nbase_port = 7100\n')
    fleet = load_fleet(fleet_file)
    deployment = build_deployment(fleet, [(0, 30)], lambda host: str(deployed), None)
    record = store.record_of(fleet, store.Settings(), deployment, {}, str(deployed), None, None)
    assert store.save(record).parent == tmp_path / "state" / "fleettui" / "deployments"
    return root


def test_ls_lists_model_split_size_age_and_use(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cache", "ls"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{cache / 'shards'}: 6 shard folder(s)")
    rows = {line.split()[0]: line for line in lines[2:]}
    assert list(rows)[:6] == ["oldest", "compiling.tmp-x", "newest", "older", "deployed", "broken"]
    assert (
        "int4  0,23,30" in rows["newest"]
        and "fp32  0,30" in rows["older"]
        and "1 MB" in rows["newest"]
    )
    assert rows["deployed"].endswith("deployed") and "2 d" in rows["deployed"]
    assert rows["broken"].endswith("incomplete")


def test_prune_keeps_the_recent_and_the_deployed(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cache", "prune", "--keep", "1", "--dry-run"]) == 0
    assert "would remove 3 folder(s)" in capsys.readouterr().out
    assert len(list((cache / "shards").iterdir())) == 7
    assert main(["cache", "prune", "--keep", "1"]) == 0
    left = sorted(path.name for path in (cache / "shards").iterdir())
    assert left == [".used", "compiling.tmp-x", "deployed", "oldest"]
    assert main(["cache", "prune", "--keep", "-1"]) == 2


@pytest.fixture(scope="module")
def ssh_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    reason = available()
    if reason and os.environ.get("CI"):
        pytest.fail(f"CI must run the real-sshd tests: {reason}")
    if reason:
        pytest.skip(reason)
    with SshHosts(1, tmp_path_factory.mktemp("sshd")) as hosts:
        yield hosts


@pytest.mark.ssh
def test_prune_on_a_host_removes_every_other_shard_folder(
    ssh_host: SshHosts, tmp_path: Path
) -> None:
    from fleettui.config.fleet import load_fleet
    from fleettui.provision.prune import prune_host

    path = tmp_path / "fleet.toml"
    path.write_text(ssh_host.fleet_toml())
    host = load_fleet(path).hosts[0]
    shards = Path(host.workdir) / "shards"
    for name in ("current", "old-1", "old-2"):
        (shards / name / "stage_0").mkdir(parents=True)
        (shards / name / "stage_0" / "openvino_model.bin").write_bytes(b"\0" * 2_000_000)
    answer = asyncio.run(prune_host(host, [f"{shards}/current"]))
    assert sorted(answer["removed"]) == ["old-1", "old-2"] and answer["bytes"] == 4_000_000
    assert [child.name for child in shards.iterdir()] == ["current"]
    assert asyncio.run(prune_host(host, [f"{shards}/current"]))["removed"] == []
