"""Provides tool calling: the tool-call format a chat template speaks, tools and calls in the
prompt, and the grammar of a call.

A template that renders `tools`, assistant `tool_calls` and `tool` results itself
(Qwen2.5/Qwen3/Hermes `<tool_call>` tags, Llama 3.x bare JSON) is used as it is: the model sees its
own format. Any other template gets the fallback: the tools described in a system message and calls
written as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, results given back as a
user message in `<tool_response>` tags. Either way the call's JSON is fixed by the grammar, so
`tool_calls.ToolCallParser` reads it back exactly."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleettui.runtime.chat_format import (
    ChatFormat,
    ChatMessage,
    ChatTemplateError,
    ToolCall,
    render_template,
)

__all__ = [
    "FALLBACK",
    "HERMES",
    "LLAMA3_JSON",
    "Tool",
    "ToolCall",
    "ToolFormat",
    "call_grammar",
    "detect_format",
    "render_with_tools",
]


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request has it (what chat templates take as `tools`)."""
        function: dict[str, Any] = {"name": self.name, "parameters": dict(self.parameters)}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolFormat:
    """How calls are written in a reply: `opening` + `{"name": "...", "<arguments_key>": {...}}` +
    `closing`, `separator` between parallel calls; `trigger` is what starts a call in free text (for
    tool_choice auto)."""

    name: str  # hermes | llama3-json | fallback
    native: bool  # the template renders tools, calls and results itself
    opening: str
    closing: str
    separator: str
    arguments_key: str
    trigger: str
    parallel: bool  # the format can hold several calls in one reply

    def call_text(self, name: str, arguments: Any, compact: bool = True) -> str:
        """One call as this format writes it: COMPACT arguments are what the grammar lets the model
        write, spaced ones what a template's `tojson` writes."""
        text = json.dumps(arguments, separators=(",", ":") if compact else None)
        body = f'{{"name": {json.dumps(name)}, "{self.arguments_key}": {text}}}'
        return self.opening + body + self.closing


HERMES = ToolFormat(
    "hermes", True, "<tool_call>\n", "\n</tool_call>", "\n", "arguments", "<tool_call>", True
)
LLAMA3_JSON = ToolFormat("llama3-json", True, "", "", "", "parameters", '{"name": ', False)
FALLBACK = ToolFormat(
    "fallback", False, "<tool_call>\n", "\n</tool_call>", "\n", "arguments", "<tool_call>", True
)

# What detection renders: a tool, a call of it and its result, each with a marker no template writes
# itself.
PROBE_TOOL = Tool(
    "probe_tool_7f3a",
    "probe",
    {"type": "object", "properties": {"probe_arg_7f3a": {"type": "string"}}},
)
PROBE_ARGUMENTS = {"probe_arg_7f3a": "v"}
PROBE_CALL: dict[str, Any] = {
    "id": "call7f3a9",
    "type": "function",
    "function": {"name": PROBE_TOOL.name, "arguments": PROBE_ARGUMENTS},
}
PROBE_RESULT = "probe_result_7f3a"


def detect_format(chat_format: ChatFormat) -> ToolFormat:
    """The template's own format if it renders tools, calls and results in one this module reads;
    else FALLBACK."""
    if chat_format.template is None:
        return FALLBACK
    conversation: list[dict[str, Any]] = [
        {"role": "user", "content": "probe question"},
        {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]},
        {
            "role": "tool",
            "content": PROBE_RESULT,
            "tool_call_id": PROBE_CALL["id"],
            "name": PROBE_TOOL.name,
        },
    ]
    try:
        text = render_template(
            chat_format.template,
            conversation,
            True,
            tools=[PROBE_TOOL.as_openai()],
            bos_token=chat_format.bos_token,
            eos_token=chat_format.eos_token,
        )
    except (ChatTemplateError, TypeError, ValueError):  # a template that refuses tool messages
        return FALLBACK
    described = text.count(PROBE_TOOL.name) >= 2  # once in the tool list, once in the call
    if not (described and "probe_arg_7f3a" in text and PROBE_RESULT in text):
        return FALLBACK
    for known in (
        HERMES,
        LLAMA3_JSON,
    ):  # the template writes the call exactly as the grammar lets the model
        if known.call_text(PROBE_TOOL.name, PROBE_ARGUMENTS, compact=False) in text:
            return known
    return FALLBACK


FALLBACK_INSTRUCTIONS = (
    "You can call functions. The functions are listed below as JSON within <tools></tools> tags.\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with a JSON object holding its name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <arguments-json-object>}}\n</tool_call>\n'
    "The results come back within <tool_response></tool_response> tags."
)


