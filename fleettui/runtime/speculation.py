"""Provides speculative drafting (a draft model worker, prompt lookup) and the adaptive choice of K."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from fleettui.runtime.ledger import CacheLedger
from fleettui.runtime.transport import Link
from remote_worker import protocol

GREEDY_SUPPORT = 0
SAMPLING_SUPPORT = 64


@dataclass(frozen=True)
class Draft:
    """K proposed tokens and, for sampling, the sparse distribution each was drawn from."""

    tokens: tuple[int, ...]
    ids: np.ndarray  # int64 [K, support]
    probs: np.ndarray  # float32 [K, support]
    fed: int = 0  # tokens the draft had to catch up on before proposing (large after a new prompt)

    @staticmethod
    def empty() -> Draft:
        return Draft((), np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float32))

    @staticmethod
    def deterministic(tokens: list[int]) -> Draft:
        """Proposals with probability 1 (prompt lookup): exact under the acceptance rule."""
        count = len(tokens)
        return Draft(
            tuple(tokens), np.array(tokens, np.int64).reshape(count, 1), np.ones((count, 1), np.float32)
        )


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Drafter(Protocol):
    name: str
    costs_time: bool  # False for drafters that are (nearly) free, like prompt lookup

    async def open(self, session: int) -> None: ...

    async def close(self, session: int) -> None: ...

    async def propose(
        self, session: int, history: list[int], k: int, sampling: Sampling, rng: np.random.Generator
    ) -> Draft: ...


class PromptLookupDrafter:
    """Proposes the continuation of the most recent earlier occurrence of the last n-gram (n = 3..1)."""

    name = "prompt-lookup"
    costs_time = False

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram

    async def open(self, session: int) -> None:
        return None

    async def close(self, session: int) -> None:
        return None

    async def propose(
        self, session: int, history: list[int], k: int, sampling: Sampling, rng: np.random.Generator
    ) -> Draft:
        return Draft.deterministic(lookup(history, k, self.max_ngram))


def lookup(history: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Up to k tokens that followed the latest earlier match of history's last n-gram."""
    if k <= 0:
        return []
    sequence = np.asarray(history, np.int64)
    for n in range(min(max_ngram, len(history) - 1), 0, -1):
        pattern = sequence[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(sequence[:-1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in sequence[start : start + k]]
    return []


class ModelDrafter:
    """A draft model served by a 1-stage worker (role "draft") on the coordinator's machine."""

    costs_time = True

    def __init__(self, link: Link, name: str = "draft-model") -> None:
        self.link = link
        self.name = name
        self._ledgers: dict[int, CacheLedger] = {}

    async def open(self, session: int) -> None:
        await self.link.request(protocol.Control(protocol.Kind.OPEN, session, 0))
        self._ledgers[session] = CacheLedger()

    async def close(self, session: int) -> None:
        if self._ledgers.pop(session, None) is not None:
            await self.link.request(protocol.Control(protocol.Kind.CLOSE, session, 0))

    async def propose(
        self, session: int, history: list[int], k: int, sampling: Sampling, rng: np.random.Generator
    ) -> Draft:
        ledger = self._ledgers[session]
        if ledger.needs_compaction():
            ack = await self.link.request(
                protocol.Control(protocol.Kind.COMPACT, session, 0, ledger.cache_len)
            )
            ledger.compact()
            assert isinstance(ack, protocol.Ack) and ack.value == ledger.cache_len
        feed = ledger.plan(history)
        support = GREEDY_SUPPORT if sampling.greedy else SAMPLING_SUPPORT
        decode = protocol.Decode(
            sampling.temperature,
            sampling.top_p,
            sampling.top_k,
            uniforms=rng.random(k) if not sampling.greedy else np.zeros(0),
        )
        reply = await self.link.request(
            protocol.Propose(
                session,
                0,
                feed.pos0,
                feed.cache_len,
                feed.ranges_array(),
                np.array(feed.tokens, np.int64),
                k,
                support,
                decode,
            )
        )
        if not isinstance(reply, protocol.Proposal):
            raise TypeError(f"draft answered {type(reply).__name__}")
        tokens = tuple(int(t) for t in reply.tokens)
        ledger.commit(feed, extra=tokens[:-1])
        return Draft(tokens, reply.ids, reply.probs, fed=len(feed.tokens))


@dataclass
class _LinearCost:
    """Least-squares fit of seconds = a + b * size over the recent samples.

    Until two different sizes were measured the slope is unknown: a `proportional` cost (drafting K tokens
    takes K draft steps) is then scaled from the one size seen, so a single measurement at K = 3 cannot make
    K = 8 look as cheap as K = 3; a non-proportional cost (a verify pass, nearly flat in K) stays flat.
    """

    proportional: bool = False
    window: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=64))

    def add(self, size: float, seconds: float) -> None:
        self.window.append((size, seconds))

    def predict(self, size: float) -> float | None:
        if not self.window:
            return None
        sizes = np.array([s for s, _ in self.window])
        times = np.array([t for _, t in self.window])
        if np.ptp(sizes) == 0:
            if self.proportional and sizes[0] > 0:
                return float(times.mean()) * size / float(sizes[0])
            return float(times.mean())
        slope, intercept = np.polyfit(sizes, times, 1)
        return float(intercept + max(slope, 0.0) * size)


