"""Provides what a choice's generated text becomes in the API: its content, its tool calls, its
finish reason, whole (`final_reply`) or as stream deltas (`StreamedReply`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleettui.runtime.generation import GenerationStats
from fleettui.runtime.tool_calls import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    Event,
    ToolCallParser,
)
from fleettui.runtime.tools import ToolCall, ToolFormat
from fleettui.serve.responses import finish_reason
from fleettui.serve.structured import Structure


@dataclass(frozen=True)
class Reply:
    content: str | None  # None: a reply of tool calls only
    tool_calls: tuple[ToolCall, ...]
    finish: str  # stop | length | tool_calls


def finish_of(stats: GenerationStats, calls: bool) -> str:
    """OpenAI's finish reason. A constrained answer whose grammar did not complete is "length" (cut:
    the client must not take it as valid), whatever stopped it; complete calls that ended the reply:
    "tool_calls"."""
    if stats.constraint_complete is False:
        return "length"
    if calls and stats.finish_reason in ("eos", "stop"):
        return "tool_calls"
    return finish_reason(stats)


def final_reply(
    text: str, stats: GenerationStats, structure: Structure, tool_format: ToolFormat
) -> Reply:
    """A whole reply: its text, or its calls and the text before them."""
    if not structure.calls_tools:
        return Reply(text, (), finish_of(stats, False))
    parser = ToolCallParser(tool_format, calls_only=structure.calls_only)
    parser.push(text)
    parser.finish()
    calls = tuple(parser.calls)
    content = parser.content.strip() if calls or parser.started else parser.content
    return Reply(content or None if calls else content, calls, finish_of(stats, bool(calls)))


def event_delta(event: Event) -> dict[str, Any]:
    """One parser event as a chat stream chunk's `delta` (OpenAI's tool-call deltas)."""
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, CallStart):
        function = {"name": event.name, "arguments": ""}
        return {
            "tool_calls": [
                {"index": event.index, "id": event.id, "type": "function", "function": function}
            ]
        }
    assert isinstance(event, ArgumentsDelta)
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


class StreamedReply:
    """One streamed choice: text deltas in, chunk deltas out. ON_CALL hears each call's function
    name."""

    def __init__(
        self, structure: Structure, tool_format: ToolFormat, on_call: Callable[[str], None]
    ) -> None:
        self.parser = (
            ToolCallParser(tool_format, calls_only=structure.calls_only)
            if structure.calls_tools
            else None
        )
        self.on_call = on_call

    def push(self, text: str) -> list[dict[str, Any]]:
        if self.parser is None:
            return [{"content": text}] if text else []
        return self._deltas(self.parser.push(text))

    def _deltas(self, events: list[Event]) -> list[dict[str, Any]]:
        for event in events:
            if isinstance(event, CallStart):
                self.on_call(event.name)
        return [
            event_delta(event)
            for event in events
            if not isinstance(event, ContentDelta) or event.text
        ]

    def finish(self, stats: GenerationStats) -> tuple[list[dict[str, Any]], str]:
        """The deltas held back to the end, and the finish reason."""
        if self.parser is None:
            return [], finish_of(stats, False)
        deltas = self._deltas(self.parser.finish())
        return deltas, finish_of(stats, bool(self.parser.calls))
