"""Provides the `fleettui` subcommands, one module each; adding one is one name in COMMANDS.

Each module defines NAME, HELP, `add_arguments(parser)` (light: no heavy imports) and `run(args) ->
int`."""

from __future__ import annotations

COMMANDS = (
    "tui",
    "ask",
    "serve",
    "plan",
    "deploy",
    "status",
    "logs",
    "stop",
    "bench",
    "init",
    "cache",
    "completion",
)
