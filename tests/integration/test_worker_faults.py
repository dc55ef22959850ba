"""Regression tests for faults found by probing the stage worker, against a real `python -m
remote_worker`.

One worker (the last stage of the real 2-stage shard, plaintext, max_sessions 2, a 4 MiB inbox)
serves the tests of this module in order: malformed control requests, requests whose header is sound
but whose body is not, the session limit, the inbox byte budget, control answers during a long step,
and finally its lease."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import zmq

from remote_worker import protocol
from remote_worker.intake import Inbox
from remote_worker.protocol import Ack, Control, Decode, Error, Kind, Result, Step
from tests.support.workers import (
    NO_RANGES,
    Client,
    FakeEngine,
    Worker,
    forwarding_server,
    shard_dir,
    stage_config,
)

HIDDEN = 576
BUDGET = 4 << 20


def raw_control(
    worker: Worker, frames: list[bytes], timeout: float = 10.0
) -> dict[str, Any] | None:
    context = zmq.Context.instance()
    request = context.socket(zmq.REQ)
    request.linger = 0
    try:
        request.connect(worker.url(worker.config.control_port))
        request.send_multipart(frames)
        if not request.poll(int(timeout * 1000)):
            return None
        reply = json.loads(request.recv())
        assert isinstance(reply, dict)
        return reply
    finally:
        request.close(0)


@pytest.fixture(autouse=True)
def no_leftover_workers() -> Iterator[None]:
    """The module's worker outlives each test on purpose; the `served` fixture stops it at the
    end."""
    yield


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    directory = tmp_path_factory.mktemp("faults")
    config = replace(
        stage_config("faults", shard_dir(2), 1), max_sessions=2, max_queue_bytes=BUDGET
    )
    worker = Worker(config, directory)
    client = Client(worker, worker)
    try:
        client.wait_ready(worker)
        yield worker, client
    finally:
        client.close()
        worker.stop()


def hidden(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 1.0, (rows, HIDDEN)).astype(np.float32)


@pytest.mark.slow
def test_every_control_request_gets_an_answer(served) -> None:  # type: ignore[no-untyped-def]
    worker, client = served
    before = client.control(worker, {"op": "stats"})["control_errors"]  # type: ignore[index]
    bad = [
        [b"", b'{"op":"ping"}', b"x"],  # killed stage 0 of main: more than one frame
        [b"[" * 100000],  # killed stage 1 of main: RecursionError in json.loads
        [b"not json"],
        [b"\xff\xfe\x00"],
        [b"[1, 2]"],
        [b'{"op": 7}'],
        [b'{"no": "op"}'],
        [b'{"op": "reboot"}'],
        [json.dumps({"op": "ping", "pad": "x" * (1 << 20)}).encode()],  # 1 MiB
        [b'{"op": "lease", "seconds": -1}'],
        [b'{"op": "lease", "seconds": "soon"}'],
    ]
    for frames in bad:
        reply = raw_control(worker, frames)
        assert reply is not None and "error" in reply, (frames[0][:30], reply)
        assert client.control(worker, {"op": "ping"})["state"] == "ready"  # type: ignore[index]
    stats = client.control(worker, {"op": "stats"})
    assert stats is not None and stats["control_errors"] == before + len(bad)
    ping = client.control(worker, {"op": "ping"})
    assert ping is not None and ping["lease_left"] is None and ping["busy_since"] is None
    assert ping["queue_bytes"] == 0 and ping["refused"] == 0 and ping["max_sessions"] == 2


@pytest.mark.slow
def test_bad_requests_fail_fast_with_an_error(served) -> None:  # type: ignore[no-untyped-def]
    worker, client = served
    client.send(Control(Kind.OPEN, 1, 1))
    assert isinstance(client.receive(), Ack)
    before = client.control(worker, {"op": "stats"})["rejected"]  # type: ignore[index]
    # --top-p 2 used to hang the coordinator: the frame was dropped and nobody answered
    wrong_top_p = protocol.encode(
        Step(1, 2, 0, 0, NO_RANGES, hidden=hidden(2), decode=Decode(temperature=1.0))
    )
    spec = bytearray(wrong_top_p[3])
    spec[4:8] = np.float32(2.0).tobytes()
    client.send_raw(
        [bytes(f) for f in wrong_top_p[:3]] + [bytes(spec)] + [bytes(f) for f in wrong_top_p[4:]]
    )
    reply = client.receive()
    assert isinstance(reply, Error) and (reply.session, reply.seq, reply.stage) == (1, 2, 1)
    assert "top_p" in reply.message

    poisoned = hidden(3)
    poisoned[1, 7] = np.nan
    client.send(Step(1, 3, 0, 0, NO_RANGES, hidden=poisoned))
    reply = client.receive()
    assert isinstance(reply, Error) and reply.seq == 3 and "NaN" in reply.message
    assert "session 1" in reply.message and "stage 1" in reply.message

    client.send(Step(1, 4, 0, 0, NO_RANGES, hidden=np.zeros((2, 100), np.float32)))
    reply = client.receive()
    assert isinstance(reply, Error) and reply.seq == 4 and "width 576" in reply.message
    client.send(Step(1, 5, 0, 0, NO_RANGES, tokens=np.array([1, 2], np.int64)))
    reply = client.receive()
    assert isinstance(reply, Error) and reply.seq == 5 and "hidden states" in reply.message
    # a frame shorter than its declared shape: refused too, never fed
    frames = [bytes(f) for f in protocol.encode(Step(1, 6, 0, 0, NO_RANGES, hidden=hidden(4)))]
    frames[2] = frames[2][: 3 * HIDDEN * 4]
    client.send_raw(frames)
    reply = client.receive()
    assert isinstance(reply, Error) and reply.seq == 6 and "hidden" in reply.message

    stats = client.control(worker, {"op": "stats"})
    assert (
        stats is not None
        and stats["rejected"] == before + 5
        and stats["sessions"]["1"]["cache_len"] == 0
    )
    client.send(Step(1, 7, 0, 0, NO_RANGES, hidden=hidden(2)))  # and the session still serves
    assert isinstance(client.receive(), Result)
    client.send(Control(Kind.CLOSE, 1, 8))
    assert isinstance(client.receive(), Ack)


@pytest.mark.slow
def test_an_open_beyond_max_sessions_is_refused(served) -> None:  # type: ignore[no-untyped-def]
    worker, client = served
    for session in (11, 12, 13):
        client.send(Control(Kind.OPEN, session, session))
    replies = {reply.seq: reply for reply in (client.receive() for _ in range(3))}
    assert isinstance(replies[11], Ack) and isinstance(replies[12], Ack)
    refused = replies[13]
    assert (
        isinstance(refused, Error)
        and "max_sessions" in refused.message
        and "at most 2" in refused.message
    )
    client.send(Control(Kind.CLOSE, 11, 14))
    client.send(Control(Kind.OPEN, 13, 15))
    assert [type(client.receive()), type(client.receive())] == [Ack, Ack]
    for session in (12, 13):
        client.send(Control(Kind.CLOSE, session, 20 + session))
        assert isinstance(client.receive(), Ack)


@pytest.mark.slow
def test_control_answers_during_a_long_step_and_the_inbox_is_bounded_in_bytes(served) -> None:  # type: ignore[no-untyped-def]
    worker, client = served
    client.send(Control(Kind.OPEN, 21, 1))
    assert isinstance(client.receive(), Ack)
    long_step = hidden(1500, seed=1)  # 3.5 MB: fits the 4 MiB inbox alone
    client.send(Step(21, 2, 0, 0, NO_RANGES, hidden=long_step))
    busy = []
    while not client.pull.poll(0):
        ping = client.control(worker, {"op": "ping"}, timeout=10.0)
        assert ping is not None
        if ping["busy_since"] is not None:
            busy.append(ping["busy_since"])
            break
    # while it computes, two more big steps arrive: the second does not fit the byte budget
    client.send(Step(21, 3, 1500, 1500, NO_RANGES, hidden=hidden(1000, seed=2)))  # 2.3 MB
    client.send(Step(22, 4, 0, 0, NO_RANGES, hidden=hidden(1000, seed=3)))  # session 22 is not open
    # 4.6 MB: larger than the budget itself
    client.send(Step(21, 5, 0, 0, NO_RANGES, hidden=hidden(2000)))
    replies = {reply.seq: reply for reply in (client.receive(timeout=300) for _ in range(4))}
    assert busy, "no ping was answered while the long step ran"
    assert isinstance(replies[2], Result) and isinstance(replies[3], Result)
    assert isinstance(replies[5], Error) and "overloaded" in replies[5].message
    assert isinstance(replies[4], Error)
    stats = client.control(worker, {"op": "stats"})
    assert stats is not None and stats["queue_bytes"] == 0 and stats["rss_mb"] < 4000
    if (
        "overloaded" in replies[4].message
    ):  # it arrived while step 3 waited (it practically always does)
        assert stats["overflow"] == 2
    else:  # step 3 was already being served: step 4 fitted, and failed on its unopened session
        assert "not open" in replies[4].message and stats["overflow"] == 1
    client.send(Control(Kind.CLOSE, 21, 6))
    assert isinstance(client.receive(), Ack)


@pytest.mark.slow
def test_a_lease_keeps_the_worker_while_pinged_and_ends_it_when_not(served) -> None:  # type: ignore[no-untyped-def]
    worker, client = served
    reply = client.control(worker, {"op": "lease", "seconds": 2})
    assert reply is not None and reply["lease"] == 2
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # 5 s of pings every 0.5 s: more than twice the lease
        ping = client.control(worker, {"op": "ping"})
        assert ping is not None and 0 < ping["lease_left"] <= 2
        time.sleep(0.5)
    assert worker.process.poll() is None
    assert worker.process.wait(30) == 0  # silence: it exits by itself, cleanly
    assert "lease of 2.0 s expired" in worker.log.read_text()


def test_inbox_is_bounded_in_bytes_and_serves_refusals_first() -> None:
    inbox = Inbox(max_bytes=100)
    hello = protocol.Hello(1)
    assert inbox.put(0.0, hello, 60) and not inbox.put(0.0, hello, 41) and inbox.put(0.0, hello, 40)
    assert inbox.bytes == 100 and len(inbox) == 2
    assert inbox.refuse(Error(1, 9, 0, "no"))
    first = inbox.get(0.0)
    assert first is not None and first[1].error.seq == 9  # type: ignore[union-attr]
    inbox.get(0.0)
    assert inbox.bytes == 40 and inbox.put(0.0, hello, 60)


def test_non_finite_model_output_is_an_error_naming_stage_and_session() -> None:
    """The model itself yields NaN: the stage answers with an Error instead of passing it on."""
    output = np.ones((2, 4), np.float32)
    output[1, 1] = np.inf
    engine = FakeEngine(output)
    with forwarding_server(engine) as (upstream, downstream):
        upstream.send_multipart(protocol.encode(Control(Kind.OPEN, 5, 1)))
        upstream.send_multipart(
            protocol.encode(Step(5, 2, 0, 0, NO_RANGES, tokens=np.array([5, 6], np.int64)))
        )
        assert isinstance(protocol.decode(downstream.recv_multipart()), Control)
        assert downstream.poll(10_000)
        error = protocol.decode(downstream.recv_multipart())
        assert isinstance(error, Error) and error.seq == 2 and error.stage == 0
        assert (
            "session 5" in error.message
            and "stage 0" in error.message
            and "NaN/Inf" in error.message
        )
        assert "non-finite" in engine.broken


def test_the_finite_check_sees_every_nan_and_inf_and_passes_huge_finite_values() -> None:
    """_check_finite sums first: NaN and Inf always make the sum non-finite; finite values whose sum
    overflows get the element-wise look and pass."""
    from types import SimpleNamespace

    from remote_worker.compute import StageCompute

    broken: list[str] = []
    compute = StageCompute.__new__(StageCompute)
    compute.engine = SimpleNamespace(
        is_last=True, mark_broken=lambda session, reason: broken.append(reason)
    )
    compute.config = SimpleNamespace(stage_index=1)
    huge = np.full((2, 8), 3e38, np.float32)  # finite, and their sum overflows float32
    compute._check_finite(7, huge)
    for bad in (np.nan, np.inf, -np.inf):
        values = huge.copy()
        values[1, 3] = bad
        with pytest.raises(ValueError, match="non-finite logits"):
            compute._check_finite(7, values)
    mixed = np.zeros((1, 4), np.float32)
    mixed[0, :2] = (np.inf, -np.inf)  # sums to NaN
    with pytest.raises(ValueError, match="session 7: stage 1"):
        compute._check_finite(7, mixed)
    assert len(broken) == 4
