"""Provides FleetControl, the seam under the UI (and any script): what a fleet can be asked to do,
typed.

`FleetController` implements it over real workers; the TUI tests' fake implements it without a
model."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from fleettui.config.fleet import Fleet
from fleettui.control.states import ModelInfo, StageState
from fleettui.runtime.generation import GenerationParams, GenerationStats
from remote_worker.replies import TelemetrySample

TokenCallback = Callable[[list[int], str], Awaitable[None] | None]


class SessionHandle(Protocol):
    """An open conversation on the fleet (its id is the workers' KV session)."""

    id: int


class Answer(Protocol):
    """A finished generation: the text, its tokens and how it went."""

    @property
    def text(self) -> str: ...

    @property
    def token_ids(self) -> tuple[int, ...] | list[int]: ...

    @property
    def stats(self) -> GenerationStats: ...


class FleetControl(Protocol):
    """Start or attach, chat in sessions, watch, detach or stop: everything the UI does to a
    fleet."""

    @property
    def fleet(self) -> Fleet: ...

    @property
    def states(self) -> Mapping[str, StageState]: ...

    @property
    def attached(self) -> bool:
        """True when serving a deployment another command launched."""

    def layer_ranges(self) -> list[tuple[float, float]]: ...

    async def start(self) -> object:
        """Attach to the fleet's live deployment or launch one; raises with a one-line reason."""

    async def stop(self) -> list[str]:
        """Stop this deployment's workers; one line per worker."""

    async def detach(self) -> list[str]:
        """Leave the workers running for the record (`fleettui stop` or a later attach finds
        them)."""

    async def open_session(self, seed: int = 0) -> SessionHandle: ...

    async def chat(
        self,
        session: SessionHandle,
        text: str,
        params: GenerationParams,
        on_tokens: TokenCallback | None = None,
        # completion mode: continue the session's text (a base model has no template)
        raw: bool = False,
    ) -> Answer: ...

    async def close_session(self, session: SessionHandle) -> None: ...

    async def fetch_logs(self, lines: int = 20) -> dict[str, list[str]]: ...

    def telemetry(self) -> Mapping[str, TelemetrySample]:
        """The latest sample of every worker."""

    def model_info(self) -> ModelInfo | None: ...

    def worker_pids(self) -> dict[str, int]: ...

    def kill(self) -> None:
        """Synchronous last resort after a crash: kill the workers this process started."""


ControlFactory = Callable[..., FleetControl]  # (fleet, on_event=...) -> FleetControl
