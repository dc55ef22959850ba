"""Provides speculative drafting (a draft model worker, prompt lookup) and the adaptive choice of
K."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fleettui.runtime.cost_model import CostModel
from fleettui.runtime.ledger import CacheLedger
from fleettui.runtime.measures import round_costs
from fleettui.runtime.policy import KPolicy
from fleettui.runtime.transport import Link
from remote_worker import protocol

__all__ = [
    "CostModel",
    "Draft",
    "Drafter",
    "KPolicy",
    "ModelDrafter",
    "NgramIndex",
    "PromptLookupDrafter",
    "round_costs",
]
GREEDY_SUPPORT = 0
SAMPLING_SUPPORT = 64


@dataclass(frozen=True)
class Draft:
    """K proposed tokens and, for sampling, the sparse distribution each was drawn from."""

    tokens: tuple[int, ...]
    ids: np.ndarray  # int64 [K, support]
    probs: np.ndarray  # float32 [K, support]
    fed: int = 0  # tokens the draft had to catch up on before proposing (large after a new prompt)
    # seconds the draft model computed it (its worker's trace; None: unknown)
    computed: float | None = None

    @staticmethod
    def empty() -> Draft:
        return Draft((), np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float32))

    @staticmethod
    def deterministic(tokens: list[int]) -> Draft:
        """Proposals with probability 1 (prompt lookup): exact under the acceptance rule."""
        count = len(tokens)
        return Draft(
            tuple(tokens),
            np.array(tokens, np.int64).reshape(count, 1),
            np.ones((count, 1), np.float32),
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
    """Proposes the continuation of the most recent earlier occurrence of the last n-gram (n =
    3..1).

    Each session's history is indexed as it grows (`NgramIndex`): a run asks the lookup at every
    token it makes, and a scan of the whole history per token would take time from the cores the
    stages compute on."""

    name = "prompt-lookup"
    costs_time = False

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram
        self._indexes: dict[int, NgramIndex] = {}

    async def open(self, session: int) -> None:
        self._indexes.pop(session, None)

    async def close(self, session: int) -> None:
        self._indexes.pop(session, None)

    async def propose(
        self, session: int, history: list[int], k: int, sampling: Sampling, rng: np.random.Generator
    ) -> Draft:
        return Draft.deterministic(self.find(history, k, session))

    def find(self, history: list[int], k: int, session: int = 0) -> list[int]:
        """What `propose` would propose, at once (a run asks it at each token it makes)."""
        index = self._indexes.get(session)
        if index is None:
            index = self._indexes[session] = NgramIndex(self.max_ngram)
        return index.find(history, k)


class NgramIndex:
    """The latest start of every n-gram (n = 1..max_ngram) seen in a history that grows by
    appending, so a lookup costs O(max_ngram) per token instead of a scan of the whole history.

    It follows one list (a reply's history, extended in place); another list, or one that shrank, is
    indexed afresh. A stale index could only propose worse drafts, never change the output: every
    draft is verified by the target."""

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram
        self.source: list[int] | None = None
        self.indexed = 0  # the n-grams ending before this position are in `latest`
        self.latest: dict[tuple[int, ...], int] = {}

    def find(self, history: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of history's last n-gram (n =
        max..1); an earlier match ends before the last token (the history's own suffix is no
        match)."""
        if history is not self.source or len(history) < self.indexed:
            self.source, self.indexed, self.latest = history, 0, {}
        end = len(history) - 1
        for last in range(self.indexed, end):
            for n in range(1, min(self.max_ngram, last + 1) + 1):
                self.latest[tuple(history[last - n + 1 : last + 1])] = last - n + 1
        self.indexed = max(self.indexed, end)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, end), 0, -1):
            start = self.latest.get(tuple(history[-n:]))
            if start is not None:
                return list(history[start + n : start + n + k])
        return []


class ModelDrafter:
    """A draft model served by a 1-stage worker (role "draft") on the coordinator's machine.

    The draft never catches up on more than `window` tokens at once: when it has fallen further
    behind (speculation was off for a while, or a long new prompt), its cache restarts from the last
    `window` tokens of the history. A draft with less context proposes a little worse, never
    wrongly: the target verifies every token, so exactness does not depend on it, while a probe
    stays cheap."""

    costs_time = True

    def __init__(self, link: Link, name: str = "draft-model", window: int = 48) -> None:
        self.link = link
        self.name = name
        self.window = window
        self._ledgers: dict[int, CacheLedger] = {}
        self._starts: dict[int, int] = {}  # session -> first history index the draft's cache holds

    async def open(self, session: int) -> None:
        await self.link.request(protocol.Control(protocol.Kind.OPEN, session, 0))
        self._ledgers[session] = CacheLedger()
        self._starts[session] = 0

    async def close(self, session: int) -> None:
        self._starts.pop(session, None)
        if self._ledgers.pop(session, None) is not None:
            await self.link.request(protocol.Control(protocol.Kind.CLOSE, session, 0))

    async def propose(
        self, session: int, history: list[int], k: int, sampling: Sampling, rng: np.random.Generator
    ) -> Draft:
        start = self._starts.get(session, 0)
        if len(history) - start - self._ledgers[session].logical_len > self.window:
            await self.open(session)  # far behind: restart from the recent window
            start = self._starts[session] = max(0, len(history) - self.window)
        history = history[start:]
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
        records = protocol.trace_records(reply.trace)
        computed = sum(
            finished - started for _stage, _received, started, finished, _sent in records
        )
        return Draft(
            tokens,
            reply.ids,
            reply.probs,
            fed=len(feed.tokens),
            computed=computed if records else None,
        )


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
