"""Integration tests of `fleettui serve` with the real parts: the real `openai` client and curl
against a real uvicorn server, on a real 2-stage fleet of the real model (ZeroMQ stage processes,
exact arithmetic).

One fleet serves the whole module (it runs on its own asyncio loop in a thread, as the coordinator
and the HTTP server share one loop in production); servers with different limits are put in front of
it."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleettui.control.deployment import free_port_block
from fleettui.runtime.chat_format import ChatMessage
from fleettui.serve.app import FleetServer
from tests.support.served import KEY, MODEL, Served, module_fleet

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TOKENS = 24
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip, briefly.",
    "Name two planets.",
    "What is 2 + 2?",
    "Give me a synonym for happy.",
    "Say hello in Spanish.",
    "What colour is the sky?",
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
def main_server(served: Served) -> tuple[FleetServer, str]:
    return served.add_server(api_keys=(KEY,), max_sessions=4, max_queued=16, max_idle=8)


@pytest.fixture(scope="module")
def small_server(served: Served) -> tuple[FleetServer, str]:
    """One slot, one queue place, no pooled sessions: every finished session closes on the
    stages."""
    return served.add_server(max_sessions=1, max_queued=1, max_idle=0)


@pytest.fixture(scope="module")
def client(main_server: tuple[FleetServer, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=main_server[1] + "/v1", api_key=KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def references(served: Served) -> dict[str, str]:
    """Sequential direct answers of the coordinator, fresh session each."""
    return {p: served.direct([ChatMessage("user", p)], TOKENS) for p in PROMPTS}


def metric(url: str, name: str, headers: dict[str, str] | None = None) -> float:
    text = httpx.get(url + "/metrics", headers=headers or {}, timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and not sample.labels:
                return sample.value
    raise AssertionError(f"{name} not in /metrics")


def wait_for(condition: Any, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


# -- the openai client
# ------------------------------------------------------------------------------
def test_chat_non_streaming_equals_direct_answer(
    client: openai.OpenAI, references: dict[str, str]
) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=TOKENS,
        temperature=0,
    )
    assert reply.choices[0].message.content == references[PROMPTS[0]]
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens <= TOKENS
    assert reply.usage.prompt_tokens > 10
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_streaming_with_usage(
    client: openai.OpenAI, references: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fleettui.serve import app

    # keep-alives between the chunks: the client skips them
    monkeypatch.setattr(app, "KEEPALIVE_SECONDS", 0.001)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[1]}],
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == references[PROMPTS[1]]
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3  # really streamed
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]  # the haiku is longer than TOKENS
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == TOKENS and not chunks[-1].choices


def test_a_stream_is_kept_alive_while_it_waits(
    main_server: tuple[FleetServer, str],
    references: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a pace shorter than the wait for a token, SSE comments go between the chunks (a proxy
    sees the stream alive through a recovery or a hold), and the chunks still spell the answer (the
    openai client skipping them: `test_chat_streaming_with_usage`)."""
    from fleettui.serve import app

    monkeypatch.setattr(app, "KEEPALIVE_SECONDS", 0.001)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[1]}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", main_server[1] + "/v1/chat/completions", json=body, headers=headers, timeout=600
    ) as raw:
        lines = [line for line in raw.iter_lines() if line]
    assert ": keep-alive" in lines and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert (
        "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        == references[PROMPTS[1]]
    )


def test_logprobs_of_chat_stream_and_legacy_completions(
    client: openai.OpenAI, references: dict[str, str]
) -> None:
    """Greedy with `logprobs`: one entry per reply token, its bytes spell the reply, the emitted
    token is the likeliest alternative with the same log-prob, alternatives in order; a stream
    carries the same entries spread over its chunks; /v1/completions gives the legacy arrays. The
    answer itself is unchanged."""
    messages = [{"role": "user", "content": PROMPTS[1]}]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    text, content = reply.choices[0].message.content, reply.choices[0].logprobs.content
    assert text == references[PROMPTS[1]] and reply.usage.completion_tokens == TOKENS == len(
        content
    )
    assert b"".join(bytes(entry.bytes) for entry in content).decode() == text
    for entry in content:
        alternatives = entry.top_logprobs
        assert len(alternatives) == 3 and alternatives[0].token == entry.token
        assert (
            alternatives[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
            and entry.logprob <= 0.0
        )
        assert [a.logprob for a in alternatives] == sorted(
            (a.logprob for a in alternatives), reverse=True
        )
        assert sum(math.exp(a.logprob) for a in alternatives) <= 1.0 + 1e-5
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0
    )
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == text
    legacy = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, logprobs=2
    )
    choice = legacy.choices[0]
    assert (
        "".join(choice.logprobs.tokens) == choice.text and len(choice.logprobs.token_logprobs) == 8
    )
    assert (
        choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)
        and choice.logprobs.text_offset[0] == 0
    )
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)


