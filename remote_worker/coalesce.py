"""Provides the last stage's coalescing of a run's Results: several leave together, not one per
token.

A run's tokens are made back to back on the stages; each Result that leaves wakes the coordinator
(its ZeroMQ I/O thread, the decryption, its asyncio loop) and this worker's own I/O thread, on the
cores the stages compute on. On a PC that serves one stage the wake-ups cost a few percent of every
token. So a Result of a run that continues leaves at once only when its session's previous Result
left at least `interval` seconds ago; else it is held, and everything held leaves together when the
oldest hold is due (the compute loop asks `seconds_to_due`), just before any other message (order on
the socket is kept), and when the run ends. A reader sees a stream in bursts of about `interval` (40
ms is a 25 Hz refresh); the first token of a reply leaves at once, the coordinator's cache ledger is
unaffected (it commits what it reads, in order).

Each held Result's trace gets the time it really left as its last `sent`, so the hop back is
measured right and the hold shows as time between `finished` and `sent` at the last stage."""

from __future__ import annotations

import time

from remote_worker import protocol

# sessions' last send times kept (forgotten on CLOSE; a bound all the same)
MAX_SESSIONS_TRACKED = 4096


class Coalescer:
    """Holds a run's Results at the last stage; `interval` 0 holds nothing."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._held: list[protocol.Result] = []
        self._last_sent: dict[int, float] = {}  # session -> monotonic time its last Result left
        self._due = float("inf")

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, result: protocol.Result, now: float) -> bool:
        """Hold `result` (a run's, more of it follows); False: it must leave now (with what is held
        before it): its session sent nothing for `interval`, or the held ones are due."""
        if self.interval <= 0:
            return False
        last = self._last_sent.get(result.session)
        if last is None or now - last >= self.interval or now >= self._due:
            return False
        self._held.append(result)
        self._due = min(self._due, last + self.interval)
        return True

    def seconds_to_due(self, now: float) -> float | None:
        """Seconds until the held Results must leave (<= 0: now); None when nothing is held."""
        return self._due - now if self._held else None

    def take(self, now: float) -> list[protocol.Result]:
        """Everything held, in order, each trace's last `sent` stamped with the wall clock (they
        leave)."""
        held, self._held, self._due = self._held, [], float("inf")
        if held:
            wall = time.time()
            for result in held:
                if result.trace.size >= protocol.TRACE_FIELDS:
                    result.trace[-1] = wall
                self.sent(result.session, now)
        return held

    def sent(self, session: int, now: float) -> None:
        """A Result of SESSION left without being held."""
        if self.interval <= 0:
            return
        if len(self._last_sent) >= MAX_SESSIONS_TRACKED and session not in self._last_sent:
            self._last_sent.clear()
        self._last_sent[session] = now

    def forget(self, session: int) -> None:
        self._last_sent.pop(session, None)
