"""The stage planner: split a model's layers over the fleet's hosts by memory and speed, from its
config alone."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from fleettui.errors import PlanError
from fleettui.model.builtin import shape_for_model
from fleettui.model.shape import (
    GIB,
    PRECISION_ORDER,
    ModelShape,
    check_manual_layers,
)
from fleettui.planning.costs import MeasuredCosts, balanced_cuts
from remote_worker.manifest import boundary_value, format_boundary, format_bounds

if TYPE_CHECKING:
    from fleettui.config.fleet import Fleet, Host

logger = logging.getLogger(__name__)

RUNTIME_OVERHEAD = int(0.6 * GIB)  # Python + OpenVINO runtime + ZeroMQ buffers of one stage process
# physical KV slots per logical token: masked (rejected) slots until compaction
ROLLBACK_SLACK = 1.5
PREFILL_CHUNK = 512  # tokens per prefill request the activation estimate assumes


# --- plans
# -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StagePlan:
    """One stage: a host and its half-open layer range [start, end), with the memory it needs."""

    index: int
    host: str
    start: int
    end: int
    is_last: bool
    weight_bytes: float
    kv_bytes: float
    activation_bytes: float
    overhead_bytes: float
    usable_bytes: float
    # runs the MLP half of layer start-1 first (the boundary cuts that layer)
    starts_mid: bool = False
    ends_mid: bool = False  # layer end-1 stops after its attention; the next stage runs its MLP
    mlp_share: float = 0.0  # a layer's MLP share of its cost (what a mid cut moves)

    @property
    def layers(self) -> tuple[int, int]:
        return (self.start, self.end)

    @property
    def compute_layers(self) -> float:
        """Layers of compute: the KV layers held, plus or minus the MLP a mid cut moves."""
        return self.count + self.mlp_share * (self.starts_mid - self.ends_mid)

    @property
    def edges(self) -> tuple[float, float]:
        """The layers as numbers, for display: (0, 12.5) ends inside layer 12 (after its
        attention)."""
        return boundary_value(self.start, self.starts_mid), boundary_value(self.end, self.ends_mid)

    @property
    def span(self) -> str:
        """The layers as written in a split: [0, 12.5) ends inside layer 12 (after its
        attention)."""
        return (
            f"[{format_boundary(self.start, self.starts_mid)}, "
            f"{format_boundary(self.end, self.ends_mid)})"
        )

    @property
    def count(self) -> int:
        return self.end - self.start

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes + self.overhead_bytes


@dataclass(frozen=True)
class Plan:
    """A split of the model over hosts, in pipeline order."""

    shape: ModelShape
    precision: str
    kv_cache_precision: str
    context_tokens: int
    sessions: int
    stages: tuple[StagePlan, ...]
    manual: bool
    # measured per-host costs the split was balanced with
    costs: tuple[MeasuredCosts, ...] | None = None

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """Each stage's layers [start, end) whose KV cache it holds."""
        return tuple(stage.layers for stage in self.stages)

    @property
    def mid_cuts(self) -> tuple[int, ...]:
        """The boundaries that cut the layer before them between its attention and its MLP."""
        return tuple(stage.start for stage in self.stages if stage.starts_mid)

    @property
    def bounds(self) -> tuple[str, ...]:
        """The split as the shard compiler takes it: 0,12.5,16 (12.5 cuts layer 12 after its
        attention)."""
        return tuple(format_bounds((0, *(stage.end for stage in self.stages)), self.mid_cuts))

    @property
    def total_bytes(self) -> float:
        return sum(stage.total_bytes for stage in self.stages)

    @property
    def usable_bytes(self) -> float:
        return sum(stage.usable_bytes for stage in self.stages)


