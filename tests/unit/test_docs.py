"""The reference docs match the code: docs/fleet-file.md lists exactly the keys the fleet file
loader accepts, and docs/performance.md shows the bench run its JSON holds, as docs/bench/render.py
renders it."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
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

DOCS = Path(__file__).resolve().parents[2] / "docs"
DOC = DOCS / "fleet-file.md"
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
    """What the loader says of `key` in `table` when it is given a value of the wrong type for
    any key."""
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


@pytest.mark.parametrize(
    ("table", "key"), [(t, k) for t, keys in documented().items() for k in keys]
)
def test_the_loader_accepts_every_documented_key(tmp_path: Path, table: str, key: str) -> None:
    message = verdict(tmp_path, table, key)
    assert "unknown key" not in message
    assert key in message  # refused for its value, and the line names it


def test_the_loader_refuses_a_key_the_doc_does_not_list(tmp_path: Path) -> None:
    for table in SETTINGS:
        assert "unknown key" in verdict(tmp_path, table, "not_documented")


def test_the_performance_page_shows_its_bench_json_as_the_renderer_renders_it() -> None:
    spec = importlib.util.spec_from_file_location("render", DOCS / "bench" / "render.py")
    assert spec is not None and spec.loader is not None
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    page = (DOCS / "performance.md").read_text(encoding="utf-8")
    found = re.findall(
        r"<!-- rendered from (bench/[\w.-]+\.json) -->\n(.*?)\n<!-- end of rendered table -->",
        page,
        re.S,
    )
    assert found
    for source, text in found[
        1:
    ]:  # every other rendered table (a model's or a group's own run) too
        assert text == render.table(json.loads((DOCS / source).read_text(encoding="utf-8"))), source
    shown = re.search(
        r"<!-- rendered from (bench/[\w.-]+\.json) -->\n(.*?)\n<!-- end of rendered table -->",
        page,
        re.S,
    )
    assert shown is not None
    doc = json.loads((DOCS / shown.group(1)).read_text(encoding="utf-8"))
    assert shown.group(2) == render.table(doc)
    ok = [row for row in doc["rows"] if row.get("status", "ok") == "ok"]
    assert ok and all(f"| {row['name']} |" in shown.group(2) for row in doc["rows"])
    assert render.users_series(doc["rows"]) and render.delay_series(doc["rows"])
    for plot, svg in render.plots(doc["rows"]).items():
        path = f"{shown.group(1)[: -len('.json')]}-{plot}.svg"
        assert f"({path})" in page
        assert (DOCS / path).read_text(encoding="utf-8") == svg