def test_n_choices_generate_at_once_greedy_equal_and_sampled_apart(
    client: openai.OpenAI, references: dict[str, str]
) -> None:
    """`n`: one session per choice, interleaved through the pipeline. Greedy choices all equal the
    answer, streamed too (every choice by its index, each with its finish; usage counts all their
    tokens); sampled choices draw with seeds seed, seed + 1, ... and so differ."""
    messages = [{"role": "user", "content": PROMPTS[1]}]
    greedy = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0, n=3
    )
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert [c.message.content for c in greedy.choices] == [references[PROMPTS[1]]] * 3
    assert greedy.usage.completion_tokens == 3 * TOKENS and greedy.usage.prompt_tokens > 10
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=TOKENS,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    streamed, finishes, usage = ["", ""], {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert streamed == [references[PROMPTS[1]]] * 2 and finishes == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 2 * TOKENS
    sampled = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=TOKENS, temperature=1.0, seed=11, n=3
    )
    assert len({c.message.content for c in sampled.choices}) > 1


def test_completions_and_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["context_length"] == 8192
    reply = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert "Paris" in reply.choices[0].text
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    assert reply.choices[0].finish_reason == "length"


def test_stop_string_and_seeded_sampling(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": PROMPTS[0]}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=TOKENS, stop=["Paris"]
    )
    assert (
        reply.choices[0].finish_reason == "stop" and "Paris" not in reply.choices[0].message.content
    )
    sampled = [
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=1.2, top_p=0.95, seed=7
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    # the same seed gives the same sample, whichever session serves it
    assert sampled[0] == sampled[1]


def test_eight_concurrent_streams_equal_sequential_answers(
    client: openai.OpenAI,
    main_server: tuple[FleetServer, str],
    references: dict[str, str],
    served: Served,
) -> None:
    server, url = main_server
    async_client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)

    async def one(prompt: str) -> str:
        stream = await async_client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=TOKENS,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def everyone() -> list[str]:
        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await async_client.close()

    texts = asyncio.run(everyone())
    assert texts == [references[p] for p in PROMPTS]
    headers = {"Authorization": f"Bearer {KEY}"}
    assert metric(url, "fleettui_serve_active_sessions", headers) == 0
    assert metric(url, "fleettui_serve_queued_sessions", headers) == 0
    # nothing leaked: the stages hold exactly the sessions the pool keeps for reuse
    pooled = metric(url, "fleettui_serve_pooled_sessions", headers)
    assert 0 < pooled <= 8
    assert set(served.stage_sessions().values()) == {int(pooled)}


def test_multi_turn_reuses_the_prefix(client: openai.OpenAI, served: Served) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are terse."}]
    cached, prompts = [], []
    for turn in ("Name a fruit.", "And a vegetable?", "And a colour?"):
        messages.append({"role": "user", "content": turn})
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)  # type: ignore[arg-type]
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        assert reply.usage is not None
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)  # type: ignore[union-attr]
        prompts.append(reply.usage.prompt_tokens)
    # turn N costs only its new tokens: everything up to the previous reply is in the cache already
    assert cached[1] >= prompts[0] and cached[2] >= prompts[1]
    # and the reused answer equals a cold session's answer for the same conversation
    last = served.direct([ChatMessage(m["role"], m["content"]) for m in messages[:-1]], 12)
    assert last == messages[-1]["content"]


