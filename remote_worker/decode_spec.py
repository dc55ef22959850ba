"""Provides the wire form of `Decode` (what the last stage computes from a step's logits) and frame
helpers.

Part of the wire contract of `remote_worker.protocol`, which re-exports everything here: a Decode
travels as a fixed little-endian spec struct plus raw buffers (drafts, proposal distribution,
uniforms, penalty ids and counts, token masks); `parse_decode` validates every size, range and count
before use."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_DRAFT = 64
MAX_SUPPORT = 1024
MAX_TOP = 32
MAX_PENALTY_IDS = 1 << 18
MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty| (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0
MAX_MASK_WORDS = 1 << 16  # 32-bit words per token-mask row: vocabularies up to 2M tokens
# temperature, top_p, top_k, n_draft, support, top_logprobs, n_uniforms,
# frequency_penalty, presence_penalty, repetition_penalty, n_penalty_ids, mask_words
DECODE = struct.Struct("<ffIHHHHfffII")
# spec, draft tokens, draft ids, draft probs, uniforms, penalty ids, penalty counts, token mask
DECODE_FRAMES = 8


class ProtocolError(ValueError):
    """A frame that must be dropped; the message says why in one line."""


@dataclass(frozen=True)
class Decode:
    """What the last stage must compute from the logits of a Step's trailing positions.

    The step's last `len(draft_tokens) + 1` positions are scored. Position j's logits judge draft
    token j (greedy: equality with the argmax; sampling: the distribution-preserving acceptance rule
    against the draft's sparse proposal distribution `draft_ids/draft_probs`). `uniforms` holds
    2*(K+1) numbers in [0, 1): K+1 for acceptance tests, then K+1 for sampling, so results are
    reproducible from a seed (a run's Step holds 2 per token of the run, in order). temperature == 0
    means greedy. `top_logprobs` = n > 0 asks for n (id, log-prob) pairs per emitted token, of the
    untempered, unpenalised distribution at its position: the emitted token's own, then the n - 1
    most probable (OpenAI's `logprobs` with `top_logprobs` = n - 1).

    Penalties are applied to the logits before greedy choice, sampling and acceptance. `penalty_ids`
    are the sorted unique token ids of the context before the scored window (prompt + reply so far)
    and `penalty_counts` how often each occurs in the reply so far; position j also counts draft
    tokens 0..j-1. `repetition_penalty` (HF/CTRL) applies to every context id, `frequency_penalty` x
    count and `presence_penalty` (OpenAI) to the ids with a count above 0.

    `token_mask` (grammar-constrained decoding) holds one row of packed bits per scored position
    (uint32 [K+1, words], bit t%32 of word t//32 set: token t allowed; llguidance's bitmask layout).
    The last stage sets every other logit to -inf after the penalties, before greedy choice,
    sampling and acceptance; ids past the mask's width are disallowed. Empty: no constraint. A run
    and a Propose never carry one."""

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
    token_mask: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.uint32))

    @property
    def constrained(self) -> bool:
        return bool(self.token_mask.size)

    @property
    def penalized(self) -> bool:
        return bool(
            self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def n_score(self) -> int:
        return len(self.draft_tokens) + 1


def raw_buffer(array: np.ndarray, dtype: type) -> memoryview | bytes:
    if not array.size:  # most frames of a plain decode step are empty: no array views for those
        return b""
    flat: Any = np.ascontiguousarray(array, dtype=dtype).reshape(-1).view(np.uint8)
    return memoryview(flat)


def decode_frames(decode: Decode | None) -> list[bytes | memoryview]:
    if decode is None:
        return [b""] * DECODE_FRAMES
    k = len(decode.draft_tokens)
    support = (
        decode.draft_ids.shape[1] if decode.draft_ids.ndim == 2 and decode.draft_ids.size else 0
    )
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
        decode.token_mask.shape[1] if decode.token_mask.ndim == 2 and decode.token_mask.size else 0,
    )
    return [
        spec,
        raw_buffer(decode.draft_tokens, np.int64),
        raw_buffer(decode.draft_ids, np.int64),
        raw_buffer(decode.draft_probs, np.float32),
        raw_buffer(decode.uniforms, np.float64),
        raw_buffer(decode.penalty_ids, np.int64),
        raw_buffer(decode.penalty_counts, np.int32),
        raw_buffer(decode.token_mask, np.uint32),
    ]


def array_of(frame: bytes | memoryview, dtype: type, count: int, what: str) -> np.ndarray:
    if not count and not len(frame):
        return np.zeros(0, dtype)
    size = np.dtype(dtype).itemsize * count
    if len(frame) != size:
        raise ProtocolError(f"{what}: {len(frame)} bytes, expected {size}")
    return np.frombuffer(frame, dtype=dtype, count=count)


def parse_decode(
    frames: Sequence[bytes | memoryview], max_tokens: int, proposals: int = 0, run: int = 0
) -> Decode | None:
    """A Step's decode (`max_tokens` bounds the drafts; a `run` of R tokens draws 2 uniforms for
    each) or, with `proposals` > 0, a Propose's (k uniforms)."""
    spec, tokens, ids, probs, uniforms, penalty_ids, penalty_counts, mask = frames
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
        mask_words,
    ) = DECODE.unpack(spec)
    if not (np.isfinite(temperature) and 0.0 <= temperature <= 100.0):
        raise ProtocolError(f"decode: temperature {temperature} out of range")
    if not (np.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise ProtocolError(f"decode: top_p {top_p} out of range")
    if k > min(MAX_DRAFT, max_tokens) or support > MAX_SUPPORT or top_logprobs > MAX_TOP:
        raise ProtocolError(f"decode: draft {k} / support {support} / top {top_logprobs} too large")
    allowed_uniforms = (0, proposals) if proposals else (0, 2 * (k + 1) * max(run, 1))
    if n_uniforms not in allowed_uniforms:
        raise ProtocolError(
            f"decode: {n_uniforms} uniforms for {proposals or k} "
            f"{'proposals' if proposals else 'drafts'}"
        )
    draft_tokens = array_of(tokens, np.int64, k, "draft tokens")
    draft_ids = array_of(ids, np.int64, k * support, "draft ids").reshape(k, support)
    draft_probs = array_of(probs, np.float32, k * support, "draft probs").reshape(k, support)
    u = array_of(uniforms, np.float64, n_uniforms, "uniforms")
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
    context_ids = array_of(penalty_ids, np.int64, n_ids, "penalty ids")
    counts = array_of(penalty_counts, np.int32, n_ids, "penalty counts")
    if n_ids and (int(context_ids[0]) < 0 or bool(np.any(np.diff(context_ids) <= 0))):
        raise ProtocolError("decode: penalty ids must be unique, sorted and non-negative")
    if n_ids and int(counts.min()) < 0:
        raise ProtocolError("decode: negative penalty count")
    token_mask = _token_mask(mask, mask_words, k + 1, proposals, run)
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
        token_mask,
    )


def _token_mask(
    frame: bytes | memoryview, words: int, rows: int, proposals: int, run: int
) -> np.ndarray:
    """The token-mask frame as uint32 [rows, words]: one row per scored position, each allowing a
    token."""
    if not words:
        if len(frame):
            raise ProtocolError("decode: a token mask without its width")
        return np.zeros((0, 0), np.uint32)
    if proposals or run > 1:
        raise ProtocolError(
            "decode: token masks only go with a verify step (not a run or a proposal)"
        )
    if words > MAX_MASK_WORDS:
        raise ProtocolError(f"decode: token mask of {words} words per row is too wide")
    mask = array_of(frame, np.uint32, rows * words, "token mask").reshape(rows, words)
    empty = np.flatnonzero(~mask.any(axis=1))
    if len(empty):
        raise ProtocolError(f"decode: token mask row {int(empty[0])} allows no token")
    return mask
