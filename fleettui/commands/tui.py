"""Provides `fleettui [tui] [FLEET]`: the TUI; it attaches to the fleet's deployment when one
runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from fleettui.commands import options
from fleettui.errors import FleetError

NAME = "tui"
HELP = "the TUI (default): deploy or attach, monitor, chat"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_fleet(parser)
    options.add_settings(parser)
    options.add_sampling(parser)
    serve = parser.add_argument_group("API", "serve the OpenAI-compatible API from the TUI too")
    serve.add_argument(
        "--serve", action="store_true", help="serve the API beside the chat (see `fleettui serve`)"
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="with --serve: address to bind (default: loopback)"
    )
    serve.add_argument(
        "--port", type=int, default=8000, help="with --serve: TCP port (0 = any free port)"
    )
    serve.add_argument(
        "--api-key-file", type=Path, help="with --serve: bearer API keys, one per line, mode 0600"
    )


def run(args: argparse.Namespace) -> int:
    from fleettui.ui.app import run_app

    if not args.serve and (
        args.api_key_file is not None or args.host != "127.0.0.1" or args.port != 8000
    ):
        raise FleetError("--host, --port and --api-key-file apply only with --serve")
    fleet = options.load_for_chat(args)
    return run_app(fleet, options.settings(args), args)
