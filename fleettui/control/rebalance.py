"""Provides the rebalancer: watches per-stage step times, flags throttled stages, proposes or
applies a split.

Fed by the coordinator's result traces (compute per stage and step) and by telemetry samples (CPU
temperature; the local CPU clock where psutil exposes it), it emits `Throttled` and
`RebalanceProposal` events. With `rebalance = "auto"` it compiles the proposed split in the
background while serving, then switches at a safe point between rounds through the recovery's replay
path, so no session loses anything."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from fleettui.control.balance import Balancer
from fleettui.control.states import ControllerEvent, LogLine, RebalanceProposal, Throttled
from remote_worker import protocol
from remote_worker.replies import TelemetrySample

if TYPE_CHECKING:
    from fleettui.config.fleet import Fleet
    from remote_worker.manifest import Manifest

log = logging.getLogger(__name__)
THROTTLE_CHECK_EVERY = 4  # results between two throttle verdicts (and proposal checks)


def head_layers(fleet: Fleet) -> float:
    """The lm_head's cost in layer equivalents: measured on the last host when it has a cost profile
    (its head after the pause it has live, against its layer), else by weight size; 0 when neither
    is known offline."""
    from fleettui.errors import PlanError
    from fleettui.model.builtin import shape_for_model
    from fleettui.planning.profiles import nearest_costs

    # (after a re-plan: its profile of another stage count)
    measured = nearest_costs(fleet, fleet.hosts[-1])
    if measured is not None and measured.layer_ms > 0 and measured.head_ms > 0:
        return measured.head_ms / measured.layer_ms
    try:
        shape = shape_for_model(fleet.model.name)
    except PlanError:
        return 0.0
    if shape is None:
        return 0.0
    return shape.head_bytes("fp32") / shape.layer_bytes("fp32")


def moved_layers(manifest: Manifest, fleet: Fleet) -> list[float]:
    """Per stage of a split that cuts inside layers: the MLP share of a layer it starts with, minus
    the one it leaves to the next stage (0 for whole layers). The share is the MLP's part of the
    layer's weights."""
    from fleettui.errors import PlanError
    from fleettui.model.builtin import shape_for_model

    if not manifest.mid_cuts:
        return []
    try:
        shape = shape_for_model(fleet.model.name)
    except PlanError:
        shape = None
    # Llama-like, unknown
    share = shape.mlp_share(fleet.model.precision) if shape is not None else 0.8
    return [share * (s.layers.starts_mid - s.layers.ends_mid) for s in manifest.stages]


def local_clock_ratio() -> float | None:
    """This machine's current / maximum CPU clock, where the OS says (local stages share it)."""
    import psutil

    try:
        frequency = psutil.cpu_freq()
    except (AttributeError, NotImplementedError, OSError):
        return None
    if frequency is None or not frequency.max:
        return None
    return float(frequency.current / frequency.max)


class Rebalancer:
    """Turns measurements into throttle flags and split proposals; `apply` switches to a
    proposal."""

    def __init__(
        self,
        ranges: Sequence[tuple[int, int]],
        names: Sequence[str],
        mode: str,
        ratio_limit: float,
        head: float,
        emit: Callable[[ControllerEvent], None],
        apply: Callable[[list[tuple[int, int]]], Any],
        window: int = 64,
        patience: int = 3,
        moved: Sequence[float] = (),
    ) -> None:
        self.mode = mode
        self.ratio_limit = ratio_limit
        self.head = head
        self.emit = emit
        self.apply = apply
        self.window = window
        self.patience = patience
        self.names = list(names)
        self.flagged: dict[int, str] = {}
        self.observed = 0
        self.proposals: list[RebalanceProposal] = []
        self.task: asyncio.Task[None] | None = None
        self.balancer = Balancer(ranges, head, ratio_limit, window, patience, moved=moved)

    def reset(
        self,
        ranges: Sequence[tuple[int, int]],
        names: Sequence[str] | None = None,
        moved: Sequence[float] = (),
    ) -> None:
        """A new split is running: measure it from scratch (`moved`: see `moved_layers`)."""
        self.balancer = Balancer(
            ranges, self.head, self.ratio_limit, self.window, self.patience, moved=moved
        )
        if names is not None:
            self.names = list(names)
        self.flagged.clear()

    def observe_sample(self, sample: TelemetrySample) -> None:
        if sample.name in self.names:
            self.balancer.hint(self.names.index(sample.name), sample.temp_c, local_clock_ratio())

    def observe(self, result: protocol.Result, received: float) -> None:
        self.balancer.observe(result, received)
        self.observed += 1
        if self.observed % THROTTLE_CHECK_EVERY:
            return  # (medians of the windows every few results: this runs on every token's path)
        flagged = self.balancer.throttled()
        for index, (ratio, reason) in flagged.items():
            if self.flagged.get(index) != reason and index < len(self.names):
                self.emit(Throttled(self.names[index], ratio, reason))
        for index in set(self.flagged) - set(flagged):
            if index < len(self.names):
                self.emit(Throttled(self.names[index], 1.0, ""))  # back to normal
        self.flagged = {index: reason for index, (_, reason) in flagged.items()}
        if self.mode == "off" or (self.task is not None and not self.task.done()):
            return
        proposed = self.balancer.proposal()
        if proposed is None:
            return
        ranges, gain = proposed
        proposal = RebalanceProposal(tuple(ranges), tuple(self.balancer.ranges), gain)
        self.proposals.append(proposal)
        self.emit(proposal)
        self.emit(LogLine("rebalance", f"proposed split {ranges} (bottleneck {gain:.0%} shorter)"))
        if self.mode == "auto":
            self.task = asyncio.get_running_loop().create_task(
                self._apply(proposal), name="rebalance"
            )

    async def _apply(self, proposal: RebalanceProposal) -> None:
        started = time.monotonic()
        try:
            await self.apply([tuple(r) for r in proposal.ranges])  # type: ignore[misc]
        except (
            Exception
        ) as error:  # a failed switch is reported; the recovery keeps the fleet serving
            log.exception("rebalance failed")
            self.emit(LogLine("rebalance", f"switching to {list(proposal.ranges)} failed: {error}"))
            return
        applied = RebalanceProposal(proposal.ranges, proposal.current, proposal.gain, applied=True)
        self.proposals.append(applied)
        self.emit(applied)
        self.emit(
            LogLine(
                "rebalance",
                f"switched to {list(proposal.ranges)} in {time.monotonic() - started:.1f} s",
            )
        )
