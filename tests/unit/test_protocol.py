"""Tests for remote_worker.protocol: every message kind round-trips, malformed frames raise
ProtocolError."""

from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest

from remote_worker import protocol
from remote_worker.protocol import (
    Ack,
    Control,
    Decode,
    Error,
    Hello,
    Kind,
    Proposal,
    Propose,
    ProtocolError,
    Result,
    Step,
    append_trace,
    decode,
    encode,
)

RNG = np.random.default_rng(1)
TRACE = append_trace(np.zeros(0), 0, 1.0, 2.0, 3.0, 4.0)
RANGES = np.array([[3, 5], [9, 10]], np.int64)
SAMPLING = Decode(
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    draft_tokens=np.array([5, 6], np.int64),
    draft_ids=np.array([[5, 1, 2], [6, 7, 8]], np.int64),
    draft_probs=np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]], np.float32),
    uniforms=RNG.random(6),
    top_logprobs=4,
)


def _wire(frames: list) -> list[bytes]:
    """What a receiver gets: bytes frames."""
    return [bytes(frame) for frame in frames]


def _roundtrip(message: protocol.Message) -> protocol.Message:
    return decode(_wire(encode(message)))


def _same(left: object, right: object) -> None:
    assert type(left) is type(right)
    for name in left.__dataclass_fields__:  # type: ignore[attr-defined]
        a, b = getattr(left, name), getattr(right, name)
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            assert a is not None and b is not None, name
            if (
                np.asarray(a).size == 0 and np.asarray(b).size == 0
            ):  # (k, 0) and (0, 0) are the same nothing
                continue
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
            assert np.asarray(a).dtype == np.asarray(b).dtype, name
        elif hasattr(a, "__dataclass_fields__"):
            _same(a, b)
        elif isinstance(a, float):  # temperature and top_p travel as float32
            assert a == pytest.approx(b, rel=1e-6), name
        else:
            assert a == b, name