class _Budget:
    """Memory of one stage as a function of its layer count and position."""

    def __init__(
        self, shape: ModelShape, precision: str, kv: str, context: int, sessions: int
    ) -> None:
        self.shape = shape
        self.layer = shape.layer_bytes(precision)
        self.active_layer = shape.active_layer_bytes(precision)  # what a token reads: decode cost
        self.kv_layer = shape.kv_bytes_per_token(kv) * context * sessions * ROLLBACK_SLACK
        self.embedding = shape.embedding_bytes(precision)
        self.head = shape.head_bytes(precision)
        self.mlp = shape.mlp_bytes(precision)
        self.mlp_share = shape.mlp_share(precision)
        chunk = min(context, PREFILL_CHUNK)
        self.activations = (
            4.0
            * chunk
            * (4 * shape.hidden + 3 * shape.intermediate + shape.heads * min(context, 4096))
        )
        self.logits = 4.0 * chunk * shape.vocab

    def fixed(self, first: bool, last: bool) -> tuple[float, float]:
        """(weights, activations) a stage needs besides its layers."""
        weights = (self.embedding if first else 0.0) + (self.head if last else 0.0)
        if first and last and self.shape.tied_embeddings:
            weights -= self.embedding  # one IR shares the tied matrix
        return weights, self.activations + (self.logits if last else 0.0)

    def stage(
        self,
        index: int,
        host: Host,
        start: int,
        end: int,
        last: bool,
        mids: tuple[bool, bool] = (False, False),
    ) -> StagePlan:
        weights, activations = self.fixed(start == 0, last)
        count = end - start
        weights += count * self.layer + self.mlp * (mids[0] - mids[1])
        return StagePlan(
            index,
            host.name,
            start,
            end,
            last,
            weights,
            count * self.kv_layer,
            activations,
            float(RUNTIME_OVERHEAD),
            host.memory_gb * GIB,
            *mids,
            self.mlp_share,
        )


def _gb(value: float) -> str:
    return f"{value / GIB:.1f} GB" if value >= 0.95 * GIB else f"{value / (1 << 20):.0f} MB"


