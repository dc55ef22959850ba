"""Unit tests of tool calling and structured output on the server side: the format a template
speaks, tools and calls in the prompt, the call grammar (compiled and run by the real llguidance on
a byte-level tokenizer), the incremental call parser, request validation and the finish reasons."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleettui.runtime.chat_format import ChatFormat, ChatMessage, compile_template
from fleettui.runtime.constraint import ConstraintError, ConstraintSpec, check_constraint
from fleettui.runtime.generation import GenerationParams, GenerationStats
from fleettui.runtime.tool_calls import ArgumentsDelta, CallStart, ContentDelta, ToolCallParser
from fleettui.runtime.tools import (
    FALLBACK,
    HERMES,
    LLAMA3_JSON,
    Tool,
    ToolCall,
    call_grammar,
    detect_format,
    render_with_tools,
)
from fleettui.serve.replies import StreamedReply, final_reply, finish_of
from fleettui.serve.responses import Envelope
from fleettui.serve.schema import RequestError, parse_request
from fleettui.serve.structured import Structure
from tests.support.chat_templates import LLAMA_3_1, MISTRAL_0_3, QWEN_2_5
from tests.support.tiny_models import write_tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
# SmolLM2-135M-Instruct's own template (plain ChatML: no tools)
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city"],
        "additionalProperties": False,
    },
)
ADD = Tool(
    "add", "", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
)


def chat_format(template: str) -> ChatFormat:
    """A ChatFormat around TEMPLATE only (no tokenizer needed to render)."""
    shaped = object.__new__(ChatFormat)
    shaped.template = compile_template(template)
    shaped.model_name, shaped.bos_token, shaped.eos_token = "test", "<s>", "</s>"
    return shaped


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real byte-level BPE tokenizer (the conformance models'), as llguidance takes it."""
    import llguidance
    from tokenizers import Tokenizer

    folder: Path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(folder)
    text = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return text, llguidance.LLTokenizer(text.to_str(), eos_token=257)


def matches(grammar: str, text: str, tokenizer: Any) -> bool:
    """Whether the grammar takes exactly TEXT (every token allowed, and complete at its end)."""
    import llguidance

    plain, wrapped = tokenizer
    matcher = llguidance.LLMatcher(wrapped, grammar, log_level=0)
    ids = plain.encode(text, add_special_tokens=False).ids
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_the_format_is_the_templates_own_where_it_renders_tools_calls_and_results() -> None:
    assert detect_format(chat_format(QWEN_2_5)) is HERMES
    assert detect_format(chat_format(LLAMA_3_1)) is LLAMA3_JSON
    assert detect_format(chat_format(SMOLLM2)) is FALLBACK  # ignores tools
    # [TOOL_CALLS] is a special token: not read
    assert detect_format(chat_format(MISTRAL_0_3)) is FALLBACK
    shipped = {
        name: chat_format((TEMPLATES / f"{name}.jinja").read_text())
        for name in ("qwen3", "gemma3", "phi3")
    }
    assert detect_format(shipped["qwen3"]) is HERMES
    for name in ("gemma3", "phi3"):  # no tool support: the fallback, which their role rules accept
        assert detect_format(shipped[name]) is FALLBACK
        text = render_with_tools(shipped[name], CONVERSATION, [WEATHER], FALLBACK)
        assert (
            text.count('<tool_call>\n{"name": "get_weather"') == 2
            and "<tool_response>\nrain" in text
        )


CONVERSATION = (
    ChatMessage("system", "Be brief."),
    ChatMessage("user", "Weather in Paris and Rome?"),
    ChatMessage(
        "assistant",
        "",
        (
            ToolCall("call_1", "get_weather", '{"city": "Paris"}'),
            ToolCall("call_2", "get_weather", '{"city": "Rome"}'),
        ),
    ),
    ChatMessage("tool", "sunny", tool_call_id="call_1"),
    ChatMessage("tool", "rain", tool_call_id="call_2"),
)


