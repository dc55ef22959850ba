"""Provides `fleettui plan FLEET --profile`: plan from measured costs and show measured vs predicted per stage."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from fleettui.errors import PlanError
from fleettui.planning.costs import predicted_ms
from fleettui.planning.planner import format_plan, plan_fleet
from fleettui.planning.profiles import calibrate, compile_split, format_comparison, time_stages

if TYPE_CHECKING:
    from fleettui.config.fleet import Fleet


def run_plan_profile(fleet: Fleet, shape: Any = None, out: Any = None) -> int:
    """`fleettui plan FLEET --profile`: calibrate (or reuse) the hosts' profiles, plan from them, then compile
    the planned split and time each stage on its host's settings: measured vs predicted per stage."""
    from fleettui.model.builtin import shape_for_model

    stream = out or sys.stdout

    def say(text: str) -> None:
        print(f"  - {text}", file=sys.stderr, flush=True)

    shape = shape or shape_for_model(fleet.model.name)
    if shape is None:
        raise PlanError(f"cannot tell the shape of {fleet.model.name!r} offline: pass its config.json")
    by_bytes = plan_fleet(fleet, shape, use_profile=False)
    found = calibrate(fleet, shape.num_layers, progress=say, force=True)  # asked for: measure now, re-cache
    planned = plan_fleet(fleet, shape)
    print(format_plan(planned), file=stream)
    if planned.costs is None:
        missing = [host.name for host in fleet.hosts if host.name not in found]
        print(f"\nno measured costs for {', '.join(missing)}: planned from parameter bytes", file=stream)
        return 0
    costs = list(planned.costs)
    names = [host.name for host in fleet.hosts]
    counts = [stage.count for stage in planned.stages]
    old = [stage.count for stage in by_bytes.stages]
    if old != counts:
        print(f"\nthe byte-count split {old} would take (predicted from the profile):", file=stream)
        print(format_comparison(names, old, costs, None), file=stream)
    measured: list[float] = []
    if all(host.is_local for host in fleet.hosts):
        splits = [0, *[stage.end for stage in planned.stages]]
        say(f"compiling the planned split {splits} (cached) and timing its stages, each after the rest")
        shard_dir = compile_split(fleet, splits)
        predicted = predicted_ms(counts, costs)
        pauses = [sum(predicted) - own for own in predicted]  # live, one user: the rest of the pipeline
        settings = {(h.device, h.threads, h.cores) for h in fleet.hosts}
        if len(settings) == 1:  # one process times every stage: the same windows for all
            indices = list(range(len(counts)))
            timed = time_stages(fleet, fleet.hosts[0], shard_dir, indices, None, pauses)
            measured = [float(s["decode_ms"]) for s in timed]
        else:
            measured = [
                float(time_stages(fleet, host, shard_dir, [index], None, [pauses[index]])[0]["decode_ms"])
                for index, host in enumerate(fleet.hosts)
            ]
    print("\nmeasured vs predicted decode ms per token, each stage on its host's settings:", file=stream)
    print(format_comparison(names, counts, costs, measured or None), file=stream)
    return 0
