"""Provides `ServedFleet`: everything the HTTP server needs from a running fleet, behind one small
protocol.

The server never touches the controller, coordinator or deployment directly; `ControllerFleet`
adapts a started `FleetController` to this protocol, so pointing the server at another orchestrator
API means writing one more adapter here."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fleettui.runtime.chat_format import ChatMessage
from fleettui.runtime.constraint import ConstraintSpec, check_constraint
from fleettui.runtime.generation import Generation, GenerationParams, TokenCallback
from fleettui.runtime.session import Session
from fleettui.runtime.tools import Tool, ToolFormat, detect_format, render_with_tools

if TYPE_CHECKING:
    from fleettui.control.controller import FleetController
    from fleettui.control.deployment import Placement


@dataclass(frozen=True)
class ModelInfo:
    name: str
    context_length: int
    num_layers: int
    created: int  # Unix time the shards were compiled (OpenAI's `created`)


@dataclass(frozen=True)
class StageHealth:
    name: str
    up: bool
    detail: str = ""


class ServedFleet(Protocol):
    """A running fleet as the server sees it: tokenizer, sessions, generation and stage
    telemetry."""

    def model_info(self) -> ModelInfo: ...

    def defaults(self) -> GenerationParams:
        """Sampling defaults: the fleet file's, else the model's recommended (max_tokens,
        temperature, top_p, seed ...)."""
        ...

    def encode_chat(self, messages: list[ChatMessage], tools: Sequence[Tool] = ()) -> list[int]:
        """The conversation's prompt; with TOOLS, or calls and results in it, in `tool_format()`."""
        ...

    def tool_format(self) -> ToolFormat:
        """How the model writes tool calls (its template's own format, or the documented
        fallback)."""
        ...

    def check_constraint(self, spec: ConstraintSpec) -> None:
        """Compile SPEC against the model's tokenizer; raises ConstraintError naming what is
        unsupported."""
        ...

    def encode_text(self, text: str) -> list[int]: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token of the model's vocabulary stands for (for log-probs)."""
        ...

    async def open_session(self, seed: int) -> Session: ...

    async def close_session(self, session: Session) -> None: ...

    async def generate(
        self,
        session: Session,
        prompt: list[int],
        params: GenerationParams,
        on_tokens: TokenCallback,
    ) -> Generation: ...

    async def stage_health(self) -> list[StageHealth]:
        """Ask every stage (and the draft) whether it answers; never raises."""
        ...

    def stage_telemetry(self) -> dict[str, dict[str, Any]]:
        """The latest telemetry sample per stage name (tok/s, busy, queue, hop_ms, rss_mb, temp_c
        ...)."""
        ...


class ControllerFleet:
    """`ServedFleet` over a started `fleettui.control.controller.FleetController`."""

    def __init__(self, controller: FleetController) -> None:
        coordinator = controller.coordinator
        if coordinator is None or controller.target is None or controller.deployment is None:
            raise RuntimeError("the fleet controller has not been started")
        if coordinator.chat_format is None:
            raise RuntimeError("this fleet's shards carry no tokenizer")
        self.controller = controller
        self.coordinator = coordinator
        self.chat_format = coordinator.chat_format

    def model_info(self) -> ModelInfo:
        # read each time: a re-plan after a loss may swap the shards
        target = self.controller.target
        if target is None:
            raise RuntimeError("the fleet controller has stopped")
        manifest = target.manifest
        created = _unix_time(manifest.created_at)
        return ModelInfo(
            manifest.model_name, manifest.max_position_embeddings, manifest.num_layers, created
        )

    def defaults(self) -> GenerationParams:
        """The fleet file's sampling, else the model's recommended (greedy under exact settings)."""
        from fleettui.control.settings import generation_params

        return generation_params(self.controller.fleet)

    def encode_chat(self, messages: list[ChatMessage], tools: Sequence[Tool] = ()) -> list[int]:
        if tools or any(m.tool_calls or m.role == "tool" for m in messages):
            return self.chat_format.encode(
                render_with_tools(self.chat_format, messages, tools, self.tool_format())
            )
        return self.chat_format.encode_chat(messages)

    @functools.cache  # noqa: B019 - one fleet, one template: detected once per server
    def tool_format(self) -> ToolFormat:
        return detect_format(self.chat_format)

    @functools.lru_cache(maxsize=64)  # noqa: B019 - clients resend the same schema: compiled once (errors are not kept)
    def check_constraint(self, spec: ConstraintSpec) -> None:
        check_constraint(spec, self.chat_format)

    def encode_text(self, text: str) -> list[int]:
        return self.chat_format.encode_text(text)

    def token_bytes(self, token_id: int) -> bytes:
        return self.chat_format.token_bytes(token_id)

    async def open_session(self, seed: int) -> Session:
        return await self.coordinator.open_session(seed)

    async def close_session(self, session: Session) -> None:
        await self.coordinator.close_session(session)

    async def generate(
        self,
        session: Session,
        prompt: list[int],
        params: GenerationParams,
        on_tokens: TokenCallback,
    ) -> Generation:
        return await self.coordinator.generate(session, prompt, params, on_tokens)

    async def stage_health(self) -> list[StageHealth]:
        from fleettui.runtime.transport import control_request

        deployment = self.controller.deployment
        if deployment is None:
            raise RuntimeError("the fleet controller has stopped")
        placements = list(deployment.placements)

        async def ping(placement: Placement) -> StageHealth:
            name = placement.config.name
            try:
                reply = await control_request(
                    placement.control_url,
                    {"op": "ping"},
                    deployment.keys,
                    placement.server_key,
                    timeout=2.0,
                )
            except Exception as error:  # a broken socket is an unhealthy stage, not a server error
                return StageHealth(name, False, str(error))
            if reply is None:
                return StageHealth(name, False, "no answer within 2 s")
            state = str(reply.get("state", "?"))
            return StageHealth(name, state == "ready", state)

        return list(await asyncio.gather(*(ping(p) for p in placements)))

    def stage_telemetry(self) -> dict[str, dict[str, Any]]:
        return {name: sample.to_dict() for name, sample in self.controller.telemetry().items()}


def _unix_time(stamp: str) -> int:
    from datetime import datetime

    try:
        return int(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp())
    except (ValueError, AttributeError):
        return int(time.time())
