"""Unit tests of the server's pure parts: request validation, admission queue, session pool, API
keys."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fleettui.runtime.generation import GenerationParams
from fleettui.runtime.ledger import Feed
from fleettui.runtime.session import Session
from fleettui.runtime.session_pool import SessionPool, common_prefix
from fleettui.serve.admission import Admission, QueueFull, Ticket
from fleettui.serve.schema import RequestError, parse_request
from fleettui.serve.security import (
    KeyChecker,
    SecurityError,
    check_bind,
    is_loopback,
    load_api_keys,
)

DEFAULTS = GenerationParams(max_tokens=256)


def parse(body: object, chat: bool = True):  # type: ignore[no-untyped-def]
    return parse_request(body, chat, "m", DEFAULTS, 100)


def test_valid_chat_request_maps_every_field() -> None:
    request = parse(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
            "max_completion_tokens": 50,
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 3,
            "stop": "END",
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert [m.content for m in request.messages or ()] == ["be brief", "hi"]
    with pytest.raises(RequestError, match="max_tokens 50 does not fit: the prompt leaves 30"):
        # asked for more than the context has left
        request.sampling.params(DEFAULTS.max_tokens, room=30)
    params = request.sampling.params(DEFAULTS.max_tokens, room=100)
    assert (params.max_tokens, params.temperature, params.top_p, params.seed, params.stop) == (
        50,
        0.7,
        0.9,
        3,
        ("END",),
    )
    assert request.stream and request.include_usage


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], None),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            "temperature",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, "top_p"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 101},
            "max_tokens",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": True},
            "max_tokens",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 9}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "frequency_penalty": -3},
            "frequency_penalty",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {}},
            "stream_options",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "logprobs": True,
                "top_logprobs": 21,
            },
            "top_logprobs",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema"},
            },
            "response_format.json_schema",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function"}],
            },
            "tools[0]",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "functions": [{"name": "f"}],
            },
            "functions",
        ),
    ],
)
def test_bad_requests_name_their_field(body: object, param: str | None) -> None:
    with pytest.raises(RequestError) as caught:
        parse(body)
    assert caught.value.param == param and caught.value.status == 400


def test_free_text_and_tools_left_unused_are_served() -> None:
    """`response_format` text, and tools the request tells the model not to call, ask nothing it
    cannot do."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert parse({**body, "response_format": {"type": "text"}}).messages
    tool = {"type": "function", "function": {"name": "f"}}
    assert not parse({**body, "tools": [tool], "tool_choice": "none"}).structure.calls_tools
    assert parse({**body, "tools": []}).messages


def test_logprobs_are_asked_for_as_openai_does() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert parse(body).sampling.logprobs is None
    assert parse({**body, "logprobs": False}).sampling.logprobs is None
    # the tokens' own, no alternatives
    assert parse({**body, "logprobs": True}).sampling.logprobs == 0
    params = parse({**body, "logprobs": True, "top_logprobs": 5}).sampling.params(10, 10)
    assert params.logprobs == 5 and params.top_columns == 6
    legacy = {"model": "m", "prompt": "once"}
    assert parse({**legacy, "logprobs": 2}, chat=False).sampling.logprobs == 2
    assert parse({**legacy, "logprobs": 0}, chat=False).sampling.logprobs == 0
    with pytest.raises(RequestError) as caught:
        parse({**legacy, "logprobs": 6}, chat=False)
    assert caught.value.param == "logprobs"


