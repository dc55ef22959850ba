"""Provides a stage's running statistics and the about-once-a-second telemetry sample it
publishes."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INTERVAL = 1.0  # seconds between telemetry samples
_PREFERRED_SENSORS = ("coretemp", "k10temp", "zenpower", "x86_pkg_temp", "cpu_thermal", "acpitz")


def cpu_temperature() -> float | None:
    """The CPU temperature in °C where the OS exposes one, else None."""
    try:
        import psutil

        sensors = psutil.sensors_temperatures() if hasattr(psutil, "sensors_temperatures") else {}
    except (OSError, RuntimeError):
        sensors = {}
    for name in (*_PREFERRED_SENSORS, *sorted(sensors)):
        readings = [entry.current for entry in sensors.get(name, ()) if entry.current is not None]
        if readings:
            return float(max(readings))
    best = None
    for zone in sorted(Path("/sys/class/thermal").glob("thermal_zone*")):
        try:
            kind = (zone / "type").read_text().strip().lower()
            value = int((zone / "temp").read_text().strip()) / 1000.0
        except (OSError, ValueError):
            continue
        if kind.startswith(("x86_pkg", "cpu", "soc", "acpitz")) and value > 0:
            best = value if best is None else max(best, value)
    return best


def rss_megabytes() -> float:
    import psutil

    return float(psutil.Process().memory_info().rss) / 1e6


@dataclass
class StageStats:
    """Counters one worker keeps while serving; `sample()` turns the last interval into rates."""

    name: str
    stage: int
    role: str
    steps: int = 0
    inferences: int = 0  # OpenVINO inferences (a batched one serves several sessions' steps)
    tokens: int = 0
    errors: int = 0  # messages whose serving failed (each answered with an Error down the chain)
    dropped: int = 0  # unparseable or unexpected frames (no header to answer to)
    received: int = 0  # multipart messages read from the data socket
    # requests with a sound header but a bad body or shape (answered with an Error)
    rejected: int = 0
    # requests refused because the queue's byte budget was full (answered with an Error)
    overflow: int = 0
    refused: int = 0  # peers whose handshake failed (CURVE, ZAP, not ZeroMQ at all)
    control_errors: int = 0  # control requests answered with an error
    unsent: int = 0  # messages that could not be sent downstream
    run_ends: int = 0  # next steps of ended runs dropped at stage 0 (expected after every Cancel)
    busy_seconds: float = 0.0
    last_step_ms: float = 0.0
    handled: Counter[str] = field(default_factory=Counter)  # message kinds served
    # inferences by the number of sessions in them
    batches: Counter[int] = field(default_factory=Counter)
    started: float = field(default_factory=time.time)
    _mark: tuple[float, int, int, float, int] = (0.0, 0, 0, 0.0, 0)
    _next_sample: float = 0.0

    def __post_init__(self) -> None:
        now = time.monotonic()
        self._mark = (now, 0, 0, 0.0, 0)
        self._next_sample = now + INTERVAL

    def record_step(self, tokens: int, seconds: float, sessions: int = 1) -> None:
        """One inference of `tokens` token rows serving `sessions` sessions' steps."""
        self.steps += sessions
        self.inferences += 1
        self.tokens += tokens
        self.last_step_ms = seconds * 1e3
        self.batches[sessions] += 1

    def due(self) -> bool:
        return time.monotonic() >= self._next_sample

    def seconds_to_sample(self) -> float:
        return max(0.0, self._next_sample - time.monotonic())

    def sample(self, state: str, queue: int, sessions: int, cache_slots: int) -> dict[str, Any]:
        """The telemetry dict for the interval since the previous sample (and start the next
        interval)."""
        now = time.monotonic()
        then, steps, tokens, busy, inferences = self._mark
        elapsed = max(now - then, 1e-6)
        self._mark = (now, self.steps, self.tokens, self.busy_seconds, self.inferences)
        self._next_sample = now + INTERVAL
        return {
            "name": self.name,
            "stage": self.stage,
            "role": self.role,
            "state": state,
            "time": time.time(),
            "steps_per_s": (self.steps - steps) / elapsed,
            "tokens_per_s": (self.tokens - tokens) / elapsed,
            "busy": min(1.0, (self.busy_seconds - busy) / elapsed),
            "batch_rows": (self.steps - steps) / max(self.inferences - inferences, 1),
            "queue": queue,
            "last_step_ms": round(self.last_step_ms, 3),
            "rss_mb": round(rss_megabytes(), 1),
            "temp_c": cpu_temperature(),
            "sessions": sessions,
            "cache_slots": cache_slots,
            "dropped": self.dropped,
            "errors": self.errors,
            "rejected": self.rejected,
            "overflow": self.overflow,
            "refused": self.refused,
            "pid": os.getpid(),
        }

    def totals(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "errors": self.errors,
            "dropped": self.dropped,
            "received": self.received,
            "rejected": self.rejected,
            "overflow": self.overflow,
            "refused": self.refused,
            "control_errors": self.control_errors,
            "unsent": self.unsent,
            "run_ends": self.run_ends,
            "busy_seconds": round(self.busy_seconds, 3),
            "last_step_ms": round(self.last_step_ms, 3),
            "handled": {kind: count for kind, count in sorted(self.handled.items())},
            "batches": {str(size): count for size, count in sorted(self.batches.items())},
            "uptime_s": round(time.time() - self.started, 3),
        }


def encode_sample(sample: dict[str, Any]) -> bytes:
    """One telemetry frame: the sample as UTF-8 JSON."""
    return json.dumps(sample, separators=(",", ":")).encode("utf-8")
