"""Provides `fleettui plan FLEET --profile`: plan from measured costs and show measured vs
predicted per stage."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fleettui.errors import PlanError
from fleettui.planning.costs import predicted_ms
from fleettui.planning.planner import format_plan, plan_fleet
from fleettui.planning.profiles import (
    Children,
    RemoteTimer,
    calibrate,
    compile_split,
    format_comparison,
    profile_arguments,
    time_stages,
)

if TYPE_CHECKING:
    from fleettui.config.fleet import Fleet


def say(text: str) -> None:
    """One line of the calibration's progress, on stderr (stdout holds the tables)."""
    print(f"  - {text}", file=sys.stderr, flush=True)


def run_plan_profile(
    fleet: Fleet,
    shape: Any = None,
    out: Any = None,
    remote: Callable[[Children], RemoteTimer] | None = None,
) -> int:
    """`fleettui plan FLEET --profile`: calibrate the hosts' profiles, plan from them, then compile
    the planned split and time each stage on its host (SSH hosts through `remote(children)`, without
    it they are neither calibrated nor timed): measured vs predicted per stage."""
    from fleettui.model.builtin import shape_for_model

    stream = out or sys.stdout
    shape = shape or shape_for_model(fleet.model.name)
    if shape is None:
        raise PlanError(
            f"cannot tell the shape of {fleet.model.name!r} offline: pass its config.json"
        )
    by_bytes = plan_fleet(fleet, shape, use_profile=False)
    children = Children()
    timer = remote(children) if remote is not None else None
    # measure now
    found = calibrate(fleet, shape.num_layers, None, say, True, None, children, timer)
    planned = plan_fleet(fleet, shape)
    print(format_plan(planned), file=stream)
    if planned.costs is None:
        missing = [host.name for host in fleet.hosts if host.name not in found]
        print(
            f"\nno measured costs for {', '.join(missing)}: planned from parameter bytes",
            file=stream,
        )
        return 0
    costs = list(planned.costs)
    names = [host.name for host in fleet.hosts]
    counts = [stage.compute_layers for stage in planned.stages]  # a mid cut moves a layer's MLP
    old = [stage.compute_layers for stage in by_bytes.stages]
    if old != counts:
        print(f"\nthe byte-count split {old} would take (predicted from the profile):", file=stream)
        print(format_comparison(names, old, costs, None), file=stream)
    measured: list[float] = []
    if timer is not None or all(host.is_local for host in fleet.hosts):
        splits = planned.bounds
        say(
            f"compiling the planned split {splits} (cached) and timing its stages, each after the "
            "rest"
        )
        shard_dir = compile_split(fleet, splits, children)
        predicted = predicted_ms(counts, costs)
        # live, one user: the rest of the pipeline
        pauses = [sum(predicted) - own for own in predicted]
        measured = _time_planned(fleet, shard_dir, pauses, children, timer)
    print(
        "\nmeasured vs predicted decode ms per token, each stage on its host's settings:",
        file=stream,
    )
    print(format_comparison(names, counts, costs, measured or None), file=stream)
    return 0


def _time_planned(
    fleet: Fleet, shard_dir: Any, pauses: list[float], children: Children, timer: RemoteTimer | None
) -> list[float]:
    """Decode ms per token of each planned stage on its own host, after its pause."""
    hosts = fleet.hosts
    if (
        all(host.is_local for host in hosts)
        and len({(h.device, h.threads, h.cores) for h in hosts}) == 1
    ):
        timed = time_stages(fleet, hosts[0], shard_dir, list(range(len(hosts))), children, pauses)
        # one process timed every stage: the same windows
        return [float(s["decode_ms"]) for s in timed]
    measured = {}
    for index, host in enumerate(hosts):  # one stage on each host, after its pause
        if host.is_local:
            measured[index] = time_stages(
                fleet, host, shard_dir, [index], children, [pauses[index]]
            )[0]
        else:  # its own files pushed, timed on the host
            assert timer is not None
            args = profile_arguments(fleet, host, [pauses[index]])
            measured[index] = timer([(host, args)], shard_dir, [index])[0]["stages"][0]
    return [float(measured[index]["decode_ms"]) for index in range(len(hosts))]
