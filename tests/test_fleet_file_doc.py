"""docs/fleet-file.md lists exactly the keys the fleet file loader accepts, table by table."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from fleettui.config.fleet import (
    Host,
    ModelSettings,
    RuntimeSettings,
    SessionSettings,
    SpeculationSettings,
    load_fleet,
)
from fleettui.config.resilience import ResilienceSettings
from fleettui.errors import FleetConfigError

DOC = Path(__file__).resolve().parent.parent / "docs" / "fleet-file.md"
SETTINGS = {
    "model": ModelSettings,
    "runtime": RuntimeSettings,
    "speculation": SpeculationSettings,
    "sessions": SessionSettings,
    "resilience": ResilienceSettings,
    "hosts": Host,
}


def documented() -> dict[str, list[str]]:
    """The keys of each `## [table]` section's Markdown table, in order."""
    found: dict[str, list[str]] = {}
    table = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"^## \[+(\w+)\]+\s*$", line)
        if heading:
            table = found.setdefault(heading.group(1), [])
        elif line.startswith("## "):
            table = None
        elif table is not None and (row := re.match(r"^\| `(\w+)` \|", line)):
            table.append(row.group(1))
    return found


def verdict(tmp_path: Path, table: str, key: str) -> str:
    """What the loader says of `key` in `table` when it is given a value of the wrong type for any key."""
    host = 'name = "a"\n'
    wrong = "{ wrong = 1 }"
    if table == "hosts":
        text = f"[[hosts]]\n{host if key != 'name' else ''}{key} = {wrong}\n"
    else:
        text = f"[{table}]\n{key} = {wrong}\n\n[[hosts]]\n{host}"
    path = tmp_path / "fleet.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(FleetConfigError) as caught:
        load_fleet(path)
    return str(caught.value)


def test_every_table_of_the_loader_is_documented_and_no_other() -> None:
    assert set(documented()) == set(SETTINGS)


@pytest.mark.parametrize("table", sorted(SETTINGS))
def test_the_documented_keys_are_the_settings_fields(table: str) -> None:
    keys = documented()[table]
    assert len(keys) == len(set(keys)), f"a key is listed twice in [{table}]"
    assert set(keys) == {field.name for field in dataclasses.fields(SETTINGS[table])}


@pytest.mark.parametrize(("table", "key"), [(t, k) for t, keys in documented().items() for k in keys])
def test_the_loader_accepts_every_documented_key(tmp_path: Path, table: str, key: str) -> None:
    message = verdict(tmp_path, table, key)
    assert "unknown key" not in message
    assert key in message  # refused for its value, and the line names it


def test_the_loader_refuses_a_key_the_doc_does_not_list(tmp_path: Path) -> None:
    for table in SETTINGS:
        assert "unknown key" in verdict(tmp_path, table, "not_documented")
