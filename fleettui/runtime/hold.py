"""Provides the hold of a degraded fleet: its rounds wait, for a while, for it to be whole again."""

from __future__ import annotations

import asyncio


class Hold:
    """A degraded fleet (its hosts left cannot hold the model) may be whole again when its lost
    hosts are back: until then each round waits here, `seconds` at most, and then goes on (its
    session replayed) or ends."""

    def __init__(self) -> None:
        self.whole = asyncio.Event()
        self.whole.set()
        self.seconds = 0.0
        self.note = ""  # what a round that waited in vain adds to the degraded line

    def begin(self, seconds: float) -> None:
        self.seconds, self.note = seconds, ""
        self.whole.clear()

    def end(self) -> None:
        """Whole again (or stopping): every held round goes on now."""
        self.whole.set()

    async def wait(self) -> bool:
        """Whether the fleet became whole again within `seconds` (False at once when nothing is
        held)."""
        if self.whole.is_set() or self.seconds <= 0:
            return False
        try:
            await asyncio.wait_for(self.whole.wait(), self.seconds)
        except TimeoutError:
            self.note = f" (waited {self.seconds:g} s for it to be whole again)"
            return False
        return True
