"""Helpers of the recovery tests (local and SSH): exact fleets and interleaved answers with one
fault fired.

The fault is triggered from the token callback after a few tokens, never by a sleep.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil

from fleettui.config.fleet import DEFAULT_FLEET, Fleet, Host, ResilienceSettings, load_fleet
from fleettui.control import store
from fleettui.control.controller import FleetController, with_overrides
from fleettui.control.deployment import free_port_block
from fleettui.control.states import RecoveryReport
from fleettui.runtime.generation import GenerationParams

TOKENS = 48
KILL_AFTER = 6  # tokens streamed (in the first session) before the fault
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip, briefly.",
]


def make_fleet(
    cache: Path, stages: int, draft: str = "none", k: int | str = "auto", **resilience: float
) -> Fleet:
    base = load_fleet(DEFAULT_FLEET)
    hosts = tuple(Host(name=f"stage-{i}", base_port=free_port_block()) for i in range(stages))
    fleet = replace(base, hosts=hosts, model=replace(base.model, shards=cache))
    fleet = with_overrides(fleet, exact=True, draft=draft)
    fleet = replace(fleet, resilience=replace(ResilienceSettings(), **resilience))
    return replace(fleet, speculation=replace(fleet.speculation, k=k))


Fault = Callable[[FleetController], None]


async def run_with_fault(
    fleet: Fleet, prompts: list[str], fault: Fault | None, events: list[object] | None = None
) -> tuple[list[list[int]], FleetController, list[RecoveryReport]]:
    """Answer `prompts` interleaved; `fault(controller)` fires once the first session streamed
    KILL_AFTER tokens.

    At each recovery report the deployment record must name the live workers (so `fleettui stop`
    finds them)."""
    events = events if events is not None else []

    def on_event(event: object) -> None:
        events.append(event)
        if isinstance(event, RecoveryReport):
            record = store.load(fleet)
            launched = {
                e.placement.config.name: e.process.pid for e in controller.launched if e.process
            }
            assert record is not None and record.pids() == launched
            assert all(psutil.pid_exists(pid) for pid in record.pids().values())

    controller = FleetController(fleet, on_event=on_event)
    fired = asyncio.Event()
    try:
        coordinator = await controller.start()
        sessions = [await coordinator.open_session() for _ in prompts]
        streamed = 0

        def on_tokens(tokens: list[int], _text: str) -> None:
            nonlocal streamed
            streamed += len(tokens)
            if fault is not None and streamed >= KILL_AFTER and not fired.is_set():
                fired.set()
                fault(controller)

        params = GenerationParams(max_tokens=TOKENS)
        calls = [
            coordinator.chat(session, prompt, params, on_tokens if index == 0 else None)
            for index, (session, prompt) in enumerate(zip(sessions, prompts, strict=True))
        ]
        generations = await asyncio.gather(*calls)
        assert fault is None or fired.is_set()
        reports = list(controller.recovery.reports) if controller.recovery else []
        return [list(g.token_ids) for g in generations], controller, reports
    finally:
        await controller.stop()


def print_reports(reports: list[RecoveryReport]) -> None:
    for r in reports:
        print(
            f"recovery {r.action} {r.stages} {r.reasons}: detect {r.detect:.2f} s, relaunch "
            f"{r.relaunch:.2f} s, "
            f"replay {r.replay:.2f} s ({r.sessions} sessions, {r.replayed_tokens} tokens) "
            f"{r.message}"
        )
