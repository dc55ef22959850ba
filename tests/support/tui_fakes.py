"""Provides a deterministic FleetControl (fleettui.control.api) to drive the TUI without a model."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fleettui.config.fleet import Fleet, Host, load_fleet
from fleettui.control.states import (
    ControllerEvent,
    Failed,
    Idle,
    Loading,
    LogLine,
    ModelInfo,
    Progress,
    Provisioning,
    Ready,
    Serving,
    StageChanged,
    StageState,
    Telemetry,
    TelemetrySample,
)
from fleettui.runtime.generation import GenerationParams, GenerationStats

SAMPLE_TIME = 1_800_000_000.0  # a fixed wall clock for the samples


def demo_fleet(path: str = "fleets/local.toml") -> Fleet:
    """The local fleet plus two SSH hosts: one still receiving its shard, one failed."""
    fleet = load_fleet(path)
    office = Host(
        "office-pc", transport="ssh", address="192.168.1.20", device="GPU", base_port=5550
    )
    laptop = Host("laptop", transport="ssh", address="192.168.1.31", base_port=5550)
    return replace(fleet, hosts=fleet.hosts + (office, laptop))


def sample(name: str, index: int, second: int, **overrides: Any) -> TelemetrySample:
    """A telemetry sample with values that vary smoothly (and reproducibly) with `second`."""
    wave = (second * 7 + index * 3) % 20
    values = {
        "name": name,
        "stage": index,
        "role": "stage",
        "state": "ready",
        "time": SAMPLE_TIME + second,
        "steps_per_s": wave / 2,
        "tokens_per_s": 10.0 + wave * 1.5,
        "busy": wave / 25,
        "queue": wave % 3,
        "last_step_ms": 12.5,
        "rss_mb": 310.0 + index * 20,
        "temp_c": 48.0 + (wave % 9),
        "sessions": 1,
        "cache_slots": 64,
        "dropped": 0,
        "errors": 0,
        "hop_ms": 0.4 + index / 10,
    }
    values.update(overrides)
    return TelemetrySample.parse(values)


@dataclass
class FakeSession:
    id: int
    messages: list[str] = field(default_factory=list)


@dataclass
class FakeGeneration:
    token_ids: tuple[int, ...]
    text: str
    stats: GenerationStats


class FakeCoordinator:
    """Echoes the prompt word by word; `gate` (when set) holds every reply until released."""

    def __init__(self) -> None:
        self.sessions: dict[int, FakeSession] = {}
        self.gate: asyncio.Event | None = None
        self.active = 0
        self.most_active = 0

    async def open_session(self, seed: int = 0) -> FakeSession:
        session = FakeSession(len(self.sessions) + 1)
        self.sessions[session.id] = session
        return session

    async def close_session(self, session: FakeSession) -> None:
        self.sessions.pop(session.id, None)

    async def chat(
        self,
        session: FakeSession,
        user_text: str,
        params: GenerationParams,
        on_tokens: Callable[[list[int], str], Awaitable[None] | None] | None = None,
        raw: bool = False,
    ) -> FakeGeneration:
        session.messages.append(user_text)
        reply = f"You said **{user_text}** in session {session.id}."
        if raw:  # completion mode: the text so far, continued
            reply = f"and so on after {' '.join(session.messages)!r}"
        words = reply.split(" ")
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            for index, word in enumerate(words):
                if self.gate is not None:
                    await self.gate.wait()
                await asyncio.sleep(0)
                if on_tokens is not None:
                    outcome = on_tokens([index], word if index == 0 else " " + word)
                    if outcome is not None:
                        await outcome
        finally:
            self.active -= 1
        stats = GenerationStats(
            prompt_tokens=5,
            tokens=len(words),
            seconds=0.5,
            ttft=0.1,
            rounds=4,
            drafted=6,
            accepted=4,
            k_values=[1, 2, 2, 1],
            finish_reason="eos",
        )
        return FakeGeneration(tuple(range(len(words))), reply, stats)


class FakeController:
    """Same surface as FleetController; `start()` replays a fixed deploy with a minute of
    telemetry."""

    def __init__(
        self, fleet: Fleet, on_event: Callable[[ControllerEvent], None] | None = None
    ) -> None:
        self.fleet = fleet
        self._on_event = on_event or (lambda event: None)
        self.states: dict[str, StageState] = {host.name: Idle() for host in fleet.hosts}
        self.samples: dict[str, TelemetrySample] = {}
        self.coordinator = FakeCoordinator()
        self.attached = False
        self.detached = 0
        self.started = 0
        self.stopped = 0
        self.fail_start: str | None = None
        self.chat_template = True  # False: a base model (the TUI chats in completion mode)

    def _set(self, name: str, state: StageState) -> None:
        self.states[name] = state
        self._on_event(StageChanged(name, state))

    def layer_ranges(self) -> list[tuple[int, int]]:
        count = len(self.fleet.hosts)
        bounds = [30 * index // count for index in range(count + 1)]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    async def start(self) -> None:
        self.started += 1
        names = [host.name for host in self.fleet.hosts]
        for name in names:
            self._set(name, Provisioning("compile"))
        self._on_event(LogLine("shard_compiler", "using cached shards"))
        if self.fail_start:
            self._set(names[0], Failed(self.fail_start))
            raise RuntimeError(self.fail_start)
        local = [host.name for host in self.fleet.hosts if host.is_local]
        remote = [host.name for host in self.fleet.hosts if not host.is_local]
        for name in local:
            self._set(name, Loading())
        for name in local:
            self._set(name, Ready())
            self._on_event(LogLine(name, "ready: stage up"))
        if remote:
            self._on_event(Progress(remote[0], "shard", 12_000_000, 40_000_000))
            self._set(remote[0], Provisioning("shard"))
        if len(remote) > 1:
            self._set(remote[1], Failed("connect: [Errno 113] No route to host"))
        for second in range(60):
            for index, name in enumerate(local):
                extra = {"temp_c": None} if index == 1 else {}
                self._sample(sample(name, index, second, **extra))
            self._sample(
                sample(
                    "draft", 0, second, role="draft", tokens_per_s=30.0, temp_c=None, hop_ms=None
                )
            )
        await asyncio.sleep(0)

    def _sample(self, values: TelemetrySample) -> None:
        name = values.name
        self.samples[name] = values
        if name in self.states and not isinstance(self.states[name], Failed):
            state = Serving(1) if name == self.fleet.hosts[0].name else Ready()
            if self.states[name] != state:
                self._set(name, state)
        self._on_event(Telemetry(name, values))

    async def stop(self) -> list[str]:
        self.stopped += 1
        for name, state in self.states.items():
            if not isinstance(state, Failed):
                self._set(name, Idle())
        return [f"{name}: stopped" for name in self.states]

    async def fetch_logs(self, lines: int = 20) -> dict[str, list[str]]:
        return {name: [f"{name} log line {i}" for i in range(2)] for name in self.states}

    async def detach(self) -> list[str]:
        self.detached += 1
        return [f"{name}: left running" for name in self.states]

    async def open_session(self, seed: int = 0) -> FakeSession:
        return await self.coordinator.open_session(seed)

    async def chat(
        self,
        session: Any,
        text: str,
        params: GenerationParams,
        on_tokens: Callable[[list[int], str], Awaitable[None] | None] | None = None,
        raw: bool = False,
    ) -> FakeGeneration:
        return await self.coordinator.chat(session, text, params, on_tokens, raw)

    async def close_session(self, session: Any) -> None:
        await self.coordinator.close_session(session)

    def telemetry(self) -> dict[str, TelemetrySample]:
        return self.samples

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            "fake", 8192, tuple(self.layer_ranges()), "fp16", "self-int4", False, self.chat_template
        )

    def worker_pids(self) -> dict[str, int]:
        return {}

    def kill(self) -> None:
        pass
