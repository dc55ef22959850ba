"""Provides the deployment store: one private record per running fleet, so any command can attach to
it or stop it.

A record lives in `paths.deployments_dir()/<key>.json` (0600: it holds the coordinator's CurveZMQ
secret key), keyed by the fleet file's resolved path. It is written as soon as workers are launched
(so a crash at any later point leaves something `fleettui stop` finds) and removed when the fleet is
stopped."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fleettui.config import paths
from fleettui.config.fleet import Fleet, Host
from fleettui.control.deployment import Deployment, Placement
from fleettui.runtime.transport import ClientKeys
from remote_worker.config import StageConfig

VERSION = 1


@dataclass(frozen=True)
class ProcessId:
    """A process as recorded: its pid and start time (a reused pid has another start time)."""

    pid: int
    started: float | None

    def alive(self) -> bool:
        import psutil

        try:
            process = psutil.Process(self.pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                return False
            return self.started is None or abs(process.create_time() - self.started) < 0.05
        except psutil.Error:
            return False

    @staticmethod
    def of(pid: int) -> ProcessId:
        import psutil

        try:
            return ProcessId(pid, psutil.Process(pid).create_time())
        except psutil.Error:
            return ProcessId(pid, None)


@dataclass(frozen=True)
class StageRecord:
    """One worker of a recorded deployment."""

    host: str
    local: bool
    connect_address: str
    config: StageConfig
    process: ProcessId | None  # local workers (SSH hosts keep their own pid files)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def role(self) -> str:
        return self.config.role

    def placement(self, hosts: Mapping[str, Host]) -> Placement:
        host = hosts.get(self.host) or Host(name=self.host, base_port=self.config.data_port)
        return Placement(host, self.config, self.connect_address)


@dataclass(frozen=True)
class Settings:
    """What the command line changed on top of the fleet file (an attach must not silently
    differ)."""

    exact: bool = False
    draft: str | None = None
    k: int | None = None


def settings_conflict(wanted: Settings, found: DeploymentRecord) -> str | None:
    """Why an attach with `wanted` settings would silently differ from the running deployment, or
    None."""
    running = found.settings
    for name in ("exact", "draft", "k"):
        value = getattr(wanted, name)
        if value not in (None, False) and value != getattr(running, name):
            return (
                f"{found.fleet_path} is deployed (deployment {found.id}) with {name} = "
                f"{getattr(running, name)!r}, not {value!r}: `fleettui stop` it first"
            )
    return None


@dataclass(frozen=True)
class DeploymentRecord:
    id: str
    fleet_path: str
    fleet_hash: str
    settings: Settings
    target_dir: str
    draft_dir: str | None
    keys: ClientKeys | None
    stages: tuple[StageRecord, ...]
    run_dir: str | None
    created: float = field(default_factory=time.time)
    # the process that started it and keeps its lease (None: deployed)
    owner: ProcessId | None = None
    holder: ProcessId | None = None  # the process using it now (the owner or an attached one)

    def deployment(self, fleet: Fleet) -> Deployment:
        """The placements again (hosts from the fleet file where it still names them)."""
        hosts = {host.name: host for host in fleet.hosts}
        placements = [stage.placement(hosts) for stage in self.stages]
        draft = next((p for p in placements if p.config.role == "draft"), None)
        stages = tuple(p for p in placements if p.config.role != "draft")
        return Deployment(self.id, stages, draft, self.keys)

    def pids(self) -> dict[str, int]:
        return {s.name: s.process.pid for s in self.stages if s.process is not None}

    def to_json(self) -> str:
        document: dict[str, Any] = {
            "version": VERSION,
            "id": self.id,
            "fleet_path": self.fleet_path,
            "fleet_hash": self.fleet_hash,
            "settings": vars(self.settings),
            "target_dir": self.target_dir,
            "draft_dir": self.draft_dir,
            "keys": vars(self.keys) if self.keys else None,
            "run_dir": self.run_dir,
            "created": self.created,
            "owner": vars(self.owner) if self.owner else None,
            "holder": vars(self.holder) if self.holder else None,
            "stages": [
                {
                    "host": s.host,
                    "local": s.local,
                    "connect_address": s.connect_address,
                    "config": json.loads(s.config.to_json()),
                    "process": vars(s.process) if s.process else None,
                }
                for s in self.stages
            ],
        }
        return json.dumps(document, indent=2)

    @staticmethod
    def from_json(text: str) -> DeploymentRecord:
        document = json.loads(text)
        if document.get("version") != VERSION:
            raise ValueError(f"record version {document.get('version')} (expected {VERSION})")
        stages = tuple(
            StageRecord(
                item["host"],
                bool(item["local"]),
                item["connect_address"],
                StageConfig.from_json(json.dumps(item["config"])),
                ProcessId(**item["process"]) if item["process"] else None,
            )
            for item in document["stages"]
        )
        return DeploymentRecord(
            id=document["id"],
            fleet_path=document["fleet_path"],
            fleet_hash=document["fleet_hash"],
            settings=Settings(**document["settings"]),
            target_dir=document["target_dir"],
            draft_dir=document["draft_dir"],
            keys=ClientKeys(**document["keys"]) if document["keys"] else None,
            stages=stages,
            run_dir=document["run_dir"],
            created=float(document["created"]),
            owner=ProcessId(**document["owner"]) if document["owner"] else None,
            holder=ProcessId(**document["holder"]) if document.get("holder") else None,
        )


def fleet_key(fleet: Fleet) -> str | None:
    """The store key of a fleet: its file's resolved path (None for a fleet that has no file)."""
    return str(fleet.path.resolve()) if fleet.path is not None else None


