"""Provides admission control: at most `max_active` requests generate, the rest wait in a bounded,
fair queue.

Fair between clients (an API key, or an address when the server has no keys): a free slot goes to
the waiting request whose client has the fewest requests generating, among equals to the client
served least recently (round robin), and within a client to its oldest, so one user's batch of
twenty requests does not hold a colleague's one question behind all of them. The queue's bound keeps
one place for each client that has nothing generating or waiting: a flood fills the queue for its
own client only."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import Counter, deque


class QueueFull(Exception):
    """Every generation slot is taken and the waiting queue is at its bound (HTTP 429)."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the server is busy; retry after {retry_after} s")
        self.retry_after = retry_after


class Ticket:
    """One admitted request: waits for its turn, then holds a generation slot until released."""

    def __init__(self, admission: Admission, client: str = "") -> None:
        self._admission = admission
        self.client = client
        self._turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.active = False
        self.released = False

    async def wait(self) -> None:
        """Until this request may generate (its client's fair turn)."""
        try:
            await asyncio.shield(self._turn)
        except asyncio.CancelledError:
            self.release()
            raise

    def release(self) -> None:
        """Give the slot (or the place in the queue) back; safe to call twice."""
        if not self.released:
            self.released = True
            self._admission._release(self)


class Admission:
    """A fair queue in front of the generation slots."""

    def __init__(self, max_active: int, max_queued: int) -> None:
        if max_active < 1 or max_queued < 0:
            raise ValueError("max_active must be >= 1 and max_queued >= 0")
        self.max_active = max_active
        self.max_queued = max_queued
        self.active = 0
        self._waiting: deque[Ticket] = deque()  # in arrival order
        self._generating: Counter[str] = Counter()  # per client
        self._served: dict[str, int] = {}  # per client: when its last request started (round robin)
        self._starts = itertools.count()
        self._mean_seconds = 5.0  # smoothed duration of a generation, for Retry-After

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def admit(self, client: str = "") -> Ticket:
        """A ticket, or `QueueFull` at once (decided before a response starts, so it can be a
        429)."""
        ticket = Ticket(self, client)
        if self.active < self.max_active and not self._waiting:
            self._start(ticket)
        elif len(self._waiting) < self.max_queued or not self._holds(client):
            self._waiting.append(ticket)
        else:
            raise QueueFull(self.retry_after())
        return ticket

    def _holds(self, client: str) -> bool:
        return self._generating[client] > 0 or any(
            ticket.client == client for ticket in self._waiting
        )

    def retry_after(self) -> int:
        """Seconds until a queue place is likely to free up (at least 1)."""
        rounds = (len(self._waiting) + 1) / self.max_active
        return max(1, min(120, math.ceil(rounds * self._mean_seconds)))

    def record(self, seconds: float) -> None:
        self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * seconds

    def _start(self, ticket: Ticket) -> None:
        self.active += 1
        self._generating[ticket.client] += 1
        self._served[ticket.client] = next(self._starts)
        ticket.active = True
        if not ticket._turn.done():
            ticket._turn.set_result(None)

    def _release(self, ticket: Ticket) -> None:
        if ticket.active:
            ticket.active = False
            self.active -= 1
            self._generating[ticket.client] -= 1
            if not self._generating[ticket.client]:
                del self._generating[ticket.client]
        elif ticket in self._waiting:
            self._waiting.remove(ticket)
        while self._waiting and self.active < self.max_active:
            # min keeps the first of equals, and the deque is in arrival order: the oldest of them
            turn = min(self._waiting, key=self._priority)
            self._waiting.remove(turn)
            self._start(turn)

    def _priority(self, ticket: Ticket) -> tuple[int, int]:
        return self._generating[ticket.client], self._served.get(ticket.client, -1)
