"""Provides `fleettui plan FLEET [--json|--profile]`: the stage plan (layer ranges, memory per
host) without starting anything."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from fleettui.commands import options

NAME = "plan"
HELP = "show the stage plan (layer ranges, memory) and exit"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_fleet(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--model-config",
        type=Path,
        help="a Hugging Face config.json to plan for, or a published one by name (qwen3-8b, "
        "gemma-3-27b, ...)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="calibrate the hosts (cached; SSH hosts on themselves) and show measured vs predicted "
        "per stage",
    )


def run(args: argparse.Namespace) -> int:
    from fleettui.config.local_cores import share_local_cores
    from fleettui.model.shape import ModelShape
    from fleettui.planning.planner import format_plan, plan_fleet

    written = options.load(args)
    fleet = share_local_cores(written)  # as it runs: local stages on their own cores
    shape = None
    if args.model_config:
        path = _config_path(args.model_config)
        shape = ModelShape.from_config_file(path)
        if path.name != "config.json":  # a published one: named by its file
            shape = replace(shape, name=path.stem)
    if args.profile:  # plan from measured costs
        from fleettui.control.calibration import remote_timer
        from fleettui.planning.plan_profile import run_plan_profile, say

        return run_plan_profile(fleet, shape, None, lambda children: remote_timer(children, say))
    plan = plan_fleet(fleet, shape)
    cores = {host.name: list(host.cores) for host in fleet.hosts if host.cores}
    if not args.json:
        print(format_plan(plan))
        if fleet != written:
            shares = ", ".join(
                f"{name} on CPU {','.join(map(str, each))}" for name, each in cores.items()
            )
            print(
                f"\nlocal stages on their own CPUs: {shares} (a host's `cores` or `threads` keeps "
                "them as written)"
            )
        return 0
    document = {
        "model": plan.shape.name,
        "precision": plan.precision,
        "kv_cache_precision": plan.kv_cache_precision,
        "context_tokens": plan.context_tokens,
        "sessions": plan.sessions,
        "manual": plan.manual,
        "total_bytes": plan.total_bytes,
        "usable_bytes": plan.usable_bytes,
        "stages": [
            {
                "host": stage.host,
                "cores": cores.get(stage.host, []),  # [] = every CPU of its host
                "layers": list(stage.layers),
                # [0, 12.5): the boundary cuts layer 12 between attention and MLP
                "span": stage.span,
                "weight_bytes": stage.weight_bytes,
                "kv_bytes": stage.kv_bytes,
                "total_bytes": stage.total_bytes,
                "usable_bytes": stage.usable_bytes,
            }
            for stage in plan.stages
        ],
    }
    print(json.dumps(document, indent=2))
    return 0


def _config_path(given: Path) -> Path:
    """GIVEN as a file, else the published config of that name (one line naming both when
    neither)."""
    from fleettui.errors import FleetError
    from fleettui.model.builtin import published_config, published_names

    if given.exists():
        return given
    found = published_config(str(given))
    if found is None:
        raise FleetError(
            f"--model-config {given}: no such file, and not a published config "
            f"({', '.join(published_names())})"
        )
    return found
