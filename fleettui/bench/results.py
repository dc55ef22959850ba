"""Provides the bench's measured rows and the per-stage time split from the stages' traces."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from remote_worker.protocol import TRACE_FIELDS

JSON_FIELDS = (
    "name",
    "stages",
    "users",
    "spec_k",
    "hop_delay_ms",
    "precision",
    "tokens",
    "seconds",
    "aggregate_tok_s",
    "per_user_tok_s",
    "ttft_s",
    "acceptance_rate",
    "stage_breakdown",
)


@dataclass
class Row:
    """One measured (or skipped) configuration of the bench."""

    name: str
    kind: str  # mono | genai | fleet
    stages: int = 1
    users: int = 1
    spec_k: int | str = 0  # 0 = no speculation, "auto" = adaptive K, n = fixed K
    hop_delay_ms: float = 0.0
    pinned: bool = False  # emulated PCs: each stage (or the mono process) on its own core, 1 thread
    precision: dict[str, str] = field(default_factory=dict)  # weights, inference, kv_cache
    tokens: int = 0
    seconds: float = 0.0
    aggregate_tok_s: float = 0.0
    per_user_tok_s: float = 0.0
    ttft_s: float | None = None
    acceptance_rate: float | None = None
    mean_k: float | None = None
    stage_breakdown: list[dict[str, float]] | None = None
    # 12.5: a boundary inside layer 12 (after its attention)
    layers: list[list[float]] | None = None
    vs_mono: float | None = None
    vs_genai: float | None = None
    status: str = "ok"  # ok | skipped: reason | failed: reason
    details: dict[str, Any] = field(default_factory=dict)
    model: str = ""  # "" = the fleet's model; else e.g. synthetic:llama-3.2-1b (the scale group)
    group: str = ""  # the bench group (--only)
    # the row this one is paired with: measured in the same rounds, adjacent windows
    versus: str = ""
    # a pinned mono run as n copies at once, one per core (the n-PC ceiling); rates summed
    copies: int = 1

    @property
    def paired_ratio(self) -> float | None:
        """Median of the per-round ratios to `versus` (adjacent windows); None without pairs."""
        ratios = self.details.get("paired_ratios") or []
        return float(np.median(ratios)) if ratios else None

    @property
    def ratio_spread(self) -> float | None:
        """(max - min) / median of the per-round ratios: how far the ratio itself moved between
        rounds."""
        ratios = self.details.get("paired_ratios") or []
        if len(ratios) < 2:
            return None
        middle = float(np.median(ratios))
        return (max(ratios) - min(ratios)) / middle if middle > 0 else None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["paired_ratio"], data["ratio_spread"] = self.paired_ratio, self.ratio_spread
        for key, value in data.items():
            if isinstance(value, float):
                data[key] = round(value, 4) if math.isfinite(value) else None
        return data


# ---------------------------------------------------------------------------------------- breakdown
@dataclass(frozen=True)
class Trip:
    """One request through the chain as the coordinator saw it, with the stages' trace records."""

    sent: float  # time.time() just before the coordinator sent the request
    received: float  # time.time() just after the reply arrived
    trace: np.ndarray  # flat, TRACE_FIELDS per stage: stage, received, started, finished, sent


def stage_breakdown(trips: Iterable[Trip], tokens: int) -> list[dict[str, float]] | None:
    """Per stage, milliseconds per generated token of compute, queueing and wire.

    compute = finished - started, queue = started - received, and wire = the rest of the round trip:
    the hop into the stage plus the stage's own send time (serialisation); the last stage also
    carries the hop back to the coordinator (and the coordinator's receive path). The three sum to
    the round trips. A run's Result held back at the last stage (sent in a burst,
    `remote_worker.coalesce`) is not on the token's path (the run went on meanwhile): its wait is
    `held_ms`, apart."""
    totals: dict[int, list[float]] = {}
    held: dict[int, float] = {}
    order: list[int] = []
    seen = False
    for trip in trips:
        records = np.asarray(trip.trace, np.float64).reshape(-1, TRACE_FIELDS)
        if not len(records):
            continue
        seen = True
        previous_sent = trip.sent
        for index, (stage, received, started, finished, sent) in enumerate(records):
            key = int(stage)
            if key not in totals:
                totals[key] = [0.0, 0.0, 0.0]
                order.append(key)
            bucket = totals[key]
            bucket[0] += finished - started
            bucket[1] += started - received
            if index == len(records) - 1:
                held[key] = held.get(key, 0.0) + (sent - finished)
                bucket[2] += (received - previous_sent) + (trip.received - sent)
            else:
                bucket[2] += (received - previous_sent) + (sent - finished)
            previous_sent = sent
    if not seen or tokens <= 0:
        return None
    scale = 1000.0 / tokens
    return [
        {
            "stage": key,
            "compute_ms": round(totals[key][0] * scale, 3),
            "queue_ms": round(totals[key][1] * scale, 3),
            "wire_ms": round(totals[key][2] * scale, 3),
            **({"held_ms": round(held[key] * scale, 3)} if key in held else {}),
        }
        for key in order
    ]


def paired_rates(
    rates: list[float],
    times: list[float | None],
    base_rates: list[float],
    base_times: list[float | None],
) -> list[tuple[float, float]]:
    """(row rate, its pair's rate) per measurement of a row. Where every measurement has its time
    (the middle of its window), the pair's rate is taken at the row's own time, interpolated between
    the pair's measurements before and after it (the nearest one outside them): a shared machine
    drifts within a group, and a row measured half a minute after its pair in every round would
    carry that drift as a ratio. Without times, measurement i goes with i."""
    points = sorted(
        (t, b) for t, b in zip(base_times, base_rates, strict=False) if t is not None and b > 0
    )
    if not points or len(times) != len(rates) or any(t is None for t in times):
        return [(a, b) for a, b in zip(rates, base_rates, strict=False) if a > 0 and b > 0]
    base_at, base = np.array(points, np.float64).T
    # linear between the pair's measurements around it, the nearest one before the first or after
    # the last
    return [
        (rate, float(np.interp(at, base_at, base)))
        for rate, at in zip(rates, times, strict=True)
        if rate > 0 and at is not None
    ]
