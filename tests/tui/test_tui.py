"""Tests of the TUI: pure display logic, the app driven by a fake controller, and (slow) the real
fleet."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import psutil
import pytest
from textual.pilot import Pilot
from textual.widgets import Input, Markdown

from fleettui.config.fleet import load_fleet
from fleettui.control.controller import generation_params
from fleettui.control.states import Failed, Progress, Ready, Serving
from fleettui.runtime.generation import GenerationParams
from fleettui.ui.app import FleetApp
from fleettui.ui.formatting import (
    BLOCKS,
    Series,
    TransferRate,
    sparkline,
    stats_text,
    transfer_text,
)
from fleettui.ui.messages import DeployProgressed, TelemetrySampled
from fleettui.ui.monitor import FleetMonitor, StageView
from fleettui.ui.screens.help import HelpScreen, key_rows
from fleettui.ui.screens.quit import QuitScreen
from fleettui.ui.widgets.chat import ChatPane
from fleettui.ui.widgets.log_pane import LogPane
from tests.support.tui_fakes import FakeController, demo_fleet, sample

SIZE = (140, 45)


async def wait_until(
    pilot: Pilot, condition: Callable[[], bool], timeout: float, what: str
) -> None:
    """Let the app run until `condition()` holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await pilot.pause(0.05)


# -- pure display logic
# ---------------------------------------------------------------------------------


def test_sparkline_scales_to_the_largest_value_and_pads_short_series():
    assert sparkline([0, 7], 4) == "  " + BLOCKS[0] + BLOCKS[7]
    assert sparkline([], 3) == "   "
    assert sparkline([5, 5, 5], 3, maximum=10) == BLOCKS[4] * 3  # half of the fixed scale


def test_sparkline_averages_a_long_series_into_its_width():
    line = sparkline([0] * 30 + [10] * 30, 6)
    assert line == BLOCKS[0] * 3 + BLOCKS[7] * 3


def test_series_keeps_only_the_last_minute_by_sample_time():
    series = Series(seconds=60)
    for second in range(100):
        series.add(1000.0 + second, second)
    assert series.values()[0] == 39 and series.last == 99
    series.add(1050.0, -1)  # out of order (an older sample collapsed behind a newer one): ignored
    series.add(1100.0, None)
    assert series.last == 99


def test_transfer_rate_from_successive_reports_and_restart():
    rate = TransferRate()
    assert rate.bytes_per_second is None
    rate.add(0, at=10.0)
    rate.add(5e6, at=11.0)
    assert rate.bytes_per_second == pytest.approx(5e6)
    rate.add(1e6, at=12.0)  # a new transfer started counting from zero
    assert rate.bytes_per_second is None
    assert transfer_text(12e6, 40e6, 5.1e6) == "12.0/40.0 MB 5.1 MB/s"


def test_stats_line_under_a_reply():
    assert stats_text(32, 21.456, 0.5, 2.25) == "32 tok · 21.5 tok/s · acceptance 50% · K≈2.2"
    assert stats_text(8, 4.0, None, 0.0) == "8 tok · 4.0 tok/s · acceptance n/a · K≈0.0"


def test_stage_row_shows_telemetry_temperature_or_na_and_failure_reason():
    view = StageView("stage-a", "127.0.0.1", 0, (0, 15), "CPU")
    for second in range(3):
        view.record(sample("stage-a", 0, second, temp_c=None if second < 2 else 55.0))
    cells = view.cells(spark_width=4)
    assert cells["layers"] == "[0, 15)"
    cut = StageView("b", layers=(12.5, 16))  # starts after layer 12's attention, with its MLP
    assert cut.cells()["layers"] == "[12.5, 16)"
    assert cells["temperature"].startswith(" 55°C")
    assert cells["busy"].endswith("%") and cells["memory"] == "310 MB" and cells["hop"] == "0.4"
    view.state = Failed("connect: refused")
    assert view.cells()["state"] == "failed: connect: refused"
    assert StageView("b").cells()["temperature"] == "n/a"


