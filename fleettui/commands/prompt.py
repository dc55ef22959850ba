"""Provides how a command reads its prompt: the argument itself, or standard input for "-"
(decoded by text_input)."""

from __future__ import annotations

import sys
from typing import BinaryIO, TextIO

from fleettui.errors import FleetError
from fleettui.text_input import check_text, decode


def read_prompt(
    value: str, stdin: BinaryIO | TextIO | None = None, encoding: str | None = None
) -> str:
    """The prompt: `value`, or all of standard input when `value` is "-" (a trailing newline
    dropped).

    Standard input is read as bytes and decoded by the one text rule (UTF-8 unless `encoding`); an
    argument is checked for the undecodable bytes the shell passed through."""
    if value != "-":
        return check_text(value, "the prompt argument")
    stream = stdin or sys.stdin
    if stream.isatty():
        print("fleettui: reading the prompt from stdin (end with ctrl-d)", file=sys.stderr)
    raw = getattr(stream, "buffer", stream).read()
    # (a text stream without bytes underneath, such as a test's StringIO, is only checked)
    text = check_text(raw, "stdin") if isinstance(raw, str) else decode(raw, "stdin", encoding)
    text = text[:-1] if text.endswith("\n") else text
    if not text.strip():
        raise FleetError("the prompt read from stdin is empty")
    return text
