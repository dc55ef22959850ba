"""Provides what the speculation policy measures: fitted costs, realized rates, the stages' load.

`LinearCost` fits seconds against a size (a verify of K + 1 tokens, K drafts); `Realized` keeps the
tokens per second an arm really achieved; `round_costs` reads a round's own latency and busiest
compute from the stages' trace; `StageLoad` says how busy the busiest stage was of late."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from remote_worker import protocol
from remote_worker.protocol import trace_records


@dataclass
class LinearCost:
    """Least-squares fit of seconds = a + b * size over the recent samples of each size.

    Each size keeps its own `PER_SIZE` latest samples: plain rounds far outnumber verifies, and one
    window for all would let a reply's plain steps push every verify out of it: the fit would lose
    its slope and a long verify would look as cheap as a plain step. Until two different sizes were
    measured the slope is unknown: a `proportional` cost (drafting K tokens takes K draft steps) is
    then scaled from the one size seen, so a single measurement at K = 3 cannot make K = 8 look as
    cheap as K = 3; a non-proportional cost (a verify pass, nearly flat in K) stays flat. The fit is
    computed once per new sample (closed form), not per prediction: a round asks for dozens."""

    PER_SIZE = 32

    proportional: bool = False
    samples: dict[float, deque[float]] = field(default_factory=dict)  # size: its latest seconds
    _fit: tuple[float, float, float] | None = None  # (intercept, slope, the one size seen or 0)

    def add(self, size: float, seconds: float) -> None:
        self.samples.setdefault(size, deque(maxlen=self.PER_SIZE)).append(seconds)
        self._fit = None

    @property
    def measured(self) -> bool:
        return bool(self.samples)

    def _fitted(self) -> tuple[float, float, float]:
        if self._fit is None:
            sizes = np.concatenate(
                [np.full(len(times), size) for size, times in self.samples.items()]
            )
            times = np.concatenate(
                [np.fromiter(times, np.float64) for times in self.samples.values()]
            )
            mean_size, mean_time = float(sizes.mean()), float(times.mean())
            spread = float(((sizes - mean_size) ** 2).sum())
            if spread == 0.0:
                self._fit = (mean_time, 0.0, float(sizes[0]))
            else:
                slope = float(((sizes - mean_size) * (times - mean_time)).sum()) / spread
                self._fit = (mean_time - slope * mean_size, slope, 0.0)
        return self._fit

    @property
    def sloped(self) -> bool:
        """Whether two different sizes were measured (else the slope is a guess)."""
        return len(self.samples) > 1

    def predict(self, size: float) -> float | None:
        if not self.samples:
            return None
        intercept, slope, only = self._fitted()
        if only:  # one size measured so far (a size 0 leaves the flat mean)
            return intercept * size / only if self.proportional else intercept
        return intercept + max(slope, 0.0) * size


def round_costs(trace: np.ndarray, wall_seconds: float) -> tuple[float, float]:
    """(own latency, busiest stage's compute) of one verify round, from its per-stage trace.

    own = wall - time queued at the stages (started - received, summed); compute = max(finished -
    started). Without a trace both are the wall time."""
    records = trace_records(trace)
    if not records:
        return wall_seconds, wall_seconds
    queued = compute = 0.0
    for _stage, received, started, finished, _sent in records:
        queued += max(started - received, 0.0)
        compute = max(compute, finished - started)
    return max(wall_seconds - queued, compute), compute


class StageLoad:
    """How busy the busiest stage was over the last `window` seconds, from the traces of the
    results.

    Several sessions generating at once compete for the stages only when the stages are busy: behind
    slow links they mostly wait on the wires, and each session's rounds then cost their own latency,
    as alone."""

    def __init__(self, window: float = 1.0) -> None:
        self.window = window
        # (received, stage, busy s)
        self._records: deque[tuple[float, int, float]] = deque(maxlen=4096)

    def observe(self, result: protocol.Result, received: float) -> None:
        for stage, _received, started, finished, _sent in trace_records(result.trace):
            self._records.append((received, int(stage), max(finished - started, 0.0)))

    def busiest(self, now: float | None = None) -> float:
        """Share of the last `window` seconds the busiest stage spent computing (0 without
        results)."""
        since = (time.time() if now is None else now) - self.window
        busy: dict[int, float] = {}
        for received, stage, seconds in reversed(self._records):
            if received < since:
                break
            busy[stage] = busy.get(stage, 0.0) + seconds
        return max(busy.values(), default=0.0) / self.window


@dataclass
class Realized:
    """Tokens per second actually achieved by one arm (plain decoding or one drafter), decayed."""

    tokens: float = 0.0
    seconds: float = 0.0
    rounds: float = 0.0

    def add(self, tokens: int, seconds: float, decay: float = 0.95) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.rounds = self.rounds * decay + 1

    def stretch(self, seconds: float) -> None:
        """Count `seconds` more (or fewer, if negative) for the tokens already recorded."""
        if self.rounds:
            self.seconds = max(self.seconds + seconds, 1e-6)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0
