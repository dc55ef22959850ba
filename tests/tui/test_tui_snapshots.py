"""Snapshot tests of the TUI at a fixed terminal size, fed by a fake controller with fixed
telemetry."""

from __future__ import annotations

import pytest
from textual.pilot import Pilot
from textual.widgets import Input

from fleettui.runtime.generation import GenerationParams
from fleettui.ui.app import FleetApp
from fleettui.ui.widgets.chat import ChatPane
from fleettui.ui.widgets.log_pane import LogPane
from tests.support.tui_fakes import FakeController, demo_fleet

SIZE = (140, 45)


@pytest.fixture(autouse=True)
def deterministic_screen(monkeypatch: pytest.MonkeyPatch) -> None:
    """No blinking cursor and a fixed clock in the log pane."""
    monkeypatch.setattr(Input, "_toggle_cursor", lambda self: None)
    monkeypatch.setattr("fleettui.ui.widgets.log_pane.timestamp", lambda: "12:00:00 ")


def snapshot_app() -> FleetApp:
    return FleetApp(demo_fleet(), FakeController, GenerationParams(max_tokens=16))


async def settle(pilot: Pilot, condition, what: str) -> None:
    for _ in range(200):
        if condition():
            return
        await pilot.pause(0.02)
    raise AssertionError(f"never reached: {what}")


# what the fake deploy logs: cached shards, two stages ready, the failed laptop
DEPLOY_LOG_LINES = 4


async def deployed(pilot: Pilot) -> None:
    """The fake deploy finished, all its log lines are in and the fleet table is drawn (no timer
    races)."""
    app = pilot.app
    await settle(pilot, lambda: app.sub_title == "ready", "the fake deploy")
    log_pane = app.query_one(LogPane)
    await settle(
        pilot, lambda: log_pane.lines_written >= DEPLOY_LOG_LINES, "the deploy's log lines"
    )
    app.redraw_fleet()
    await pilot.pause()


async def deployed_with_one_answer(pilot: Pilot) -> None:
    app = pilot.app
    await deployed(pilot)
    await pilot.press(*"What is the capital of France?", "enter")
    session = app.query_one(ChatPane).active
    await settle(pilot, lambda: session.replies and session.replies[-1].done, "the reply")
    app.redraw_fleet()
    await pilot.pause()
    await newest_log_line(pilot)


async def newest_log_line(pilot: Pilot) -> None:
    """The log shows its newest line. It follows its lines by itself, but a line written before
    the pane had its size (a busy machine) is laid out later, after that follow."""
    log_pane = pilot.app.query_one(LogPane)
    log_pane.scroll_end(animate=False, immediate=True)
    await pilot.pause()


class TestMainScreen:
    def test_deployed_fleet_with_one_answer(self, snap_compare):
        assert snap_compare(snapshot_app(), terminal_size=SIZE, run_before=deployed_with_one_answer)

    def test_second_session(self, snap_compare):
        async def second_session(pilot: Pilot) -> None:
            await deployed_with_one_answer(pilot)
            await pilot.press("ctrl+n", *"hi", "enter")
            chat = pilot.app.query_one(ChatPane)
            await settle(
                pilot, lambda: chat.active.replies and chat.active.replies[-1].done, "the reply"
            )

        assert snap_compare(snapshot_app(), terminal_size=SIZE, run_before=second_session)


class TestHelpScreen:
    def test_help_lists_the_keys(self, snap_compare):
        async def open_help(pilot: Pilot) -> None:
            await deployed(pilot)
            await pilot.press("f1")

        assert snap_compare(snapshot_app(), terminal_size=SIZE, run_before=open_help)


class TestQuitDialog:
    def test_quit_asks_about_the_fleet(self, snap_compare):
        async def ask_to_quit(pilot: Pilot) -> None:
            await deployed(pilot)
            await pilot.press("ctrl+q")

        assert snap_compare(snapshot_app(), terminal_size=SIZE, run_before=ask_to_quit)


@pytest.mark.parametrize("size", [(80, 24), (200, 50)], ids=["80x24", "200x50"])
def test_the_main_screen_fits_small_and_large_terminals(
    snap_compare, size: tuple[int, int]
) -> None:
    """The smallest common terminal keeps the fleet table, the chat and its input; a large one
    uses the room."""
    assert snap_compare(snapshot_app(), terminal_size=size, run_before=deployed_with_one_answer)
