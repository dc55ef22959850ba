"""Provides the `fleettui` command: subcommands from `fleettui.commands`, plus the old flag forms
as aliases."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from types import ModuleType
from typing import NoReturn

from fleettui.commands import COMMANDS
from fleettui.errors import FleetError, Interrupted, one_line

LEGACY = {
    "--ask": "ask",
    "--plan": "plan",
    "--bench": "bench",
    "--deploy": "deploy",
    "--stop": "stop",
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fleettui")
    except PackageNotFoundError:
        return "unknown (not installed)"


def command_module(name: str) -> ModuleType:
    return importlib.import_module(f"fleettui.commands.{name}")


class _Parser(argparse.ArgumentParser):
    """argparse whose error line stays one line: arguments echoed in it show control characters
    escaped."""

    def error(self, message: str) -> NoReturn:
        super().error(one_line(message))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fleettui",
        description="Run a large language model on a fleet of ordinary PCs: deploy, monitor and "
        "chat.",
        epilog="`fleettui FLEET` opens the TUI; the old forms `FLEET --ask Q | --plan | --bench | "
        "--deploy | "
        "--stop` still work.",
    )
    parser.add_argument("--version", action="version", version=f"fleettui {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        module = command_module(name)
        sub = commands.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.add_argument("--verbose", "-v", action="store_true", help="log to stderr")
        sub.add_argument(
            "--debug", action="store_true", help="an unexpected error prints its traceback"
        )
        sub.set_defaults(run=module.run, parser=parser)
    return parser


def translate(argv: list[str]) -> list[str]:
    """The subcommand form of an old flag form: `FLEET --ask Q ...` -> `ask FLEET Q ...`; `FLEET`
    -> `tui FLEET`."""
    if argv[:1] and argv[0] in (*COMMANDS, "-h", "--help", "--version"):
        return argv
    modes = [flag for flag in argv if flag in LEGACY or flag.startswith("--ask=")]
    if not modes:
        return ["tui", *argv]
    if len(modes) > 1:
        raise FleetError(f"{' and '.join(modes)} cannot be combined")
    rest = list(argv)
    index = rest.index(modes[0])
    flag = rest.pop(index)
    prompt = None
    if flag.startswith("--ask="):
        prompt, flag = flag.partition("=")[2], "--ask"
    elif flag == "--ask":
        if index >= len(rest):
            raise FleetError("--ask needs a question")
        prompt = rest.pop(index)
    fleet = next(
        (word for word in rest if not word.startswith("-") and word.endswith(".toml")), None
    )
    if fleet is None and rest[:1] and not rest[0].startswith("-"):
        fleet = rest[0]
    if fleet is not None:
        rest.remove(fleet)
    command = LEGACY[flag]
    head = [command, *([fleet] if fleet else [])]
    if command == "ask":
        if fleet is None:
            from fleettui.config.fleet import DEFAULT_FLEET

            head.append(str(DEFAULT_FLEET))
        head.append(prompt or "")
    if command == "bench" and "--json" in rest and rest.index("--json") == len(rest) - 1:
        rest.append("-")
    return [*head, *rest]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(translate(argv))
        logging.basicConfig(
            level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
            format="%(asctime)s %(name)s %(levelname)s %(message)s",
            stream=sys.stderr,
        )
        return int(args.run(args))
    except FleetError as error:
        print(f"fleettui: {one_line(str(error))}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `fleettui ... | head`: the reader left; end quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("fleettui: interrupted", file=sys.stderr)
        return 130
    except Interrupted as error:
        return error.code
    except Exception as error:  # a bug, not bad input: one line, the traceback kept in a log file
        from fleettui.crash import report_crash

        return report_crash(error, argv, debug="--debug" in argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
