"""The prompt argument: text as given, or standard input for "-"."""

from __future__ import annotations

import io

import pytest

from fleettui.commands.prompt import read_prompt
from fleettui.errors import FleetError


def test_dash_reads_stdin_and_other_values_are_the_prompt() -> None:
    assert read_prompt("-", io.StringIO("line one\nline two\n")) == "line one\nline two"
    assert read_prompt("what is -?", io.StringIO("unused")) == "what is -?"
    with pytest.raises(FleetError, match="empty"):
        read_prompt("-", io.StringIO("  \n"))
