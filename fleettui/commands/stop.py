"""Provides `fleettui stop FLEET`: stop exactly the recorded deployment of this fleet file (and
its SSH stages)."""

from __future__ import annotations

import argparse

from fleettui.commands import options

NAME = "stop"
HELP = "stop the fleet's recorded deployment (only its own workers)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_fleet(parser)


def run(args: argparse.Namespace) -> int:
    from fleettui.control import store
    from fleettui.control.controller import FleetController
    from fleettui.control.running import run as run_loop

    fleet = options.load(args)
    record = store.load(fleet)
    if record is None:
        print(f"nothing recorded for {fleet.path}: nothing to stop")
        return 0

    async def main() -> int:
        controller = FleetController(fleet)
        controller.adopt(record)
        for line in await controller.stop():
            print(line)
        print(f"deployment {record.id} stopped")
        return 0

    return run_loop(main)
