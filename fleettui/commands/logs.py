"""Provides `fleettui logs FLEET`: the last lines of every worker's log of the recorded
deployment."""

from __future__ import annotations

import argparse

from fleettui.commands import options

NAME = "logs"
HELP = "print the end of every worker's log (local files, SSH hosts over SSH)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_fleet(parser)
    parser.add_argument("-n", "--lines", type=int, default=20, help="lines per worker (default 20)")


def run(args: argparse.Namespace) -> int:
    from fleettui.control import store
    from fleettui.control.controller import FleetController
    from fleettui.control.running import run as run_loop

    fleet = options.load(args)
    record = store.load(fleet)
    if record is None:
        print(f"{fleet.path}: not deployed")
        return 3

    async def main() -> int:
        controller = FleetController(fleet)
        controller.adopt(record)
        for name, lines in (await controller.fetch_logs(args.lines)).items():
            for line in lines:
                print(f"[{name}] {line}")
        return 0

    return run_loop(main)
