"""The last stage's coalescing of a run's Results (`remote_worker.coalesce`): held, then sent
together, in order, none lost, the first of a reply at once, and every held one ahead of any later
message."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from remote_worker import protocol
from remote_worker.coalesce import Coalescer
from remote_worker.config import ConfigError, StageConfig
from remote_worker.protocol import Ack, Control, Decode, Kind, Result, Step
from tests.support.workers import FakeEngine, free_port

NO_RANGES = np.zeros((0, 2), np.int64)


def _result(session: int, seq: int) -> Result:
    trace = np.array([0, 1.0, 2.0, 3.0, 3.5], np.float64)
    return Result(session, seq, np.array([seq], np.int64), 0, trace=trace)


def test_a_session_silent_for_the_interval_sends_at_once_then_holds_until_due() -> None:
    coalescer = Coalescer(0.040)
    # nothing sent before: the first token leaves now
    assert not coalescer.hold(_result(1, 1), now=10.0)
    coalescer.sent(1, 10.0)
    assert coalescer.hold(_result(1, 2), now=10.010) and coalescer.hold(_result(1, 3), now=10.020)
    assert not coalescer.hold(_result(2, 1), now=10.021)  # another session's first leaves at once
    # 40 ms after session 1's last send
    assert coalescer.seconds_to_due(10.030) == pytest.approx(0.010)
    before = time.time()
    held = coalescer.take(10.050)
    assert [(r.session, r.seq) for r in held] == [(1, 2), (1, 3)] and len(coalescer) == 0
    assert all(r.trace[-1] >= before for r in held)  # `sent` is when they really left
    assert coalescer.seconds_to_due(10.050) is None
    assert coalescer.hold(_result(1, 4), now=10.060)  # 10 ms after the burst: held again
    assert not coalescer.hold(_result(1, 5), now=10.095)  # the held one is due: this leaves with it


def test_interval_zero_holds_nothing_and_a_closed_session_starts_afresh() -> None:
    off = Coalescer(0.0)
    off.sent(1, 1.0)
    assert not off.hold(_result(1, 2), now=1.001) and len(off) == 0
    coalescer = Coalescer(0.040)
    coalescer.sent(1, 1.0)
    coalescer.forget(1)
    assert not coalescer.hold(_result(1, 2), now=1.001)


@pytest.mark.parametrize("value", [-1.0, 1001.0, True, "40"])
def test_the_worker_refuses_a_result_batch_outside_0_to_1000_ms(value: object) -> None:
    with pytest.raises(ConfigError, match="result_batch_ms"):
        StageConfig("s", "/x", 0, 5000, 5001, 5002, result_port=5003, result_batch_ms=value)  # type: ignore[arg-type]


class _OneStageEngine(FakeEngine):
    """A first and last stage: each step takes `seconds` and its logits pick token (position + 1)
    % 7."""

    is_first = is_last = True

    def __init__(self, seconds: float) -> None:
        super().__init__(np.zeros((1, 7), np.float32))
        self.seconds = seconds

    def close(self, session: int) -> None:
        self.sessions.pop(session, None)

    def step(self, session, pos0, cache_len, ranges, data, keep_last=0):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
        time.sleep(self.seconds)
        self.sessions[session] = cache_len + len(data)
        logits = np.zeros((len(data), 7), np.float32)
        for row in range(len(data)):
            logits[row, (pos0 + row + 1) % 7] = 1.0
        return logits[-keep_last:] if keep_last else logits


def test_a_runs_results_arrive_in_bursts_in_order_and_ahead_of_the_cancels_ack() -> None:
    from remote_worker.server import StageServer

    config = StageConfig(
        "one",
        "/unused",
        0,
        free_port(),
        free_port(),
        free_port(),
        result_port=free_port(),
        result_batch_ms=40,
    )
    server = StageServer(config, _OneStageEngine(0.010))
    context = zmq.Context()
    head = context.socket(zmq.PUSH)
    head.connect(f"tcp://127.0.0.1:{config.data_port}")
    tail = context.socket(zmq.PULL)
    tail.connect(f"tcp://127.0.0.1:{config.result_port}")
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        head.send_multipart(protocol.encode(Control(Kind.OPEN, 1, 1)))
        assert tail.poll(10_000) and isinstance(protocol.decode(tail.recv_multipart()), Ack)
        run = Step(
            1, 2, 0, 0, NO_RANGES, tokens=np.array([3, 4], np.int64), decode=Decode(), run=30
        )
        head.send_multipart(protocol.encode(run))
        arrivals: list[tuple[float, Result]] = []
        while len(arrivals) < 30:
            assert tail.poll(10_000), f"only {len(arrivals)} of the run's 30 Results arrived"
            message = protocol.decode(tail.recv_multipart())
            assert isinstance(message, Result), message
            arrivals.append((time.monotonic(), message))
        tokens = [int(result.tokens[-1]) for _, result in arrivals]
        assert tokens == [(position + 1) % 7 for position in range(1, 31)]  # every token, in order
        gaps = [
            later - earlier
            for (earlier, _), (later, _) in zip(arrivals, arrivals[1:], strict=False)
        ]
        bursts = 1 + sum(gap > 0.005 for gap in gaps)
        assert bursts <= 12, f"{bursts} bursts for 30 tokens made 10 ms apart: not coalesced"
        for _, result in arrivals:  # finished <= sent: `sent` is when the Result really left
            assert result.trace[3] <= result.trace[4]

        # a Cancel mid-run: its Ack follows every Result the run made, none is left held
        head.send_multipart(
            protocol.encode(
                Step(
                    1,
                    3,
                    32,
                    32,
                    NO_RANGES,
                    tokens=np.array([1], np.int64),
                    decode=Decode(),
                    run=1000,
                )
            )
        )
        assert tail.poll(10_000)
        time.sleep(0.1)
        head.send_multipart(protocol.encode(Control(Kind.CANCEL, 1, 4)))
        seen: list[object] = []
        while not seen or not isinstance(seen[-1], Ack):
            assert tail.poll(10_000), "the Cancel's Ack never came"
            seen.append(protocol.decode(tail.recv_multipart()))
        assert all(isinstance(message, Result) for message in seen[:-1]) and len(seen) > 5
        assert not tail.poll(200)  # nothing after the Ack: no Result was still held
    finally:
        server.stop()
        thread.join(10)
        server.close()
        context.destroy(linger=0)
