"""Files where the platform expects them: XDG_* respected by the fleet, the compiler, the
wheelhouse and the TUI log."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import tomllib

from fleettui.config import paths
from fleettui.config.fleet import load_fleet
from fleettui.errors import ProvisionError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("CACHE", "STATE", "DATA", "CONFIG"):
        monkeypatch.setenv(f"XDG_{name}_HOME", str(tmp_path / name.lower()))
    return tmp_path


@pytest.mark.skipif(sys.platform != "linux", reason="XDG_* is the Linux convention")
def test_caches_follow_xdg_cache_home(xdg: Path) -> None:
    from fleettui.provision.wheelhouse import default_cache
    from shard_compiler.compiler import default_cache_root

    path = xdg / "fleet.toml"
    path.write_text('[[hosts]]\nname = "a"\n')
    assert load_fleet(path).model.shards == xdg / "cache" / "fleettui" == paths.cache_dir()
    # the compiler agrees without importing fleettui
    assert default_cache_root() == paths.cache_dir()
    assert default_cache() == xdg / "cache" / "fleettui" / "wheelhouse"
    assert paths.log_dir() == xdg / "state" / "fleettui" / "log" and paths.log_dir().is_dir()
    # an explicit root stays as given
    path.write_text('[model]\nshards = "here"\n[[hosts]]\nname = "a"\n')
    assert load_fleet(path).model.shards == xdg / "here"


def test_the_tui_log_pane_keeps_a_rotating_file(xdg: Path) -> None:
    from textual.app import App, ComposeResult

    from fleettui.ui.widgets.log_pane import LogPane

    log_file = paths.log_dir() / "tui.log"

    class Pane(App[None]):
        def compose(self) -> ComposeResult:
            yield LogPane(id="log", log_file=log_file)

    async def run() -> None:
        app = Pane()
        async with app.run_test() as pilot:
            app.query_one(LogPane).write_line("stage-a", "ready: INFERENCE_PRECISION_HINT f32")
            app.query_one(LogPane).write_line("fleettui.ui.app", "stage-b failed: boom", 40)
            await pilot.pause()

    asyncio.run(run())
    text = log_file.read_text()
    assert "INFO stage-a: ready: INFERENCE_PRECISION_HINT f32" in text
    assert "ERROR fleettui.ui.app: stage-b failed: boom" in text


def test_the_wheelhouse_build_declares_setuptools(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import importlib.util

    from fleettui.provision import wheelhouse

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(dependency.startswith("setuptools") for dependency in dependencies)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "setuptools" else real(name, *a),
    )
    with pytest.raises(ProvisionError, match="needs setuptools"):
        asyncio.run(
            wheelhouse.build_wheelhouse(wheelhouse.Target.here(), tmp_path, requirements=[])
        )
