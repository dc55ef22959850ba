"""Provides `ToolCallParser`: a reply's text read incrementally into free text and OpenAI tool
calls.

Fed the text deltas of a reply, it returns what to send: content deltas, the start of a call (its id
and function name) and fragments of its arguments, as OpenAI's stream has them. Text that may be the
start of a call's opening is held back until it is known not to be one."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from fleettui.runtime.tools import ToolCall, ToolFormat

HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # the call's place among this reply's calls
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


Event = ContentDelta | CallStart | ArgumentsDelta


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class ToolCallParser:
    """Reads one reply in TOOL_FORMAT. `calls_only`: the grammar starts at the first token
    (tool_choice required or named), so the whole reply is calls; else calls begin at the format's
    trigger."""

    tool_format: ToolFormat
    calls_only: bool = False
    _buffer: str = ""  # text received and not yet taken apart
    _state: str = "text"  # text | head | arguments | tail
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _closing: str = ""
    _calls: list[_Call] = field(default_factory=list)
    content: str = ""

    def __post_init__(self) -> None:
        if self.calls_only:
            self._state = "opening"

    @property
    def calls(self) -> list[ToolCall]:
        """The calls whose arguments are complete (a reply cut by max_tokens may end inside one)."""
        return [ToolCall(c.id, c.name, c.arguments) for c in self._calls if c.complete]

    @property
    def started(self) -> bool:
        return bool(self._calls)

    def push(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            before = (self._state, len(self._buffer))
            events += getattr(self, f"_{self._state}")()
            if (self._state, len(self._buffer)) == before:
                return events

    def finish(self) -> list[Event]:
        """The reply ended: text held back for a possible opening is content after all."""
        if self._state == "text" and self._buffer:
            held, self._buffer = self._buffer, ""
            self.content += held
            return [ContentDelta(held)]
        return []

    # -- states: each takes what it can from the buffer
    # --------------------------------------------------
    def _text(self) -> list[Event]:
        trigger = self.tool_format.trigger
        found = self._buffer.find(trigger)
        if found >= 0:
            shown = self._buffer[:found]
            self._buffer = self._buffer[found:]
            self._state = "opening"
        else:
            hold = next(
                (
                    size
                    for size in range(min(len(trigger) - 1, len(self._buffer)), 0, -1)
                    if self._buffer.endswith(trigger[:size])
                ),
                0,
            )
            shown = self._buffer[
                : len(self._buffer) - hold
            ].rstrip()  # a blank may precede a call: held too
            self._buffer = self._buffer[len(shown) :]
        if not shown:
            return []
        if found >= 0:  # the blank between text and a call is not content
            shown = shown.rstrip()
        self.content += shown
        return [ContentDelta(shown)] if shown else []

    def _opening(self) -> list[Event]:
        opening = self.tool_format.opening.strip()
        stripped = self._buffer.lstrip()
        if len(stripped) < len(opening):
            return []
        if not stripped.startswith(
            opening
        ):  # not a call after all: it is text (never with a grammar on)
            self._state = "text"
            self.content += self._buffer[:1]
            shown, self._buffer = self._buffer[:1], self._buffer[1:]
            return [ContentDelta(shown)]
        self._buffer = stripped[len(opening) :]
        self._state = "head"
        return []

    def _head(self) -> list[Event]:
        match = HEAD.match(self._buffer)
        if match is None:
            return []
        name = json.loads(f'"{match.group(1)}"')
        self._buffer = self._buffer[match.end() :]
        self._calls.append(_Call(new_call_id(), name))
        self._state, self._depth, self._in_string, self._escaped = "arguments", 0, False, False
        return [CallStart(len(self._calls) - 1, self._calls[-1].id, name)]

    def _arguments(self) -> list[Event]:
        """Arguments go out as they come; the object ends where its braces balance (strings
        skipped)."""
        taken = 0
        for index, char in enumerate(self._buffer):
            taken = index + 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    break
        else:
            if not self._buffer:
                return []
        piece, self._buffer = self._buffer[:taken], self._buffer[taken:]
        call = self._calls[-1]
        if not call.arguments:
            piece = piece.lstrip()
            if not piece:
                return []
        call.arguments += piece
        if self._depth == 0 and piece.strip():
            call.complete = True
            self._state, self._closing = "tail", "}" + self.tool_format.closing
        return [ArgumentsDelta(len(self._calls) - 1, piece)]

    def _tail(self) -> list[Event]:
        """The call's closing brace and tag, then either the next call or more text."""
        expected = self._closing.strip()
        stripped = self._buffer.lstrip()
        matched = 0
        while (
            matched < len(expected)
            and matched < len(stripped)
            and stripped[matched] == expected[matched]
        ):
            matched += 1
        if matched < len(expected) and matched == len(stripped):
            return []  # the closing is still coming
        self._buffer = stripped[matched:]
        self._state = "opening" if self.calls_only else "text"
        if self.calls_only and not self._buffer.strip():
            self._buffer = ""
        return []
