"""Provides slow/hot stage detection and rebalancing: pure decisions from measured per-stage step
times.

`throttle_reason` compares a stage's recent step time with its own baseline and reads its
temperature and clock; `propose_split` turns measured per-stage compute into per-layer costs (the
last stage's lm_head counted separately, in layer equivalents) and finds the contiguous split that
minimises the slowest stage; `Balancer` feeds both from result traces and says when one stage has
stayed the bottleneck long enough to propose (or, with `rebalance = "auto"`, apply) a new split."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

from remote_worker import protocol

HOT_CELSIUS = 90.0  # a CPU this hot is throttling or about to
LOW_CLOCK = 0.7  # current / maximum frequency below this counts as a lowered clock


def throttle_reason(
    baseline: float | None,
    recent: float | None,
    ratio_limit: float,
    temp_c: float | None = None,
    freq_ratio: float | None = None,
) -> tuple[float, str] | None:
    """(slowdown ratio, why) when a stage counts as throttled, else None (pure)."""
    ratio = recent / baseline if baseline and recent else 1.0
    reasons = []
    if ratio >= ratio_limit:
        reasons.append(f"{ratio:.1f}x its own baseline step time")
    if temp_c is not None and temp_c >= HOT_CELSIUS:
        reasons.append(f"CPU at {temp_c:.0f} °C")
    if freq_ratio is not None and freq_ratio < LOW_CLOCK:
        reasons.append(f"clock at {freq_ratio:.0%} of its maximum")
    return (ratio, ", ".join(reasons)) if reasons else None


def stage_costs(
    ranges: Sequence[tuple[int, int]],
    seconds: Sequence[float],
    head_layers: float = 0.0,
    moved: Sequence[float] = (),
) -> list[float]:
    """Per-layer cost of each stage's host; the last stage's time also pays `head_layers` of
    lm_head, and a stage of a split that cuts inside layers `moved[i]` layers more (+ the MLP it
    starts with, - the one after its last attention)."""
    costs = []
    for index, ((start, end), spent) in enumerate(zip(ranges, seconds, strict=True)):
        layers = (end - start) + (moved[index] if moved else 0.0)
        layers += head_layers if index == len(ranges) - 1 else 0.0
        costs.append(spent / layers if layers > 0 else 0.0)
    return costs


def best_split(
    num_layers: int,
    costs: Sequence[float],
    head_layers: float = 0.0,
    capacity: Sequence[int] | None = None,
) -> list[tuple[int, int]]:
    """The contiguous split (≥ 1 layer per host, ≤ capacity) minimising the slowest stage's time
    (pure).

    Stage time = layers × host cost (+ the head on the last host). Adding layers one at a time to
    the host whose time grows least is optimal for this separable min-max problem."""
    count = len(costs)
    if count == 0 or num_layers < count:
        raise ValueError(f"cannot split {num_layers} layers over {count} hosts")
    limits = list(capacity) if capacity is not None else [num_layers] * count
    layers = [1] * count

    def time_with(index: int, extra: int) -> float:
        head = head_layers * costs[index] if index == count - 1 else 0.0
        return (layers[index] + extra) * costs[index] + head

    for _ in range(num_layers - count):
        candidates = [i for i in range(count) if layers[i] < limits[i]]
        if not candidates:
            raise ValueError("the hosts' capacity cannot hold every layer")
        chosen = min(candidates, key=lambda i: (time_with(i, 1), i))
        layers[chosen] += 1
    ranges, start = [], 0
    for n in layers:
        ranges.append((start, start + n))
        start += n
    return ranges


def bottleneck_time(
    ranges: Sequence[tuple[int, int]],
    costs: Sequence[float],
    head_layers: float,
    moved: Sequence[float] = (),
) -> float:
    last = len(ranges) - 1
    return max(
        ((end - start) + (moved[i] if moved else 0.0) + (head_layers if i == last else 0.0)) * cost
        for i, ((start, end), cost) in enumerate(zip(ranges, costs, strict=True))
    )


def propose_split(
    ranges: Sequence[tuple[int, int]],
    seconds: Sequence[float],
    head_layers: float = 0.0,
    min_gain: float = 0.1,
    capacity: Sequence[int] | None = None,
    moved: Sequence[float] = (),
) -> tuple[list[tuple[int, int]], float] | None:
    """A better split of whole layers and its expected gain (fraction of the bottleneck saved), or
    None if < min_gain. `moved`: what a running split that cuts inside layers moves per stage
    (`stage_costs`)."""
    costs = stage_costs(ranges, seconds, head_layers, moved)
    if any(cost <= 0 for cost in costs):
        return None
    num_layers = ranges[-1][1] - ranges[0][0]
    candidate = best_split(num_layers, costs, head_layers, capacity)
    candidate = [(start + ranges[0][0], end + ranges[0][0]) for start, end in candidate]
    now = bottleneck_time(ranges, costs, head_layers, moved)
    then = bottleneck_time(candidate, costs, head_layers)
    gain = 1.0 - then / now if now > 0 else 0.0
    if (candidate == list(ranges) and not any(moved)) or gain < min_gain:
        return None
    return candidate, gain


RECENT = 32  # steps in the running comparison


def relative_slowdown(
    baseline: Sequence[Sequence[float]], recent: Sequence[Sequence[float]], stage: int
) -> float:
    """How much more of the pipeline's compute STAGE takes now than in the baseline, against the
    other stages (1.0 = unchanged; pure). Rows are steps, each with every stage's time for that same
    step, so a machine slowing down as a whole cancels out, and a slowdown that hits only some steps
    (a duty-cycle throttle, a noisy neighbour) counts with its full weight, which a median of step
    times would miss.

    Each step's share counts once, whatever its length: a prefill's shares differ from a decode's
    (the last stage's head scores only the last position), and a sum over a baseline of long
    prefills would weigh them so much that the decodes after it read as the last stage slowing
    down."""

    def share(rows: Sequence[Sequence[float]]) -> float:
        shares = [row[stage] / others for row in rows if (others := sum(row) - row[stage]) > 0]
        return sum(shares) / len(shares) if shares else 0.0

    before, now = share(baseline), share(recent)
    return now / before if before > 0 and now > 0 else 1.0


class Balancer:
    """Per-stage step times from result traces; throttle flags and a split proposal when one stage
    lags.

    `window` steps make one comparison; a proposal needs the same bottleneck in `patience` windows
    running."""

    def __init__(
        self,
        ranges: Sequence[tuple[int, int]],
        head_layers: float = 0.0,
        ratio_limit: float = 1.5,
        window: int = 32,
        patience: int = 3,
        min_gain: float = 0.1,
        moved: Sequence[float] = (),
    ) -> None:
        self.ranges = list(ranges)
        self.moved = list(moved)  # layers of compute a split cut inside layers moves per stage
        self.head_layers = head_layers
        self.ratio_limit = ratio_limit
        self.window = window
        self.patience = patience
        self.min_gain = min_gain
        self.baseline_rows: list[
            tuple[float, ...]
        ] = []  # the first `window` steps, every stage's time
        self.recent_rows: deque[tuple[float, ...]] = deque(maxlen=RECENT)
        self.sums = [0.0] * len(ranges)
        self.steps = 0
        self.streak: tuple[int, int] = (-1, 0)  # (bottleneck stage, windows in a row)
        self.hints: dict[
            int, tuple[float | None, float | None]
        ] = {}  # stage -> (temp_c, freq_ratio)

    def observe(self, result: protocol.Result, _received: float = 0.0) -> None:
        trace = result.trace.reshape(-1, protocol.TRACE_FIELDS)
        if len(trace) != len(self.ranges):
            return
        row = [0.0] * len(self.ranges)
        for stage, _arrived, started, finished, _sent in trace:
            index = int(stage)
            spent = max(0.0, float(finished - started))
            row[index] = spent
            self.sums[index] += spent
        if len(self.baseline_rows) < self.window:
            self.baseline_rows.append(tuple(row))
        self.recent_rows.append(tuple(row))
        self.steps += 1

    def hint(self, stage: int, temp_c: float | None, freq_ratio: float | None) -> None:
        self.hints[stage] = (temp_c, freq_ratio)

    def throttled(self) -> dict[int, tuple[float, str]]:
        """Stages that count as throttled now: stage -> (ratio, reason).

        The ratio is the larger of two readings: the median step time against the stage's own
        baseline median (every step slower: a lowered clock, a hot CPU, also when all stages slow
        down together) and, with two or more stages, the stage's share of the compute against the
        others (`relative_slowdown`)."""
        flagged = {}
        full = len(self.baseline_rows) >= self.window
        enough = len(self.recent_rows) >= RECENT // 2
        for index in range(len(self.ranges)):
            baseline = statistics.median(row[index] for row in self.baseline_rows) if full else None
            recent = statistics.median(row[index] for row in self.recent_rows) if enough else None
            if baseline and recent and len(self.ranges) > 1:
                relative = relative_slowdown(self.baseline_rows, self.recent_rows, index)
                recent = max(recent, baseline * relative)
            temp_c, freq_ratio = self.hints.get(index, (None, None))
            verdict = throttle_reason(baseline, recent, self.ratio_limit, temp_c, freq_ratio)
            if verdict is not None:
                flagged[index] = verdict
        return flagged

    def proposal(self) -> tuple[list[tuple[int, int]], float] | None:
        """At the end of each window: a new split once the same stage was the bottleneck
        `patience` times."""
        if self.steps < self.window:
            return None
        seconds = list(self.sums)
        self.sums = [0.0] * len(self.ranges)
        self.steps = 0
        slowest = max(range(len(seconds)), key=seconds.__getitem__)  # compute spent = layers x cost
        stage, run = self.streak
        self.streak = (slowest, run + 1 if stage == slowest else 1)
        if self.streak[1] < self.patience:
            return None
        proposed = propose_split(
            self.ranges, seconds, self.head_layers, self.min_gain, moved=self.moved
        )
        if proposed is not None:
            self.streak = (-1, 0)
        return proposed
