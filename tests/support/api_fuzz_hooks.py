"""Schemathesis hooks of the API fuzz run (SCHEMATHESIS_HOOKS=tests.support.api_fuzz_hooks): a
bounded generation budget and structured-output fields the server can really serve.

Before each call, in every phase:
- a `max_tokens` the document allows is capped to a few tokens, so a request costs little of the
  real fleet; values it forbids (out of range, wrong type) go out as generated;
- a JSON schema the fuzzer made up (a `response_format` schema, a tool's `parameters`) is replaced
  by one of a few small compilable schemas, picked by the made-up one, so a schema-valid request
  gets a grammar that compiles (the document cannot say "a schema llguidance supports"); a field
  that is not an object is left as generated (the server must refuse it);
- what the document cannot express across items is made true: tool names unique, a named
  `tool_choice` naming one of the tools, a call's `arguments` the JSON text of an object."""

from __future__ import annotations

import json
import zlib
from typing import Any

import schemathesis

BUDGET = 4  # new tokens per choice at most
CAPPED = ("max_tokens", "max_completion_tokens")
SCHEMAS = (
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}},
        "required": ["name"],
    },
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
)


def _maximum(case: Any, name: str) -> int:
    """The document's own maximum of field `name` in this operation's JSON body (0 when it has
    none)."""
    try:
        body = case.operation.definition.raw["requestBody"]["content"]["application/json"]["schema"]
        return int(body["properties"][name]["maximum"])
    except (KeyError, TypeError, ValueError):
        return 0


def _compilable(made_up: Any) -> Any:
    """One of SCHEMAS for a made-up schema object (anything else unchanged)."""
    if not isinstance(made_up, dict):
        return made_up
    return SCHEMAS[
        zlib.crc32(json.dumps(made_up, sort_keys=True, default=str).encode()) % len(SCHEMAS)
    ]


def _structured(body: dict[str, Any]) -> None:
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and isinstance(response_format.get("json_schema"), dict):
        spec = response_format["json_schema"]
        if "schema" in spec and spec["schema"] is not None:
            spec["schema"] = _compilable(spec["schema"])
    tools = body.get("tools")
    names: list[str] = []
    if isinstance(tools, list):
        for index, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict):
                continue
            if isinstance(function.get("parameters"), dict):
                function["parameters"] = _compilable(function["parameters"])
            if isinstance(function.get("name"), str):
                if function["name"] in names:
                    function["name"] = f"tool_{index}"  # unique (the pattern allows it)
                names.append(function["name"])
    choice = body.get("tool_choice")
    function = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(function, dict) and isinstance(function.get("name"), str) and names:
        function["name"] = names[0]
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    valid = isinstance(json.loads(function["arguments"]), dict)
                except ValueError:
                    valid = False
                if not valid:
                    function["arguments"] = json.dumps({"value": function["arguments"][:16]})


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: Any) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    if all(body.get(name) is None for name in CAPPED) and "messages" in body or "prompt" in body:
        # the server's default budget would be hundreds of tokens per choice
        body["max_tokens"] = BUDGET
    for name in CAPPED:
        value = body.get(name)
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and BUDGET < value <= _maximum(case, name)
        ):
            body[name] = BUDGET
    _structured(body)