def test_monitor_derives_the_state_of_stages_the_controller_does_not_track():
    monitor = FleetMonitor()
    monitor.record("draft", sample("draft", 0, 0, sessions=2, busy=0.5), known=False)
    assert monitor.stages["draft"].state == Serving(2)
    monitor.add(StageView("stage-a"))
    monitor.record("stage-a", sample("stage-a", 0, 0), known=True)
    assert monitor.stages["stage-a"].state.label == "idle"  # the controller's StageChanged decides
    assert monitor.serving() == ["draft"]


def test_newer_telemetry_of_the_same_stage_supersedes_a_queued_one():
    a, b = sample("a", 0, 0), sample("b", 1, 0)
    older, newer, other = (
        TelemetrySampled("a", a),
        TelemetrySampled("a", a),
        TelemetrySampled("b", b),
    )
    assert older.can_replace(newer) and not older.can_replace(other)
    assert not older.can_replace(DeployProgressed(Progress("a", "shard", 1, 2, "")))


def test_help_rows_cover_every_app_binding():
    rows = dict((description, keys) for keys, description in key_rows(FleetApp.BINDINGS))
    assert rows["switch to session N"] == "1…9"
    assert rows["quit"] == "q / ctrl+q" and rows["help"] == "? / f1"
    described = {binding.description for binding in FleetApp.BINDINGS}
    assert described == set(rows)


def test_generation_params_take_the_fleet_defaults_and_command_line_overrides():
    fleet = load_fleet("fleets/local.toml")
    defaults = generation_params(fleet)
    assert (defaults.max_tokens, defaults.temperature, defaults.top_p, defaults.spec_k) == (
        fleet.sessions.max_tokens,
        0.2,  # SmolLM2's recommended sampling: the fleet file sets none
        0.9,
        None,
    )
    assert generation_params(fleet, 8, 0.7, 0.9, 3, no_spec=True) == GenerationParams(
        max_tokens=8, temperature=0.7, top_p=0.9, seed=3, spec_k=0
    )


# -- the app with a fake controller
# -----------------------------------------------------------------------


def fake_app(**kwargs) -> FleetApp:
    return FleetApp(demo_fleet(), FakeController, GenerationParams(max_tokens=16), **kwargs)


async def test_deploy_on_mount_fills_fleet_panel_deploy_panel_and_log():
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.sub_title == "ready", 10, "the fake deploy")
        app.redraw_fleet()
        await pilot.pause()
        table = app.query_one("#fleet")
        assert list(table.rows) == ["stage-a", "stage-b", "office-pc", "laptop", "draft"]
        assert str(table.get_cell("laptop", "state")).startswith("failed: connect")
        assert str(table.get_cell("stage-b", "temperature")) == "n/a"
        deploy = app.query_one("#deploy")
        assert deploy.row("office-pc").detail == "12.0/40.0 MB" and deploy.row("laptop").failed
        assert app.query_one(LogPane).lines_written >= 3
        assert app.monitor.stages["stage-a"].state == Serving(1)


async def test_a_failed_deploy_is_reported_and_d_retries():
    app = fake_app()
    app.controller.fail_start = "shard compiler: no space left on device"
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.sub_title == "deploy failed", 10, "the failure")
        assert not app.ready
        deploy = app.query_one("#deploy")
        assert (
            deploy.row("fleet").failed
            and deploy.row("fleet").detail == "shard compiler: no space left on device"
        )
        app.controller.fail_start = None
        app.query_one(ChatPane).active.focus()
        await pilot.press("d")
        await wait_until(pilot, lambda: app.sub_title == "ready", 10, "the second deploy")
        assert app.controller.started == 2
        await pilot.pause()
        assert "fleet" not in [row.host_name for row in deploy.query("DeployRow")]


