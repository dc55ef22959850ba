"""Provides what a stage worker's I/O thread needs: a byte-bounded inbox and the parsing of
control requests."""

from __future__ import annotations

import json
import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from remote_worker import protocol

MAX_CONTROL_BYTES = 64 << 10  # a control request is a small JSON object
MAX_REFUSALS = 1024  # pending Error replies for refused requests; beyond this they are only counted
MAX_LEASE_SECONDS = 86400.0


class ControlRequestError(ValueError):
    """A control request that is answered with {"error": message}."""


@dataclass(frozen=True)
class Refusal:
    """An Error to send down the chain for a request refused at intake (it never reaches the
    engine)."""

    error: protocol.Error


@dataclass(frozen=True)
class RunStep:
    """A step of a one-stage pipeline's run in the inbox: the first (from the coordinator) or a next
    one (queued by the compute thread itself, behind what arrived meanwhile)."""

    step: protocol.Step
    first: bool = False


class RunStops:
    """The run each session is in at stage 0, by the seq of its first step (the I/O thread records
    it as it admits that step). Any control message of the session admitted later ends the run: its
    next step is dropped wherever it is (queued here, or on its way back from the last stage), so
    the control's answer follows the run's last Result."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[int, int] = {}

    def started(self, session: int, seq: int) -> None:
        with self._lock:
            self._runs[session] = seq

    def stopped(self, session: int) -> None:
        with self._lock:
            self._runs.pop(session, None)

    def current(self, session: int, seq: int) -> bool:
        with self._lock:
            return self._runs.get(session) == seq


class Inbox:
    """FIFO of received messages bounded in bytes and in count; refusals jump the queue (they are
    tiny)."""

    def __init__(self, max_bytes: int, max_messages: int = 4096) -> None:
        self.max_bytes = max_bytes
        self.max_messages = max_messages
        self._items: deque[tuple[float, protocol.Message | RunStep, int]] = deque()
        self._refusals: deque[Refusal] = deque()  # served first, in their own order
        self._bytes = 0
        self._condition = threading.Condition()

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items) + len(self._refusals)

    def put(self, received: float, message: protocol.Message | RunStep, size: int) -> bool:
        """Queue a message; False (and nothing queued) when it would exceed the byte or count
        budget."""
        with self._condition:
            if self._bytes + size > self.max_bytes or len(self._items) >= self.max_messages:
                return False
            self._items.append((received, message, size))
            self._bytes += size
            self._condition.notify()
            return True

    def resume(self, received: float, run: RunStep) -> None:
        """Queue a run's next step at the back, beyond the budgets: it replaces the step just
        served."""
        with self._condition:
            self._items.append((received, run, 0))
            self._condition.notify()

    def refuse(self, error: protocol.Error) -> bool:
        """Queue an Error reply ahead of the waiting work; False when too many are already
        pending."""
        with self._condition:
            if len(self._refusals) >= MAX_REFUSALS:
                return False
            self._refusals.append(Refusal(error))
            self._condition.notify()
            return True

    def get(self, timeout: float) -> tuple[float, protocol.Message | RunStep | Refusal] | None:
        """The next item, or None after `timeout` seconds (or a `wake()`)."""
        with self._condition:
            if not self._items and not self._refusals:
                self._condition.wait(timeout)
            if self._refusals:
                return 0.0, self._refusals.popleft()
            if not self._items:
                return None
            received, item, size = self._items.popleft()
            self._bytes -= size
            return received, item

    def together(self) -> threading.Condition:
        """Hold the queue while several puts go in (a batch arrives whole: the compute thread
        sees all)."""
        return self._condition

    def take_steps(
        self, exclude: set[int], limit: int, fits: Callable[[protocol.Step], bool]
    ) -> list[tuple[float, protocol.Step | RunStep]]:
        """Take up to `limit` queued steps that `fit`, of sessions not in `exclude` and each the
        first queued message of its session (a session's messages are never reordered)."""
        taken: list[tuple[float, protocol.Step | RunStep]] = []
        with self._condition:
            seen = set(exclude)
            kept: deque[tuple[float, protocol.Message | RunStep, int]] = deque()
            for entry in self._items:
                received, item, size = entry
                step = item.step if isinstance(item, RunStep) else item
                session = getattr(step, "session", None)
                if (
                    len(taken) < limit
                    and isinstance(step, protocol.Step)
                    and session not in seen
                    and fits(step)
                ):
                    taken.append((received, item))  # type: ignore[arg-type]
                    self._bytes -= size
                else:
                    kept.append(entry)
                if session is not None:
                    seen.add(session)
            self._items = kept
        return taken

    def wake(self) -> None:
        with self._condition:
            self._condition.notify_all()


def parse_control(frames: list[bytes]) -> tuple[str, dict[str, Any]]:
    """(op, request) of one control request; ControlRequestError says, in one line, why it cannot
    be served."""
    if len(frames) != 1:
        raise ControlRequestError(f"expected a request of one frame, got {len(frames)} frames")
    raw = frames[0]
    if len(raw) > MAX_CONTROL_BYTES:
        raise ControlRequestError(f"request of {len(raw)} bytes exceeds {MAX_CONTROL_BYTES} bytes")
    try:
        request = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: b"[" * 100000
        raise ControlRequestError("not a JSON document") from None
    if not isinstance(request, dict) or not isinstance(request.get("op"), str):
        raise ControlRequestError("expected a JSON object with a string 'op'")
    return request["op"], request


def lease_seconds(request: dict[str, Any]) -> float:
    """The `seconds` of a lease request: a number in 0..86400 (0 turns the lease off)."""
    seconds = request.get("seconds")
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not math.isfinite(seconds)
    ):
        raise ControlRequestError("lease: 'seconds' must be a number")
    if not 0 <= seconds <= MAX_LEASE_SECONDS:
        raise ControlRequestError(f"lease: seconds {seconds} outside 0..{MAX_LEASE_SECONDS:g}")
    return float(seconds)
