"""Line numbers of keys in a TOML text (tomllib has none) and typed table access raising
FleetConfigError."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fleettui.errors import FleetConfigError
from fleettui.text_input import TextError, check_text, decode

_HEADER = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.\-\s\"']+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"^\s*([A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*')\s*[=.]")
_STRING = re.compile(r"\"\"\".*?\"\"\"|'''.*?'''|\"(?:\\.|[^\"\\])*\"|'[^']*'", re.S)


def decoded(path: Path, data: bytes) -> str:
    """A fleet file's text by the one text rule (strict UTF-8, BOM dropped, CRLF read as LF), or a
    FleetConfigError at the line of its first undecodable byte."""
    try:
        return decode(data, str(path), hint="a TOML file is UTF-8")
    except TextError as error:
        raise FleetConfigError(
            path, data[: error.offset].count(b"\n") + 1, "fleet", error.reason
        ) from None


class LineIndex:
    """Maps (table, array index, key) to the 1-based line it is written on."""

    def __init__(self, text: str) -> None:
        self.headers: dict[tuple[str, int], int] = {}
        self.keys: dict[tuple[str, int, str], int] = {}
        counts: dict[str, int] = {}
        table, index, depth = "", 0, 0
        for number, line in enumerate(text.splitlines(), start=1):
            if depth == 0:
                header = _HEADER.match(line)
                if header:
                    table = header.group(2).replace(" ", "").replace('"', "").replace("'", "")
                    if header.group(1) == "[[":
                        index = counts.get(table, -1) + 1
                        counts[table] = index
                    else:
                        index = 0
                    self.headers[(table, index)] = number
                    continue
                key = _KEY.match(line)
                if key:
                    self.keys.setdefault((table, index, key.group(1).strip("\"'")), number)
            code = _STRING.sub('""', line).split("#", 1)[0]
            depth = max(
                0, depth + code.count("[") + code.count("{") - code.count("]") - code.count("}")
            )

    def line(self, table: str, index: int = 0, key: str | None = None) -> int:
        if key is not None and (table, index, key) in self.keys:
            return self.keys[(table, index, key)]
        return self.headers.get((table, index), 1 if not table else 0)


# --------------------------------------------------------------------------------------------------
# Validation helpers: each returns the typed value or raises FleetConfigError at the key's line.


class Section:
    """One table of the fleet file being validated, with what is needed to point at its lines."""

    def __init__(
        self, path: Path, lines: LineIndex, table: str, index: int, label: str, data: Any
    ) -> None:
        self.path, self.lines, self.table, self.index, self.label = path, lines, table, index, label
        if not isinstance(data, Mapping):
            raise FleetConfigError(path, lines.line(table, index), label, "expected a table")
        self.data: Mapping[str, Any] = data

    def error(self, key: str | None, reason: str) -> FleetConfigError:
        name = f"{self.label}.{key_name(key)}" if key else self.label
        return FleetConfigError(
            self.path, self.lines.line(self.table, self.index, key), name, reason
        )

    def reject_unknown(self, known: tuple[str, ...]) -> None:
        for key in self.data:
            if key not in known:
                raise self.error(key, f"unknown key (expected one of: {', '.join(known)})")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        if key not in self.data:
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, bool) and bool not in kinds:
            raise self.error(key, f"expected {_kind_name(kinds)}, got {show(value)}")
        if not isinstance(value, kinds):
            raise self.error(key, f"expected {_kind_name(kinds)}, got {show(value)}")
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str):  # names, paths, hosts and commands: a NUL would reach the OS
                try:
                    check_text(text, key, allow_nul=False)
                except TextError as error:
                    raise self.error(key, error.reason) from None
        return value

    def choice(
        self, key: str, choices: tuple[str, ...], default: str, *, upper: bool = False
    ) -> str:
        value = self.get(key, str, default)
        value = value.upper() if upper else value
        if value not in choices:
            raise self.error(key, f"{show(value)} is not one of: {' | '.join(choices)}")
        return str(value)

    def number(
        self, key: str, kind: type, default: Any, check: Callable[[Any], bool], rule: str
    ) -> Any:
        value = self.get(key, kind, default)
        if not check(value):
            raise self.error(key, f"{show(value)} is out of range: {rule}")
        return value


def _kind_name(kinds: tuple[type, ...]) -> str:
    names = {
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "true or false",
        list: "a list",
    }
    return " or ".join(names.get(kind, kind.__name__) for kind in kinds)


def key_name(key: str) -> str:
    """A key or name as written, or quoted with escapes when it holds a newline, a NUL or another
    control."""
    return key if key.isprintable() else json.dumps(key, ensure_ascii=False)


def show(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # quoted, a newline or NUL escaped: one line
    return repr(value).replace("True", "true").replace("False", "false")