async def test_prompt_streams_a_markdown_reply_with_its_statistics():
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.ready, 10, "ready")
        await pilot.press(*"hello", "enter")
        session = app.query_one(ChatPane).active
        await wait_until(
            pilot, lambda: session.replies and session.replies[-1].done, 10, "the reply"
        )
        reply = session.replies[-1]
        assert reply.text == "You said **hello** in session 1." and reply.chunks == 6
        assert reply.query_one(Markdown).source == reply.text
        assert "6 tok · 12.0 tok/s · acceptance 67% · K≈1.5" in str(
            reply.query_one(".reply-stats").render()
        )
        assert app.query_one("#prompt", Input).value == ""


async def test_a_prompt_with_a_lone_surrogate_is_refused_in_one_notice_and_kept_for_editing():
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.ready, 10, "ready")
        app.query_one("#prompt", Input).value = "caf\ud800"
        await pilot.press("enter")
        await pilot.pause()
        notices = [notice.message for notice in app._notifications]
        assert notices == ["chat input: a lone surrogate U+D800 at character 3 is not text"]
        assert not app.query_one(ChatPane).active.replies
        assert app.query_one("#prompt", Input).value == "caf\ud800"


async def test_two_sessions_generate_at_the_same_time():
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.ready, 10, "ready")
        app.controller.coordinator.gate = gate = asyncio.Event()
        await pilot.press(*"one", "enter", "ctrl+n", *"two", "enter")
        chat = app.query_one(ChatPane)
        await wait_until(
            pilot, lambda: all(s.busy for s in chat.sessions), 10, "both sessions answering"
        )
        running = [w for w in app.workers if w.group.startswith("chat-") and w.is_running]
        assert sorted(w.group for w in running) == ["chat-1", "chat-2"]
        gate.set()
        await wait_until(
            pilot, lambda: all(s.replies[-1].done for s in chat.sessions), 10, "both replies"
        )
        assert app.controller.coordinator.most_active == 2
        assert [s.replies[-1].text for s in chat.sessions] == [
            "You said **one** in session 1.",
            "You said **two** in session 2.",
        ]


async def test_a_busy_session_refuses_a_second_prompt_and_sessions_switch_by_number():
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.ready, 10, "ready")
        app.controller.coordinator.gate = asyncio.Event()
        chat = app.query_one(ChatPane)
        await pilot.press(*"one", "enter")
        await wait_until(pilot, lambda: chat.active.busy, 10, "session 1 answering")
        await pilot.press(*"again", "enter")
        await pilot.pause()
        assert len(chat.active.replies) == 1 and app.query_one("#prompt", Input).value == "again"
        await pilot.press("ctrl+n", "escape", "1")
        assert chat.active.number == 1
        await pilot.press("2")
        assert chat.active.number == 2
        await pilot.press("ctrl+pagedown")
        assert chat.active.number == 1
        app.controller.coordinator.gate.set()


async def test_the_chat_follows_the_stream_unless_the_reader_scrolled_up():
    app = fake_app()
    long_prompt = " ".join(f"word{index}" for index in range(80))

    async def send() -> None:
        app.query_one("#prompt", Input).value = long_prompt
        await pilot.press("enter")

    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.ready, 10, "ready")
        session = app.query_one(ChatPane).active
        for count in range(1, 4):
            await send()
            await wait_until(
                pilot,
                lambda n=count: len(session.replies) == n and session.replies[-1].done,
                20,
                "a reply",
            )
        await pilot.pause(0.1)
        # followed the end
        assert session.max_scroll_y > 0 and session.scroll_y == session.max_scroll_y
        app.controller.coordinator.gate = gate = asyncio.Event()
        await send()
        await wait_until(pilot, lambda: len(session.replies) == 4, 10, "the fourth reply to start")
        session.scroll_home(animate=False)  # the reader scrolls up while the reply streams
        gate.set()
        await wait_until(pilot, lambda: session.replies[-1].done, 20, "the fourth reply")
        await pilot.pause(0.1)
        assert session.scroll_y == 0 and session.max_scroll_y > 0


