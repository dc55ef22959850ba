"""Provides `fleettui status FLEET`: the recorded deployment's workers, whether each is alive,
and if the record is stale."""

from __future__ import annotations

import argparse
import json

from fleettui.commands import options

NAME = "status"
HELP = "show the fleet's recorded deployment: workers, pids, ports, alive or stale"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_fleet(parser)
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    from fleettui.control import store
    from fleettui.control.running import run as run_loop

    fleet = options.load(args)
    record = store.load(fleet)
    if record is None:
        if args.json:
            print(json.dumps({"fleet": str(fleet.path), "deployment": None}))
        else:
            print(f"{fleet.path}: not deployed")
        return 3

    async def main() -> int:
        from fleettui.control.status import probe

        report = await probe(record, fleet)
        if args.json:
            print(json.dumps(report.to_dict(), indent=2))
        else:
            print(report.text())
        return 0 if report.alive else 1

    return run_loop(main)
