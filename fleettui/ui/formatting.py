"""Provides the pure display logic of the TUI: sparklines, rolling series, transfer rates, number
formats."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

BLOCKS = "▁▂▃▄▅▆▇█"
HISTORY_SECONDS = 60.0


def sparkline(
    values: Sequence[float], width: int, maximum: float | None = None, minimum: float = 0.0
) -> str:
    """`values` (oldest first) squeezed into `width` block characters, left-padded with spaces.

    Each character is the mean of its share of the values; the scale is [minimum, maximum] where
    maximum defaults to the largest value (so an idle series draws as a flat floor, not noise).
    """
    if width <= 0:
        return ""
    points = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not points:
        return " " * width
    if len(points) > width:
        buckets: list[float] = []
        for index in range(width):
            start = index * len(points) // width
            end = max(start + 1, (index + 1) * len(points) // width)
            chunk = points[start:end]
            buckets.append(sum(chunk) / len(chunk))
        points = buckets
    top = max(points) if maximum is None else maximum
    span = top - minimum
    characters = []
    for value in points:
        level = (
            0
            if span <= 0
            else round((min(max(value, minimum), top) - minimum) / span * (len(BLOCKS) - 1))
        )
        characters.append(BLOCKS[level])
    return " " * (width - len(characters)) + "".join(characters)


@dataclass
class Series:
    """The samples of one metric over the last `seconds`, keyed by the sample's own timestamp."""

    seconds: float = HISTORY_SECONDS
    points: deque[tuple[float, float]] = field(default_factory=deque)

    def add(self, at: float, value: float | None) -> None:
        if value is None or not math.isfinite(value):
            return
        if self.points and at < self.points[-1][0]:
            return  # an out-of-order (collapsed or replayed) sample
        self.points.append((at, float(value)))
        while self.points and self.points[0][0] < at - self.seconds:
            self.points.popleft()

    def values(self) -> list[float]:
        return [value for _, value in self.points]

    @property
    def last(self) -> float | None:
        return self.points[-1][1] if self.points else None

    def __len__(self) -> int:
        return len(self.points)


@dataclass
class TransferRate:
    """Bytes per second of one transfer, from successive (time, bytes done) reports."""

    window: float = 3.0
    marks: deque[tuple[float, float]] = field(default_factory=deque)

    def add(self, done: float, at: float | None = None) -> None:
        at = time.monotonic() if at is None else at
        if self.marks and done < self.marks[-1][1]:
            self.marks.clear()  # a new transfer restarted the count
        self.marks.append((at, done))
        while len(self.marks) > 2 and self.marks[0][0] < at - self.window:
            self.marks.popleft()

    @property
    def bytes_per_second(self) -> float | None:
        if len(self.marks) < 2:
            return None
        (first_time, first_done), (last_time, last_done) = self.marks[0], self.marks[-1]
        elapsed = last_time - first_time
        return (last_done - first_done) / elapsed if elapsed > 0 else None


def megabytes(count: float) -> str:
    return f"{count / 1e6:.1f} MB"


def transfer_text(done: float, total: float, rate: float | None) -> str:
    """ "12.3/40.0 MB 5.1 MB/s" (the rate only once it is known)."""
    text = f"{done / 1e6:.1f}/{total / 1e6:.1f} MB"
    return text + (f" {rate / 1e6:.1f} MB/s" if rate is not None else "")


def rate_text(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def percent_text(fraction: float | None) -> str:
    return "—" if fraction is None else f"{fraction * 100:.0f}%"


def temperature_text(celsius: float | None) -> str:
    return "n/a" if celsius is None else f"{celsius:.0f}°C"


def memory_text(megabytes_used: float | None) -> str:
    if megabytes_used is None:
        return "—"
    return (
        f"{megabytes_used / 1024:.2f} GB" if megabytes_used >= 1024 else f"{megabytes_used:.0f} MB"
    )


def layers_text(layers: tuple[float, float] | None) -> str:
    """[0, 12.5): a .5 boundary cuts that layer between its attention and its MLP."""
    return "—" if layers is None else f"[{layers[0]:g}, {layers[1]:g})"


def stats_text(
    tokens: int, tokens_per_second: float, acceptance: float | None, mean_k: float
) -> str:
    """The line under a reply: "N tok · X tok/s · acceptance Y% · K≈Z"."""
    accepted = "n/a" if acceptance is None else f"{acceptance:.0%}"
    return f"{tokens} tok · {tokens_per_second:.1f} tok/s · acceptance {accepted} · K≈{mean_k:.1f}"


def truncate(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"
