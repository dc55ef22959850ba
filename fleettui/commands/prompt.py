"""Provides how a command reads its prompt: the argument itself, or standard input for "-"."""

from __future__ import annotations

import sys
from typing import TextIO

from fleettui.errors import FleetError


def read_prompt(value: str, stdin: TextIO | None = None) -> str:
    """The prompt: `value`, or all of standard input when `value` is "-" (a trailing newline dropped)."""
    if value != "-":
        return value
    stream = stdin or sys.stdin
    if stream.isatty():
        print("fleettui: reading the prompt from stdin (end with ctrl-d)", file=sys.stderr)
    text = stream.read()
    text = text[:-1] if text.endswith("\n") else text
    if not text.strip():
        raise FleetError("the prompt read from stdin is empty")
    return text
