"""The coordinator's ZmqLink against a scripted stage on real ZeroMQ sockets (no model): replies
matched by sequence number in any order, malformed and unexpected replies dropped and counted,
errors, timeouts, a blocked link, close, and a link used from a second event loop (replies are read
from the loop's readiness callback on the PULL socket, so the link must follow the loop it is used
from)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import zmq

from fleettui.runtime.transport import LinkError, StageFailure, StageLost, ZmqLink
from remote_worker import protocol

Script = Callable[[list[protocol.Step]], list[list[bytes | memoryview]]]


def _result(step: protocol.Step, token: int) -> list[bytes | memoryview]:
    return protocol.encode(
        protocol.Result(
            step.session,
            step.seq,
            np.array([token], np.int64),
            0,
            np.zeros((0, 0), np.int64),
            np.zeros((0, 0), np.float32),
            np.zeros(0, np.float64),
        )
    )


class ScriptedStage:
    """A PULL socket the link pushes into and a PUSH socket it pulls from; every `batch` steps
    received are answered by `script(steps)` (the frames to send back, in that order)."""

    def __init__(self, script: Script, batch: int = 1) -> None:
        self.context = zmq.Context()
        self.pull = self.context.socket(zmq.PULL)
        self.push = self.context.socket(zmq.PUSH)
        for socket in (self.pull, self.push):
            socket.linger = 0
        head = self.pull.bind_to_random_port("tcp://127.0.0.1")
        tail = self.push.bind_to_random_port("tcp://127.0.0.1")
        self.head, self.tail = f"tcp://127.0.0.1:{head}", f"tcp://127.0.0.1:{tail}"
        self.script, self.batch = script, batch
        self.received: list[int] = []  # messages in each multipart received (a Batch holds several)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        waiting: list[protocol.Step] = []
        while not self.stopping.is_set():
            if not self.pull.poll(50):
                continue
            received = protocol.split(self.pull.recv_multipart())
            self.received.append(len(received))
            for part in received:
                message = protocol.decode(part)
                assert isinstance(message, protocol.Step)
                waiting.append(message)
                if len(waiting) == self.batch:
                    for frames in self.script(waiting):
                        self.push.send_multipart(frames)
                    waiting = []

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.context.destroy(0)


@pytest.fixture
def stage() -> Iterator[Callable[..., ScriptedStage]]:
    made: list[ScriptedStage] = []

    def make(script: Script, batch: int = 1) -> ScriptedStage:
        made.append(ScriptedStage(script, batch))
        return made[-1]

    yield make
    for each in made:
        each.close()


def _step(session: int, token: int = 5) -> protocol.Step:
    return protocol.Step(
        session, 0, 0, 0, np.zeros((0, 2), np.int64), tokens=np.array([token], np.int64)
    )


def test_replies_in_any_order_reach_their_requests(stage: Callable[..., ScriptedStage]) -> None:
    """Three requests in flight; the stage answers them in reverse order, each with its session
    id + 100."""
    fake = stage(lambda steps: [_result(s, s.session + 100) for s in reversed(steps)], batch=3)

    async def scenario() -> list[int]:
        link = ZmqLink(fake.head, fake.tail, timeout=10)
        try:
            replies = await asyncio.gather(*(link.request(_step(session)) for session in (1, 2, 3)))
        finally:
            await link.close()
        assert link.dropped == 0
        return [int(r.tokens[0]) for r in replies]  # type: ignore[attr-defined]

    assert asyncio.run(scenario()) == [101, 102, 103]
    assert fake.received == [3]  # asked for in one turn of the event loop: they left as one Batch


def test_malformed_and_unexpected_replies_are_dropped_and_the_real_one_answers(
    stage: Callable[..., ScriptedStage],
) -> None:
    def script(steps: list[protocol.Step]) -> list[list[bytes | memoryview]]:
        step = steps[0]
        stray = protocol.Step(
            step.session, step.seq + 1000, 0, 0, step.mask_ranges, tokens=step.tokens
        )
        return [[b"garbage"], _result(stray, 1), _result(step, 42)]  # type: ignore[arg-type]

    fake = stage(script)

    async def scenario() -> tuple[int, int]:
        link = ZmqLink(fake.head, fake.tail, timeout=10)
        try:
            reply = await link.request(_step(1))
        finally:
            await link.close()
        return int(reply.tokens[0]), link.dropped  # type: ignore[attr-defined]

    assert asyncio.run(scenario()) == (42, 2)


def test_an_error_reply_raises_stage_failure_with_the_stage_and_reason(
    stage: Callable[..., ScriptedStage],
) -> None:
    fake = stage(
        lambda steps: [protocol.encode(protocol.Error(steps[0].session, steps[0].seq, 1, "boom"))]
    )

    async def scenario() -> None:
        link = ZmqLink(fake.head, fake.tail, timeout=10)
        try:
            await link.request(_step(1))
        finally:
            await link.close()

    with pytest.raises(StageFailure, match="stage 1: boom"):
        asyncio.run(scenario())


def test_no_answer_times_out_with_a_clear_error_and_a_late_answer_is_ignored_quietly(
    stage: Callable[..., ScriptedStage], caplog: pytest.LogCaptureFixture
) -> None:
    """The late answer to a request its caller stopped waiting for (timed out, or cancelled as on a
    SIGTERM) is expected: it is ignored without a warning and not counted as an unexpected reply."""
    late: list[protocol.Step] = []

    def script(steps: list[protocol.Step]) -> list[list[bytes | memoryview]]:
        late.extend(steps)  # answered only with the next request
        return [_result(s, 7) for s in late[:-1]] + (
            [_result(late[-1], 8)] if len(late) > 1 else []
        )

    fake = stage(script)

    async def scenario() -> tuple[str, int, int]:
        link = ZmqLink(fake.head, fake.tail, timeout=10)
        try:
            with pytest.raises(LinkError) as caught:
                await link.request(_step(1), timeout=0.3)
            # the stage now sends the late answer first, then this one
            reply = await link.request(_step(2))
        finally:
            await link.close()
        return str(caught.value), int(reply.tokens[0]), link.dropped  # type: ignore[attr-defined]

    message, token, dropped = asyncio.run(scenario())
    assert "no answer from the pipeline within 0.3 s (Step seq 1)" in message
    assert (token, dropped) == (8, 0)
    assert not [record for record in caplog.records if "unexpected" in record.getMessage()]


def test_block_fails_pending_and_new_requests_fast_until_unblock(
    stage: Callable[..., ScriptedStage],
) -> None:
    # session 1: never answered
    fake = stage(lambda steps: [_result(s, 9) for s in steps if s.session != 1])

    async def scenario() -> int:
        link = ZmqLink(fake.head, fake.tail, timeout=10)
        try:
            pending = asyncio.ensure_future(link.request(_step(1)))
            await asyncio.sleep(0.1)
            link.block(StageLost("stage-1 lost"))
            with pytest.raises(StageLost, match="stage-1 lost"):
                await pending
            with pytest.raises(StageLost):
                await link.request(_step(2))
            link.unblock()
            first, second = await asyncio.gather(link.request(_step(3)), link.request(_step(4)))
        finally:
            await link.close()
        return int(first.tokens[0]) + int(second.tokens[0])  # type: ignore[attr-defined]

    assert asyncio.run(scenario()) == 18


def test_close_fails_what_is_pending(stage: Callable[..., ScriptedStage]) -> None:
    fake = stage(lambda steps: [], batch=1)  # never answers

    async def scenario() -> None:
        link = ZmqLink(fake.head, fake.tail, timeout=10)
        pending = asyncio.ensure_future(link.request(_step(1)))
        await asyncio.sleep(0.1)
        await link.close()
        await pending

    with pytest.raises(LinkError, match="link closed"):
        asyncio.run(scenario())


def test_one_link_serves_a_second_event_loop(stage: Callable[..., ScriptedStage]) -> None:
    fake = stage(lambda steps: [_result(s, s.session) for s in steps])
    link = ZmqLink(fake.head, fake.tail, timeout=10)
    first = asyncio.run(link.request(_step(1)))
    second = asyncio.run(link.request(_step(2)))
    asyncio.run(link.close())
    assert [int(first.tokens[0]), int(second.tokens[0])] == [1, 2]  # type: ignore[attr-defined]


def _run_step(session: int, run: int) -> protocol.Step:
    greedy = protocol.Decode()
    return protocol.Step(
        session,
        0,
        0,
        0,
        np.zeros((0, 2), np.int64),
        tokens=np.array([5], np.int64),
        decode=greedy,
        run=run,
    )


def test_a_run_streams_its_results_in_order_and_late_ones_are_dropped_quietly(
    stage: Callable[..., ScriptedStage],
) -> None:
    """A run of 4 answered with 4 Results of its seq plus one more (as a stage past a Cancel
    would)."""
    fake = stage(
        lambda steps: [_result(steps[0], token) for token in range(10, 15 if steps[0].run else 11)]
    )

    async def scenario() -> tuple[list[int], bool, int]:
        link = ZmqLink(fake.head, fake.tail, timeout=10)
        try:
            stream = await link.stream(_run_step(1, 4))
            tokens = [int((await stream.next())[0].tokens[0]) for _ in range(4)]
            # the fifth Result of the run arrives before this answer
            reply = await link.request(_step(2))
            tokens.append(int(reply.tokens[0]))  # type: ignore[attr-defined]
        finally:
            await link.close()
        return tokens, stream.done, link.dropped

    assert asyncio.run(scenario()) == ([10, 11, 12, 13, 10], True, 0)


def test_a_run_that_errors_or_is_blocked_fails_its_stream_after_what_arrived(
    stage: Callable[..., ScriptedStage],
) -> None:
    def script(steps: list[protocol.Step]) -> list[list[bytes | memoryview]]:
        step = steps[0]
        if step.session == 1:  # two tokens, then the stage fails
            return [
                _result(step, 1),
                _result(step, 2),
                protocol.encode(protocol.Error(1, step.seq, 0, "boom")),
            ]
        return [_result(step, 3)]  # session 2: one token of a run of 5, then silence

    fake = stage(script)

    async def scenario() -> None:
        link = ZmqLink(fake.head, fake.tail, timeout=10)
        try:
            failing = await link.stream(_run_step(1, 5))
            assert [int((await failing.next())[0].tokens[0]) for _ in range(2)] == [1, 2]
            with pytest.raises(StageFailure, match="stage 0: boom"):
                await failing.next()
            assert failing.failure is not None and not failing.done
            silent = await link.stream(_run_step(2, 5))
            assert int((await silent.next())[0].tokens[0]) == 3
            link.block(StageLost("stage-0 lost"))
            with pytest.raises(StageLost, match="stage-0 lost"):
                await silent.next()
            with pytest.raises(StageLost):
                await link.stream(_run_step(3, 5))
        finally:
            await link.close()

    asyncio.run(scenario())