class KPolicy:
    """Chooses K per round to maximise expected tokens per second, K = 0 when speculation does not pay.

    Acceptance is modelled as i.i.d. per draft token with rate alpha (estimated with decay from how many
    drafts each verify accepted); a round with K drafts then yields (1 - alpha^(K+1)) / (1 - alpha) tokens
    and costs draft(K) + verify(K + 1) seconds, both fitted from measured timings. When K = 0 wins, every
    `probe_every` rounds one small probe keeps the acceptance estimate alive.
    """

    def __init__(self, fixed_k: int | None, max_k: int = 8, probe_every: int = 16) -> None:
        self.fixed_k = fixed_k
        self.max_k = max_k
        self.probe_every = probe_every
        self._accepted = 1.0  # decayed pseudo-counts: prior alpha = 0.5
        self._rejected = 1.0
        self._verify = _LinearCost()
        self._draft = _LinearCost(proportional=True)
        self._rounds_since_probe = 0
        self._probe_interval = probe_every
        self.last_choice = 0

    @property
    def alpha(self) -> float:
        return self._accepted / (self._accepted + self._rejected)

    def record_round(
        self, k: int, accepted: int, draft_seconds: float, verify_seconds: float, catch_up: bool = False
    ) -> None:
        """Learn from one round. `catch_up` rounds (the first after a new prompt, which also prefilled the
        target or the draft) still teach acceptance but not costs: counting a prefill as the cost of a plain
        decode step would make K = 0 look slow forever, since K = 0 would then never be tried again."""
        if k > 0:
            decay = 0.97
            self._accepted = self._accepted * decay + accepted
            self._rejected = self._rejected * decay + (1 if accepted < k else 0)
            if not catch_up:
                self._draft.add(k, draft_seconds)
        if not catch_up:
            self._verify.add(k + 1, verify_seconds)

    def expected_rate(self, k: int, free_draft: bool = False) -> float | None:
        verify = self._verify.predict(k + 1)
        if verify is None:
            return None
        draft = 0.0
        if k > 0 and not free_draft:
            predicted = self._draft.predict(k)
            if predicted is None:
                return None
            draft = predicted
        alpha = min(self.alpha, 0.999)
        tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
        return tokens / max(draft + verify, 1e-6)

    def choose(self, free_draft: bool = False) -> int:
        if self.fixed_k is not None:
            self.last_choice = self.fixed_k
            return self.fixed_k
        rates = {k: self.expected_rate(k, free_draft) for k in range(self.max_k + 1)}
        unknown = [k for k, rate in rates.items() if rate is None]
        if unknown:  # measure before modelling: K=0 first, then a mid-size K for the draft's cost
            choice = 0 if 0 in unknown else min(3, self.max_k)
        else:
            choice = max(rates, key=lambda k: rates[k] or 0.0)
            self._rounds_since_probe = 0 if choice else self._rounds_since_probe + 1
            if choice:
                self._probe_interval = self.probe_every
            elif self._rounds_since_probe >= self._probe_interval:
                # A probe makes a costly draft catch up on everything since its last use: back off while
                # probes keep confirming K = 0, so exploring stays a small share of the work.
                self._rounds_since_probe = 0
                self._probe_interval = min(2 * self._probe_interval, 512)
                choice = min(2, self.max_k)
        self.last_choice = choice
        return choice


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