def fleet_hash(fleet: Fleet) -> str:
    """The content hash of the fleet file ("" when it cannot be read)."""
    try:
        return hashlib.sha256(fleet.path.read_bytes()).hexdigest()[:16] if fleet.path else ""
    except OSError:
        return ""


def record_path(key: str) -> Path:
    return paths.deployments_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def load(fleet: Fleet) -> DeploymentRecord | None:
    """The record of this fleet file, or None (an unreadable record counts as none)."""
    key = fleet_key(fleet)
    if key is None:
        return None
    try:
        return DeploymentRecord.from_json(record_path(key).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(record: DeploymentRecord) -> Path:
    path = record_path(record.fleet_path)
    paths.write_private(path, record.to_json())
    return path


def remove(record: DeploymentRecord) -> None:
    """Forget the record, but only if it is still this deployment's (never another's)."""
    path = record_path(record.fleet_path)
    try:
        current = DeploymentRecord.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return
    if current.id == record.id:
        path.unlink(missing_ok=True)


def held_by(record: DeploymentRecord, holder: int | None) -> DeploymentRecord:
    """The record while `holder` uses the fleet (None: free to attach)."""
    return replace(record, holder=ProcessId.of(holder) if holder is not None else None)


def handed_over(record: DeploymentRecord) -> DeploymentRecord:
    """The record of a fleet left running: no owner (no lease), nobody holding it."""
    return replace(record, owner=None, holder=None)


def staleness(record: DeploymentRecord, fleet: Fleet) -> str | None:
    """Why the record no longer describes a running fleet of this file, or None when it does
    (local check)."""
    dead = [
        s.name for s in record.stages if s.local and s.process is not None and not s.process.alive()
    ]
    if dead:
        return f"deployment {record.id} is stale: {', '.join(dead)} no longer running"
    if record.owner is not None and not record.owner.alive():  # its workers' lease is lapsing
        return (
            f"deployment {record.id} is stale: the process that started it (pid "
            f"{record.owner.pid}) exited"
        )
    if record.fleet_hash and fleet_hash(fleet) != record.fleet_hash:
        return f"deployment {record.id} is stale: {record.fleet_path} changed since it was deployed"
    return None


def busy_owner(record: DeploymentRecord) -> ProcessId | None:
    """The other live process that holds this fleet now, if any."""
    holder = record.holder
    if holder is None or holder.pid == os.getpid() or not holder.alive():
        return None
    return holder


def record_of(
    fleet: Fleet,
    settings: Settings,
    deployment: Deployment,
    running: Mapping[str, tuple[StageConfig, ProcessId | None]],
    target_dir: str,
    draft_dir: str | None,
    owner: int | None,
) -> DeploymentRecord:
    """The record of `deployment`; `running` gives each launched worker's real config and
    process."""
    stages = []
    for placement in deployment.placements:
        config, process = running.get(placement.config.name, (placement.config, None))
        stages.append(
            StageRecord(
                placement.host.name,
                placement.host.is_local,
                placement.connect_address,
                config,
                process,
            )
        )
    return DeploymentRecord(
        id=deployment.id,
        fleet_path=fleet_key(fleet) or "",
        fleet_hash=fleet_hash(fleet),
        settings=settings,
        target_dir=target_dir,
        draft_dir=draft_dir,
        keys=deployment.keys,
        stages=tuple(stages),
        run_dir=str(paths.state_dir() / "runs" / deployment.id),
        owner=ProcessId.of(owner) if owner is not None else None,
        holder=ProcessId.of(owner) if owner is not None else None,
    )


def restaged(
    record: DeploymentRecord,
    deployment: Deployment,
    running: Mapping[str, tuple[StageConfig, ProcessId | None]],
    target_dir: str,
) -> DeploymentRecord:
    """The record after a recovery: relaunched workers (`running`) or a new split; the rest as
    recorded."""
    known = {stage.name: (stage.config, stage.process) for stage in record.stages}
    stages = []
    for placement in deployment.placements:
        name = placement.config.name
        config, process = running.get(name) or known.get(name) or (placement.config, None)
        host = placement.host
        stages.append(
            StageRecord(host.name, host.is_local, placement.connect_address, config, process)
        )
    return replace(record, stages=tuple(stages), target_dir=target_dir)
