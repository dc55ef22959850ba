"""Provides the wire contract: versioned frames exchanged between the coordinator, the stages and the draft.

A message is a ZeroMQ multipart: frame 0 is a fixed little-endian header, the other frames are raw numpy
buffers (never pickle). `encode` turns a message dataclass into frames; `decode` validates every size,
dtype, range and count before anything is used and raises `ProtocolError` on the first problem, so a
receiver can count the frame as dropped and carry on.

Message flow (daisy chain): coordinator -> stage 0 -> stage 1 -> ... -> last stage -> coordinator.
Control messages (Hello, Open, Close, Reset, Compact) travel the same chain so they stay ordered with
the steps of their session; the last stage answers them with an Ack. A stage that cannot serve a message
sends an Error down the chain instead, so the coordinator never waits forever.

Attention-mask deltas: every stage keeps, per session, a mask over its physical KV slots. A Step carries
only the physical slot ranges to mask from now on (`mask_ranges`, half-open) plus the logical position of
its first token, never the full mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from remote_worker.messages import (  # the vocabulary, re-exported: protocol.Step etc.
    DECODE,
    DECODE_FRAMES,
    FLAG_F16,
    HEADER,
    MAGIC,
    MAX_DRAFT,
    MAX_MASK_RANGES,
    MAX_PENALTY,
    MAX_PENALTY_IDS,
    MAX_REPETITION_PENALTY,
    MAX_SUPPORT,
    MAX_TEXT,
    MAX_TOKENS_PER_STEP,
    MAX_TOP,
    MAX_TRACE,
    TRACE_FIELDS,
    VERSION,
    Ack,
    Control,
    Decode,
    Error,
    Hello,
    Kind,
    Message,
    Proposal,
    Propose,
    ProtocolError,
    RequestError,
    Result,
    Step,
)

__all__ = [
    "MAGIC",
    "VERSION",
    "MAX_TOKENS_PER_STEP",
    "MAX_MASK_RANGES",
    "MAX_DRAFT",
    "MAX_SUPPORT",
    "MAX_TOP",
    "MAX_TRACE",
    "MAX_TEXT",
    "MAX_PENALTY_IDS",
    "MAX_PENALTY",
    "MAX_REPETITION_PENALTY",
    "HEADER",
    "DECODE",
    "DECODE_FRAMES",
    "FLAG_F16",
    "Kind",
    "ProtocolError",
    "RequestError",
    "Decode",
    "Hello",
    "Control",
    "Step",
    "Propose",
    "Ack",
    "Result",
    "Proposal",
    "Error",
    "Message",
    "TRACE_FIELDS",
    "append_trace",
    "decode",
    "encode",
]


def _header(
    kind: int,
    flags: int = 0,
    session: int = 0,
    seq: int = 0,
    pos0: int = 0,
    cache_len: int = 0,
    n: int = 0,
    width: int = 0,
    count_a: int = 0,
    count_b: int = 0,
) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, flags, session, seq, pos0, cache_len, n, width, count_a, count_b)


def _raw(array: np.ndarray, dtype: type) -> memoryview:
    flat: Any = np.ascontiguousarray(array, dtype=dtype).reshape(-1).view(np.uint8)
    return memoryview(flat)


def _decode_frames(decode: Decode | None) -> list[bytes | memoryview]:
    if decode is None:
        return [b""] * DECODE_FRAMES
    k = len(decode.draft_tokens)
    support = decode.draft_ids.shape[1] if decode.draft_ids.ndim == 2 and decode.draft_ids.size else 0
    spec = DECODE.pack(
        float(decode.temperature),
        float(decode.top_p),
        int(decode.top_k),
        k,
        support,
        int(decode.top_logprobs),
        len(decode.uniforms),
        float(decode.frequency_penalty),
        float(decode.presence_penalty),
        float(decode.repetition_penalty),
        len(decode.penalty_ids),
    )
    return [
        spec,
        _raw(decode.draft_tokens, np.int64),
        _raw(decode.draft_ids, np.int64),
        _raw(decode.draft_probs, np.float32),
        _raw(decode.uniforms, np.float64),
        _raw(decode.penalty_ids, np.int64),
        _raw(decode.penalty_counts, np.int32),
    ]


def encode(message: Message) -> list[bytes | memoryview]:
    """Frames for one message, ready for `socket.send_multipart(frames, copy=False)`."""
    if isinstance(message, Hello):
        return [_header(Kind.HELLO, seq=message.seq), _raw(message.trace, np.float64)]
    if isinstance(message, Control):
        return [_header(message.kind, session=message.session, seq=message.seq, cache_len=message.cache_len)]
    if isinstance(message, Step):
        if (message.tokens is None) == (message.hidden is None):
            raise ProtocolError("a step carries either tokens or hidden states")
        ranges = _raw(message.mask_ranges.reshape(-1, 2), np.int64)
        if message.tokens is not None:
            flags, width, data = 0, 0, _raw(message.tokens, np.int64)
        else:
            hidden = message.hidden
            assert hidden is not None
            # anything that is not float16 travels as float32, as the flag promises
            flags = FLAG_F16 if hidden.dtype == np.float16 else 0
            width, data = int(hidden.shape[1]), _raw(hidden, np.float16 if flags else np.float32)
        header = _header(
            Kind.STEP,
            flags,
            message.session,
            message.seq,
            message.pos0,
            message.cache_len,
            message.n,
            width,
            len(message.mask_ranges),
        )
        return [header, ranges, data, *_decode_frames(message.decode), _raw(message.trace, np.float64)]
    if isinstance(message, Propose):
        header = _header(
            Kind.PROPOSE,
            0,
            message.session,
            message.seq,
            message.pos0,
            message.cache_len,
            len(message.tokens),
            0,
            len(message.mask_ranges),
            message.k | (message.support << 16),
        )
        return [
            header,
            _raw(message.mask_ranges.reshape(-1, 2), np.int64),
            _raw(message.tokens, np.int64),
            *_decode_frames(message.decode),
        ]
    if isinstance(message, Ack):
        header = _header(
            Kind.ACK, 0, message.session, message.seq, count_a=int(message.kind), count_b=message.value
        )
        return [header, _raw(message.trace, np.float64)]
    if isinstance(message, Result):
        top = message.top_ids.shape[1] if message.top_ids.ndim == 2 else 0
        header = _header(
            Kind.RESULT,
            0,
            message.session,
            message.seq,
            n=len(message.tokens),
            count_a=message.accepted,
            count_b=top,
        )
        return [
            header,
            _raw(message.tokens, np.int64),
            _raw(message.top_ids, np.int64),
            _raw(message.top_logprobs, np.float32),
            _raw(message.trace, np.float64),
        ]
    if isinstance(message, Proposal):
        support = message.ids.shape[1] if message.ids.ndim == 2 else 0
        header = _header(
            Kind.PROPOSAL, 0, message.session, message.seq, n=len(message.tokens), count_a=support
        )
        return [
            header,
            _raw(message.tokens, np.int64),
            _raw(message.ids, np.int64),
            _raw(message.probs, np.float32),
            _raw(message.trace, np.float64),
        ]
    if isinstance(message, Error):
        text = message.message.encode("utf-8")[:MAX_TEXT]
        return [_header(Kind.ERROR, 0, message.session, message.seq, count_a=message.stage), text]
    raise ProtocolError(f"cannot encode {type(message).__name__}")


def _array(frame: bytes | memoryview, dtype: type, count: int, what: str) -> np.ndarray:
    size = np.dtype(dtype).itemsize * count
    if len(frame) != size:
        raise ProtocolError(f"{what}: {len(frame)} bytes, expected {size}")
    return np.frombuffer(frame, dtype=dtype, count=count)


def _trace(frame: bytes | memoryview) -> np.ndarray:
    if len(frame) % 8 or len(frame) // 8 > MAX_TRACE * TRACE_FIELDS:
        raise ProtocolError(f"trace: bad length {len(frame)}")
    return np.frombuffer(frame, dtype=np.float64).copy()


def _parse_decode(frames: Sequence[bytes | memoryview], max_tokens: int, proposals: int = 0) -> Decode | None:
    """A Step's decode (`max_tokens` bounds the drafts) or, with `proposals` > 0, a Propose's (k uniforms)."""
    spec, tokens, ids, probs, uniforms, penalty_ids, penalty_counts = frames
    if len(spec) == 0:
        if any(len(f) for f in frames):
            raise ProtocolError("decode: arrays without a decode header")
        return None
    if len(spec) != DECODE.size:
        raise ProtocolError(f"decode header: {len(spec)} bytes, expected {DECODE.size}")
    (
        temperature,
        top_p,
        top_k,
        k,
        support,
        top_logprobs,
        n_uniforms,
        frequency,
        presence,
        repetition,
        n_ids,
    ) = DECODE.unpack(spec)
    if not (np.isfinite(temperature) and 0.0 <= temperature <= 100.0):
        raise ProtocolError(f"decode: temperature {temperature} out of range")
    if not (np.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise ProtocolError(f"decode: top_p {top_p} out of range")
    if k > min(MAX_DRAFT, max_tokens) or support > MAX_SUPPORT or top_logprobs > MAX_TOP:
        raise ProtocolError(f"decode: draft {k} / support {support} / top {top_logprobs} too large")
    allowed_uniforms = (0, proposals) if proposals else (0, 2 * (k + 1))
    if n_uniforms not in allowed_uniforms:
        raise ProtocolError(
            f"decode: {n_uniforms} uniforms for {proposals or k} {'proposals' if proposals else 'drafts'}"
        )
    draft_tokens = _array(tokens, np.int64, k, "draft tokens")
    draft_ids = _array(ids, np.int64, k * support, "draft ids").reshape(k, support)
    draft_probs = _array(probs, np.float32, k * support, "draft probs").reshape(k, support)
    u = _array(uniforms, np.float64, n_uniforms, "uniforms")
    if n_uniforms and not bool(np.all((u >= 0.0) & (u < 1.0))):
        raise ProtocolError("decode: uniforms outside [0, 1)")
    if draft_tokens.size and int(draft_tokens.min()) < 0:
        raise ProtocolError("decode: negative draft token")
    if draft_ids.size and int(draft_ids.min()) < 0:
        raise ProtocolError("decode: negative draft proposal id")
    if draft_probs.size and not bool(np.all(np.isfinite(draft_probs) & (draft_probs >= 0.0))):
        raise ProtocolError("decode: draft probabilities must be finite and non-negative")
    for name, value in (("frequency_penalty", frequency), ("presence_penalty", presence)):
        if not (np.isfinite(value) and abs(value) <= MAX_PENALTY):
            raise ProtocolError(f"decode: {name} {value} out of range")
    if not (np.isfinite(repetition) and 0.0 < repetition <= MAX_REPETITION_PENALTY):
        raise ProtocolError(f"decode: repetition_penalty {repetition} out of range")
    if n_ids > MAX_PENALTY_IDS:
        raise ProtocolError(f"decode: {n_ids} penalty ids is too many")
    context_ids = _array(penalty_ids, np.int64, n_ids, "penalty ids")
    counts = _array(penalty_counts, np.int32, n_ids, "penalty counts")
    if n_ids and (int(context_ids[0]) < 0 or bool(np.any(np.diff(context_ids) <= 0))):
        raise ProtocolError("decode: penalty ids must be unique, sorted and non-negative")
    if n_ids and int(counts.min()) < 0:
        raise ProtocolError("decode: negative penalty count")
    return Decode(
        temperature,
        top_p,
        top_k,
        draft_tokens,
        draft_ids,
        draft_probs,
        u,
        top_logprobs,
        frequency,
        presence,
        repetition,
        context_ids,
        counts,
    )


def _ranges(frame: bytes | memoryview, count: int) -> np.ndarray:
    if count > MAX_MASK_RANGES:
        raise ProtocolError(f"mask: {count} ranges is too many")
    ranges = _array(frame, np.int64, 2 * count, "mask ranges").reshape(count, 2)
    if count and (int(ranges.min()) < 0 or bool(np.any(ranges[:, 1] <= ranges[:, 0]))):
        raise ProtocolError("mask: ranges must be non-empty and non-negative")
    return ranges


def decode(frames: Sequence[bytes | memoryview]) -> Message:
    """Validate and parse one multipart message; raises ProtocolError with a one-line reason."""
    if not frames:
        raise ProtocolError("empty message")
    head = frames[0]
    if len(head) != HEADER.size:
        raise ProtocolError(f"header: {len(head)} bytes, expected {HEADER.size}")
    magic, version, kind_value, flags, session, seq, pos0, cache_len, n, width, count_a, count_b = (
        HEADER.unpack(head)
    )
    if magic != MAGIC:
        raise ProtocolError("header: bad magic")
    if version != VERSION:
        raise ProtocolError(f"header: protocol version {version}, this side speaks {VERSION}")
    try:
        kind = Kind(kind_value)
    except ValueError:
        raise ProtocolError(f"header: unknown kind {kind_value}") from None
    body = frames[1:]
    if kind in _REQUESTS:
        try:
            return _request(kind, body, flags, session, seq, pos0, cache_len, n, width, count_a, count_b)
        except ProtocolError as error:  # the header is sound: say so to whoever sent it
            raise RequestError(str(error), kind, session, seq) from None
    return _reply(kind, body, session, seq, n, count_a, count_b)


_REQUESTS = frozenset({Kind.HELLO, Kind.OPEN, Kind.CLOSE, Kind.RESET, Kind.COMPACT, Kind.STEP, Kind.PROPOSE})


def _expect(kind: Kind, body: Sequence[bytes | memoryview], count: int) -> None:
    if len(body) != count:
        raise ProtocolError(f"{kind.name}: {len(body)} payload frames, expected {count}")


def _request(
    kind: Kind,
    body: Sequence[bytes | memoryview],
    flags: int,
    session: int,
    seq: int,
    pos0: int,
    cache_len: int,
    n: int,
    width: int,
    count_a: int,
    count_b: int,
) -> Message:
    def expect(count: int) -> None:
        _expect(kind, body, count)

    if kind == Kind.HELLO:
        expect(1)
        return Hello(seq, _trace(body[0]))
    if kind in (Kind.OPEN, Kind.CLOSE, Kind.RESET, Kind.COMPACT):
        expect(0)
        return Control(kind, session, seq, cache_len)
    if kind == Kind.STEP:
        expect(3 + DECODE_FRAMES)
        if not 0 < n <= MAX_TOKENS_PER_STEP:
            raise ProtocolError(f"step: {n} tokens")
        ranges = _ranges(body[0], count_a)
        if width == 0:
            tokens = _array(body[1], np.int64, n, "tokens")
            if int(tokens.min()) < 0:
                raise ProtocolError("step: negative token id")
            hidden = None
        else:
            if width > 1 << 16:
                raise ProtocolError(f"step: hidden width {width}")
            dtype = np.float16 if flags & FLAG_F16 else np.float32
            hidden = _array(body[1], dtype, n * width, "hidden").reshape(n, width)
            tokens = None
        step_decode = _parse_decode(body[2 : 2 + DECODE_FRAMES], n - 1)
        trace = _trace(body[2 + DECODE_FRAMES])
        return Step(session, seq, pos0, cache_len, ranges, tokens, hidden, step_decode, trace)
    if kind == Kind.PROPOSE:
        expect(2 + DECODE_FRAMES)
        k, support = count_b & 0xFFFF, count_b >> 16
        if not 0 < n <= MAX_TOKENS_PER_STEP or not 0 < k <= MAX_DRAFT or support > MAX_SUPPORT:
            raise ProtocolError(f"propose: {n} tokens, k={k}, support={support}")
        ranges = _ranges(body[0], count_a)
        tokens = _array(body[1], np.int64, n, "tokens")
        if int(tokens.min()) < 0:
            raise ProtocolError("propose: negative token id")
        propose_decode = _parse_decode(body[2 : 2 + DECODE_FRAMES], 0, proposals=k)
        if propose_decode is None:
            raise ProtocolError("propose: missing decode header")
        return Propose(session, seq, pos0, cache_len, ranges, tokens, k, support, propose_decode)
    raise ProtocolError(f"header: kind {kind.name} is not a request")  # pragma: no cover


def _reply(
    kind: Kind, body: Sequence[bytes | memoryview], session: int, seq: int, n: int, count_a: int, count_b: int
) -> Message:
    def expect(count: int) -> None:
        _expect(kind, body, count)

    if kind == Kind.ACK:
        expect(1)
        try:
            acked = Kind(count_a)
        except ValueError:
            raise ProtocolError(f"ack: unknown kind {count_a}") from None
        return Ack(acked, session, seq, count_b, _trace(body[0]))
    if kind == Kind.RESULT:
        expect(4)
        if not 0 < n <= MAX_DRAFT + 1 or count_a >= n or count_b > MAX_TOP:
            raise ProtocolError(f"result: {n} tokens, {count_a} accepted, top {count_b}")
        tokens = _array(body[0], np.int64, n, "tokens")
        rows = len(body[1]) // 8 // count_b if count_b else 0
        top_ids = _array(body[1], np.int64, rows * count_b, "top ids").reshape(rows, count_b)
        top_logprobs = _array(body[2], np.float32, rows * count_b, "top logprobs").reshape(rows, count_b)
        return Result(session, seq, tokens, count_a, top_ids, top_logprobs, _trace(body[3]))
    if kind == Kind.PROPOSAL:
        expect(4)
        if not 0 < n <= MAX_DRAFT or count_a > MAX_SUPPORT:
            raise ProtocolError(f"proposal: {n} tokens, support {count_a}")
        tokens = _array(body[0], np.int64, n, "tokens")
        ids = _array(body[1], np.int64, n * count_a, "proposal ids").reshape(n, count_a)
        probs = _array(body[2], np.float32, n * count_a, "proposal probs").reshape(n, count_a)
        return Proposal(session, seq, tokens, ids, probs, _trace(body[3]))
    if kind == Kind.ERROR:
        expect(1)
        if len(body[0]) > MAX_TEXT:
            raise ProtocolError("error: text too long")
        return Error(session, seq, count_a, bytes(body[0]).decode("utf-8", errors="replace"))
    raise ProtocolError(f"header: kind {kind.name} is not a message")  # pragma: no cover


def append_trace(
    trace: np.ndarray, stage: int, received: float, started: float, finished: float, sent: float
) -> np.ndarray:
    """The trace with one more stage record (the stages append as the message travels)."""
    return np.concatenate([trace, np.array([stage, received, started, finished, sent], np.float64)])
