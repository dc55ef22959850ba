"""Provides pipelined prefill: a prompt's chunks go down the chain back to back, so stage 0 computes
chunk c + 1 while the stage after it computes chunk c.

Fed one chunk at a time (each sent when the one before was back), a long prompt kept all but one
stage idle: on S stages its prefill took the sum of every stage's time for every chunk. With up to
`depth` chunks in flight (the number of stages: one per stage, so another session's step waits
behind at most one chunk at stage 0), it takes about the slowest stage's time for every chunk. The
stages apply a session's steps in the order sent, so each chunk is planned on a copy of the cache
ledger that already holds the ones before it, and it is committed to the real ledger when its Result
is back, in order: the steps are exactly those of the serial prefill."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

from fleettui.runtime.ledger import CacheLedger, Feed
from fleettui.runtime.session import Session
from fleettui.runtime.transport import Link, StageLost
from remote_worker import protocol

PREFILL_CHUNK = 128  # prompt tokens per prefill step
# ... while other sessions generate: each of their tokens waits for the chunk a stage computes
SHARED_CHUNK = 32


def prompt_chunk(
    history: list[int], size: Callable[[], int] = lambda: PREFILL_CHUNK
) -> Callable[[CacheLedger], Feed | None]:
    """The next chunk of a reply's prompt, `size()` tokens: all but its last chunk are fed unscored
    (the last is the reply's first round, which yields token 1)."""

    def plan(ledger: CacheLedger) -> Feed | None:
        chunk = size()
        if len(history) - ledger.logical_len <= chunk:
            return None
        end = ledger.logical_len + chunk
        feed = ledger.plan(history[: end + 1])
        return Feed(feed.cache_len, feed.pos0, feed.tokens[:chunk], feed.mask_ranges)

    return plan


def replay_chunk(prefix: list[int]) -> Callable[[CacheLedger], Feed | None]:
    """The next chunk of a history replayed into a rebuilt pipeline (its ledger reset): all of
    `prefix`."""

    def plan(ledger: CacheLedger) -> Feed | None:
        if ledger.logical_len >= len(prefix):
            return None
        return ledger.plan(prefix[: min(len(prefix), ledger.logical_len + PREFILL_CHUNK)])

    return plan


async def prefill(
    ledger: CacheLedger,
    next_feed: Callable[[CacheLedger], Feed | None],
    send: Callable[[Feed], Awaitable[object]],
    depth: int,
) -> None:
    """Feed what `next_feed` plans, up to `depth` steps in flight.

    A step that fails ends the prefill with its error; the steps behind it are cancelled (not
    committed: a lost stage's recovery resets the ledger and replays the history)."""
    ahead = ledger.copy()
    flight: deque[tuple[Feed, asyncio.Future[object]]] = deque()
    try:
        while True:
            while len(flight) < max(1, depth) and (feed := next_feed(ahead)) is not None:
                ahead.commit(feed)
                flight.append((feed, asyncio.ensure_future(send(feed))))  # sent in this order
            if not flight:
                return
            feed, reply = flight[0]
            await reply
            flight.popleft()
            ledger.commit(feed)
    finally:
        for _, reply in flight:
            reply.cancel()
        await asyncio.gather(*(reply for _, reply in flight), return_exceptions=True)


class PrefillRounds:
    """The coordinator's prefills (a mixin of `Coordinator`, which provides these attributes)."""

    target: Link
    target_epoch: int
    stages: int  # how many stages the last Hello crossed: one chunk in flight per stage
    _result: Callable[[protocol.Message], protocol.Result]
    _maybe_compact: Callable[[Session], Awaitable[None]]
    _several: Callable[[], bool]
    prefill_serial = False  # the bench's baseline: one PREFILL_CHUNK chunk at a time, as before

    async def _prefill(self, session: Session) -> None:
        """Feed the reply's prompt but its last chunk, unscored (none left after a rebuild); in
        chunks of SHARED_CHUNK tokens while other sessions generate (each of their steps waits
        behind a chunk)."""
        serial = self.prefill_serial
        chunks = prompt_chunk(
            session.history,
            lambda: SHARED_CHUNK if self._several() and not serial else PREFILL_CHUNK,
        )
        if chunks(session.ledger) is not None:
            await self._maybe_compact(session)
            depth = 1 if serial else self.stages
            await prefill(session.ledger, chunks, self._sender(session, self.target_epoch), depth)

    async def _replay(self, session: Session, prefix: list[int], epoch: int) -> None:
        """Feed `prefix` into the pipeline of `epoch`, rebuilt without the session (its ledger
        reset)."""
        await prefill(
            session.ledger, replay_chunk(prefix), self._sender(session, epoch), self.stages
        )

    def _sender(self, session: Session, epoch: int) -> Callable[[Feed], Awaitable[protocol.Result]]:
        async def send(feed: Feed) -> protocol.Result:  # committed by `prefill`, in order
            if (
                self.target_epoch != epoch
            ):  # a pipeline rebuilt since: it never knew the steps before
                raise StageLost(f"session {session.id}: the pipeline changed during its prefill")
            return self._result(await self.target.request(feed.step(session.id, None)))

        return send
