"""Provides `fleettui deploy FLEET`: bring every stage up (SSH hosts too), record the deployment,
leave it running."""

from __future__ import annotations

import argparse
import sys

from fleettui.commands import options

NAME = "deploy"
HELP = (
    "deploy the fleet (SSH hosts too) and leave it running for ask, the TUI, status, logs and stop"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_fleet(parser)
    options.add_settings(parser)
    parser.add_argument(
        "--prune",
        action="store_true",
        help="remove other (older) shard folders on the SSH hosts once pushed",
    )
    parser.add_argument(
        "--recheck",
        action="store_true",
        help="read every stage file again, here and on each host, instead of trusting the stamps "
        "of earlier "
        "checks (finds bit rot that left a file's size and times alone)",
    )


def run(args: argparse.Namespace) -> int:
    from fleettui.commands.progress import ProgressReporter
    from fleettui.control.controller import ControllerError, FleetController
    from fleettui.control.running import run as run_loop
    from fleettui.control.states import LogLine

    fleet = options.load(args)
    # compile, wheelhouse, SFTP push, worker start: bars on a terminal, else lines
    reporter = ProgressReporter()

    def show(event: object) -> None:
        reporter(event)
        if (
            isinstance(event, LogLine)
            and event.source != "shard_compiler"
            and (args.verbose or event.source == "fleet")
        ):
            print(f"[{event.source}] {event.text}", file=sys.stderr, flush=True)

    controller = FleetController(
        fleet,
        on_event=show,
        settings=options.settings(args),
        prune=args.prune,
        recheck=args.recheck,
    )

    async def main() -> int:
        done = False
        try:
            with reporter:
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