async def test_help_screen_lists_the_keys():
    app = fake_app(auto_deploy=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        keys = [row[0] for row in app.screen.rows]
        assert "ctrl+n" in keys[1] and "f1" in " ".join(keys)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


@pytest.mark.parametrize(
    ("key", "stopped", "exits"), [("s", 1, True), ("l", 0, True), ("escape", 0, False)]
)
async def test_quit_does_what_the_operator_chose(key, stopped, exits):
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.ready, 10, "ready")
        await pilot.press("ctrl+q")
        assert isinstance(app.screen, QuitScreen)
        await pilot.press(key)
        await wait_until(
            pilot, lambda: not isinstance(app.screen, QuitScreen), 10, "the dialog to close"
        )
        if exits:
            await wait_until(pilot, lambda: app.return_code == 0, 10, "the app to exit")
        else:
            await pilot.pause()
            assert app.return_code is None
        assert app.controller.stopped == stopped


async def test_logging_records_go_to_the_log_pane_not_the_terminal():
    app = fake_app(auto_deploy=False)
    async with app.run_test(size=SIZE) as pilot:
        pane = app.query_one(LogPane)
        before = pane.lines_written
        logging.getLogger("fleettui.somewhere").warning("disk almost full")
        await wait_until(
            pilot, lambda: pane.lines_written == before + 1, 10, "the record in the pane"
        )
        assert any("disk almost full" in line.text for line in pane.lines)
    assert app._log_handler not in logging.getLogger().handlers


async def test_fetched_logs_land_in_the_log_pane():
    app = fake_app(auto_deploy=False)
    async with app.run_test(size=SIZE) as pilot:
        app.query_one(ChatPane).active.focus()
        await pilot.press("l")
        pane = app.query_one(LogPane)
        await wait_until(pilot, lambda: pane.lines_written >= 8, 10, "the fetched lines")


# -- the real fleet (fleets/local.toml, the real model, real worker processes)
# ------------------------------

REAL_TIMEOUT = 900.0  # deploy includes compiling the shards when the cache is cold
PROMPT = "What is the capital of France?"


def real_fleet():
    """fleets/local.toml with fixed K=3 (so two runs verify the same drafts) on free ports."""
    from fleettui.control.controller import with_overrides
    from fleettui.control.deployment import free_port_block

    fleet = with_overrides(load_fleet("fleets/local.toml"), k=3)
    hosts = tuple(replace(host, base_port=free_port_block()) for host in fleet.hosts)
    return replace(fleet, hosts=hosts)


def real_app(max_tokens: int = 32) -> FleetApp:
    from fleettui.control.controller import FleetController

    return FleetApp(
        real_fleet(), FleetController, GenerationParams(max_tokens=max_tokens, spec_k=3)
    )


async def reference_answer(prompt: str, max_tokens: int) -> str:
    """What `FleetController.ask` (the `--ask` path) answers, on its own fleet."""
    from fleettui.control.controller import FleetController

    controller = FleetController(real_fleet())
    try:
        generation = await controller.ask(prompt, GenerationParams(max_tokens=max_tokens, spec_k=3))
    finally:
        await controller.stop()
    return generation.text


async def deployed(pilot: Pilot, app: FleetApp) -> list[int]:
    """Wait until every stage is ready; returns the worker processes' ids."""
    names = [host.name for host in app.fleet.hosts]
    await wait_until(
        pilot,
        lambda: app.ready or app.sub_title == "deploy failed",
        REAL_TIMEOUT,
        "the deploy",
    )
    assert app.ready, app.sub_title
    assert all(isinstance(app.controller.states[name], (Ready, Serving)) for name in names)
    assert all(app.monitor.stages[name].state.label in ("ready", "serving") for name in names)
    return list(app.controller.worker_pids().values())


