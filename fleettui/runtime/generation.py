"""Provides the values of one generation: its parameters, its statistics, its result, and one round
of it.

Shared by the coordinator (which drives the rounds) and the run rounds (`fleettui.runtime.runs`).

A constrained reply (`GenerationParams.constraint`, `fleettui.runtime.constraint`) reports in
`GenerationStats.constraint_complete` whether its grammar was completed: True (the constrained text
is a full sentence of the grammar), False (it ended before, e.g. finish_reason "length" when
max_tokens cut it), None (no constraint, or a trigger that never came: no constrained text)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleettui.runtime.constraint import ConstraintSpec
from fleettui.runtime.ledger import Feed
from fleettui.runtime.policy import KPolicy
from fleettui.runtime.speculation import Draft, Sampling
from remote_worker import protocol

NO_UNIFORMS = np.zeros(0)  # greedy rounds draw nothing: one shared empty array, not one per round
NO_UNIFORMS.flags.writeable = False


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    spec_k: int | None = None  # None = adaptive; 0 = no speculation
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: count exactly max_tokens
    # OpenAI: minus count x this, over the tokens generated in this reply
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0  # OpenAI: minus this once a token appeared in this reply
    # HF/CTRL: over prompt + reply, positive logits / r, negative x r
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # n: each reply token's log-prob and its n likeliest alternatives
    # a grammar the reply must follow (fleettui.runtime.constraint)
    constraint: ConstraintSpec | None = None

    @property
    def top_columns(self) -> int:
        """The Decode's `top_logprobs`: the emitted token's column, then the alternatives (0:
        none)."""
        return 0 if self.logprobs is None else self.logprobs + 1

    @property
    def penalized(self) -> bool:
        return bool(
            self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
        )

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    tokens: int = 0
    seconds: float = 0.0
    ttft: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    compactions: int = 0
    k_values: list[int] = field(default_factory=list)
    finish_reason: str = ""
    constraint_complete: bool | None = None  # the grammar was completed (None: no constrained text)
    drafts_cut: int = 0  # draft tokens the grammar rejected before verification (never sent)
    # tokens the grammar forced, verified in place of drafts (not in drafted / accepted)
    forced: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_k(self) -> float:
        return float(np.mean(self.k_values)) if self.k_values else 0.0


@dataclass(frozen=True)
class TokenLogprob:
    """A reply token's log-probability under the model (no temperature, no penalties) and the
    likeliest tokens at its position with theirs, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(result: protocol.Result, emitted: list[int]) -> list[TokenLogprob]:
    """The log-probs of `emitted` (the first tokens of `result`) from the result's top arrays."""
    ids, values = result.top_ids, result.top_logprobs
    if ids.ndim != 2 or len(ids) < len(emitted) or ids.shape[1] < 1:
        raise RuntimeError(f"the last stage sent log-probs for {len(ids)} of {len(emitted)} tokens")
    return [
        TokenLogprob(
            token,
            float(values[row, 0]),
            tuple((int(i), float(v)) for i, v in zip(ids[row, 1:], values[row, 1:], strict=True)),
        )
        for row, token in enumerate(emitted)
    ]


@dataclass(frozen=True)
class Generation:
    token_ids: tuple[int, ...]
    text: str
    stats: GenerationStats
    logprobs: tuple[TokenLogprob, ...] = ()  # one per reply token shown (not EOS), when asked for


TokenCallback = Callable[[list[int], str], Awaitable[None] | None]


@dataclass(frozen=True)
class Round:
    """One round as the generation loop consumes it: K drafts verified, or one token of a run."""

    k: int
    draft: Draft
    feed: Feed
    result: protocol.Result
    draft_seconds: float
    verify_seconds: float
    asked: int  # the K asked of the drafter (it may propose fewer)
    policy: KPolicy  # whose costs and acceptance this round updates
    loaded: bool  # other sessions were generating when it started
    # its verify was sent before the previous result (its wait teaches no costs)
    pipelined: bool = False
    forced: bool = False  # its drafts are the tokens a grammar forces (no drafter proposed them)


def verify_decode(
    params: GenerationParams,
    draft: Draft,
    uniforms: np.ndarray,
    history: list[int],
    generated: list[int],
    token_mask: np.ndarray | None = None,
) -> protocol.Decode:
    """The Decode of a verify step: the request's sampling, the drafts and their proposals, the
    penalties, the grammar's token masks (one row per scored position)."""
    sampling = params.sampling
    extra = penalties(params, history, generated)
    if token_mask is not None:
        extra["token_mask"] = token_mask
    return protocol.Decode(
        sampling.temperature,
        sampling.top_p,
        sampling.top_k,
        np.array(draft.tokens, np.int64),
        np.asarray(draft.ids, np.int64),  # no copy when already int64 / float32 (the usual case)
        np.asarray(draft.probs, np.float32),
        uniforms,
        params.top_columns,
        **extra,
    )


def penalties(params: GenerationParams, history: list[int], generated: list[int]) -> dict[str, Any]:
    """The Decode fields of the penalties: unique ids of prompt + reply so far with their counts in
    the reply.

    The last stage adds the verify window's draft tokens itself, position by position (exact under
    speculation). Without penalties nothing extra travels.
    """
    if not params.penalized:
        return {}
    ids = np.unique(np.asarray(history, np.int64))
    counts = np.zeros(len(ids), np.int32)
    if generated:
        reply_ids, reply_counts = np.unique(np.asarray(generated, np.int64), return_counts=True)
        counts[np.searchsorted(ids, reply_ids)] = reply_counts
    return {
        "frequency_penalty": params.frequency_penalty,
        "presence_penalty": params.presence_penalty,
        "repetition_penalty": params.repetition_penalty,
        "penalty_ids": ids,
        "penalty_counts": counts,
    }
