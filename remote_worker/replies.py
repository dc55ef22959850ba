"""Provides the typed control plane of the wire contract: a worker's telemetry sample and its ping
reply.

Both travel as JSON (telemetry PUB frames, control REP answers); the coordinator side validates them
with `parse()` like data frames: a wrong type or a missing field raises ReplyError and the message
is dropped. Fields a newer worker adds are kept in `extra`, so both sides can be upgraded one at a
time."""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal, TypeVar

WorkerState = Literal["starting", "loading", "ready", "stopping"]
Role = Literal["stage", "draft"]
STATES: tuple[WorkerState, ...] = ("starting", "loading", "ready", "stopping")
ROLES: tuple[Role, ...] = ("stage", "draft")


class ReplyError(ValueError):
    """A telemetry sample or control reply that does not have the contract's shape."""


Parsed = TypeVar("Parsed", "TelemetrySample", "PingReply")


def _parse(kind: type[Parsed], data: object) -> Parsed:
    if not isinstance(data, dict):
        raise ReplyError(f"{kind.__name__}: expected a JSON object, got {type(data).__name__}")
    values: dict[str, Any] = {}
    known = {spec.name: spec for spec in fields(kind) if spec.name != "extra"}
    for name, spec in known.items():
        if name not in data:
            if spec.default is not MISSING or spec.default_factory is not MISSING:
                continue
            raise ReplyError(f"{kind.__name__}: missing {name!r}")
        values[name] = _check(kind.__name__, name, str(spec.type), data[name])
    extra = {key: value for key, value in data.items() if key not in known}
    return kind(**values, extra=extra)


def _check(kind: str, name: str, annotation: str, value: object) -> object:
    optional = "None" in annotation
    if value is None:
        if optional:
            return None
        raise ReplyError(f"{kind}.{name}: null")
    if annotation.startswith(("float", "int")) or annotation.startswith(("float |", "int |")):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise ReplyError(f"{kind}.{name}: expected a finite number, got {value!r}")
        return int(value) if annotation.startswith("int") else float(value)
    if annotation.startswith("str") or annotation.startswith(("WorkerState", "Role")):
        if not isinstance(value, str):
            raise ReplyError(f"{kind}.{name}: expected text, got {value!r}")
        if annotation.startswith("WorkerState") and value not in STATES:
            raise ReplyError(f"{kind}.{name}: unknown state {value!r}")
        if annotation.startswith("Role") and value not in ROLES:
            raise ReplyError(f"{kind}.{name}: unknown role {value!r}")
        return value
    if annotation.startswith("bool"):
        if not isinstance(value, bool):
            raise ReplyError(f"{kind}.{name}: expected true/false, got {value!r}")
        return value
    if annotation.startswith("dict"):
        if not isinstance(value, dict):
            raise ReplyError(f"{kind}.{name}: expected an object, got {value!r}")
        return {str(key): str(item) for key, item in value.items()}
    if annotation.startswith("tuple"):
        if not (
            isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value)
        ):
            raise ReplyError(f"{kind}.{name}: expected [start, end], got {value!r}")
        return (value[0], value[1])
    return value


@dataclass(frozen=True)
class TelemetrySample:
    """One worker's about-once-a-second report (rates over the last interval)."""

    name: str
    stage: int
    role: Role
    state: WorkerState
    time: float
    steps_per_s: float
    tokens_per_s: float
    busy: float
    queue: int
    last_step_ms: float
    rss_mb: float
    sessions: int
    cache_slots: int
    dropped: int
    errors: int
    temp_c: float | None = None
    pid: int | None = None
    hop_ms: float | None = None  # added by the coordinator from the per-stage traces
    batch_rows: float = 0.0  # sessions' steps per inference over the interval (1 = no batching)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @staticmethod
    def parse(data: object) -> TelemetrySample:
        return _parse(TelemetrySample, data)

    def to_dict(self) -> dict[str, Any]:
        values = {
            spec.name: getattr(self, spec.name) for spec in fields(self) if spec.name != "extra"
        }
        return {**self.extra, **values}


@dataclass(frozen=True)
class PingReply:
    """A worker's answer to `{"op": "ping"}`: who it is, whether it is ready, and how it
    computes."""

    state: WorkerState
    stage: int
    name: str
    pid: int
    role: Role
    deployment: str
    # the OpenVINO plugin's effective properties
    properties: dict[str, str] = field(default_factory=dict)
    layers: tuple[int, int] | None = None
    is_first: bool | None = None
    is_last: bool | None = None
    security: str | None = None
    # e.g. busy_since, lease_left, urls
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @staticmethod
    def parse(data: object) -> PingReply:
        return _parse(PingReply, data)
