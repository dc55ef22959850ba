"""Provides the wire contract: versioned frames exchanged between the coordinator, the stages and
the draft.

A message is a ZeroMQ multipart: frame 0 is a fixed little-endian header, the other frames are raw
numpy buffers (never pickle). `encode` turns a message dataclass into frames; `decode` validates
every size, dtype, range and count before anything is used and raises `ProtocolError` on the first
problem, so a receiver can count the frame as dropped and carry on.

Message flow (daisy chain): coordinator -> stage 0 -> stage 1 -> ... -> last stage -> coordinator.
Control messages (Hello, Open, Close, Reset, Compact, Cancel) travel the same chain so they stay
ordered with the steps of their session; the last stage answers them with an Ack. A stage that
cannot serve a message sends an Error down the chain instead, so the coordinator never waits
forever.

Batches: several messages of distinct sessions may travel as one multipart (`encode_batch`): a BATCH
header whose count is the number of messages, a frame of each message's frame count, then each
message's own frames. `split` undoes it; every message inside is then decoded and validated on its
own, so one bad message is refused alone. A stage serves the steps of one batch as one batched
inference.

Attention-mask deltas: every stage keeps, per session, a mask over its physical KV slots. A Step
carries only the physical slot ranges to mask from now on (`mask_ranges`, half-open) plus the
logical position of its first token, never the full mask.

Runs: a Step with `run` = R > 1 asks the pipeline to generate R tokens by itself, feeding each token
the last stage scores back in as the next step, without waiting for the coordinator: a one-stage
pipeline queues it behind its own work, the last stage of a longer one sends it to stage 0
(`looped`, over its `loop` link). Every token comes back as its own Result, all with the run's seq,
in order. The run ends after R tokens, or earlier when any control message of its session (Cancel,
which does nothing else) reaches stage 0: stage 0 then drops the run's next step, so the Ack of that
message follows the run's last Result."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Union

import numpy as np

from remote_worker.decode_spec import (  # noqa: F401 - re-exported: protocol is the wire contract
    DECODE,
    DECODE_FRAMES,
    MAX_DRAFT,
    MAX_MASK_WORDS,
    MAX_PENALTY,
    MAX_PENALTY_IDS,
    MAX_REPETITION_PENALTY,
    MAX_SUPPORT,
    MAX_TOP,
    Decode,
    ProtocolError,
    array_of,
    decode_frames,
    parse_decode,
    raw_buffer,
)

MAGIC = b"FLTW"
VERSION = 5  # 2: Decode carries penalties; 3: runs, Cancel; 4: Batch containers; 5: token masks
MAX_TOKENS_PER_STEP = 1 << 16
MAX_MASK_RANGES = 1 << 14
MAX_TRACE = 256
MAX_TEXT = 4096
MAX_RUN = 1 << 16  # tokens one Step may ask a one-stage pipeline to generate on its own

# magic, version, kind, flags, session, seq, pos0, cache_len, n, width, count_a, count_b
HEADER = struct.Struct("<4sHBBIIIIIIII")

FLAG_F16 = 1  # hidden payload is float16 (else float32)
FLAG_LOOPED = 2  # a run's next step, sent back to stage 0 by the last stage of a longer chain


class Kind(IntEnum):
    HELLO = 1
    OPEN = 2
    CLOSE = 3
    RESET = 4
    COMPACT = 5
    STEP = 6
    CANCEL = 8
    PROPOSE = 7
    ACK = 16
    RESULT = 17
    PROPOSAL = 18
    ERROR = 19
    BATCH = 32


class RequestError(ProtocolError):
    """A request whose header is sound but whose body is not: it is answered with an Error, not
    dropped.

    `kind`, `session` and `seq` come from the validated header, so the refusal can travel down the
    chain to the coordinator and fail the request at once instead of leaving it to time out."""

    def __init__(self, reason: str, kind: Kind, session: int, seq: int) -> None:
        super().__init__(reason)
        self.kind = kind
        self.session = session
        self.seq = seq


@dataclass(frozen=True)
class Hello:
    seq: int
    trace: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))


@dataclass(frozen=True)
class Control:
    """Open, Close, Reset, Compact or Cancel (end its run) a session on every stage of the chain."""

    kind: Kind
    session: int
    seq: int
    cache_len: int = 0  # Compact: physical length the coordinator expects before compaction


@dataclass(frozen=True)
class Step:
    """Feed n tokens of one session through the chain.

    `tokens` (int64 [n]) enters stage 0; `hidden` ([n, H] float16/float32) travels between stages.
    `cache_len` is the physical KV length before the step (each stage checks it against its own),
    `pos0` the logical position of the first new token. `decode` is None for prefill chunks whose
    logits nobody needs except the last position's (then it is Decode() with no draft).
    """

    session: int
    seq: int
    pos0: int
    cache_len: int
    mask_ranges: np.ndarray  # int64 [m, 2], physical half-open ranges to mask before this step
    tokens: np.ndarray | None = None
    hidden: np.ndarray | None = None
    decode: Decode | None = None
    trace: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    run: int = 0  # > 1: the pipeline generates this many tokens on its own (see the module doc)
    looped: bool = False  # a run's next step, sent back to stage 0 by the last stage

    @property
    def n(self) -> int:
        data = self.tokens if self.tokens is not None else self.hidden
        assert data is not None
        return int(data.shape[0])


@dataclass(frozen=True)
class Propose:
    """Ask a draft worker to feed `tokens` then propose `k` tokens (sampled per `decode` or greedy).

    `decode.uniforms` needs k numbers when sampling; `decode.top_k`/`top_p`/`temperature` shape the
    proposal distribution, which is truncated to `support` ids and returned so the target can apply
    the acceptance rule exactly. The draft's cache grows by len(tokens) + k - 1 slots."""

    session: int
    seq: int
    pos0: int
    cache_len: int
    mask_ranges: np.ndarray
    tokens: np.ndarray
    k: int
    support: int
    decode: Decode


