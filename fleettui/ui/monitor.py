"""Provides the fleet panel's model: per-stage state, last telemetry sample and one-minute
histories (no UI)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fleettui.control.states import (
    Degraded,
    Failed,
    Idle,
    Lost,
    Provisioning,
    Recovering,
    Serving,
    StageState,
    TelemetrySample,
    next_state,
)
from fleettui.ui.formatting import (
    Series,
    layers_text,
    memory_text,
    percent_text,
    rate_text,
    sparkline,
    temperature_text,
)

SPARK_WIDTH = 8  # one character per 7.5 seconds of the last minute


@dataclass
class StageView:
    """What the fleet panel knows about one stage (a fleet host, or the draft worker once it
    reports)."""

    name: str
    address: str = "—"
    index: int | None = None
    layers: tuple[float, float] | None = None
    device: str = "—"
    state: StageState = field(default_factory=Idle)
    sample: TelemetrySample | None = None
    tokens: Series = field(default_factory=Series)
    temperature: Series = field(default_factory=Series)
    throttled: str = ""  # why the stage runs slower than its own baseline ("" = it does not)

    @property
    def state_text(self) -> str:
        if isinstance(self.state, (Failed, Degraded)):
            text = f"{self.state.label}: {self.state.reason}"
        elif isinstance(self.state, Lost):
            text = f"lost ({self.state.reason})"
        else:
            step = self.state.step if isinstance(self.state, (Provisioning, Recovering)) else ""
            text = f"{self.state.label} ({step})" if step else self.state.label
        return f"{text}, throttled: {self.throttled}" if self.throttled else text

    def record(self, sample: TelemetrySample) -> None:
        self.sample = sample
        self.tokens.add(sample.time, sample.tokens_per_s)
        self.temperature.add(sample.time, sample.temp_c)

    def cells(self, spark_width: int = SPARK_WIDTH) -> dict[str, str]:
        """The row's text, by column key (colours are the widget's business)."""
        sample = self.sample
        tokens = sample.tokens_per_s if sample else None
        temperature = sample.temp_c if sample else None
        hop = sample.hop_ms if sample else None
        draft = sample is not None and sample.role == "draft"
        stage = "draft" if draft else ("—" if self.index is None else str(self.index))
        tokens_spark = (
            sparkline(self.tokens.values(), spark_width) if len(self.tokens) else " " * spark_width
        )
        if temperature is None:
            temperature_cell = temperature_text(None)
        else:
            temperature_cell = f"{temperature_text(temperature):>5} " + sparkline(
                self.temperature.values(), spark_width, minimum=min(self.temperature.values()) - 1.0
            )
        return {
            "name": self.name,
            "address": self.address,
            "stage": stage,
            "layers": layers_text(self.layers),
            "device": self.device,
            "state": self.state_text,
            "tokens": f"{rate_text(tokens):>6} {tokens_spark}",
            "busy": percent_text(sample.busy if sample else None),
            "queue": "—" if sample is None else str(sample.queue),
            "hop": "n/a" if hop is None else f"{hop:.1f}",
            "temperature": temperature_cell,
            "memory": memory_text(sample.rss_mb if sample else None),
        }


COLUMNS: tuple[tuple[str, str], ...] = (
    ("name", "name"),
    ("address", "address"),
    ("stage", "stage"),
    ("layers", "layers"),
    ("device", "device"),
    ("state", "state"),
    ("tokens", "tok/s (1 min)"),
    ("busy", "busy"),
    ("queue", "queue"),
    ("hop", "hop ms"),
    ("temperature", "temp (1 min)"),
    ("memory", "memory"),
)


class FleetMonitor:
    """All stages in fleet order; telemetry for names not in the fleet (the draft) adds a row."""

    def __init__(self) -> None:
        self.stages: dict[str, StageView] = {}
        self.version = 0  # bumped on every change, so the panel redraws only when something moved

    def add(self, view: StageView) -> None:
        self.stages[view.name] = view
        self.version += 1

    def view(self, name: str) -> StageView:
        if name not in self.stages:
            self.add(StageView(name))
        return self.stages[name]

    def set_state(self, name: str, state: StageState) -> None:
        self.view(name).state = state
        self.version += 1

    def set_throttled(self, name: str, reason: str) -> None:
        self.view(name).throttled = reason
        self.version += 1

    def record(self, name: str, sample: TelemetrySample, known: bool) -> None:
        """A telemetry sample; `known` says the controller tracks this stage's state itself."""
        view = self.view(name)
        view.record(sample)
        if not known:
            view.state = next_state(view.state, sample)
        self.version += 1

    def serving(self) -> list[str]:
        return [name for name, view in self.stages.items() if isinstance(view.state, Serving)]
