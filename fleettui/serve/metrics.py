"""Provides the server's Prometheus metrics: request counters and latency histograms, and
per-stage gauges."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

THROTTLE_CELSIUS = 95.0  # at or above this a desktop CPU is throttling (or about to)
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class StageCollector(Collector):
    """Per-stage gauges read from the latest telemetry samples at scrape time."""

    SERIES = (
        # name, help, sample key, scale
        (
            "fleettui_stage_tokens_per_second",
            "Tokens per second computed by the stage",
            "tokens_per_s",
            1.0,
        ),
        (
            "fleettui_stage_busy_ratio",
            "Share of the last interval the stage was computing",
            "busy",
            1.0,
        ),
        ("fleettui_stage_queue_depth", "Steps waiting in the stage's queue", "queue", 1.0),
        (
            "fleettui_stage_hop_latency_seconds",
            "Wire time to the next stage (smoothed)",
            "hop_ms",
            0.001,
        ),
        (
            "fleettui_stage_resident_memory_bytes",
            "Resident memory of the stage worker",
            "rss_mb",
            2.0**20,
        ),
        (
            "fleettui_stage_temperature_celsius",
            "CPU temperature of the stage's host",
            "temp_c",
            1.0,
        ),
        ("fleettui_stage_sessions", "Sessions open on the stage", "sessions", 1.0),
        (
            "fleettui_stage_batch_rows",
            "Session steps per inference (last interval)",
            "batch_rows",
            1.0,
        ),
    )

    def __init__(self, samples: Callable[[], dict[str, dict[str, Any]]]) -> None:
        self._samples = samples

    def describe(self) -> list[Any]:
        return []  # collected lazily; the registry must not call collect() at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        samples = self._samples()
        for name, text, key, scale in self.SERIES:
            family = GaugeMetricFamily(name, text, labels=["stage"])
            for stage, sample in sorted(samples.items()):
                value = _number(sample.get(key))
                if value is not None:
                    family.add_metric([stage], value * scale)
            yield family
        throttled = GaugeMetricFamily(
            "fleettui_stage_throttled",
            f"1 when the stage reports throttling or its CPU is at {THROTTLE_CELSIUS:g} C or more",
            labels=["stage"],
        )
        for stage, sample in sorted(samples.items()):
            temperature = _number(sample.get("temp_c"))
            hot = temperature is not None and temperature >= THROTTLE_CELSIUS
            throttled.add_metric([stage], 1.0 if sample.get("throttled") or hot else 0.0)
        yield throttled


class ServerMetrics:
    """Every series of one server, in its own registry (several servers can live in one process)."""

    def __init__(self, samples: Callable[[], dict[str, dict[str, Any]]]) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "fleettui_serve_requests",
            "Requests by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=registry,
        )
        self.active = Gauge(
            "fleettui_serve_active_sessions", "Requests generating now", registry=registry
        )
        self.queued = Gauge(
            "fleettui_serve_queued_sessions", "Requests waiting for a slot", registry=registry
        )
        self.pooled = Gauge(
            "fleettui_serve_pooled_sessions",
            "Idle sessions kept open for prefix reuse",
            registry=registry,
        )
        self.ttft = Histogram(
            "fleettui_serve_time_to_first_token_seconds",
            "From admission to the first token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token = Histogram(
            "fleettui_serve_inter_token_latency_seconds",
            "Between consecutive token deliveries",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "fleettui_serve_tokens", "Tokens by kind", ["kind"], registry=registry
        )
        self.acceptance = Gauge(
            "fleettui_serve_acceptance_rate",
            "Speculative acceptance rate of the last request that drafted",
            registry=registry,
        )
        self.mean_k = Gauge(
            "fleettui_serve_mean_k", "Mean draft length K of the last request", registry=registry
        )
        self.disconnects = Counter(
            "fleettui_serve_client_disconnects",
            "Requests whose client left before the end",
            registry=registry,
        )
        registry.register(StageCollector(samples))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
