"""Provides the session pool: idle sessions kept with their KV caches so a resent conversation
reuses its prefix.

A stateless API (OpenAI's) resends the whole conversation every turn. The pool keeps the sessions of
finished requests open on the stages, remembers what their caches hold (the ledger's token
sequence), and hands a new request the idle session sharing the longest prefix with its prompt: the
coordinator then feeds only the tokens after that prefix (the ledger masks whatever diverges).
Beyond `max_idle` idle sessions the least recently used one is closed on the stages. A session whose
generation was cancelled or failed is closed, never reused: its caches may hold a step the ledger
never committed."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from fleettui.runtime.session import Session


def common_prefix(left: list[int], right: list[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    limit = min(len(left), len(right))
    index = 0
    while index < limit and left[index] == right[index]:
        index += 1
    return index


@dataclass(frozen=True)
class Lease:
    """A session handed to one request, and how many prompt tokens its cache already holds."""

    session: Session
    reused_tokens: int


class SessionPool:
    """Opens, lends, keeps and closes sessions through `opener`/`closer` (the coordinator's)."""

    def __init__(
        self,
        opener: Callable[[int], Awaitable[Session]],
        closer: Callable[[Session], Awaitable[None]],
        max_idle: int = 8,
        max_open: int | None = None,
    ) -> None:
        if max_idle < 0:
            raise ValueError("max_idle must be >= 0")
        if max_open is not None and max_open < 1:
            raise ValueError("max_open must be >= 1")
        # The stages hold at most `max_sessions` open sessions (their KV budget): idle sessions kept
        # for prefix reuse count too, so a fresh session first evicts the least recently used idle
        # one.
        self.max_open = max_open
        self._open = opener
        self._close = closer
        self.max_idle = max_idle
        self._idle: OrderedDict[int, Session] = OrderedDict()  # least recently used first
        self._lent: dict[int, Session] = {}
        self.opened = 0
        self.closed = 0
        self.reused_tokens = 0
        # closes of sessions whose opener was cancelled
        self._orphans: set[asyncio.Future[None]] = set()
        # sessions being opened or closed: they hold a place on the stages meanwhile
        self._moving = 0
        self._settled = asyncio.Event()  # set (and replaced) whenever an open or a close ends

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def lent(self) -> int:
        return len(self._lent)

    def best_match(self, prompt: list[int]) -> tuple[Session | None, int]:
        """The idle session whose cached tokens share the longest prefix with `prompt` (ties:
        most recent)."""
        best: Session | None = None
        best_length = 0
        for session in self._idle.values():
            length = common_prefix(session.ledger.sequence(), prompt)
            if length >= best_length and length > 0:
                best, best_length = session, length
        return best, best_length

    async def acquire(self, prompt: list[int], seed: int) -> Lease:
        """A session for `prompt`: the best idle match, else a fresh one (evicting beyond the
        bound)."""
        session, reused = self.best_match(prompt)
        if session is not None:
            del self._idle[session.id]
            # A prompt never reuses its own last token: the coordinator always feeds at least one
            # token.
            reused = min(reused, len(prompt) - 1)
        else:
            await self._make_room()
            self._moving += 1
            try:
                session = await self._open_shielded(seed)
            finally:
                self._moved()
            self.opened += 1
            reused = 0
        # Same seed, same samples, whichever session the request lands on.
        session.rng = np.random.default_rng([seed, 0])
        self._lent[session.id] = session
        self.reused_tokens += reused
        return Lease(session, reused)

    async def _make_room(self) -> None:
        """Wait until a fresh session fits under `max_open`, closing idle ones first: a session
        still closing (a cancelled request's) or opening counts, or the stages would see one more
        than they hold."""
        while self.max_open is not None and self.idle + self.lent + self._moving >= self.max_open:
            if self._idle:
                _, oldest = self._idle.popitem(last=False)
                await self._close_one(oldest)
            elif self._moving:
                await self._settled.wait()
            else:
                return  # every place is lent: admission lets no more in, so this is not reached

    def _moved(self) -> None:
        self._moving -= 1
        self._settled.set()
        self._settled = asyncio.Event()

    async def _open_shielded(self, seed: int) -> Session:
        """Open a session; if the caller is cancelled meanwhile, the session is closed once it is
        open."""
        opening = asyncio.ensure_future(self._open(seed))
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(self._close_orphan)
            raise

    def _close_orphan(self, opening: asyncio.Future[Session]) -> None:
        if opening.cancelled() or opening.exception() is not None:
            return
        closing = asyncio.ensure_future(self._close_one(opening.result()))
        self._orphans.add(closing)
        closing.add_done_callback(self._orphans.discard)

    async def release(self, session: Session, reusable: bool) -> None:
        """Give a session back: kept idle when `reusable`, else closed on every stage."""
        self._lent.pop(session.id, None)
        if not reusable or self.max_idle == 0:
            await self._close_one(session)
            return
        self._idle[session.id] = session
        while len(self._idle) > self.max_idle:
            _, oldest = self._idle.popitem(last=False)
            await self._close_one(oldest)

    async def _close_one(self, session: Session) -> None:
        self.closed += 1
        self._moving += 1
        try:
            await self._close(session)
        finally:
            self._moved()

    async def close_all(self) -> None:
        """Close every idle session (lent ones are closed by their requests)."""
        if self._orphans:
            await asyncio.gather(*self._orphans, return_exceptions=True)
        while self._idle:
            _, session = self._idle.popitem(last=False)
            await self._close_one(session)
