"""Provides the cache ledger: the coordinator's mirror of one session's physical KV cache on one
model.

Rollback is by attention mask only. A ReadValue/Assign cache only appends, so every token fed
occupies a physical slot forever (until compaction). The ledger records, per physical slot, the
token it holds and whether it is still attended. To move the cache to a new token sequence it keeps
the longest valid prefix that matches, masks every valid slot after it (rejected drafts, a rewritten
chat turn) and feeds the rest at the logical position right after the kept prefix. The same
mechanism serves the target pipeline and a draft model, speculation and multi-turn chat alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from remote_worker import protocol


@dataclass(frozen=True)
class Feed:
    """What to send for one step: mask these physical ranges, then feed `tokens` at logical
    `pos0`."""

    cache_len: int  # physical length before the step
    pos0: int
    tokens: tuple[int, ...]
    mask_ranges: tuple[tuple[int, int], ...]

    def ranges_array(self) -> np.ndarray:
        return np.array(self.mask_ranges, dtype=np.int64).reshape(-1, 2)

    def step(self, session: int, decode: protocol.Decode | None, run: int = 0) -> protocol.Step:
        """The Step that applies this feed to `session` (the link sets its seq)."""
        tokens = np.array(self.tokens, np.int64)
        return protocol.Step(
            session,
            0,
            self.pos0,
            self.cache_len,
            self.ranges_array(),
            tokens=tokens,
            decode=decode,
            run=run,
        )


def _runs(slots: list[int]) -> tuple[tuple[int, int], ...]:
    """Sorted slot indices as half-open runs."""
    runs: list[tuple[int, int]] = []
    for slot in slots:
        if runs and runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], slot + 1)
        else:
            runs.append((slot, slot + 1))
    return tuple(runs)


class CacheLedger:
    """Physical slots of one session's cache: token ids, and which slots the mask still lets
    through."""

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._valid: list[bool] = []
        self._valid_slots: list[int] = []  # physical index of each valid slot, in logical order

    def copy(self) -> CacheLedger:
        """An independent ledger in the same state (lists of ints: a shallow copy each, not a
        deepcopy)."""
        twin = CacheLedger()
        twin._tokens, twin._valid, twin._valid_slots = (
            list(self._tokens),
            list(self._valid),
            list(self._valid_slots),
        )
        return twin

    @property
    def cache_len(self) -> int:
        return len(self._tokens)

    @property
    def logical_len(self) -> int:
        return len(self._valid_slots)

    @property
    def garbage(self) -> int:
        """Masked slots still held in the physical cache."""
        return self.cache_len - self.logical_len

    def sequence(self) -> list[int]:
        """The token sequence the cache holds, in logical order."""
        return [self._tokens[slot] for slot in self._valid_slots]

    def plan(self, sequence: list[int] | tuple[int, ...], scored: int = 1) -> Feed:
        """The step that moves the cache to hold `sequence`, feeding at least its last `scored`
        tokens.

        A verify step scores the last history token and every draft after it, so it feeds them all
        even when the cache already holds them (the same prompt again: its cached reply is masked
        and re-fed)."""
        if not 1 <= scored <= len(sequence):
            raise ValueError(
                f"cannot plan {scored} scored tokens of a {len(sequence)}-token sequence"
            )
        common = 0
        limit = min(len(self._valid_slots), len(sequence) - scored)
        while common < limit and self._tokens[self._valid_slots[common]] == sequence[common]:
            common += 1
        rejected = self._valid_slots[common:]
        return Feed(
            self.cache_len, common, tuple(int(t) for t in sequence[common:]), _runs(rejected)
        )

    def plan_after(
        self, pending: Sequence[Feed], sequence: list[int] | tuple[int, ...], scored: int = 1
    ) -> Feed:
        """`plan` as if the `pending` steps (sent in this order, their results not yet back) were
        committed; those already committed are skipped. The ledger is unchanged."""
        ahead = self.copy()
        for feed in pending:
            if feed.cache_len >= ahead.cache_len:  # committed steps lie below the physical length
                ahead.commit(feed)
        return ahead.plan(sequence, scored)

    def commit(self, feed: Feed, extra: tuple[int, ...] = ()) -> None:
        """Record that `feed` was applied (plus `extra` tokens a draft fed after it)."""
        if feed.cache_len != self.cache_len:
            raise ValueError(
                f"feed planned at cache length {feed.cache_len}, ledger is at {self.cache_len}"
            )
        if (
            feed.mask_ranges
        ):  # rebuilt only when slots were masked: a plain step costs O(its tokens)
            for start, end in feed.mask_ranges:
                for slot in range(start, end):
                    self._valid[slot] = False
            self._valid_slots = [slot for slot in self._valid_slots if self._valid[slot]]
        if len(self._valid_slots) != feed.pos0:
            raise ValueError(
                f"feed keeps {len(self._valid_slots)} slots but starts at position {feed.pos0}"
            )
        for token in (*feed.tokens, *extra):
            self._valid_slots.append(len(self._tokens))
            self._tokens.append(int(token))
            self._valid.append(True)

    def compact(self) -> None:
        """Drop masked slots, as the workers do on a Compact message."""
        self._tokens = self.sequence()
        self._valid = [True] * len(self._tokens)
        self._valid_slots = list(range(len(self._tokens)))

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def needs_compaction(self, ratio: float = 0.5, minimum: int = 64) -> bool:
        """True when masked slots pass both `minimum` and `ratio` of the valid ones."""
        return self.garbage >= minimum and self.garbage >= ratio * max(1, self.logical_len)