@dataclass(frozen=True)
class Ack:
    kind: Kind  # the control kind acknowledged
    session: int
    seq: int
    value: int = 0  # Compact: new physical length; Hello: number of stages
    trace: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))


@dataclass(frozen=True)
class Result:
    """Tokens emitted by a verify/decode step: accepted drafts then one correction or bonus
    token."""

    session: int
    seq: int
    tokens: np.ndarray  # int64 [accepted + 1]
    accepted: int
    top_ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    top_logprobs: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    trace: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))


@dataclass(frozen=True)
class Proposal:
    session: int
    seq: int
    tokens: np.ndarray  # int64 [k]
    ids: np.ndarray  # int64 [k, support] proposal distribution support (empty when greedy)
    probs: np.ndarray  # float32 [k, support]
    trace: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))


@dataclass(frozen=True)
class Error:
    session: int
    seq: int
    stage: int
    message: str


Message = Union[Hello, Control, Step, Propose, Ack, Result, Proposal, Error]
TRACE_FIELDS = 5  # per stage: stage index, received, started, finished, sent (time.time() seconds)


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
    return HEADER.pack(
        MAGIC, VERSION, kind, flags, session, seq, pos0, cache_len, n, width, count_a, count_b
    )


def encode(message: Message) -> list[bytes | memoryview]:
    """Frames for one message, ready for `socket.send_multipart(frames, copy=False)`."""
    if isinstance(message, Hello):
        return [_header(Kind.HELLO, seq=message.seq), raw_buffer(message.trace, np.float64)]
    if isinstance(message, Control):
        return [
            _header(
                message.kind, session=message.session, seq=message.seq, cache_len=message.cache_len
            )
        ]
    if isinstance(message, Step):
        if (message.tokens is None) == (message.hidden is None):
            raise ProtocolError("a step carries either tokens or hidden states")
        ranges = raw_buffer(message.mask_ranges.reshape(-1, 2), np.int64)
        if message.tokens is not None:
            flags, width, data = (
                FLAG_LOOPED if message.looped else 0,
                0,
                raw_buffer(message.tokens, np.int64),
            )
        else:
            hidden = message.hidden
            assert hidden is not None
            # anything that is not float16 travels as float32, as the flag promises
            flags = FLAG_F16 if hidden.dtype == np.float16 else 0
            width, data = (
                int(hidden.shape[1]),
                raw_buffer(hidden, np.float16 if flags else np.float32),
            )
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
            message.run,
        )
        return [
            header,
            ranges,
            data,
            *decode_frames(message.decode),
            raw_buffer(message.trace, np.float64),
        ]
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
            raw_buffer(message.mask_ranges.reshape(-1, 2), np.int64),
            raw_buffer(message.tokens, np.int64),
            *decode_frames(message.decode),
        ]
    if isinstance(message, Ack):
        header = _header(
            Kind.ACK,
            0,
            message.session,
            message.seq,
            count_a=int(message.kind),
            count_b=message.value,
        )
        return [header, raw_buffer(message.trace, np.float64)]
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
            raw_buffer(message.tokens, np.int64),
            raw_buffer(message.top_ids, np.int64),
            raw_buffer(message.top_logprobs, np.float32),
            raw_buffer(message.trace, np.float64),
        ]
    if isinstance(message, Proposal):
        support = message.ids.shape[1] if message.ids.ndim == 2 else 0
        header = _header(
            Kind.PROPOSAL, 0, message.session, message.seq, n=len(message.tokens), count_a=support
        )
        return [
            header,
            raw_buffer(message.tokens, np.int64),
            raw_buffer(message.ids, np.int64),
            raw_buffer(message.probs, np.float32),
            raw_buffer(message.trace, np.float64),
        ]
    if isinstance(message, Error):
        text = message.message.encode("utf-8")[:MAX_TEXT]
        return [_header(Kind.ERROR, 0, message.session, message.seq, count_a=message.stage), text]
    raise ProtocolError(f"cannot encode {type(message).__name__}")