# -- errors
# -----------------------------------------------------------------------------------------
def test_missing_or_wrong_key_is_401(main_server: tuple[FleetServer, str]) -> None:
    url = main_server[1]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789"}, {"Authorization": KEY}):
        response = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="sk-not-the-key-0123456789", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"model": "smollm2-135m-instruct", "messages": [', None),
        ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, "model"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 9000}]}, "messages"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 3},
            "temperature",
        ),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": -0.1}, "top_p"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
            "max_tokens",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9000},
            "max_tokens",
        ),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 9}, "n"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [1]}, "stop"),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "presence_penalty": 2.5,
            },
            "presence_penalty",
        ),
        ({"model": MODEL, "prompt": ""}, "prompt"),
    ],
)
def test_bad_input_is_400_naming_the_field(
    main_server: tuple[FleetServer, str], body: Any, param: str | None
) -> None:
    url = main_server[1]
    endpoint = (
        "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    )
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    response = httpx.post(url + endpoint, content=content, headers=headers, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    if param is None:
        assert "malformed JSON" in error["message"]


def test_an_oversized_body_is_413_before_it_is_read_whole(
    main_server: tuple[FleetServer, str],
) -> None:
    """Declared too large (Content-Length) or streamed past the cap without a length: 413, one
    line."""
    from fleettui.serve.app import MAX_BODY_BYTES

    url = main_server[1] + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    declared = httpx.post(url, content=b" " * (MAX_BODY_BYTES + 1), headers=headers, timeout=60)
    assert declared.status_code == 413 and "larger than" in declared.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # chunked transfer: no Content-Length to refuse up front
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b" " * 65536

    streamed = httpx.post(url, content=chunks(), headers=headers, timeout=60)
    assert streamed.status_code == 413 and "larger than" in streamed.json()["error"]["message"]
    assert httpx.get(main_server[1] + "/health", timeout=30).status_code == 200  # still serving


def test_openai_client_sees_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], n=0
        )
    assert caught.value.param == "n"  # type: ignore[attr-defined]
    # structured output the fleet cannot serve as asked: refused, naming the field
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": 3}},
            },
        )
    assert caught.value.param == "response_format.json_schema.schema"  # type: ignore[attr-defined]
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": "news"}},
        )
    assert caught.value.param == "tool_choice"  # type: ignore[attr-defined]


def test_one_slot_is_shared_fairly_between_two_api_keys(served: Served) -> None:
    """One generation slot, two keys: alice sends three requests at once, bob one once two of hers
    wait. A first-come queue would answer bob last; the fair queue answers him next (second, or
    third when alice's first ended before his arrived); every answer is complete."""
    second_key = "sk-fleettui-test-bob-0123456789"
    server, url = served.add_server(
        api_keys=(KEY, second_key), max_sessions=1, max_queued=4, max_idle=0
    )
    finished: list[str] = []
    lock = threading.Lock()

    def ask(name: str, key: str, prompt: str) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 48}
        reply = httpx.post(
            url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=600,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
        with lock:
            finished.append(name)

    threads = [threading.Thread(target=ask, args=(f"alice-{i}", KEY, PROMPTS[i])) for i in range(3)]
    for thread in threads:
        thread.start()
    wait_for(lambda: server.admission.active == 1 and server.admission.queued == 2)
    bob = threading.Thread(target=ask, args=("bob", second_key, PROMPTS[3]))
    bob.start()
    for thread in [*threads, bob]:
        thread.join(600)
    assert (
        sorted(finished) == ["alice-0", "alice-1", "alice-2", "bob"] and finished.index("bob") < 3
    ), finished
    print(f"answered in the order {finished}")


def test_queue_full_is_429_with_retry_after(small_server: tuple[FleetServer, str]) -> None:
    server, url = small_server
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[1]}],
        "max_tokens": 200,
    }
    body["stream"] = True
    with (
        httpx.Client(base_url=url, timeout=600) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as first,
    ):
        assert first.status_code == 200
        # kept: a dropped iterator closes the stream (a disconnect)
        first_lines = first.iter_lines()
        next(first_lines)  # the one slot is taken
        with http.stream("POST", "/v1/chat/completions", json=body) as second:  # waits in the queue
            assert second.status_code == 200
            wait_for(lambda: server.admission.queued == 1)
            third = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
            assert third.status_code == 429
            assert int(third.headers["Retry-After"]) >= 1
            assert third.json()["error"]["type"] == "rate_limit_error"
    wait_for(lambda: server.admission.active == 0 and server.admission.queued == 0)