def fallback_messages(messages: Sequence[ChatMessage], tools: Sequence[Tool]) -> list[ChatMessage]:
    """The conversation for a template without tool support: tools in the system message, calls as
    tagged JSON in the assistant's text, results (consecutive ones together) as a user message."""
    rendered: list[ChatMessage] = []
    if tools:
        listing = "\n".join(json.dumps(tool.as_openai()) for tool in tools)
        instructions = FALLBACK_INSTRUCTIONS.format(tools=listing)
        if messages and messages[0].role == "system":
            rendered.append(ChatMessage("system", f"{messages[0].content}\n\n{instructions}"))
            messages = messages[1:]
        else:
            rendered.append(ChatMessage("system", instructions))
    for message in messages:
        if message.role == "tool":
            response = f"<tool_response>\n{message.content}\n</tool_response>"
            if (
                rendered
                and rendered[-1].role == "user"
                and rendered[-1].content.startswith("<tool_response>")
            ):
                rendered[-1] = ChatMessage("user", f"{rendered[-1].content}\n{response}")
            else:
                rendered.append(ChatMessage("user", response))
        elif message.tool_calls:
            calls = FALLBACK.separator.join(
                FALLBACK.call_text(call.name, json.loads(call.arguments))
                for call in message.tool_calls
            )
            text = f"{message.content}\n{calls}" if message.content else calls
            rendered.append(ChatMessage("assistant", text))
        else:
            rendered.append(ChatMessage(message.role, message.content))
    return rendered


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as transformers' templates take them: calls with their arguments as objects, results
    with the id and name of their call."""
    names = {call.id: call.name for message in messages for call in message.tool_calls}
    shaped: list[dict[str, Any]] = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.loads(c.arguments)},
                }
                for c in message.tool_calls
            ]
        if message.role == "tool":
            item["tool_call_id"] = message.tool_call_id
            if message.tool_call_id in names:
                item["name"] = names[message.tool_call_id]
        shaped.append(item)
    return shaped


def render_with_tools(
    chat_format: ChatFormat,
    messages: Sequence[ChatMessage],
    tools: Sequence[Tool],
    tool_format: ToolFormat,
) -> str:
    """The prompt of a conversation that offers TOOLS or holds calls and results, in TOOL_FORMAT."""
    if not tool_format.native:
        return chat_format.render(fallback_messages(messages, tools))
    if chat_format.template is None:
        raise ChatTemplateError(f"{chat_format.model_name} has no chat template")
    options: dict[str, Any] = {"tools": [tool.as_openai() for tool in tools]} if tools else {}
    return render_template(
        chat_format.template,
        template_messages(messages),
        True,
        bos_token=chat_format.bos_token,
        eos_token=chat_format.eos_token,
        **options,
    )


def compact(schema: Mapping[str, Any]) -> dict[str, Any]:
    """SCHEMA with llguidance told to write compact JSON (as `constraint.json_schema_grammar` does:
    the fewest tokens, and no run of blank lines a small model can fall into) unless it says
    otherwise itself."""
    return (
        {**schema}
        if "x-guidance" in schema
        else {**schema, "x-guidance": {"whitespace_flexible": False}}
    )


def _literal(text: str) -> str:
    """TEXT as a Lark string literal."""
    return json.dumps(text)


def call_grammar(
    tools: Sequence[Tool], tool_format: ToolFormat, parallel: bool, after_trigger: bool = False
) -> str:
    """The llguidance Lark grammar of a reply made of calls to TOOLS (one, or several when PARALLEL
    and the format allows it). AFTER_TRIGGER: the grammar of what follows the format's trigger
    (tool_choice auto: the model wrote the trigger in free text, the grammar takes over from
    there)."""
    if not tools:
        raise ValueError("a call grammar needs at least one tool")
    call = tool_format.opening + '{"name": '  # every call starts so, then the name picks the tool
    if after_trigger and not call.startswith(tool_format.trigger):
        raise ValueError(f"the {tool_format.name} format's trigger does not open its calls")
    first = call[len(tool_format.trigger) :] if after_trigger else call
    if parallel and tool_format.parallel:
        lines = [
            f"start: {_literal(first)} named ({_literal(tool_format.separator + call)} named)*"
        ]
    else:
        lines = [f"start: {_literal(first)} named"]
    lines.append("named: " + " | ".join(f"tool_{index}" for index in range(len(tools))))
    key, end = f', "{tool_format.arguments_key}": ', "}" + tool_format.closing
    for index, tool in enumerate(tools):
        lines.append(
            f"tool_{index}: {_literal(json.dumps(tool.name) + key)} arguments_{index} "
            f"{_literal(end)}"
        )
        lines.append(
            f"arguments_{index}: %json{json.dumps(compact(tool.parameters), sort_keys=True)}"
        )
    return "\n".join(lines) + "\n"