def test_the_fallback_puts_tools_in_the_system_message_and_calls_and_results_in_tags() -> None:
    text = render_with_tools(chat_format(SMOLLM2), CONVERSATION, [WEATHER], FALLBACK)
    system = text.split("<|im_end|>")[0]
    assert (
        system.startswith("<|im_start|>system\nBe brief.")
        and json.dumps(WEATHER.as_openai()) in system
    )
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city":"Paris"}}\n</tool_call>\n<tool_call>' in text  # as generated
    )
    # both results in one user turn, in order, then the assistant's turn
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        in text
    )
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>tool" not in text


def test_a_native_template_gets_tools_calls_and_results_its_own_way() -> None:
    text = render_with_tools(chat_format(QWEN_2_5), CONVERSATION, [WEATHER], HERMES)
    assert "<tools>\n" + json.dumps(WEATHER.as_openai()) in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    )
    assert "<tool_response>\nrain\n</tool_response>" in text
    llama = render_with_tools(chat_format(LLAMA_3_1), CONVERSATION[:2], [WEATHER], LLAMA3_JSON)
    assert '"name": "get_weather"' in llama and "Environment: ipython" in llama


@pytest.mark.parametrize("tool_format", [HERMES, FALLBACK, LLAMA3_JSON])
def test_the_call_grammar_takes_exactly_the_calls_of_the_offered_tools(
    tool_format: Any, tokenizer: Any
) -> None:
    tools = [WEATHER, ADD]
    one = tool_format.call_text("get_weather", {"city": "Paris", "days": 2})
    two = one + tool_format.separator + tool_format.call_text("add", {"a": 3})
    single = call_grammar(tools, tool_format, parallel=False)
    check_constraint(ConstraintSpec(single, "tools required"), tokenizer[1])
    assert matches(single, one, tokenizer)
    assert not matches(single, tool_format.call_text("nope", {"city": "Paris"}), tokenizer)
    assert not matches(
        single, tool_format.call_text("get_weather", {"city": "Paris", "x": 1}), tokenizer
    )
    # required
    assert not matches(single, tool_format.call_text("get_weather", {"days": 2}), tokenizer)
    parallel = call_grammar(tools, tool_format, parallel=True)
    assert matches(parallel, two, tokenizer) == tool_format.parallel
    after = call_grammar(tools, tool_format, parallel=True, after_trigger=True)
    assert tool_format.call_text("add", {"a": 1}).startswith(tool_format.trigger)
    assert matches(
        after, tool_format.call_text("add", {"a": 1})[len(tool_format.trigger) :], tokenizer
    )


def test_an_unsupported_schema_keyword_is_a_constraint_error(tokenizer: Any) -> None:
    odd = Tool(
        "odd",
        "",
        {
            "type": "object",
            "properties": {"x": {"type": "string", "format": "hostname-ish"}},
            "dependentSchemas": {"x": {"required": ["y"]}},
        },
    )
    with pytest.raises(ConstraintError, match="dependentSchemas"):
        check_constraint(
            ConstraintSpec(call_grammar([odd], HERMES, False), "tools required"), tokenizer[1]
        )


def feed(parser: ToolCallParser, text: str, step: int) -> list[Any]:
    events = []
    for start in range(0, len(text), step):
        events += parser.push(text[start : start + step])
    return events + parser.finish()


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_the_parser_streams_text_then_calls_in_openai_deltas(step: int) -> None:
    arguments = {"city": 'Pa"ris {}', "days": [1, {"n": "]"}]}
    text = (
        "Let me look.\n"
        + HERMES.call_text("get_weather", arguments)
        + "\n"
        + HERMES.call_text("add", {"a": 3})
    )
    parser = ToolCallParser(HERMES)
    events = feed(parser, text, step)
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Let me look."
    starts = [e for e in events if isinstance(e, CallStart)]
    assert [(s.index, s.name) for s in starts] == [(0, "get_weather"), (1, "add")]
    assert all(s.id.startswith("call_") for s in starts) and starts[0].id != starts[1].id
    pieces = [
        "".join(e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == i)
        for i in (0, 1)
    ]
    assert [json.loads(p) for p in pieces] == [arguments, {"a": 3}]
    assert [(c.id, c.name, json.loads(c.arguments)) for c in parser.calls] == [
        (starts[0].id, "get_weather", arguments),
        (starts[1].id, "add", {"a": 3}),
    ]
    # every event comes after the one before it: the start of a call precedes its arguments
    assert events.index(starts[1]) > max(
        i for i, e in enumerate(events) if isinstance(e, ArgumentsDelta) and e.index == 0
    )


