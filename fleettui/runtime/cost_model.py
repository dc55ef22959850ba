"""Provides the speculation policy's pipeline-wide measures: `CostModel`, the fitted verify and
draft costs and the realized rates every session's policy shares, with the probe budget.

A verify of K + 1 tokens costs
- alone (one session generating): its own latency, the round trip minus time spent queued at the
  stages;
- loaded (several sessions at once while the busiest stage computes at least half the time,
  `StageLoad`): what it takes from the busiest stage, its compute, since the pipeline is then bound
  by that stage's throughput and not by one session's latency. Both come from the stages' own traces
  (received / started / finished / sent), not from wall time, so a session's rounds are not charged
  for the queue other sessions build."""

from __future__ import annotations

from dataclasses import dataclass, field

from fleettui.runtime.measures import LinearCost, Realized
from fleettui.runtime.tuning import TUNING


@dataclass
class CostModel:
    """Verify and draft costs of one pipeline, shared by its sessions' policies.

    Beside the fitted costs it keeps what each arm really achieved (tokens per second of wall time,
    apart for one session alone and for several at once): the guard that keeps speculation from
    being a loss whatever the model misses (Python overheads, a draft that shares the stages' cores,
    queueing)."""

    latency: LinearCost = field(default_factory=LinearCost)  # one session: own round-trip latency
    compute: LinearCost = field(default_factory=LinearCost)  # several: the busiest stage's compute
    drafts: dict[str, LinearCost] = field(default_factory=dict)
    # a run cut short for a free drafter (fleettui.runtime.lookup_watch): what its Cancel cost
    cut: LinearCost = field(default_factory=LinearCost)
    realized: dict[tuple[str, bool], Realized] = field(default_factory=dict)
    # drafter: decayed [accepted, rejected]
    acceptance: dict[str, list[float]] = field(default_factory=dict)
    # drafter: decayed [proposed, asked]
    proposals: dict[str, list[float]] = field(default_factory=dict)
    # (drafter, loaded): rounds
    probe_intervals: dict[tuple[str, bool], int] = field(default_factory=dict)
    # ... of any session since a probe
    since_probe: dict[tuple[str, bool], int] = field(default_factory=dict)
    # seconds of rounds recorded (every arm, each session's round counted), alone and loaded:
    # generating time
    generating: dict[bool, float] = field(default_factory=lambda: {False: 0.0, True: 0.0})
    # (drafter, loaded): the generating time when its last speculative round was recorded, and what
    # that round lost against plain decoding (its after-effect on the plain rounds that followed
    # included)
    last_drafted: dict[tuple[str, bool], tuple[float, float]] = field(default_factory=dict)
    # plain rounds still charged to it
    after_probe: dict[tuple[str, bool], int] = field(default_factory=dict)
    # loaded: (drafter, plain rounds left, session) whose excess still goes to that drafter's
    # realized rate
    after_verify: dict[bool, tuple[str, int, int]] = field(default_factory=dict)

    def probe_affordable(self, drafter: str, loaded: bool) -> bool:
        """Whether the time spent generating since `drafter` last drafted in this regime (`loaded`
        or alone) is enough for a probe to take at most `Tuning.probe_share` of it: a probe of a
        costly draft pays its catch-up on all it missed, so counting rounds alone would let probes
        come too often. Idle time does not count: a probe after a pause costs the next reply as
        much. A free drafter (prompt lookup) is always affordable."""
        last = self.last_drafted.get((drafter, loaded))
        return last is None or self.generating[loaded] - last[0] >= last[1] / TUNING.probe_share

    def charge_probe(
        self, drafter: str, loaded: bool, tokens: int, seconds: float, plain_seconds: float
    ) -> None:
        """Record a speculative round of `drafter` (draft and verify: `seconds`) as the one a next
        probe is budgeted against: its cost is the time it took beyond its `tokens` at plain
        decoding's `plain_seconds` per token; the next `Tuning.after_probe_rounds` plain rounds add
        their excess."""
        key = (drafter, loaded)
        self.last_drafted[key] = (
            self.generating[loaded],
            max(seconds - tokens * plain_seconds, 0.0),
        )
        self.after_probe[key] = TUNING.after_probe_rounds

    def charge_after_probe(self, loaded: bool, seconds: float, plain_seconds: float | None) -> None:
        """A plain round (any session's): what it took beyond plain decoding's time per token goes
        to every probe still charged with its after-effect in this regime."""
        for key, left in list(self.after_probe.items()):
            if key[1] != loaded:
                continue
            if left <= 1:
                del self.after_probe[key]
            else:
                self.after_probe[key] = left - 1
            if plain_seconds is not None and key in self.last_drafted:
                since, cost = self.last_drafted[key]
                self.last_drafted[key] = (since, cost + max(seconds - plain_seconds, 0.0))

    def draft(self, name: str) -> LinearCost:
        return self.drafts.setdefault(name, LinearCost(proportional=True))

    def achieved(self, arm: str, loaded: bool) -> Realized:
        return self.realized.setdefault((arm, loaded), Realized())

    def losing(self, drafter: str, loaded: bool, own: Realized | None = None) -> bool:
        """Whether speculating with `drafter` has measurably yielded fewer tokens per second than
        not.

        `own` is one session's record with that drafter: it speaks for the session once it has
        enough rounds (acceptance differs a lot between sessions), else the pipeline's record does.
        """
        plain = self.achieved("plain", loaded)
        spec = (
            own
            if own is not None and own.rounds >= TUNING.min_speculative_rounds
            else self.achieved(drafter, loaded)
        )
        if plain.rounds < TUNING.min_realized_rounds or spec.rounds < TUNING.min_speculative_rounds:
            return False
        return spec.rate < plain.rate

    def verify(self, size: int, loaded: bool) -> float | None:
        if loaded and self.compute.measured:
            return self.compute.predict(size)
        return self.latency.predict(size)