async def quit_stopping_the_fleet(pilot: Pilot, app: FleetApp, pids: list[int]) -> None:
    await pilot.press("ctrl+q")
    await wait_until(pilot, lambda: isinstance(app.screen, QuitScreen), 10, "the quit dialog")
    await pilot.click("#stop")
    await wait_until(
        pilot, lambda: app.return_code is not None, 60, "the app to stop the fleet and exit"
    )
    assert app.return_code == 0 and app.controller.worker_pids() == {}
    assert not [pid for pid in pids if psutil.pid_exists(pid)]


@pytest.mark.slow
async def test_real_fleet_deploys_streams_the_ask_answer_and_stops_on_quit():
    expected = await reference_answer(PROMPT, 32)
    app = real_app(32)
    async with app.run_test(size=SIZE) as pilot:
        pids = await deployed(pilot, app)
        assert len(pids) >= len(app.fleet.hosts)
        await pilot.press(*PROMPT, "enter")
        session = app.query_one(ChatPane).active
        await wait_until(
            pilot, lambda: session.replies and session.replies[-1].done, REAL_TIMEOUT, "the reply"
        )
        reply = session.replies[-1]
        assert reply.text == expected
        assert reply.chunks > 1 and reply.query_one(Markdown).source == expected
        assert "tok/s · acceptance" in str(reply.query_one(".reply-stats").render())
        await quit_stopping_the_fleet(pilot, app, pids)


@pytest.mark.slow
async def test_real_fleet_serves_two_sessions_at_once():
    app = real_app(128)
    overlapped = False
    served_both: set[str] = set()  # stages the fleet panel showed serving two sessions
    async with app.run_test(size=SIZE) as pilot:
        pids = await deployed(pilot, app)
        # The second prompt is set, not typed: typing it key by key on a loaded CI machine can take
        # longer than the first reply, and the point is two generations in flight at once.
        prompt = app.query_one("#prompt", Input)
        prompt.value = "Tell me about the sea."
        await pilot.press("enter", "ctrl+n")
        prompt.value = "Tell me about the sky."
        await pilot.press("enter")
        chat = app.query_one(ChatPane)

        def both_streaming_or_done() -> bool:
            nonlocal overlapped
            replies = [s.replies[-1] for s in chat.sessions if s.replies]
            if (
                len(replies) == 2
                and all(s.busy for s in chat.sessions)
                and any(r.chunks for r in replies)
            ):
                overlapped = True  # both generations in flight at once, one already streaming
            for name, view in app.monitor.stages.items():
                if isinstance(view.state, Serving) and view.state.sessions >= 2:
                    served_both.add(name)
            return len(replies) == 2 and all(r.done for r in replies)

        await wait_until(pilot, both_streaming_or_done, REAL_TIMEOUT, "both replies")
        assert overlapped
        assert {host.name for host in app.fleet.hosts} <= served_both
        assert all(
            s.replies[-1].text and "failed" not in s.replies[-1].classes for s in chat.sessions
        )
        await quit_stopping_the_fleet(pilot, app, pids)


def test_what_next_is_a_function_of_the_stage_states():
    from fleettui.control.states import Idle, Loading, next_step

    assert next_step({"a": Idle(), "b": Idle()}) == "launch"
    assert next_step({"a": Ready(), "b": Loading()}) == "wait"
    assert next_step({"a": Ready(), "b": Serving(2)}) == "serve"
    assert next_step({"a": Serving(1), "b": Failed("lost")}) == "recover"


