"""Provides `fleettui [tui] [FLEET]`: the TUI; it attaches to the fleet's deployment when one runs."""

from __future__ import annotations

import argparse

from fleettui.commands import options

NAME = "tui"
HELP = "the TUI (default): deploy or attach, monitor, chat"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_fleet(parser)
    options.add_settings(parser)
    options.add_sampling(parser)


def run(args: argparse.Namespace) -> int:
    from fleettui.ui.app import run_app

    fleet = options.load(args)
    return run_app(fleet, options.settings(args), args)