def test_the_parser_passes_text_without_calls_and_holds_back_only_a_possible_opening() -> None:
    parser = ToolCallParser(HERMES)
    assert parser.push("a < b and <tool") == [ContentDelta("a < b and")]
    assert parser.push("box>") == [ContentDelta(" <toolbox>")]
    assert parser.finish() == [] and not parser.calls and parser.content == "a < b and <toolbox>"
    llama = ToolCallParser(LLAMA3_JSON, calls_only=True)
    events = feed(llama, LLAMA3_JSON.call_text("add", {"a": 1}), 3)
    assert [c.name for c in llama.calls] == ["add"] and not any(
        isinstance(e, ContentDelta) for e in events
    )


def test_a_call_cut_by_max_tokens_is_not_a_call_and_the_answer_is_length() -> None:
    structure = Structure(tools=(WEATHER,), tool_choice="required")
    cut = HERMES.call_text("get_weather", {"city": "Paris"})[:-20]
    stats = GenerationStats(finish_reason="length", constraint_complete=False)
    reply = final_reply(cut, stats, structure, HERMES)
    assert reply.tool_calls == () and reply.finish == "length"
    done = GenerationStats(finish_reason="stop", constraint_complete=True)
    whole = final_reply(HERMES.call_text("get_weather", {"city": "Paris"}), done, structure, HERMES)
    assert whole.finish == "tool_calls" and whole.content is None
    assert json.loads(whole.tool_calls[0].arguments) == {"city": "Paris"}
    # a grammar left open
    json_cut = GenerationStats(finish_reason="stop", constraint_complete=False)
    assert finish_of(json_cut, False) == "length"
    assert (
        finish_of(GenerationStats(finish_reason="eos", constraint_complete=True), False) == "stop"
    )


def test_streamed_tool_calls_are_openai_chunks() -> None:
    names: list[str] = []
    reply = StreamedReply(Structure(tools=(WEATHER,), tool_choice="auto"), HERMES, names.append)
    text = "Checking.\n" + HERMES.call_text("get_weather", {"city": "Oslo"})
    deltas = [d for start in range(0, len(text), 4) for d in reply.push(text[start : start + 4])]
    held, finish = reply.finish(GenerationStats(finish_reason="eos", constraint_complete=True))
    deltas += held
    envelope = Envelope(True, "m")
    chunks = [envelope.chunk(None, delta=d)["choices"][0]["delta"] for d in deltas]
    calls = [c["tool_calls"][0] for c in chunks if "tool_calls" in c]
    first = calls[0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert all(
        set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:]
    )
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Oslo"}
    assert "".join(c.get("content", "") for c in chunks) == "Checking." and finish == "tool_calls"
    assert names == ["get_weather"]


DEFAULTS = GenerationParams(max_tokens=64)
ASK = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}}


def parse(**fields: Any) -> Any:
    return parse_request({**ASK, **fields}, True, "m", DEFAULTS, 1000)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a b", "schema": {}},
                }
            },
            "response_format.json_schema.name",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "P", "schema": {"type": "wrong"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "P", "schema": [1]},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": 7}}},
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {
                "tools": [TOOL],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_object"}, "stop": "}"}, "stop"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{not json"},
                            }
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages[0].tool_call_id"),
    ],
)
def test_bad_structured_requests_name_their_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse(**fields)
    assert caught.value.param == param and caught.value.status == 400, caught.value.message


