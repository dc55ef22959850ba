"""Provides placement from measured costs: fit per-layer / head / per-call costs from stage timings,
and the split that minimises the slowest stage (pure functions; the calibration run is in
`planning.profiles`).

A stage's decode time per token is modelled as `call + layers x layer + head (last stage only)`: the
head (final norm + lm_head over the whole vocabulary) is charged as measured, not as a parameter
count — on SmolLM2 it costs about as much as seven decoder layers, which a byte count
underestimates."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fleettui.errors import PlanError


@dataclass(frozen=True)
class StageTiming:
    """One measured stage: how many layers it holds, whether it holds the head, and its ms per
    token."""

    layers: int
    last: bool
    decode_ms: float
    prefill_ms: float = 0.0


@dataclass(frozen=True)
class MeasuredCosts:
    """Per-token decode costs on one host (ms), and the same for one prefill chunk."""

    layer_ms: float
    head_ms: float
    call_ms: float  # per stage call: dispatch, embedding gather, I/O of the request
    prefill_layer_ms: float = 0.0
    prefill_head_ms: float = 0.0

    def stage_ms(self, layers: float, last: bool) -> float:
        return self.call_ms + layers * self.layer_ms + (self.head_ms if last else 0.0)


def fit_costs(timings: Sequence[StageTiming]) -> MeasuredCosts:
    """Least-squares fit of `call + n x layer + last x head` to at least three stages with different
    shapes.

    The calibration split [0, 1, L-1, L] gives exactly that: one layer (+ embedding), L-2 layers,
    and one layer + head, so the three unknowns are determined. Costs are clamped at zero (noise can
    push a tiny per-call cost below it)."""
    import numpy as np

    if len(timings) < 3 or len({(t.layers, t.last) for t in timings}) < 3:
        raise PlanError(
            "a cost profile needs three stages of different shapes (the [0, 1, L-1, L] split)"
        )
    design = np.array([[1.0, t.layers, 1.0 if t.last else 0.0] for t in timings])
    decode = np.array([t.decode_ms for t in timings])
    prefill = np.array([t.prefill_ms for t in timings])
    call, layer, head = _nonnegative_fit(design, decode)
    _, prefill_layer, prefill_head = _nonnegative_fit(design, prefill)
    if layer <= 0:
        raise PlanError(
            "the profile gives no positive per-layer cost: measure again on a quieter machine"
        )
    return MeasuredCosts(layer, head, call, prefill_layer, prefill_head)


def _nonnegative_fit(design: Any, times: Any) -> tuple[float, float, float]:
    """(call, layer, head) >= 0 by least squares; when a term comes out negative (noise on a tiny
    model), the per-call term is pinned at zero first (then the negative one) and the rest
    refitted."""
    import numpy as np

    free = [0, 1, 2]
    while True:
        solution, *_ = np.linalg.lstsq(design[:, free], times, rcond=None)
        negative = [term for term, value in zip(free, solution, strict=True) if value < 0]
        if not negative or len(free) == 1:
            found = dict(zip(free, (max(float(v), 0.0) for v in solution), strict=True))
            return found.get(0, 0.0), found.get(1, 0.0), found.get(2, 0.0)
        # the per-call term goes first: layers must stay
        free.remove(0 if 0 in free else negative[0])


def balanced_split(
    total: int, costs: Sequence[MeasuredCosts], capacity: Sequence[int]
) -> list[int]:
    """Layer counts (each >= 1 and <= its capacity, summing to TOTAL) minimising the slowest stage's
    time.

    Stage i runs on the host with costs[i]; the last stage also carries the head. Exact (dynamic
    programming over hosts x layers used; ties go to the split with the smaller sum of squared stage
    times)."""
    count = len(costs)
    if count == 0 or count != len(capacity):
        raise PlanError("one cost profile and one capacity per host are needed")
    if count > total or sum(min(c, total) for c in capacity) < total or min(capacity) < 1:
        raise PlanError(
            f"{total} layers cannot be split over hosts with capacities {list(capacity)}"
        )

    def options(index: int, used: int) -> Iterator[tuple[int, float]]:
        last, left_after = index == count - 1, count - index - 1  # every later stage needs a layer
        for take in range(1, capacity[index] + 1):
            reach = used + take
            if reach <= total - left_after and (not last or reach == total):
                yield reach, costs[index].stage_ms(take, last)

    found = _min_max_split(count, total, options)
    if found is None:
        raise PlanError(
            f"{total} layers cannot be split over hosts with capacities {list(capacity)}"
        )
    return [stop - start for start, stop in zip((0, *found[:-1]), found, strict=True)]


def _min_max_split(
    count: int, total: int, options: Callable[[int, int], Iterable[tuple[int, float]]]
) -> tuple[int, ...] | None:
    """Where each of COUNT stages ends (units of work, the last at TOTAL) minimising the slowest
    stage; ties go to the smaller sum of squared stage times. `options(i, used)` gives stage i's
    possible (end, ms) when it starts at `used`. Exact dynamic programming over stages x units
    used."""
    best: list[dict[int, tuple[float, float, tuple[int, ...]]]] = [{0: (0.0, 0.0, ())}]
    for index in range(count):
        reached: dict[int, tuple[float, float, tuple[int, ...]]] = {}
        for used, (worst, squares, stops) in best[index].items():
            for stop, stage in options(index, used):
                candidate = (max(worst, stage), squares + stage * stage, (*stops, stop))
                known = reached.get(stop)
                if known is None or candidate[:2] < known[:2]:
                    reached[stop] = candidate
        best.append(reached)
    found = best[count].get(total)
    return found[2] if found is not None else None


# a split that cuts inside layers must beat the best whole-layer one by this much
MID_CUT_MIN_GAIN = 0.01


def balanced_cuts(
    total: int, costs: Sequence[MeasuredCosts], capacity: Sequence[int], attention_share: float
) -> list[tuple[int, bool]]:
    """Each stage's end as (layer boundary, mid), minimising the slowest stage's time when a
    boundary may also cut a layer between its attention (`attention_share` of a layer's cost) and
    its MLP.

    Whole-layer cuts (`balanced_split`) unless cutting inside layers makes the slowest stage at
    least `MID_CUT_MIN_GAIN` faster: a mid cut is exact (the same ops, only the graph is cut) but
    new shards to compile. Exact dynamic programming over half layers: unit 2i is layer i's
    attention, 2i + 1 its MLP; each stage holds at least one attention (its KV cache), and a stage
    that starts with the MLP of the layer before it needs room for one more layer's weights."""
    whole = balanced_split(total, costs, capacity)
    ends, reach = [], 0
    for taken in whole:
        reach += taken
        ends.append((reach, False))
    if not 0.0 < attention_share < 1.0 or len(costs) < 2:
        return ends
    units, count = 2 * total, len(costs)

    def options(index: int, used: int) -> Iterator[tuple[int, float]]:
        last, left_after = index == count - 1, count - index - 1
        for stop in range(used + 1, units + 1):
            attention = _attention_units(used, stop)
            if attention + used % 2 > capacity[index] or total - (stop + 1) // 2 < left_after:
                return
            if attention >= 1 and (not last or stop == units):
                yield (
                    stop,
                    costs[index].stage_ms(_compute_layers(used, stop, attention_share), last),
                )

    found = _min_max_split(count, units, options)
    if found is None or max(predicted_cut_ms(found, costs, attention_share)) > (
        1.0 - MID_CUT_MIN_GAIN
    ) * max(predicted_ms(whole, costs)):
        return ends
    return [((stop + 1) // 2, stop % 2 == 1) for stop in found]


def predicted_cut_ms(
    stops: Sequence[int], costs: Sequence[MeasuredCosts], attention_share: float
) -> list[float]:
    """Each stage's predicted ms of a split whose stages end at STOPS, in half layers (2i + 1: after
    layer i's attention)."""
    times, used = [], 0
    for index, stop in enumerate(stops):
        times.append(
            costs[index].stage_ms(
                _compute_layers(used, stop, attention_share), index == len(stops) - 1
            )
        )
        used = stop
    return times


def _attention_units(used: int, stop: int) -> int:
    """Attentions (even half-layer units) in [used, stop)."""
    return (stop + 1) // 2 - (used + 1) // 2


def _compute_layers(used: int, stop: int, attention_share: float) -> float:
    """Layers of compute in the half-layer units [used, stop)."""
    attention = _attention_units(used, stop)
    return attention * attention_share + (stop - used - attention) * (1.0 - attention_share)


def predicted_ms(counts: Sequence[float], costs: Sequence[MeasuredCosts]) -> list[float]:
    """Each stage's predicted decode ms per token for a split (layer counts; a mid cut moves a
    fraction)."""
    return [
        cost.stage_ms(layers, index == len(counts) - 1)
        for index, (layers, cost) in enumerate(zip(counts, costs, strict=True))
    ]


def imbalance(times: Sequence[float]) -> float:
    """(slowest - fastest) / slowest: 0 = perfectly balanced stages."""
    slowest = max(times)
    return (slowest - min(times)) / slowest if slowest > 0 and not math.isinf(slowest) else 0.0
