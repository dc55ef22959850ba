"""Provides the wire contract's vocabulary: limits, kinds, errors and the message dataclasses (see protocol)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Union

import numpy as np

MAGIC = b"FLTW"
VERSION = 2  # 2: Decode carries penalties (three floats, unique context ids and their counts)
MAX_TOKENS_PER_STEP = 1 << 16
MAX_MASK_RANGES = 1 << 14
MAX_DRAFT = 64
MAX_SUPPORT = 1024
MAX_TOP = 32
MAX_TRACE = 256
MAX_TEXT = 4096
MAX_PENALTY_IDS = 1 << 18
MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty| (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0

# magic, version, kind, flags, session, seq, pos0, cache_len, n, width, count_a, count_b
HEADER = struct.Struct("<4sHBBIIIIIIII")
# temperature, top_p, top_k, n_draft, support, top_logprobs, n_uniforms,
# frequency_penalty, presence_penalty, repetition_penalty, n_penalty_ids
DECODE = struct.Struct("<ffIHHHHfffI")
DECODE_FRAMES = 7  # spec, draft tokens, draft ids, draft probs, uniforms, penalty ids, penalty counts

FLAG_F16 = 1  # hidden payload is float16 (else float32)


class Kind(IntEnum):
    HELLO = 1
    OPEN = 2
    CLOSE = 3
    RESET = 4
    COMPACT = 5
    STEP = 6
    PROPOSE = 7
    ACK = 16
    RESULT = 17
    PROPOSAL = 18
    ERROR = 19


class ProtocolError(ValueError):
    """A frame that must be dropped; the message says why in one line."""


class RequestError(ProtocolError):
    """A request whose header is sound but whose body is not: it is answered with an Error, not dropped.

    `kind`, `session` and `seq` come from the validated header, so the refusal can travel down the chain to
    the coordinator and fail the request at once instead of leaving it to time out.
    """

    def __init__(self, reason: str, kind: Kind, session: int, seq: int) -> None:
        super().__init__(reason)
        self.kind = kind
        self.session = session
        self.seq = seq


@dataclass(frozen=True)
class Decode:
    """What the last stage must compute from the logits of a Step's trailing positions.

    The step's last `len(draft_tokens) + 1` positions are scored. Position j's logits judge draft token
    j (greedy: equality with the argmax; sampling: the distribution-preserving acceptance rule against the
    draft's sparse proposal distribution `draft_ids/draft_probs`). `uniforms` holds 2*(K+1) numbers in
    [0, 1): K+1 for acceptance tests, then K+1 for sampling, so results are reproducible from a seed.
    temperature == 0 means greedy. `top_logprobs` > 0 asks for that many (id, log-prob) pairs per scored
    position of the untempered distribution.

    Penalties are applied to the logits before greedy choice, sampling and acceptance. `penalty_ids` are the
    sorted unique token ids of the context before the scored window (prompt + reply so far) and
    `penalty_counts` how often each occurs in the reply so far; position j also counts draft tokens 0..j-1.
    `repetition_penalty` (HF/CTRL) applies to every context id, `frequency_penalty` x count and
    `presence_penalty` (OpenAI) to the ids with a count above 0.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    draft_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    draft_ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    draft_probs: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    uniforms: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    top_logprobs: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    penalty_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    penalty_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    @property
    def penalized(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def n_score(self) -> int:
        return len(self.draft_tokens) + 1


@dataclass(frozen=True)
class Hello:
    seq: int
    trace: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))


@dataclass(frozen=True)
class Control:
    """Open, Close, Reset or Compact a session on every stage of the chain."""

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

    @property
    def n(self) -> int:
        data = self.tokens if self.tokens is not None else self.hidden
        assert data is not None
        return int(data.shape[0])


@dataclass(frozen=True)
class Propose:
    """Ask a draft worker to feed `tokens` then propose `k` tokens (sampled per `decode` or greedy).

    `decode.uniforms` needs k numbers when sampling; `decode.top_k`/`top_p`/`temperature` shape the
    proposal distribution, which is truncated to `support` ids and returned so the target can apply the
    acceptance rule exactly. The draft's cache grows by len(tokens) + k - 1 slots.
    """

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
    """Tokens emitted by a verify/decode step: accepted drafts then one correction or bonus token."""

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
