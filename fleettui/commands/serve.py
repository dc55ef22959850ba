"""Provides `fleettui serve [FLEET]`: the fleet as an OpenAI-compatible HTTP API (attaches to a
deployed fleet)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fleettui.commands import options
from fleettui.errors import FleetError

NAME = "serve"
HELP = (
    "serve the fleet as an OpenAI-compatible HTTP API (attaches to a deployed fleet, else starts "
    "one)"
)
# what a serving fleet tells its operator, one line each
SERVING_SOURCES = (
    "recovery",
    "rebalance",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_fleet(parser)
    options.add_settings(parser)
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: loopback only)"
    )
    parser.add_argument(
        "--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)"
    )
    parser.add_argument(
        "--api-key-file", type=Path, help="file of bearer API keys, one per line, mode 0600"
    )
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate: serve HTTPS")
    parser.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    parser.add_argument(
        "--max-queued", type=int, default=16, help="requests that may wait for a slot"
    )


def run(args: argparse.Namespace) -> int:
    from fleettui.control.running import run as run_loop

    if not 0 <= args.port <= 65535:
        raise FleetError(f"--port: {args.port} is out of range 0..65535")
    if args.max_queued < 0:
        raise FleetError(f"--max-queued: {args.max_queued} must be >= 0")
    fleet = options.load_for_chat(args)
    settings = options.settings(args)

    async def main() -> int:
        from fleettui.commands.progress import ProgressReporter
        from fleettui.control.controller import ControllerError
        from fleettui.control.states import LogLine
        from fleettui.serve.command import serve_fleet

        reporter = ProgressReporter()  # compile and worker start until the server listens

        def on_event(event: object) -> None:
            """The start's progress, then one line per recovery or rebalancing for whoever
            watches the server."""
            if not reporter.closed:
                reporter(event)
            elif isinstance(event, LogLine) and event.source in SERVING_SOURCES:
                print(
                    f"{time.strftime('%H:%M:%S')} {event.source}: {event.text}",
                    file=sys.stderr,
                    flush=True,
                )

        def ready(url: str) -> None:
            reporter.close()
            print(
                f"fleettui serve: {url}/v1 (model {fleet.model.name}); ctrl+c stops",
                file=sys.stderr,
                flush=True,
            )

        try:
            await serve_fleet(
                fleet,
                settings,
                args.host,
                args.port,
                args.api_key_file,
                args.tls_cert,
                args.tls_key,
                ready,
                max_queued=args.max_queued,
                on_event=on_event,
            )
        except ControllerError as error:
            reporter.close()
            print(f"fleettui: {error}", file=sys.stderr)
            return 1
        finally:
            reporter.close()
        return 0

    return run_loop(main)