def _trace(frame: bytes | memoryview) -> np.ndarray:
    if len(frame) % 8 or len(frame) // 8 > MAX_TRACE * TRACE_FIELDS:
        raise ProtocolError(f"trace: bad length {len(frame)}")
    return np.frombuffer(frame, dtype=np.float64).copy()


def _ranges(frame: bytes | memoryview, count: int) -> np.ndarray:
    if count > MAX_MASK_RANGES:
        raise ProtocolError(f"mask: {count} ranges is too many")
    ranges = array_of(frame, np.int64, 2 * count, "mask ranges").reshape(count, 2)
    if count and (int(ranges.min()) < 0 or bool(np.any(ranges[:, 1] <= ranges[:, 0]))):
        raise ProtocolError("mask: ranges must be non-empty and non-negative")
    return ranges


MAX_BATCH = 1024  # messages in one Batch container


def encode_batch(messages: Sequence[Message]) -> list[bytes | memoryview]:
    """Frames for several messages sent as one (a single message is sent as itself)."""
    return batch_frames([encode(message) for message in messages])


def batch_frames(parts: Sequence[list[bytes | memoryview]]) -> list[bytes | memoryview]:
    """One multipart for several encoded messages (see `encode_batch`)."""
    if len(parts) == 1:
        return parts[0]
    counts = np.asarray([len(part) for part in parts], np.uint32)
    frames: list[bytes | memoryview] = [_header(Kind.BATCH, count_a=len(parts)), counts.tobytes()]
    for part in parts:
        frames.extend(part)
    return frames


def split(frames: Sequence[bytes | memoryview]) -> list[Sequence[bytes | memoryview]]:
    """The messages in a multipart: those of a Batch container, else the multipart itself as the
    one."""
    if not frames or len(frames[0]) != HEADER.size or bytes(frames[0][6:7]) != bytes([Kind.BATCH]):
        return [frames]
    magic, version, _, _, _, _, _, _, _, _, count, _ = HEADER.unpack(frames[0])
    if magic != MAGIC or version != VERSION:
        raise ProtocolError("batch: bad magic or protocol version")
    if not 1 <= count <= MAX_BATCH or len(frames) < 2:
        raise ProtocolError(f"batch: {count} messages, expected 1..{MAX_BATCH}")
    counts = array_of(frames[1], np.uint32, count, "batch frame counts")
    if int(counts.min()) < 1 or int(counts.sum()) != len(frames) - 2:
        raise ProtocolError(
            f"batch: frame counts sum to {int(counts.sum())}, it has {len(frames) - 2}"
        )
    ends = np.cumsum(counts) + 2
    return [frames[int(end - size) : int(end)] for end, size in zip(ends, counts, strict=True)]


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
            return _request(
                kind, body, flags, session, seq, pos0, cache_len, n, width, count_a, count_b
            )
        except ProtocolError as error:  # the header is sound: say so to whoever sent it
            raise RequestError(str(error), kind, session, seq) from None
    return _reply(kind, body, session, seq, n, count_a, count_b)