def test_structured_requests_map_to_their_constraint() -> None:
    person = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    schema = parse(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "Person", "schema": person, "strict": True},
        }
    ).structure
    spec = schema.constraint(HERMES)
    assert (
        spec is not None
        and spec.label == "json_schema Person"
        and spec.trigger is None
        and "%json" in spec.grammar
    )
    auto = parse(tools=[TOOL]).structure
    assert auto.tool_choice == "auto" and auto.constraint(HERMES).trigger == "<tool_call>"  # type: ignore[union-attr]
    named = parse(
        tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    ).structure
    assert named.calls_only and named.constraint(HERMES).label == "tool get_weather"  # type: ignore[union-attr]
    assert parse(tools=[TOOL], tool_choice="none").structure.constraint(HERMES) is None
    turns = parse(
        messages=[
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "f", "arguments": "{}"},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "42"}]},
        ]
    ).messages
    assert (
        turns[1].tool_calls == (ToolCall("call_1", "f", "{}"),)
        and turns[2].tool_call_id == "call_1"
    )
    assert turns[2].content == "42"
    completion = parse_request(
        {"model": "m", "prompt": "p", "response_format": {"type": "json_object"}},
        False,
        "m",
        DEFAULTS,
        1000,
    )
    assert completion.structure.constraint(FALLBACK).label == "json_object"  # type: ignore[union-attr]


WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": WEATHER.parameters},
}
CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        }
    ],
}
BODIES = [
    {"response_format": {"type": "json_object"}},
    {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "P", "schema": WEATHER.parameters},
        }
    },
    {"tools": [WEATHER_TOOL]},
    {"tools": [WEATHER_TOOL], "tool_choice": "required", "parallel_tool_calls": False},
    {
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },
    {"tools": [WEATHER_TOOL], "tool_choice": "none", "response_format": {"type": "json_object"}},
    {"tools": [WEATHER_TOOL], "stop": "x"},
    {
        "messages": [
            ASK["messages"][0],
            CALLED,
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    },
    # refused
    {"tool_choice": "required"},
    {
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
    },
    {"response_format": {"type": "json_object"}, "stop": "x"},
    {"tools": [WEATHER_TOOL], "tool_choice": "required", "stop": ["x"]},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
    {"messages": [{"role": "tool", "content": "sunny"}]},
    {"messages": [{"role": "user", "content": "x", "tool_calls": CALLED["tool_calls"]}]},
    {"messages": [{"role": "assistant", "content": None}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
]


def plain_json_schema(value: Any) -> Any:
    """An OpenAPI 3.0 schema as JSON Schema: `nullable: true` becomes "or null"."""
    if isinstance(value, list):
        return [plain_json_schema(item) for item in value]
    if not isinstance(value, dict):
        return value
    schema = {key: plain_json_schema(item) for key, item in value.items() if key != "nullable"}
    return {"anyOf": [{"type": "null"}, schema]} if value.get("nullable") else schema


@pytest.mark.parametrize("fields", BODIES)
def test_the_openapi_document_accepts_exactly_what_the_server_accepts(
    fields: dict[str, Any],
) -> None:
    """The fuzz run's rules, checked here without a fleet: the document's request schema and
    `parse_request` agree on each body."""
    import jsonschema

    from fleettui.serve.fleet import ModelInfo
    from fleettui.serve.openapi import chat_request

    document = jsonschema.Draft7Validator(
        plain_json_schema(chat_request(ModelInfo("m", 1000, 2, 0)))
    )
    body = {**ASK, **fields}
    try:
        parse_request(body, True, "m", DEFAULTS, 1000)
        served = True
    except RequestError:
        served = False
    assert document.is_valid(body) == served, [
        error.message for error in document.iter_errors(body)
    ]
