"""Provides the batch rows of a stage engine: sessions living as rows of shared InferRequests.

A group is one InferRequest whose KV state has one row per member session; a lone session is a group
of one. A batched step feeds every row of a group at once: each row's new tokens are right-aligned
in the step (left pads masked out), and a member that has no step this time is a row of pads. Each
session keeps its own *local* slots (what the coordinator counts, masks and compacts) and a map from
local slot to the physical slot of its row, so pads and regrouping never show through the wire
protocol. Rows leave a group for free (beam_idx omits them at the group's next inference); joining
copies the KV rows into a new group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Group:
    """One InferRequest serving `members` as its rows."""

    request: Any  # openvino.InferRequest
    members: list[int] = field(default_factory=list)
    # state row of each member
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    length: int = 0  # physical slots in every row of the state
    sparse: int = 0  # inferences in a row that left some member idle
    inputs: tuple[np.ndarray, ...] = ()  # the last step's arrays, which its tensors share

    def add(self, session: int) -> None:
        self.members.append(session)
        self.rows = np.append(self.rows, np.int32(len(self.rows))).astype(np.int32)

    def remove(self, session: int) -> None:
        """Drop a member; its row leaves the state at the group's next inference (beam_idx omits
        it)."""
        index = self.members.index(session)
        del self.members[index]
        self.rows = np.delete(self.rows, index).astype(np.int32)

    def settled(self) -> None:
        """After an inference the state holds exactly the members' rows, in order."""
        self.rows = np.arange(len(self.members), dtype=np.int32)


@dataclass
class Session:
    """One session's view of its cache: local slots, their mask and their physical slots in its
    group."""

    group: Group
    cache_len: int = 0  # local slots, masked ones included
    # 1 = attend, per local slot
    mask: np.ndarray = field(default_factory=lambda: np.ones(256, np.int64))
    # physical slot per local
    slots: np.ndarray = field(default_factory=lambda: np.zeros(256, np.int64))
    broken: str = ""  # why the state can no longer be trusted (a failed infer or regrouping)

    def reserve(self, length: int) -> None:
        if length > len(self.mask):
            size = max(length, 2 * len(self.mask))
            mask, slots = np.ones(size, np.int64), np.zeros(size, np.int64)
            mask[: self.cache_len] = self.mask[: self.cache_len]
            slots[: self.cache_len] = self.slots[: self.cache_len]
            self.mask, self.slots = mask, slots

    def live(self) -> int:
        return int(self.mask[: self.cache_len].sum())


@dataclass(frozen=True)
class Item:
    """One session's part of a batched step (already validated)."""

    session: int
    pos0: int
    data: np.ndarray  # int64 [n] token ids or float32 [n, H] hidden states
    keep: int  # rows of output wanted, the last `keep` (1..n)

    @property
    def n(self) -> int:
        return int(self.data.shape[0])


@dataclass(frozen=True)
class BatchInputs:
    """The arrays of one group inference: data [B, n(, H)], mask [B, L + n], positions [B, n],
    keep [1]."""

    data: np.ndarray
    mask: np.ndarray
    positions: np.ndarray
    keep: np.ndarray
    width: int  # n: the step's token rows (each item right-aligned in them)


def batch_inputs(
    group: Group,
    sessions: dict[int, Session],
    items: dict[int, Item],
    hidden_size: int,
    first: bool,
) -> BatchInputs:
    """Lay out one inference of `group`: member rows in order, items right-aligned, everything else
    masked.

    A member without an item is fed pads at its next logical position (they attend to its live
    slots, so no row ever attends to nothing); its pads stay masked forever, like every pad."""
    width = max(item.n for item in items.values())
    rows, length = len(group.members), group.length
    data = (
        np.zeros((rows, width), np.int64)
        if first
        else np.zeros((rows, width, hidden_size), np.float32)
    )
    mask = np.zeros((rows, length + width), np.int64)
    positions = np.zeros((rows, width), np.int64)
    keep = max(item.keep for item in items.values())
    for row, member in enumerate(group.members):
        state = sessions[member]
        used = state.cache_len
        mask[row, state.slots[:used]] = state.mask[:used]
        item = items.get(member)
        if item is None:
            positions[row] = state.live()
            continue
        pad = width - item.n
        data[row, pad:] = item.data
        mask[row, length + pad :] = 1
        positions[row, :pad] = item.pos0
        positions[row, pad:] = np.arange(item.pos0, item.pos0 + item.n)
    return BatchInputs(data, mask, positions, np.asarray([keep], np.int64), width)


def record_step(
    group: Group, sessions: dict[int, Session], items: dict[int, Item], width: int
) -> None:
    """After an inference: the items' tokens become local slots of their sessions (pads belong to
    nobody)."""
    length = group.length
    for member in group.members:
        state = sessions[member]
        item = items.get(member)
        if item is None:
            continue
        state.reserve(state.cache_len + item.n)
        start = length + width - item.n
        state.slots[state.cache_len : state.cache_len + item.n] = np.arange(start, length + width)
        state.mask[state.cache_len : state.cache_len + item.n] = 1
        state.cache_len += item.n
    group.length = length + width
    group.settled()


def item_output(output: np.ndarray, row: int, item: Item) -> np.ndarray:
    """The rows of a batched output that are `item`'s: its last `keep` (items are right-aligned)."""
    rows: np.ndarray = output[row]
    return rows[len(rows) - item.keep :]


def gather_rows(states: list[np.ndarray], row: int, slots: np.ndarray) -> list[np.ndarray]:
    """One session's KV out of its group's states: [kv_heads, used, head_dim] per state, local
    order."""
    return [np.ascontiguousarray(state[row][:, slots, :]) for state in states]


def stack_rows(per_session: list[list[np.ndarray]]) -> tuple[list[np.ndarray], list[int]]:
    """New group states from each member's local KV, right-aligned to the longest; with each
    one's start."""
    length = max((rows[0].shape[1] for rows in per_session), default=0)
    starts = [length - rows[0].shape[1] for rows in per_session]
    stacked = []
    for index in range(len(per_session[0])):
        first = per_session[0][index]
        out = np.zeros((len(per_session), first.shape[0], length, first.shape[2]), first.dtype)
        for member, rows in enumerate(per_session):
            out[member, :, starts[member] :, :] = rows[index]
        stacked.append(out)
    return stacked, starts
