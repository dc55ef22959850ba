"""Renders docs/img/tui.svg: the TUI at 120x36 after one answer, driven by the tests' fake controller.

Run from the repository root: `.venv/bin/python docs/img/screenshot.py`.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the fakes live with the tests

from textual.widgets import Input  # noqa: E402
from tui_fakes import FakeController, FakeCoordinator, FakeGeneration, demo_fleet  # noqa: E402

from fleettui.runtime.generation import GenerationParams, GenerationStats
from fleettui.ui.app import FleetApp  # noqa: E402
from fleettui.ui.widgets import log_pane  # noqa: E402
from fleettui.ui.widgets.chat import ChatPane  # noqa: E402

SIZE = (120, 36)
OUT = ROOT / "docs" / "img" / "tui.svg"
REPLY = "The capital of France is **Paris**."


async def answer(self: FakeCoordinator, session: object, user_text: str, params: object, on_tokens=None):  # type: ignore[no-untyped-def]
    """The fake coordinator's chat with the real model's answer instead of an echo."""
    words = REPLY.split(" ")
    for index, word in enumerate(words):
        if on_tokens is not None and (outcome := on_tokens([index], word if index == 0 else " " + word)):
            await outcome
    stats = GenerationStats(
        prompt_tokens=14, tokens=8, seconds=0.09, ttft=0.03, rounds=3, drafted=6, accepted=5,
        k_values=[2, 2, 2], finish_reason="eos",
    )  # fmt: skip
    return FakeGeneration(tuple(range(len(words))), REPLY, stats)


async def main() -> None:
    FakeCoordinator.chat = answer  # type: ignore[method-assign]
    Input._toggle_cursor = lambda self: None  # type: ignore[method-assign]  # no blinking cursor
    log_pane.timestamp = lambda: "12:00:00 "  # a fixed clock in the log pane
    app = FleetApp(
        demo_fleet(str(ROOT / "fleets" / "local.toml")), FakeController, GenerationParams(max_tokens=16)
    )
    async with app.run_test(size=SIZE) as pilot:
        for _ in range(200):
            if app.sub_title == "ready":
                break
            await pilot.pause(0.02)
        await pilot.pause(0.3)
        await pilot.press(*"What is the capital of France?", "enter")
        session = app.query_one(ChatPane).active
        for _ in range(200):
            if session.replies and session.replies[-1].done:
                break
            await pilot.pause(0.02)
        app.redraw_fleet()
        await pilot.pause(0.2)
        app.save_screenshot(filename=OUT.name, path=str(OUT.parent))
    print(OUT)


if __name__ == "__main__":
    asyncio.run(main())