_CONTROLS = frozenset({Kind.OPEN, Kind.CLOSE, Kind.RESET, Kind.COMPACT, Kind.CANCEL})
_REQUESTS = _CONTROLS | {Kind.HELLO, Kind.STEP, Kind.PROPOSE}


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
    if kind in _CONTROLS:
        expect(0)
        return Control(kind, session, seq, cache_len)
    if kind == Kind.STEP:
        expect(3 + DECODE_FRAMES)
        if not 0 < n <= MAX_TOKENS_PER_STEP:
            raise ProtocolError(f"step: {n} tokens")
        ranges = _ranges(body[0], count_a)
        if width == 0:
            tokens = array_of(body[1], np.int64, n, "tokens")
            if int(tokens.min()) < 0:
                raise ProtocolError("step: negative token id")
            hidden = None
        else:
            if width > 1 << 16:
                raise ProtocolError(f"step: hidden width {width}")
            dtype = np.float16 if flags & FLAG_F16 else np.float32
            hidden = array_of(body[1], dtype, n * width, "hidden").reshape(n, width)
            tokens = None
        if count_b > MAX_RUN:
            raise ProtocolError(f"step: a run of {count_b} tokens (at most {MAX_RUN})")
        step_decode = parse_decode(body[2 : 2 + DECODE_FRAMES], n - 1, run=count_b)
        if count_b > 1 and (step_decode is None or len(step_decode.draft_tokens)):
            raise ProtocolError("step: a run needs a decode without drafts")
        trace = _trace(body[2 + DECODE_FRAMES])
        looped = bool(flags & FLAG_LOOPED)
        if looped and (tokens is None or n != 1 or count_b < 1):
            raise ProtocolError("step: a looped step carries one token of a run")
        return Step(
            session,
            seq,
            pos0,
            cache_len,
            ranges,
            tokens,
            hidden,
            step_decode,
            trace,
            count_b,
            looped,
        )
    if kind == Kind.PROPOSE:
        expect(2 + DECODE_FRAMES)
        k, support = count_b & 0xFFFF, count_b >> 16
        if not 0 < n <= MAX_TOKENS_PER_STEP or not 0 < k <= MAX_DRAFT or support > MAX_SUPPORT:
            raise ProtocolError(f"propose: {n} tokens, k={k}, support={support}")
        ranges = _ranges(body[0], count_a)
        tokens = array_of(body[1], np.int64, n, "tokens")
        if int(tokens.min()) < 0:
            raise ProtocolError("propose: negative token id")
        propose_decode = parse_decode(body[2 : 2 + DECODE_FRAMES], 0, proposals=k)
        if propose_decode is None:
            raise ProtocolError("propose: missing decode header")
        return Propose(session, seq, pos0, cache_len, ranges, tokens, k, support, propose_decode)
    raise ProtocolError(f"header: kind {kind.name} is not a request")  # pragma: no cover


def _reply(
    kind: Kind,
    body: Sequence[bytes | memoryview],
    session: int,
    seq: int,
    n: int,
    count_a: int,
    count_b: int,
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
        tokens = array_of(body[0], np.int64, n, "tokens")
        rows = len(body[1]) // 8 // count_b if count_b else 0
        top_ids = array_of(body[1], np.int64, rows * count_b, "top ids").reshape(rows, count_b)
        top_logprobs = array_of(body[2], np.float32, rows * count_b, "top logprobs").reshape(
            rows, count_b
        )
        return Result(session, seq, tokens, count_a, top_ids, top_logprobs, _trace(body[3]))
    if kind == Kind.PROPOSAL:
        expect(4)
        if not 0 < n <= MAX_DRAFT or count_a > MAX_SUPPORT:
            raise ProtocolError(f"proposal: {n} tokens, support {count_a}")
        tokens = array_of(body[0], np.int64, n, "tokens")
        ids = array_of(body[1], np.int64, n * count_a, "proposal ids").reshape(n, count_a)
        probs = array_of(body[2], np.float32, n * count_a, "proposal probs").reshape(n, count_a)
        return Proposal(session, seq, tokens, ids, probs, _trace(body[3]))
    if kind == Kind.ERROR:
        expect(1)
        if len(body[0]) > MAX_TEXT:
            raise ProtocolError("error: text too long")
        return Error(session, seq, count_a, bytes(body[0]).decode("utf-8", errors="replace"))
    raise ProtocolError(f"header: kind {kind.name} is not a message")  # pragma: no cover


def trace_records(trace: np.ndarray) -> list[list[float]]:
    """The trace as one [stage, received, started, finished, sent] list per stage (plain floats: a
    few stages are read on every token's path, where numpy on tiny arrays costs more than it
    saves)."""
    values = trace.tolist()
    return [values[start : start + TRACE_FIELDS] for start in range(0, len(values), TRACE_FIELDS)]


def append_trace(
    trace: np.ndarray, stage: int, received: float, started: float, finished: float, sent: float
) -> np.ndarray:
    """The trace with one more stage record (the stages append as the message travels)."""
    return np.concatenate([trace, np.array([stage, received, started, finished, sent], np.float64)])