def test_logprobs_objects_of_chat_and_of_legacy_completions() -> None:
    from fleettui.runtime.generation import TokenLogprob
    from fleettui.serve.responses import Logprobs

    # 3 and 4: one character split in two tokens
    pieces = {
        1: b"Hi",
        2: b" th",
        3: b"\xe2\x80",
        4: b"\x94",
    }
    entries = [
        TokenLogprob(1, -0.5, ((1, -0.5), (2, -1.5))),
        TokenLogprob(3, -0.25, ((3, -0.25), (4, -2.0))),
    ]
    chat = Logprobs(True, pieces.__getitem__).of(entries)
    assert chat["refusal"] is None and [e["token"] for e in chat["content"]] == ["Hi", "\ufffd"]
    assert b"".join(bytes(e["bytes"]) for e in chat["content"]) == b"Hi\xe2\x80"
    assert chat["content"][0]["logprob"] == -0.5
    assert chat["content"][0]["top_logprobs"] == [
        {"token": "Hi", "logprob": -0.5, "bytes": list(b"Hi")},
        {"token": " th", "logprob": -1.5, "bytes": list(b" th")},
    ]
    legacy = Logprobs(False, pieces.__getitem__)
    first = legacy.of(entries[:1])
    assert first == {
        "tokens": ["Hi"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"Hi": -0.5, " th": -1.5}],
        "text_offset": [0],
    }
    # a stream's offsets go on from chunk to chunk
    assert legacy.of(entries[1:])["text_offset"] == [2]


