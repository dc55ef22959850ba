"""Provides the structured-output fields of a request: `response_format`, `tools`, `tool_choice`,
`parallel_tool_calls`, and the tool calls and results of a conversation; and the constraint they ask
for."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleettui.runtime.chat_format import ChatMessage
from fleettui.runtime.constraint import (
    ConstraintError,
    ConstraintSpec,
    InvalidSchema,
    check_json_schema,
    json_object_grammar,
    json_schema_grammar,
)
from fleettui.runtime.tools import Tool, ToolCall, ToolFormat, call_grammar
from fleettui.serve.request_error import RequestError

if TYPE_CHECKING:
    from fleettui.serve.fleet import ServedFleet

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function and schema names
FORMATS = ("text", "json_object", "json_schema")
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Structure:
    """What shape the answer must have: free text, JSON (any object or a schema's), or tool
    calls."""

    response_format: str = "text"  # text | json_object | json_schema
    schema: Mapping[str, Any] | None = None
    schema_name: str = ""
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "auto"  # none | auto | required | function (the one named in `function`)
    function: str = ""
    parallel: bool = True

    @property
    def calls_tools(self) -> bool:
        """Whether the reply may hold tool calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def calls_only(self) -> bool:
        """Whether the reply is calls from its first token (tool_choice required or a named
        function)."""
        return self.calls_tools and self.tool_choice in ("required", "function")

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the grammar may call: all, or the named one."""
        if self.tool_choice == "function":
            return tuple(tool for tool in self.tools if tool.name == self.function)
        return self.tools

    def constraint(self, tool_format: ToolFormat) -> ConstraintSpec | None:
        """The grammar the reply must follow (None: free text)."""
        if self.response_format == "json_object":
            return ConstraintSpec(json_object_grammar(), "json_object")
        if self.response_format == "json_schema":
            assert self.schema is not None
            return ConstraintSpec(
                json_schema_grammar(self.schema), f"json_schema {self.schema_name}"
            )
        if not self.calls_tools:
            return None
        if self.tool_choice == "auto":
            grammar = call_grammar(self.tools, tool_format, self.parallel, after_trigger=True)
            return ConstraintSpec(grammar, "tools auto", trigger=tool_format.trigger)
        if self.tool_choice == "function":
            return ConstraintSpec(
                call_grammar(self.offered, tool_format, False), f"tool {self.function}"
            )
        return ConstraintSpec(
            call_grammar(self.tools, tool_format, self.parallel), "tools required"
        )


def _check_schema(schema: Any, param: str) -> Mapping[str, Any]:
    """A JSON schema that is one by the JSON Schema meta-schema (its draft, else 2020-12)."""
    if not isinstance(schema, dict):
        raise RequestError(f"'{param}' must be a JSON schema (an object)", param)
    try:
        check_json_schema(schema)
    except InvalidSchema as error:
        raise RequestError(
            f"'{param}' is not a valid JSON schema: {error.message}"
            + (f" (at {error.where})" if error.where else ""),
            param,
        ) from None
    try:
        json_schema_grammar(schema)
    except ConstraintError as error:
        raise RequestError(f"'{param}': {error}", param) from None
    return schema


def _response_format(body: dict[str, Any]) -> tuple[str, Mapping[str, Any] | None, str]:
    value = body.get("response_format")
    if value is None or value == "text":
        return "text", None, ""
    if not isinstance(value, dict) or value.get("type") not in FORMATS:
        raise RequestError(
            '\'response_format\' must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
            "response_format",
        )
    kind = value["type"]
    if kind != "json_schema":
        return kind, None, ""
    spec = value.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise RequestError(f"'{param}' must be an object with 'name' and 'schema'", param)
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise RequestError(
            f"'{param}.name' must be 1-64 letters, digits, '_' or '-'", f"{param}.name"
        )
    for key, kinds, what in (("strict", (bool,), "a boolean"), ("description", (str,), "a string")):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise RequestError(f"'{param}.{key}' must be {what}", f"{param}.{key}")
    if spec.get("schema") is None:  # OpenAI's schema is optional: any JSON object then
        return "json_object", None, name
    return kind, _check_schema(spec["schema"], f"{param}.schema"), name


def _tools(body: dict[str, Any]) -> tuple[Tool, ...]:
    value = body.get("tools")
    if value is None:
        return ()
    if not isinstance(value, list):
        raise RequestError("'tools' must be a list", "tools")
    tools: list[Tool] = []
    for index, item in enumerate(value):
        param = f"tools[{index}]"
        if (
            not isinstance(item, dict)
            or item.get("type") != "function"
            or not isinstance(item.get("function"), dict)
        ):
            raise RequestError(
                f'\'{param}\' must be {{"type": "function", "function": {{...}}}}', param
            )
        function = item["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise RequestError(
                f"'{param}.function.name' must be 1-64 letters, digits, '_' or '-'",
                f"{param}.function.name",
            )
        if any(tool.name == name for tool in tools):
            raise RequestError(
                f"'{param}.function.name': a second tool named {name!r}", f"{param}.function.name"
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise RequestError(
                f"'{param}.function.description' must be a string", f"{param}.function.description"
            )
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise RequestError(
                f"'{param}.function.strict' must be a boolean", f"{param}.function.strict"
            )
        parameters = function.get("parameters")
        if parameters is None:  # OpenAI: a function without parameters takes an empty object
            parameters = {"type": "object", "properties": {}}
        parameters = _check_schema(parameters, f"{param}.function.parameters")
        if parameters.get("type", "object") != "object":
            raise RequestError(
                f"'{param}.function.parameters' must describe an object (its 'type' is \"object\")",
                f"{param}.function.parameters",
            )
        tools.append(Tool(name, description or "", parameters))
    return tuple(tools)


def _tool_choice(body: dict[str, Any], tools: tuple[Tool, ...]) -> tuple[str, str]:
    value = body.get("tool_choice")
    if value is None:
        return ("auto" if tools else "none"), ""
    if isinstance(value, str):
        if value not in CHOICES:
            raise RequestError(
                f"'tool_choice' must be one of {', '.join(CHOICES)} or a named function",
                "tool_choice",
            )
        if value == "required" and not tools:
            raise RequestError("'tool_choice' 'required' needs 'tools'", "tool_choice")
        return value, ""
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise RequestError(
            '\'tool_choice\' must be none, auto, required or {"type": "function", "function": '
            '{"name": ...}}',
            "tool_choice",
        )
    if not any(tool.name == name for tool in tools):
        raise RequestError(
            f"'tool_choice' names the function {name!r}, which is not in 'tools'", "tool_choice"
        )
    return "function", name


def parse_structure(body: dict[str, Any], chat: bool) -> Structure:
    """The request's structured-output fields, validated; raises RequestError naming the bad
    field."""
    if body.get("functions") and body.get("function_call") != "none":
        raise RequestError(
            "'functions' (deprecated by OpenAI) is not supported: send 'tools'", "functions"
        )
    if body.get("functions") is not None and not isinstance(body["functions"], list):
        raise RequestError("'functions' must be a list", "functions")
    kind, schema, name = _response_format(body)
    if not chat:
        if body.get("tools"):
            raise RequestError("'tools' is served on /v1/chat/completions", "tools")
        if body.get("stop") and kind != "text":
            raise RequestError(
                "'stop' would cut a constrained answer: leave it out with this response", "stop"
            )
        return Structure(kind, schema, name)
    tools = _tools(body)
    choice, function = _tool_choice(body, tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    structure = Structure(
        kind, schema, name, tools, choice, function, True if parallel is None else parallel
    )
    if structure.calls_tools and kind != "text":
        raise RequestError(
            "'response_format' JSON and tool calls exclude each other: send 'tool_choice': 'none' "
            "or no "
            "'response_format'",
            "response_format",
        )
    if body.get("stop") and (kind != "text" or structure.calls_only):
        raise RequestError(
            "'stop' would cut a constrained answer: leave it out with this response", "stop"
        )
    return structure


def tool_calls(value: Any, param: str) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls`, with arguments that are a JSON object's text."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise RequestError(f"'{param}' must be a list", param)
    calls = []
    for index, item in enumerate(value):
        where = f"{param}[{index}]"
        function = item.get("function") if isinstance(item, dict) else None
        if (
            not isinstance(function, dict)
            or item.get("type", "function") != "function"
            or not isinstance(item.get("id"), str)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise RequestError(
                f'\'{where}\' must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                '"arguments": "<JSON text>"}}',
                where,
            )
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise RequestError(
                f"'{where}.function.arguments' must be the JSON text of an object",
                f"{where}.function.arguments",
            )
        calls.append(ToolCall(item["id"], function["name"], function["arguments"]))
    return tuple(calls)


def uses_tools(messages: tuple[ChatMessage, ...], structure: Structure) -> bool:
    """Whether the prompt needs the tool format: tools offered, or calls and results in the
    conversation."""
    return bool(structure.tools) or any(m.tool_calls or m.role == "tool" for m in messages)


async def checked_constraint(structure: Structure, fleet: ServedFleet) -> ConstraintSpec | None:
    """The grammar the request asks for, compiled against the model's tokenizer (off the event loop:
    a big schema takes a while); a schema keyword the grammar library does not support is a 400
    naming it."""
    spec = structure.constraint(fleet.tool_format())
    if spec is None:
        return None
    try:
        await asyncio.to_thread(fleet.check_constraint, spec)
        return spec
    except ConstraintError as error:
        failure = error
    if structure.response_format == "json_schema":
        param = "response_format.json_schema.schema"
    elif structure.calls_tools:  # name the tool whose parameters fail
        param = "tools"
        for index, tool in enumerate(structure.tools):
            single = ConstraintSpec(json_schema_grammar(tool.parameters), tool.name)
            try:
                await asyncio.to_thread(fleet.check_constraint, single)
            except ConstraintError as error:
                param, failure = f"tools[{index}].function.parameters", error
                break
    else:
        param = "response_format"
    raise RequestError(f"'{param}': {failure}", param)
