"""Provides the lifecycle states of a stage and the events the controller reports (no UI code)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True)
class Idle:
    label = "idle"


@dataclass(frozen=True)
class Provisioning:
    step: str = ""
    fraction: float | None = None
    label = "provisioning"


@dataclass(frozen=True)
class Loading:
    label = "loading"


@dataclass(frozen=True)
class Ready:
    label = "ready"


@dataclass(frozen=True)
class Serving:
    sessions: int = 0
    label = "serving"


@dataclass(frozen=True)
class Failed:
    reason: str
    label = "failed"


@dataclass(frozen=True)
class Lost:
    """Declared lost by the heartbeat watcher (dead, stopped, unreachable); recovery is under way."""

    reason: str
    label = "lost"


@dataclass(frozen=True)
class Recovering:
    """Relaunching the stage's worker or replaying the sessions' histories into the pipeline."""

    step: str = ""  # relaunch | replay | replan
    label = "recovering"


@dataclass(frozen=True)
class Degraded:
    """The fleet cannot run the model without a host that did not come back."""

    reason: str
    label = "degraded"


StageState = Union[Idle, Provisioning, Loading, Ready, Serving, Failed, Lost, Recovering, Degraded]


def next_state(current: StageState, sample: dict[str, Any] | None) -> StageState:
    """The state a telemetry sample implies (a failure or a loss stays until the stage is back)."""
    if isinstance(current, (Failed, Lost, Recovering, Degraded)) or sample is None:
        return current
    if sample.get("state") != "ready":
        return Loading()
    sessions = int(sample.get("sessions") or 0)
    busy = float(sample.get("busy") or 0.0)
    return Serving(sessions) if sessions and busy > 0.0 else Ready()


@dataclass(frozen=True)
class StageChanged:
    name: str
    state: StageState


@dataclass(frozen=True)
class Progress:
    """A step of preparing or deploying a host (bytes for transfers, a fraction for compiles)."""

    name: str
    step: str
    done: float = 0.0
    total: float = 0.0
    message: str = ""


@dataclass(frozen=True)
class LogLine:
    source: str
    text: str


@dataclass(frozen=True)
class Telemetry:
    name: str
    sample: dict[str, Any]


@dataclass(frozen=True)
class RecoveryReport:
    """One recovery: which stages were lost and why, what was done, and how long each step took (seconds).

    `detect` runs from the last good heartbeat to the declaration; `relaunch` from the declaration to the
    new workers' handshakes (or the new split's launch); `replay` is the rebuild of every open session.
    """

    stages: tuple[str, ...]
    reasons: tuple[str, ...]
    action: str  # relaunch | replan | degraded | failed
    detect: float
    relaunch: float
    replay: float
    sessions: int
    replayed_tokens: int
    message: str = ""


@dataclass(frozen=True)
class Throttled:
    """A stage runs slower than its own baseline (ratio) and/or reports heat or a lowered clock."""

    name: str
    ratio: float
    reason: str


@dataclass(frozen=True)
class RebalanceProposal:
    """A better split computed from measured per-stage costs; `applied` when rebalance = "auto" did it."""

    ranges: tuple[tuple[int, int], ...]
    current: tuple[tuple[int, int], ...]
    gain: float  # expected bottleneck time saved, as a fraction
    applied: bool = False


ControllerEvent = Union[
    StageChanged, Progress, LogLine, Telemetry, RecoveryReport, Throttled, RebalanceProposal
]