def plan(
    shape: ModelShape,
    hosts: Sequence[Host],
    precision: str = "int4",
    context_tokens: int = 4096,
    sessions: int = 1,
    kv_cache_precision: str = "auto",
    balance_head: bool = True,
    costs: Sequence[MeasuredCosts] | None = None,
) -> Plan:
    """Split ``shape`` over ``hosts`` (in pipeline order) or raise PlanError explaining why it
    cannot.

    Layers go to hosts in proportion to their speed, after charging the last host for the lm_head it
    also runs (decode reads every weight once per token, so cost ~ weight bytes / speed), within
    what each host's usable memory holds. With ``costs`` (one measured profile per host) the split
    instead minimises the slowest stage's measured time per token. A ``layers`` override is
    validated instead."""
    if precision not in PRECISION_ORDER:
        raise PlanError(
            f"unknown precision {precision!r}: expected one of {', '.join(PRECISION_ORDER)}"
        )
    if not hosts:
        raise PlanError("no hosts to plan for")
    if context_tokens < 1 or sessions < 1:
        raise PlanError("context_tokens and sessions must be at least 1")
    budget = _Budget(shape, precision, kv_cache_precision, context_tokens, sessions)
    count = len(hosts)
    manual = any(host.layers is not None for host in hosts)
    if manual:
        check_manual_layers(shape, hosts)
        stages = tuple(
            budget.stage(i, host, *_kv_range(host.layers), i == count - 1, _mids(host.layers))  # type: ignore[arg-type]
            for i, host in enumerate(hosts)
        )
        for stage in stages:
            if stage.total_bytes > stage.usable_bytes:
                raise PlanError(
                    f"layers {stage.span} need {_gb(stage.total_bytes)} "
                    f"but the host offers {_gb(stage.usable_bytes)} usable",
                    host=stage.host,
                    key="layers",
                )
        return Plan(shape, precision, kv_cache_precision, context_tokens, sessions, stages, True)

    if count > shape.num_layers:
        raise PlanError(
            f"{count} hosts but {shape.name} has only {shape.num_layers} layers: remove a host"
        )
    _check_total(shape, hosts, precision, kv_cache_precision, context_tokens, sessions)
    per_layer = budget.layer + budget.kv_layer
    capacity = []
    for i, host in enumerate(hosts):
        weights, activations = budget.fixed(i == 0, i == count - 1)
        free = host.memory_gb * GIB - RUNTIME_OVERHEAD - weights - activations
        layers = max(0, int(free // per_layer))
        if layers < 1:
            role = " the embedding," if i == 0 else ""
            role += " the lm_head," if i == count - 1 else ""
            raise PlanError(
                f"{_gb(host.memory_gb * GIB)} usable cannot hold{role} one layer and its KV cache "
                f"({_gb(per_layer)}) plus runtime and activations "
                f"({_gb(RUNTIME_OVERHEAD + activations)}): "
                "give it more memory, move it, or remove it",
                host=host.name,
                key="memory_gb",
            )
        capacity.append(layers)
    if sum(capacity) < shape.num_layers:
        raise PlanError(
            f"the hosts hold {sum(capacity)} of {shape.name}'s {shape.num_layers} layers at "
            f"{precision} "
            "once each stage's fixed memory is counted: add a host or use a lower precision"
        )
    head_cost = [0.0] * count
    if balance_head:
        head_cost[-1] = budget.head / budget.active_layer  # in layer equivalents of compute
    if costs is not None and len(costs) == count:
        ends = balanced_cuts(shape.num_layers, costs, capacity, 1.0 - budget.mlp_share)
    else:
        costs = None
        counts = _split(shape.num_layers, [host.speed for host in hosts], capacity, head_cost)
        ends = [(sum(counts[: i + 1]), False) for i in range(count)]
    stages_list, start, starts_mid = [], 0, False
    for i, (host, (end, ends_mid)) in enumerate(zip(hosts, ends, strict=True)):
        stages_list.append(
            budget.stage(i, host, start, end, i == count - 1, (starts_mid, ends_mid))
        )
        start, starts_mid = end, ends_mid
    return Plan(
        shape,
        precision,
        kv_cache_precision,
        context_tokens,
        sessions,
        tuple(stages_list),
        False,
        tuple(costs) if costs is not None else None,
    )


def _kv_range(layers: tuple[float, float]) -> tuple[int, int]:
    """The layers whose KV cache a manual range [12.5, 16) holds: [13, 16) (layer 12's attention
    is before)."""
    return math.ceil(layers[0]), math.ceil(layers[1])


def _mids(layers: tuple[float, float]) -> tuple[bool, bool]:
    return layers[0] != int(layers[0]), layers[1] != int(layers[1])


def _check_total(
    shape: ModelShape, hosts: Sequence[Host], precision: str, kv: str, context: int, sessions: int
) -> None:
    """Refuse early, with the totals and a way out, when the fleet cannot hold the model at all."""

    def need(candidate: str) -> float:
        budget = _Budget(shape, candidate, kv, context, sessions)
        fixed = sum(sum(budget.fixed(i == 0, i == len(hosts) - 1)) for i in range(len(hosts)))
        return (
            fixed
            + len(hosts) * RUNTIME_OVERHEAD
            + shape.num_layers * (budget.layer + budget.kv_layer)
        )

    offered = sum(host.memory_gb for host in hosts) * GIB
    needed = need(precision)
    if needed <= offered:
        return
    ways = ["add a host"]
    lower = PRECISION_ORDER[PRECISION_ORDER.index(precision) + 1 :]
    fitting = next((candidate for candidate in lower if need(candidate) <= offered), None)
    if fitting:
        ways.append(f"use {fitting}")
    kv_total = shape.num_layers * _Budget(shape, precision, kv, context, sessions).kv_layer
    if kv_total > 0.1 * needed:
        ways.append(f"lower the context or sessions (KV cache {_gb(kv_total)})")
    raise PlanError(
        f"{shape.name} at {precision} needs {_gb(needed)}, hosts offer {_gb(offered)} usable: "
        + " or ".join(ways)
    )


def _split(
    total: int, speeds: list[float], capacity: list[int], head_cost: list[float]
) -> list[int]:
    """Integer layer counts ≥ 1 and ≤ capacity, summing to total, balancing (count + head) /
    speed."""
    count = len(speeds)
    fixed: dict[int, float] = {}
    while True:
        free = [i for i in range(count) if i not in fixed]
        remaining = total - sum(fixed.values())
        if not free:
            break
        target = (remaining + sum(head_cost[i] for i in free)) / sum(speeds[i] for i in free)
        shares = {i: target * speeds[i] - head_cost[i] for i in free}
        clamped = {
            i: min(max(share, 1.0), capacity[i])
            for i, share in shares.items()
            if not 1 <= share <= capacity[i]
        }
        if not clamped:
            fixed.update(shares)
            break
        fixed.update(clamped)
    counts = [max(1, min(capacity[i], math.floor(fixed[i]))) for i in range(count)]
    order = sorted(range(count), key=lambda i: fixed[i] - math.floor(fixed[i]), reverse=True)
    while sum(counts) < total:
        i = next(i for i in order + list(range(count)) if counts[i] < capacity[i])
        counts[i] += 1
        order.remove(i) if i in order else None
    while sum(counts) > total:
        i = max((i for i in range(count) if counts[i] > 1), key=lambda i: counts[i] - fixed[i])
        counts[i] -= 1
    return counts


def plan_fleet(
    fleet: Fleet,
    shape: ModelShape | None = None,
    context_tokens: int = 4096,
    use_profile: bool = True,
) -> Plan:
    """The plan of a loaded fleet with its precision, sessions and KV-cache settings.

    When every host has a cached cost profile (`fleettui plan --profile`), the split balances
    measured stage times instead of parameter bytes.

    A refusal is a PlanError that points at the fleet file (``path:line: key: reason``).
    """
    try:
        if shape is None:
            shape = shape_for_model(fleet.model.name, online=True)
            if shape is None:
                raise PlanError(
                    f"cannot tell the shape of {fleet.model.name!r} offline: pass its config.json"
                )
        costs = None
        if use_profile:
            from fleettui.planning.profiles import fleet_costs

            costs = fleet_costs(fleet)
        return plan(
            shape,
            fleet.hosts,
            fleet.model.precision,
            context_tokens,
            fleet.sessions.max_sessions,
            fleet.runtime.kv_cache_precision,
            costs=costs,
        )
    except PlanError as error:
        if fleet.path is None or error.path is not None:
            raise
        raise _located(error, fleet) from None


def _located(error: PlanError, fleet: Fleet) -> PlanError:
    """The error pointing at the fleet file: the host's key, or the hosts / model table."""
    from fleettui.config.toml_source import LineIndex

    assert fleet.path is not None
    try:
        lines = LineIndex(fleet.path.read_text(encoding="utf-8"))
    except OSError:
        return error
    names = [host.name for host in fleet.hosts]
    if error.host in names:
        index = names.index(error.host)
        key = error.key or "memory_gb"
        return error.located(
            fleet.path, lines.line("hosts", index, key), f"hosts[{error.host}].{key}"
        )
    if "offline" in error.message:
        return error.located(fleet.path, lines.line("model", 0, "name"), "model.name")
    return error.located(fleet.path, lines.line("hosts", 0), "hosts")


def format_plan(plan: Plan) -> str:
    """A text table of a plan for the terminal."""
    shape = plan.shape
    lines = [
        f"{shape.name}: {shape.num_layers} layers, {shape.parameter_count() / 1e9:.2f} B "
        "parameters, "
        f"{plan.precision} weights"
        + (f" (group {shape.group_size})" if plan.precision == "int4" else "")
        + f", KV {plan.kv_cache_precision}, {plan.sessions} session(s) x {plan.context_tokens} "
        "tokens"
        + (" — manual split" if plan.manual else "")
        + (
            " — split from measured costs (cached profiles; plan --profile measures again)"
            if plan.costs
            else ""
        )
        + (
            " — split from parameter bytes (no measured profile yet: the next deploy or plan "
            "--profile measures)"
            if not plan.costs and not plan.manual and len(plan.stages) > 1
            else ""
        )
        + (
            " — SYNTHETIC (seeded random weights, for benchmarks)"
            if shape.name.startswith("synthetic:")
            else ""
        ),
        "",
        f"{'stage':<6}{'host':<16}{'layers':<12}{'n':>4}{'weights':>11}"
        f"{'KV cache':>11}{'other':>10}"
        f"{'total':>11}{'usable':>11}{'use':>6}",
    ]
    local = set(shape.local_layers)
    for stage in plan.stages:
        role = ("+emb" if stage.is_first else "") + ("+head" if stage.is_last else "")
        if local:
            kinds = [layer in local for layer in range(*stage.layers)]
            role += f" {sum(kinds)} local/{len(kinds) - sum(kinds)} global"
        lines.append(
            f"{stage.index:<6}{stage.host[:15]:<16}{stage.span:<12}{stage.count:>4}"
            f"{_gb(stage.weight_bytes):>11}{_gb(stage.kv_bytes):>11}"
            f"{_gb(stage.activation_bytes + stage.overhead_bytes):>10}{_gb(stage.total_bytes):>11}"
            f"{_gb(stage.usable_bytes):>11}{stage.total_bytes / stage.usable_bytes:>6.0%} {role}"
        )
    lines.append(
        f"{'total':<38}{_gb(sum(s.weight_bytes for s in plan.stages)):>11}"
        f"{_gb(sum(s.kv_bytes for s in plan.stages)):>11}"
        f"{_gb(sum(s.activation_bytes + s.overhead_bytes for s in plan.stages)):>10}"
        f"{_gb(plan.total_bytes):>11}{_gb(plan.usable_bytes):>11}"
        f"{plan.total_bytes / plan.usable_bytes:>6.0%}"
    )
    return "\n".join(lines + shape_notes(plan))


def shape_notes(plan: Plan) -> list[str]:
    """What the table does not show: experts (total vs active), local/global layers, a tied
    embedding's copies."""
    shape, notes = plan.shape, []
    if shape.experts:
        notes.append(
            f"mixture of experts: {shape.experts} experts per layer, {shape.experts_per_token} "
            "active per token; "
            f"{shape.parameter_count() / 1e9:.2f} B parameters in total (every expert of a stage's "
            "layers lives on "
            f"its host: memory above), {shape.parameter_count(active=True) / 1e9:.2f} B active per "
            "token "
            f"(what a stage computes: the split's cost)"
        )
    if shape.local_layers:
        notes.append(
            f"attention: {len(shape.local_layers)} local layers (sliding window "
            f"{shape.sliding_window}) and "
            f"{len(shape.global_layers)} global ({', '.join(map(str, shape.global_layers))}); the "
            "KV cache of a "
            "local layer still keeps every position (rollback masks, never trims), so KV is sized "
            "by the context"
        )
    if shape.tied_embeddings and len(plan.stages) > 1:
        matrix = shape.embedding_bytes(plan.precision)
        notes.append(
            f"tied embeddings: the first stage (embedding) and the last (lm_head) each hold the "
            f"{shape.vocab} x {shape.hidden} matrix, {_gb(matrix)} at "
            f"{'int8' if plan.precision == 'int4' else plan.precision}: {_gb(matrix)} more than "
            "one copy"
        )
    return [""] + notes if notes else []


def rest_can_run(fleet: Fleet, failed: set[str]) -> str:
    """Whether the hosts that did not fail could still hold the model, as one line."""
    rest = tuple(host for host in fleet.hosts if host.name not in failed)
    if not rest:
        return "no host is left to run the model"
    try:
        plan = plan_fleet(
            replace(fleet, hosts=tuple(replace(host, layers=None) for host in rest), path=None)
        )
    except PlanError as error:
        return f"without {', '.join(sorted(failed))} the model does not fit: {error}"
    ranges = ", ".join(f"{stage.host} {stage.span}" for stage in plan.stages)
    return (
        f"without {', '.join(sorted(failed))} the rest can run it: {ranges} (remove the failed "
        "hosts and deploy again)"
    )
