"""Provides the status of a recorded deployment: each worker's process and control answer, and
staleness."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fleettui.config.fleet import Fleet
from fleettui.control import store
from fleettui.control.store import DeploymentRecord
from fleettui.runtime.transport import control_request
from remote_worker.replies import PingReply, ReplyError


@dataclass(frozen=True)
class WorkerStatus:
    name: str
    role: str
    host: str
    address: str
    ports: tuple[int, ...]
    pid: int | None
    state: str  # the worker's own answer ("ready", "loading") or why there is none
    # "compiled in 1.4 s, warmed up in 0.3 s" or "loaded from the compile cache in …"
    compiled: str = ""


@dataclass(frozen=True)
class StatusReport:
    record: DeploymentRecord
    workers: tuple[WorkerStatus, ...]
    stale: str | None
    owner: int | None

    @property
    def alive(self) -> bool:
        return self.stale is None and all(w.state == "ready" for w in self.workers)

    def to_dict(self) -> dict[str, object]:
        return {
            "fleet": self.record.fleet_path,
            "deployment": self.record.id,
            "alive": self.alive,
            "stale": self.stale,
            "in_use_by": self.owner,
            "workers": [vars(worker) for worker in self.workers],
        }

    def text(self) -> str:
        head = f"deployment {self.record.id} of {self.record.fleet_path}: "
        head += self.stale if self.stale else ("running" if self.alive else "degraded")
        if self.owner is not None:
            head += f", in use by pid {self.owner}"
        rows = [head]
        for w in self.workers:
            pid = f"pid {w.pid}" if w.pid is not None else "remote"
            ports = ",".join(map(str, w.ports))
            compiled = f" ({w.compiled})" if w.compiled else ""
            rows.append(
                f"  {w.name:<12} {w.role:<6} {w.address:<15} ports {ports:<24} {pid:<11} "
                f"{w.state}{compiled}"
            )
        return "\n".join(rows)


def answer_seconds(answer: dict[str, object], key: str) -> float | None:
    """A duration a worker's ping answer reports (compile, warm-up), or None when it does not
    say."""
    value = answer.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _compiled(extra: dict[str, object]) -> str:
    """How the worker got its compiled model, from its ping answer ("" when it does not say)."""
    seconds = answer_seconds(extra, "compile_seconds")
    if seconds is None:
        return ""
    how = (
        "loaded from the compile cache" if extra.get("compiled_from_cache") is True else "compiled"
    )
    warm = answer_seconds(extra, "warm_up_seconds")
    return f"{how} in {seconds:.1f} s" + (
        f", warmed up in {warm:.1f} s" if warm is not None else ""
    )


async def probe(record: DeploymentRecord, fleet: Fleet) -> StatusReport:
    """Ask every recorded worker for its state (control ping, CurveZMQ when keyed)."""
    hosts = {host.name: host for host in fleet.hosts}

    async def one(stage: store.StageRecord) -> WorkerStatus:
        placement = stage.placement(hosts)
        config = stage.config
        ports = tuple(
            p
            for p in (
                config.data_port,
                config.control_port,
                config.telemetry_port,
                config.result_port,
            )
            if p
        )
        pid = stage.process.pid if stage.process else None
        compiled = ""
        if stage.process is not None and not stage.process.alive():
            state = "lost (process exited)"
        else:
            answer = await control_request(
                placement.control_url, {"op": "ping"}, record.keys, placement.server_key, 2.0
            )
            try:
                reply = None if answer is None else PingReply.parse(answer)
            except ReplyError as error:
                reply, state = None, f"a malformed answer ({error})"
            else:
                state = "lost (no answer within 2 s)"
            if reply is not None and reply.deployment != record.id:
                state = f"another deployment ({reply.deployment}) answers"
            elif reply is not None:
                state = reply.state
                pid = pid if pid is not None else reply.pid
                compiled = _compiled(reply.extra)
        return WorkerStatus(
            stage.name, stage.role, stage.host, stage.connect_address, ports, pid, state, compiled
        )

    workers = tuple(await asyncio.gather(*(one(stage) for stage in record.stages)))
    stale = store.staleness(record, fleet)
    if stale is None and any(w.state not in ("ready", "loading") for w in workers):
        stale = (
            f"stale: {', '.join(w.name for w in workers if w.state not in ('ready', 'loading'))} "
            "not running"
        )
    owner = store.busy_owner(record)
    return StatusReport(record, workers, stale, owner.pid if owner else None)
