"""Provides `fleettui deploy FLEET`: bring every stage up (SSH hosts too), record the deployment, leave it running."""

from __future__ import annotations

import argparse
import sys

from fleettui.commands import options

NAME = "deploy"
HELP = "deploy the fleet (SSH hosts too) and leave it running for ask, the TUI, status, logs and stop"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_fleet(parser)
    options.add_settings(parser)


def run(args: argparse.Namespace) -> int:
    from fleettui.commands.running import run as run_loop
    from fleettui.control.controller import ControllerError, FleetController
    from fleettui.control.states import LogLine, ProvisionEvent

    fleet = options.load(args)

    def show(event: object) -> None:
        if isinstance(event, LogLine) and event.source != "shard_compiler":
            print(f"[{event.source}] {event.text}", file=sys.stderr, flush=True)
        elif isinstance(event, ProvisionEvent) and event.step == "compile" and args.verbose:
            print(f"[compile] {event.message}", file=sys.stderr, flush=True)

    controller = FleetController(fleet, on_event=show, settings=options.settings(args))

    async def main() -> int:
        done = False
        try:
            print("compiling (or finding cached) shards …", file=sys.stderr, flush=True)
            lines = await controller.deploy()
            done = True
        except ControllerError as error:
            print(f"fleettui: deploy failed: {error}", file=sys.stderr)
            return 1
        finally:
            if not done:
                await controller.stop()
        for line in lines:
            print(line)
        return 0

    return run_loop(main)