def test_disconnect_mid_stream_frees_the_session(
    small_server: tuple[FleetServer, str], main_server: tuple[FleetServer, str], served: Served
) -> None:
    server, url = small_server
    # only this test's sessions on the stages from here on
    served.run(main_server[0].pool.close_all())
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[1]}],
        "max_tokens": 400,
    }
    before = metric(url, "fleettui_serve_client_disconnects_total")
    with (
        httpx.Client(base_url=url, timeout=600) as http,
        http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response,
    ):
        lines = response.iter_lines()
        seen = [next(lines) for _ in range(8)]
        assert sum(1 for line in seen if line.startswith("data:")) >= 3
        assert set(served.stage_sessions().values()) == {1}
    wait_for(lambda: metric(url, "fleettui_serve_client_disconnects_total") == before + 1)
    wait_for(lambda: metric(url, "fleettui_serve_active_sessions") == 0)
    wait_for(lambda: set(served.stage_sessions().values()) == {0})
    assert not server.jobs and server.pool.lent == 0 and not server.live.requests
    # a non-streaming client that gives up is cancelled too: it hangs up once its generation has
    # started
    long_body = {
        **body,
        "messages": [{"role": "user", "content": "Count from 1 to 500, one number per line."}],
    }
    payload = json.dumps(long_body).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
            "application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        wait_for(lambda: server.pool.lent == 1)
    wait_for(lambda: metric(url, "fleettui_serve_client_disconnects_total") == before + 2)
    wait_for(lambda: set(served.stage_sessions().values()) == {0})


def test_thousand_requests_leak_nothing(
    small_server: tuple[FleetServer, str], main_server: tuple[FleetServer, str], served: Served
) -> None:
    server, url = main_server
    headers = {"Authorization": f"Bearer {KEY}"}
    rss_before = psutil.Process().memory_info().rss

    async def hammer() -> dict[int, int]:
        statuses: dict[int, int] = {}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as http:
            semaphore = asyncio.Semaphore(8)

            async def one(index: int) -> None:
                body: dict[str, Any] = {
                    "model": MODEL,
                    "prompt": f"Count {index % 7}",
                    "max_tokens": 1,
                }
                if index % 10 == 9:
                    body["temperature"] = 9  # a 400 now and then
                async with semaphore:
                    response = await http.post("/v1/completions", json=body)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

            await asyncio.gather(*(one(i) for i in range(1000)))
        return statuses

    statuses = asyncio.run(hammer())
    assert statuses == {200: 900, 400: 100}
    assert server.admission.active == 0 and server.admission.queued == 0 and not server.jobs
    assert server.pool.lent == 0 and server.pool.idle <= 8
    coordinator_sessions = served.run(_count(served))
    assert coordinator_sessions == server.pool.idle + small_server[0].pool.idle
    assert set(served.stage_sessions().values()) == {coordinator_sessions}
    assert psutil.Process().memory_info().rss - rss_before < 200 * 2**20


async def _count(served: Served) -> int:
    return len(served.controller.coordinator.sessions)