MESSAGES = [
    Hello(7, TRACE),
    Control(Kind.OPEN, 3, 1),
    Control(Kind.CLOSE, 3, 2),
    Control(Kind.RESET, 3, 3),
    Control(Kind.COMPACT, 3, 4, cache_len=321),
    Step(
        1,
        2,
        pos0=10,
        cache_len=12,
        mask_ranges=RANGES,
        tokens=np.array([1, 2, 3], np.int64),
        decode=Decode(draft_tokens=np.array([4, 5], np.int64)),
        trace=TRACE,
    ),
    Step(
        1,
        2,
        pos0=10,
        cache_len=12,
        mask_ranges=np.zeros((0, 2), np.int64),
        tokens=np.array([9], np.int64),
    ),
    Step(
        1,
        3,
        pos0=10,
        cache_len=12,
        mask_ranges=RANGES,
        hidden=RNG.normal(size=(3, 8)).astype(np.float16),
        decode=SAMPLING,
        trace=TRACE,
    ),
    Step(
        1,
        4,
        pos0=0,
        cache_len=0,
        mask_ranges=np.zeros((0, 2), np.int64),
        hidden=RNG.normal(size=(2, 8)).astype(np.float32),
    ),
    Propose(
        2,
        5,
        pos0=4,
        cache_len=6,
        mask_ranges=RANGES,
        tokens=np.array([8, 9], np.int64),
        k=3,
        support=16,
        decode=Decode(temperature=1.0, uniforms=RNG.random(3)),
    ),
    Propose(
        2,
        6,
        pos0=4,
        cache_len=6,
        mask_ranges=np.zeros((0, 2), np.int64),
        tokens=np.array([8], np.int64),
        k=4,
        support=0,
        decode=Decode(),
    ),
    Ack(Kind.COMPACT, 3, 4, 200, TRACE),
    Ack(Kind.HELLO, 0, 7, 3),
    Result(
        1,
        2,
        np.array([4, 5, 6], np.int64),
        2,
        RNG.integers(0, 100, (3, 4)),
        RNG.random((3, 4)).astype(np.float32),
        TRACE,
    ),
    Result(1, 2, np.array([4], np.int64), 0),
    Proposal(
        2,
        5,
        np.array([1, 2, 3], np.int64),
        RNG.integers(0, 100, (3, 16)),
        RNG.random((3, 16)).astype(np.float32),
        TRACE,
    ),
    Proposal(
        2, 6, np.array([1, 2], np.int64), np.zeros((2, 0), np.int64), np.zeros((2, 0), np.float32)
    ),
    Error(1, 2, 1, "session 1: step expects 12 cached slots — stage 1 has 11"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: protocol.Message) -> None:
    _same(_roundtrip(message), message)


def test_float64_hidden_travels_as_float32() -> None:
    step = Step(1, 1, 0, 0, np.zeros((0, 2), np.int64), hidden=np.ones((2, 4), np.float64))
    received = _roundtrip(step)
    assert (
        isinstance(received, Step)
        and received.hidden is not None
        and received.hidden.dtype == np.float32
    )


def test_append_trace_grows_by_one_record() -> None:
    trace = append_trace(TRACE, 1, 5.0, 6.0, 7.0, 8.0)
    assert trace.shape == (2 * protocol.TRACE_FIELDS,) and trace[protocol.TRACE_FIELDS] == 1


def _step_frames() -> list[bytes]:
    return _wire(encode(MESSAGES[7]))


def _header(frames: list[bytes], **changes: int) -> list[bytes]:
    names = [
        "magic",
        "version",
        "kind",
        "flags",
        "session",
        "seq",
        "pos0",
        "cache_len",
        "n",
        "width",
        "count_a",
        "count_b",
    ]
    values = dict(zip(names, protocol.HEADER.unpack(frames[0]), strict=True))
    values.update(changes)
    return [protocol.HEADER.pack(*(values[name] for name in names)), *frames[1:]]


MALFORMED = {
    "empty": [],
    "short header": [b"FLTW\x01"],
    "bad magic": [b"XXXX" + _step_frames()[0][4:], *_step_frames()[1:]],
    "bad version": _header(_step_frames(), version=99),
    "unknown kind": _header(_step_frames(), kind=99),
    "too few frames": _step_frames()[:-1],
    "too many frames": [*_step_frames(), b""],
    "truncated hidden": [*_step_frames()[:2], _step_frames()[2][:-2], *_step_frames()[3:]],
    "truncated ranges": [_step_frames()[0], _step_frames()[1][:-8], *_step_frames()[2:]],
    "zero tokens": _header(_step_frames(), n=0),
    "absurd token count": _header(_step_frames(), n=1 << 30),
    "absurd width": _header(_step_frames(), width=1 << 20),
    "absurd range count": _header(_step_frames(), count_a=1 << 20),
    "empty range": [
        _step_frames()[0],
        np.array([[5, 5], [9, 10]], np.int64).tobytes(),
        *_step_frames()[2:],
    ],
    "negative range": [
        _step_frames()[0],
        np.array([[-1, 5], [9, 10]], np.int64).tobytes(),
        *_step_frames()[2:],
    ],
    "bad decode header": [*_step_frames()[:3], b"\x00" * 5, *_step_frames()[4:]],
    "arrays without decode": _wire(encode(MESSAGES[8]))[:3]
    + [b"", b"\x00" * 8, b"", b"", b""]
    + [b""],
    "more drafts than tokens": _wire(
        encode(
            Step(
                1,
                1,
                0,
                0,
                np.zeros((0, 2), np.int64),
                tokens=np.array([1, 2]),
                decode=Decode(draft_tokens=np.array([3, 4], np.int64)),
            )
        )
    ),
    "uniform of 1.0": [
        *_step_frames()[:7],
        np.concatenate([np.full(5, 0.5), [1.0]]).tobytes(),
        _step_frames()[8],
    ],
    "nan temperature": [
        *_step_frames()[:3],
        struct.pack("<ffIHHHH", float("nan"), 0.9, 40, 2, 3, 4, 6),
        *_step_frames()[4:],
    ],
    "negative probability": [
        *_step_frames()[:6],
        np.array([[-0.5, 0.3, 0.2], [0.6, 0.3, 0.1]], np.float32).tobytes(),
        *_step_frames()[7:],
    ],
    "trace not float64 sized": [*_step_frames()[:8], b"\x00" * 12],
    "negative token": _wire(
        encode(Step(1, 1, 0, 0, np.zeros((0, 2), np.int64), tokens=np.array([1], np.int64)))
    )[:2]
    + [np.array([-4], np.int64).tobytes()]
    + [b""] * 6,
    "control with payload": [*_wire(encode(MESSAGES[1])), b"x"],
    "ack of unknown kind": _header(_wire(encode(MESSAGES[11])), count_a=77),
    "result accepting all": _header(_wire(encode(MESSAGES[13])), count_a=3),
    "result top rows mismatch": [
        *_wire(encode(MESSAGES[13]))[:3],
        b"\x00" * 4,
        _wire(encode(MESSAGES[13]))[4],
    ],
    "proposal too long": _header(_wire(encode(MESSAGES[15])), n=1000),
    "propose k zero": _header(_wire(encode(MESSAGES[9])), count_b=0 | (16 << 16)),
    "propose uniform count": _header(_wire(encode(MESSAGES[9])), count_b=5 | (16 << 16)),
    "error text too long": [_wire(encode(MESSAGES[-1]))[0], b"x" * (protocol.MAX_TEXT + 1)],
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_frames_raise_protocol_error(name: str) -> None:
    with pytest.raises(ProtocolError):
        decode(MALFORMED[name])


def test_random_garbage_never_escapes_as_another_exception() -> None:
    rng = np.random.default_rng(5)
    valid = [_wire(encode(message)) for message in MESSAGES]
    for trial in range(3000):
        frames = [bytearray(frame) for frame in valid[trial % len(valid)]]
        target = frames[int(rng.integers(len(frames)))]
        if target:
            for _ in range(int(rng.integers(1, 4))):
                target[int(rng.integers(len(target)))] = int(rng.integers(256))
        with contextlib.suppress(ProtocolError):  # anything else escaping fails the test
            decode([bytes(frame) for frame in frames])


# -- the typed control plane: telemetry samples and ping replies are validated like data frames
# ----------


def test_telemetry_samples_and_ping_replies_are_validated_and_keep_unknown_fields() -> None:
    import math

    from remote_worker.replies import PingReply, ReplyError, TelemetrySample

    good = {
        "name": "a",
        "stage": 0,
        "role": "stage",
        "state": "ready",
        "time": 1.0,
        "steps_per_s": 2.0,
        "tokens_per_s": 3.0,
        "busy": 0.5,
        "queue": 1,
        "last_step_ms": 4.0,
        "rss_mb": 300.0,
        "temp_c": None,
        "sessions": 2,
        "cache_slots": 64,
        "dropped": 0,
        "errors": 0,
        "pid": 7,
        "lease_left": 12.5,
    }
    sample = TelemetrySample.parse(good)
    assert sample.sessions == 2 and sample.temp_c is None and sample.extra == {"lease_left": 12.5}
    assert TelemetrySample.parse(sample.to_dict()) == sample
    for broken in (
        {**good, "busy": math.nan},
        {**good, "state": "asleep"},
        {**good, "queue": "1"},
        {key: value for key, value in good.items() if key != "sessions"},
        [good],
    ):
        with pytest.raises(ReplyError):
            TelemetrySample.parse(broken)
    reply = PingReply.parse(
        {
            "state": "ready",
            "stage": 1,
            "name": "b",
            "pid": 9,
            "role": "stage",
            "deployment": "d1",
            "properties": {"INFERENCE_PRECISION_HINT": "f32"},
            "layers": [15, 30],
            "busy_since": None,
        }
    )
    assert reply.layers == (15, 30) and reply.properties["INFERENCE_PRECISION_HINT"] == "f32"
    assert reply.extra == {"busy_since": None}
    with pytest.raises(ReplyError):
        PingReply.parse(
            {
                "state": "ready",
                "stage": 1,
                "name": "b",
                "pid": "9",
                "role": "stage",
                "deployment": "x",
            }
        )


def test_decode_penalties_round_trip_and_out_of_range_is_a_request_error() -> None:
    import numpy as np

    from remote_worker import protocol

    decode = protocol.Decode(
        frequency_penalty=0.5,
        presence_penalty=-1.0,
        repetition_penalty=1.2,
        penalty_ids=np.array([2, 9, 40], np.int64),
        penalty_counts=np.array([0, 1, 3], np.int32),
    )
    step = protocol.Step(
        4, 9, 0, 0, np.zeros((0, 2), np.int64), tokens=np.array([1, 2], np.int64), decode=decode
    )
    back = protocol.decode([bytes(f) for f in protocol.encode(step)])
    assert isinstance(back, protocol.Step) and back.decode is not None
    assert back.decode.penalty_ids.tolist() == [
        2,
        9,
        40,
    ] and back.decode.penalty_counts.tolist() == [0, 1, 3]
    assert (
        back.decode.repetition_penalty == pytest.approx(1.2)
        and back.decode.presence_penalty == -1.0
    )
    for bad in (
        {"top_p": 2.0},
        {"temperature": -1.0},
        {"frequency_penalty": 3.0},
        {"repetition_penalty": 0.0},
        {"penalty_ids": np.array([9, 2], np.int64), "penalty_counts": np.zeros(2, np.int32)},
    ):
        wrong = protocol.Step(
            4,
            11,
            0,
            0,
            np.zeros((0, 2), np.int64),
            tokens=np.array([1], np.int64),
            decode=protocol.Decode(**bad),
        )
        with pytest.raises(protocol.RequestError) as caught:
            protocol.decode([bytes(f) for f in protocol.encode(wrong)])
        assert (
            caught.value.session == 4
            and caught.value.seq == 11
            and caught.value.kind == protocol.Kind.STEP
        )
    with pytest.raises(protocol.ProtocolError) as dropped:
        protocol.decode([b"garbage"])
    assert not isinstance(dropped.value, protocol.RequestError)


def test_a_run_and_a_cancel_round_trip_and_a_bad_run_is_a_request_error() -> None:
    """A run's Step carries its length and 2 uniforms per token; a run with drafts, the uniforms of
    another length or a length beyond MAX_RUN is refused (answered, not dropped)."""
    no_ranges = np.zeros((0, 2), np.int64)
    run = Step(
        3,
        4,
        10,
        12,
        no_ranges,
        tokens=np.array([1, 2, 3], np.int64),
        decode=Decode(0.7, uniforms=RNG.random(8)),
        run=4,
    )
    _same(_roundtrip(run), run)
    cancel = Control(Kind.CANCEL, 3, 5)
    _same(_roundtrip(cancel), cancel)
    drafts = Decode(draft_tokens=np.array([7], np.int64))
    bad = {
        "drafts": Step(
            3, 6, 0, 0, no_ranges, tokens=np.array([1, 2], np.int64), decode=drafts, run=4
        ),
        "uniforms": Step(
            3,
            6,
            0,
            0,
            no_ranges,
            tokens=np.array([1], np.int64),
            decode=Decode(0.7, uniforms=RNG.random(6)),
            run=4,
        ),
        "no decode": Step(3, 6, 0, 0, no_ranges, tokens=np.array([1], np.int64), run=4),
    }
    frames = {name: _wire(encode(step)) for name, step in bad.items()}
    frames["too long"] = _header(_wire(encode(run)), count_b=protocol.MAX_RUN + 1)
    for name, wire in frames.items():
        with pytest.raises(protocol.RequestError) as caught:
            decode(wire)
        assert (caught.value.session, caught.value.kind) == (3, Kind.STEP), name
