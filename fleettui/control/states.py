"""Provides the lifecycle states of a stage and the events the controller reports (no UI code)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Union

from fleettui.provision.events import ProvisionEvent, Step
from remote_worker.replies import TelemetrySample

if TYPE_CHECKING:
    from fleettui.config.fleet import Fleet
    from remote_worker.manifest import Manifest

__all__ = ["TelemetrySample"]  # re-exported: the UI reads samples through the control layer


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
    """Declared lost by the heartbeat watcher (dead, stopped, unreachable); recovery is under
    way."""

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


def next_state(current: StageState, sample: TelemetrySample | None) -> StageState:
    """The state a telemetry sample implies (a failure or a loss stays until the stage is back)."""
    if isinstance(current, (Failed, Lost, Recovering, Degraded)) or sample is None:
        return current
    if sample.state != "ready":
        return Loading()
    return Serving(sample.sessions) if sample.sessions and sample.busy > 0.0 else Ready()


@dataclass(frozen=True)
class StageChanged:
    name: str
    state: StageState


@dataclass(frozen=True)
class LogLine:
    source: str
    text: str


@dataclass(frozen=True)
class Telemetry:
    name: str
    sample: TelemetrySample


@dataclass(frozen=True)
class RecoveryReport:
    """One recovery: which stages were lost and why, what was done, and how long each step took
    (seconds).

    `detect` runs from the last good heartbeat to the declaration; `relaunch` from the declaration
    to the new workers' handshakes (or the new split's launch); `replay` is the rebuild of every
    open session."""

    stages: tuple[str, ...]
    reasons: tuple[str, ...]
    action: str  # relaunch | replan | degraded | failed | rebalance | rejoin
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
    """A better split computed from measured per-stage costs; `applied` when rebalance = "auto"
    did it."""

    ranges: tuple[tuple[int, int], ...]
    current: tuple[tuple[int, int], ...]
    gain: float  # expected bottleneck time saved, as a fraction
    applied: bool = False


Progress = ProvisionEvent  # the one deploy event, for compile steps too
ControllerEvent = Union[
    StageChanged, ProvisionEvent, LogLine, Telemetry, RecoveryReport, Throttled, RebalanceProposal
]


@dataclass(frozen=True)
class ModelInfo:
    """What a running fleet serves: the model, its context length and split, and how it computes."""

    name: str
    context_length: int
    stages: tuple[tuple[int, int], ...]
    precision: str
    draft: str
    exact: bool
    # False: a base model, served for completions (chat refused, the TUI continues text)
    chat_template: bool = True

    @classmethod
    def of(cls, fleet: Fleet, manifest: Manifest) -> ModelInfo:
        """What FLEET serves with the compiled target MANIFEST."""
        return cls(
            name=fleet.model.name,
            context_length=manifest.max_position_embeddings,
            stages=tuple((s.layers.start, s.layers.end) for s in manifest.stages),
            precision=manifest.precision,
            draft=fleet.speculation.draft,
            exact=fleet.runtime.exact,
            chat_template=bool(manifest.chat_template),
        )


NextStep = Literal["launch", "wait", "serve", "recover"]


def next_step(states: Mapping[str, StageState]) -> NextStep:
    """What to do next, from the stages' states alone: launch (all idle), wait (some provisioning or
    loading), serve (all ready or serving) or recover (a stage failed, was lost or the fleet is
    degraded)."""
    values = list(states.values())
    if any(isinstance(state, (Failed, Lost, Degraded)) for state in values):
        return "recover"
    if values and all(isinstance(state, (Ready, Serving)) for state in values):
        return "serve"
    if all(isinstance(state, Idle) for state in values):
        return "launch"
    return "wait"


def provision_state(step: Step, message: str = "") -> StageState | None:
    """The state a deploy step of an SSH host implies (None: no change)."""
    if step == "failed":
        return Failed(message or "deploy failed")
    if step == "ready":
        return Loading()
    if step == "done":
        return Ready()
    return None if step == "skipped" else Provisioning(step)