def test_top_p_zero_is_greedy() -> None:
    """OpenAI's `top_p: 0` keeps only the most likely token: greedy, not an error and not top_p =
    1."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "top_p": 0,
        "temperature": 0.9,
    }
    params = parse(body).sampling.params(DEFAULTS.max_tokens, room=100)
    assert (params.temperature, params.top_p) == (0.0, 1.0)


def test_penalties_are_refused_until_generation_params_has_them() -> None:
    from dataclasses import fields

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}
    if "presence_penalty" in {f.name for f in fields(GenerationParams)}:
        params = parse(body).sampling.params(10, 10)
        assert params.presence_penalty == 0.5  # type: ignore[attr-defined]
    else:
        with pytest.raises(RequestError, match="not supported"):
            parse(body)
    assert parse({**body, "presence_penalty": 0}).sampling.penalties == {}


def test_the_fleets_recommended_sampling_applies_when_a_request_sets_no_temperature() -> None:
    recommended = GenerationParams(
        max_tokens=256, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.1
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    params = parse_request(body, True, "m", recommended, 100).sampling.params(10, 10)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (
        0.7,
        0.8,
        20,
        1.1,
    )
    plain = parse_request({**body, "temperature": 0}, True, "m", recommended, 100).sampling.params(
        10, 10
    )
    # what the client asked
    assert (plain.temperature, plain.top_k, plain.repetition_penalty) == (
        0.0,
        0,
        1.0,
    )


def test_completion_prompt() -> None:
    assert parse({"model": "m", "prompt": ["once"]}, chat=False).prompt == "once"
    with pytest.raises(RequestError) as caught:
        parse({"model": "m", "prompt": "x", "echo": True}, chat=False)
    assert caught.value.param == "echo"


async def test_admission_is_fifo_bounded_and_releases_cancelled_waiters() -> None:
    admission = Admission(max_active=1, max_queued=2)
    first = admission.admit()
    second, third = admission.admit(), admission.admit()
    with pytest.raises(QueueFull) as full:
        admission.admit()
    assert full.value.retry_after >= 1
    await first.wait()
    waiter = asyncio.ensure_future(second.wait())
    await asyncio.sleep(0)
    waiter.cancel()  # a client that leaves the queue frees its place
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert admission.queued == 1
    first.release()
    await asyncio.wait_for(third.wait(), 1)  # the next in line, not the cancelled one
    assert admission.active == 1 and admission.queued == 0
    third.release()
    third.release()  # twice is harmless
    assert admission.active == 0


async def test_admission_is_fair_between_clients_and_keeps_a_place_for_each() -> None:
    """One slot: alice sends four, bob one after them; bob's goes next, then alice's in order. With
    alice's requests filling the queue her next is refused, bob's first still gets a place."""
    admission = Admission(max_active=1, max_queued=3)
    # 1 generating, 3 waiting: the queue is full
    alice = [admission.admit("alice") for _ in range(4)]
    with pytest.raises(QueueFull):
        admission.admit("alice")
    bob = admission.admit("bob")  # nothing of bob's anywhere: his place is kept
    assert admission.queued == 4
    order: list[str] = []

    async def run(name: str, ticket: Ticket) -> None:
        await ticket.wait()
        order.append(name)
        await asyncio.sleep(0)
        ticket.release()

    await asyncio.wait_for(
        asyncio.gather(*(run(f"alice-{i}", t) for i, t in enumerate(alice)), run("bob", bob)), 5
    )
    assert order == ["alice-0", "bob", "alice-1", "alice-2", "alice-3"]
    assert admission.active == 0 and admission.queued == 0
    with pytest.raises(QueueFull):  # bob's kept place is one, not a second queue
        crowd = [admission.admit("alice") for _ in range(4)] + [admission.admit("bob")]
        admission.admit("bob")
    for ticket in crowd:
        ticket.release()


class FakeSessions:
    def __init__(self) -> None:
        self.open: set[int] = set()
        self.next = 0

    async def opener(self, seed: int) -> Session:
        self.next += 1
        await asyncio.sleep(0.01)
        self.open.add(self.next)
        return Session(self.next, seed)

    async def closer(self, session: Session) -> None:
        self.open.discard(session.id)


def fill(session: Session, tokens: list[int]) -> None:
    session.ledger.commit(Feed(0, 0, tuple(tokens), ()))


async def test_pool_picks_the_longest_prefix_and_evicts_lru() -> None:
    fake = FakeSessions()
    pool = SessionPool(fake.opener, fake.closer, max_idle=2)
    a = (await pool.acquire([1, 2, 3], 0)).session
    fill(a, [1, 2, 3, 4])
    b = (await pool.acquire([1, 9], 0)).session
    fill(b, [1, 9, 9])
    await pool.release(a, reusable=True)
    await pool.release(b, reusable=True)
    lease = await pool.acquire([1, 2, 3, 4, 5, 6], 0)
    assert lease.session is a and lease.reused_tokens == 4
    await pool.release(a, reusable=False)  # a cancelled generation: closed, never reused
    assert a.id not in fake.open
    c = (await pool.acquire([7], 0)).session  # nothing shared: a new session
    assert c not in (a, b)
    fill(c, [7, 8])
    d = (await pool.acquire([5], 0)).session
    for session in (c, d):
        await pool.release(session, reusable=True)
    assert pool.idle == 2 and b.id not in fake.open  # b was the least recently used
    await pool.close_all()
    assert not fake.open and common_prefix([1, 2], [1, 3]) == 1


async def test_pool_never_keeps_more_sessions_open_than_the_stages_allow() -> None:
    fake = FakeSessions()
    pool = SessionPool(fake.opener, fake.closer, max_idle=4, max_open=2)
    a = (await pool.acquire([1], 0)).session
    fill(a, [1, 2])
    await pool.release(a, reusable=True)
    b = (await pool.acquire([3], 0)).session
    c = (
        await pool.acquire([4], 0)
    ).session  # a third open session would exceed 2: idle `a` is closed first
    assert len(fake.open) == 2 and a.id not in fake.open and {b.id, c.id} == fake.open
    for session in (b, c):
        await pool.release(session, reusable=True)
    await pool.close_all()
    assert not fake.open


class SlowSessions(FakeSessions):
    """Sessions whose close takes a while on the stages; `peak` is the most ever open at once."""

    peak = 0

    async def opener(self, seed: int) -> Session:
        session = await super().opener(seed)
        self.peak = max(self.peak, len(self.open))
        return session

    async def closer(self, session: Session) -> None:
        await asyncio.sleep(0.05)
        self.open.discard(session.id)


async def test_pool_waits_for_a_session_still_closing_before_it_opens_another() -> None:
    fake = SlowSessions()
    pool = SessionPool(fake.opener, fake.closer, max_idle=2, max_open=2)
    a = (await pool.acquire([1], 0)).session
    b = (await pool.acquire([2], 0)).session
    # a cancelled request's session
    closing = asyncio.ensure_future(pool.release(a, reusable=False))
    await asyncio.sleep(0)
    c = (await pool.acquire([3], 0)).session  # admitted the moment `a`'s request let go of its slot
    # it waited for `a` to be closed: never 3 open on the stages
    assert fake.peak == 2 and closing.done()
    for session in (b, c):
        await pool.release(session, reusable=False)
    await pool.close_all()
    assert not fake.open


async def test_pool_closes_a_session_whose_opener_was_cancelled() -> None:
    fake = FakeSessions()
    pool = SessionPool(fake.opener, fake.closer, max_idle=2)
    acquiring = asyncio.ensure_future(pool.acquire([1, 2], 0))
    await asyncio.sleep(0)
    acquiring.cancel()
    with pytest.raises(asyncio.CancelledError):
        await acquiring
    await pool.close_all()
    assert fake.next == 1 and not fake.open


def test_keys_file_mode_and_constant_time_check(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# comment\nsk-0123456789abcdef\n\nsk-fedcba9876543210\n")
    path.chmod(0o640)
    with pytest.raises(SecurityError, match="chmod 600"):
        load_api_keys(path)
    path.chmod(0o600)
    keys = load_api_keys(path)
    checker = KeyChecker(keys)
    assert checker.allows("Bearer sk-fedcba9876543210") and checker.allows(
        "bearer sk-0123456789abcdef"
    )
    assert (
        not checker.allows(None)
        and not checker.allows("Bearer ")
        and not checker.allows("sk-0123456789abcdef")
    )
    assert KeyChecker(()).allows(None)
    with pytest.raises(SecurityError, match="no keys"):
        path.write_text("# none\n")
        load_api_keys(path)


def test_bind_rules() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert (
        not is_loopback("0.0.0.0")
        and not is_loopback("192.168.1.5")
        and not is_loopback("example.org")
    )
    check_bind("127.0.0.1", ())
    check_bind("0.0.0.0", ("k" * 16,))
    with pytest.raises(SecurityError, match="without --api-key-file"):
        check_bind("0.0.0.0", ())


def test_live_requests_are_registered_until_they_end_shown_a_moment_after_and_shown_as_cells() -> (
    None
):
    from fleettui.serve.live import LiveRequests
    from fleettui.ui.widgets.api_panel import request_cells

    live = LiveRequests()
    first = live.begin("10.0.0.5:5123", "chat", "What is\nthe capital   of France?", 17)
    second = live.begin("10.0.0.6:6000", "completions", "x" * 200, 3)
    assert [each.id for each in live.snapshot()] == [first.id, second.id]
    assert first.preview == "What is the capital of France?" and len(second.preview) == 60
    first.state, first.tokens, first.first_token = "generating", 11, 100.0
    cells = request_cells(first, now=102.0)
    assert (
        cells["client"] == "10.0.0.5:5123"
        and cells["tokens"] == "11/17p"
        and cells["rate"] == "5.0"
    )
    assert request_cells(second, now=102.0)["rate"] == "-"
    assert cells["output"] == "text"
    third = live.begin("10.0.0.7:7000", "chat", "weather?", 30, "tools auto")
    third.tool_calls += ["get_weather", "get_time"]
    assert request_cells(third, now=102.0)["output"] == "tools auto → get_weather, get_time"
    live.end(third)
    live.end(first)
    ended = first.ended
    live.end(first, "stopped")  # twice is harmless: the first end holds
    assert ended is not None and first.state == "done" and first.ended == ended
    assert live.finished == 2 and list(live.requests.values()) == [second]
    # a finished request stays on show a moment,
    assert live.snapshot(now=ended + 1.0) == [
        first,
        second,
        third,
    ]
    # frozen
    assert request_cells(first, now=ended + 50.0)["rate"] == request_cells(first, now=ended)["rate"]
    assert not first.active and second.active
    assert live.snapshot(now=(third.ended or 0) + live.linger + 0.1) == [second]  # then leaves


async def test_a_stream_that_waits_is_kept_alive_between_its_deltas() -> None:
    """`paced` passes every delta in order and puts a keep-alive (None) in each gap longer than
    its pace."""
    from fleettui.serve.responses import paced

    queue: asyncio.Queue[str | None] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    queue.put_nowait("a")
    loop.call_later(0.25, queue.put_nowait, "b")  # a long wait: a recovery, a hold, a long prefill
    loop.call_later(0.3, queue.put_nowait, "c")
    loop.call_later(0.3, queue.put_nowait, None)
    seen = [item async for item in paced(queue, 0.1)]
    assert [item for item in seen if item is not None] == ["a", "b", "c"]
    assert seen[0] == "a" and seen[1] is None and 1 <= seen.count(None) <= 3