def test_health_and_metrics_parse(main_server: tuple[FleetServer, str]) -> None:
    url = main_server[1]
    health = httpx.get(url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert [s["up"] for s in health.json()["stages"]] == [True, True]
    assert httpx.get(url + "/metrics", timeout=30).status_code == 401
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for name in (
        "fleettui_serve_requests",
        "fleettui_serve_active_sessions",
        "fleettui_serve_queued_sessions",
        "fleettui_serve_time_to_first_token_seconds",
        "fleettui_serve_inter_token_latency_seconds",
        "fleettui_serve_acceptance_rate",
        "fleettui_serve_mean_k",
        "fleettui_stage_tokens_per_second",
        "fleettui_stage_busy_ratio",
        "fleettui_stage_queue_depth",
        "fleettui_stage_hop_latency_seconds",
        "fleettui_stage_resident_memory_bytes",
        "fleettui_stage_temperature_celsius",
        "fleettui_stage_throttled",
        "fleettui_stage_batch_rows",
    ):
        assert name in families, name
    ok = [s for s in families["fleettui_serve_requests"].samples if s.labels.get("status") == "200"]
    assert ok and sum(s.value for s in ok if s.name.endswith("_total")) > 0
    stages = {s.labels["stage"] for s in families["fleettui_stage_resident_memory_bytes"].samples}
    assert stages == {"stage-0", "stage-1"}
    ttft = [
        s
        for s in families["fleettui_serve_time_to_first_token_seconds"].samples
        if s.name.endswith("_count")
    ]
    assert ttft[0].value > 0


# -- the real command
# -------------------------------------------------------------------------------
def test_fleettui_serve_command_with_curl(shard_cache: Path, tmp_path: Path) -> None:
    assert shutil.which("curl"), "curl is needed for this test"
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(
        f'[model]\nname = "{MODEL}"\nshards = "{shard_cache}"\n[speculation]\ndraft = "none"\n'
        f'[[hosts]]\nname = "a"\nbase_port = {free_port_block()}\n'
        f'[[hosts]]\nname = "b"\nbase_port = {free_port_block()}\n'
    )
    keys = tmp_path / "keys"
    keys.write_text(f"# office keys\n{KEY}\n")
    keys.chmod(0o600)
    command = [sys.executable, "-m", "fleettui", "serve", str(fleet_file), "--exact", "--port", "0"]
    process = subprocess.Popen(
        [*command, "--api-key-file", str(keys)],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stderr is not None
        output = []
        while not (output and output[-1].startswith("fleettui serve: ")) and len(output) < 50:
            output.append(process.stderr.readline())
            assert output[-1], "".join(output)  # the command died before it was ready
        line = output[-1]
        assert "fleettui serve: http://127.0.0.1:" in line, line
        base = line.split()[2]  # http://127.0.0.1:PORT/v1
        workers = [c.pid for c in psutil.Process(process.pid).children(recursive=True)]
        assert len(workers) >= 2
        body = json.dumps(
            {
                "model": MODEL,
                "stream": True,
                "max_tokens": 12,
                "messages": [{"role": "user", "content": PROMPTS[0]}],
            }
        )
        curl = [
            "curl",
            "-sS",
            "-N",
            f"{base}/chat/completions",
            "-H",
            "Content-Type: application/json",
        ]
        streamed = subprocess.run(
            [*curl, "-H", f"Authorization: Bearer {KEY}", "-d", body],
            capture_output=True,
            text=True,
            timeout=300,
        )
        events = [line[6:] for line in streamed.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        text = "".join(
            json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
        )
        assert "Paris" in text
        refused = subprocess.run(
            [*curl, "-w", "%{http_code}", "-o", "/dev/null", "-d", body],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.stdout == "401"
        # a worker killed while serving: relaunched, and the terminal says so in one line
        lines: list[str] = []
        reader = threading.Thread(
            target=lambda: lines.extend(iter(process.stderr.readline, "")), daemon=True
        )
        reader.start()
        victim = next(
            p for p in workers if "remote_worker" in " ".join(psutil.Process(p).cmdline())
        )
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (
            not any(" recovery: relaunch " in line for line in lines)
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        said = [line for line in lines if " recovery: " in line]
        assert said and " recovery: relaunch " in said[-1], lines
        again = subprocess.run(
            [*curl, "-H", f"Authorization: Bearer {KEY}", "-d", body],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert "Paris" in "".join(
            json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            for line in again.stdout.splitlines()
            if line.startswith("data: {")
        )
        workers = [c.pid for c in psutil.Process(process.pid).children(recursive=True)]
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        psutil.wait_procs([psutil.Process(p) for p in workers if psutil.pid_exists(p)], timeout=30)
        assert not [
            p for p in workers if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
        ]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serve_refuses_public_bind_without_keys_and_loose_key_files(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "fleettui", "serve", "--host", "0.0.0.0", "--port", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "fleettui: refusing to serve on 0.0.0.0 without --api-key-file (only loopback may go "
        "keyless)"
    ]
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    keys.chmod(0o644)
    result = subprocess.run(
        [*command, "--api-key-file", str(keys)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "mode 0644" in result.stderr and "chmod 600" in result.stderr
