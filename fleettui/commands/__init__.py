"""Provides the `fleettui` subcommands, one module each (`add_parser(subparsers)` and `run(args) -> int`)."""