@pytest.mark.slow
async def test_real_fleet_serves_the_api_beside_the_chat_and_shows_its_requests():
    import httpx

    from fleettui.control.controller import FleetController
    from fleettui.ui.api import ApiOptions, ApiService
    from fleettui.ui.widgets.api_panel import ApiPanel

    app = FleetApp(
        real_fleet(),
        FleetController,
        GenerationParams(max_tokens=32, spec_k=3),
        api=ApiService(ApiOptions(port=0)),
    )
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
    }

    def ask(url: str) -> tuple[str, list[str]]:
        chunks = []
        with httpx.stream(
            "POST", url + "/chat/completions", json=body, timeout=REAL_TIMEOUT
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                    chunks.append(delta or "")
        return "".join(chunks), chunks

    async with app.run_test(size=SIZE) as pilot:
        pids = await deployed(pilot, app)
        assert app.api is not None
        await wait_until(pilot, lambda: bool(app.api and app.api.url), 60, "the API to listen")
        panel = app.query_one(ApiPanel)
        answer = asyncio.ensure_future(asyncio.to_thread(ask, app.api.url))
        await wait_until(pilot, answer.done, REAL_TIMEOUT, "the API answer")
        text, chunks = answer.result()
        assert "Paris" in text and len(chunks) > 2

        # Who asked stays on show a moment after the answer, however short it was (redraws are 0.5 s
        # apart).
        def row() -> list[str]:
            return [str(cell) for cell in panel.get_row_at(0)] if panel.row_count == 1 else []

        await wait_until(
            pilot, lambda: row()[3:4] == ["done"], 5, "the finished request in the panel"
        )
        assert row()[1].startswith("127.0.0.1:"), row()
        await wait_until(
            pilot, lambda: panel.row_count == 0, 10, "the finished request to leave the panel"
        )
        assert "1 answered" in str(panel.border_subtitle) and app.api.url in str(
            panel.border_subtitle
        )
        assert row() == [] and panel.get_column_index("output") == 5

        # A constrained request shows its grammar and the function it called.
        weather = {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
        named = {
            **body,
            "stream": False,
            "max_tokens": 96,
            "tools": [weather],
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }
        called = asyncio.ensure_future(
            asyncio.to_thread(
                httpx.post, app.api.url + "/chat/completions", json=named, timeout=REAL_TIMEOUT
            )
        )
        await wait_until(pilot, called.done, REAL_TIMEOUT, "the tool call")
        assert called.result().json()["choices"][0]["finish_reason"] == "tool_calls", (
            called.result().text
        )
        await wait_until(pilot, lambda: row()[3:4] == ["done"], 5, "the tool call in the panel")
        assert row()[5] == "tool get_weather → get_weather", row()
        url = app.api.url
        await quit_stopping_the_fleet(pilot, app, pids)
    with pytest.raises(httpx.ConnectError):  # the API stopped with the fleet
        await asyncio.to_thread(httpx.get, url + "/models", timeout=5)


def test_stage_row_shows_lost_recovering_degraded_and_throttled():
    from fleettui.control.states import Degraded, Lost, Recovering

    monitor = FleetMonitor()
    monitor.add(StageView("stage-b", "127.0.0.1", 1, (23, 30), "CPU"))
    monitor.set_state("stage-b", Lost("process exited with -9"))
    assert monitor.stages["stage-b"].state_text == "lost (process exited with -9)"
    monitor.set_state("stage-b", Recovering("replay"))
    assert monitor.stages["stage-b"].state_text == "recovering (replay)"
    monitor.set_throttled("stage-b", "1.8x its baseline, 96 °C")
    assert (
        monitor.stages["stage-b"].state_text
        == "recovering (replay), throttled: 1.8x its baseline, 96 °C"
    )
    monitor.set_throttled("stage-b", "")
    monitor.set_state("stage-b", Degraded("needs 2.1 GB more"))
    assert monitor.stages["stage-b"].state_text == "degraded: needs 2.1 GB more"


async def test_throttled_events_reach_the_fleet_panel():
    from fleettui.control.states import Throttled

    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        name = app.fleet.hosts[0].name
        app.handle_controller_event(Throttled(name, 2.0, "slower than its baseline"))
        await wait_until(
            pilot, lambda: bool(app.monitor.stages[name].throttled), 10, "the throttle flag"
        )
        assert "2.0x its baseline" in app.monitor.stages[name].state_text
        app.handle_controller_event(Throttled(name, 1.0, ""))
        await wait_until(
            pilot, lambda: not app.monitor.stages[name].throttled, 10, "the flag to clear"
        )
