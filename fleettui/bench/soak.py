"""Provides the soak: many sessions answering for minutes while a random stage is killed at
intervals.

`fleettui bench --soak` runs `soak()`: `sessions` users ask prompts in a loop (a fresh session per
answer) on an exact fleet; every `kill_every` seconds a random worker (a stage or the draft) gets
SIGKILL. Every answer must complete and equal the fault-free answer to the same prompt; the
coordinator's and workers' memory is sampled so growth shows. The report lists each recovery with
its detect / relaunch / replay time."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from fleettui.config.fleet import Fleet
from fleettui.control.states import ControllerEvent, RecoveryReport

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip, briefly.",
    "Name two primary colours.",
    "What is 12 times 12?",
    "Say hello in Spanish.",
    "Give one tip for sleeping well.",
    "What does a CPU do? One sentence.",
)


@dataclass
class SoakReport:
    seconds: float
    sessions: int
    answers: int = 0
    tokens: int = 0
    kills: list[str] = field(default_factory=list)
    recoveries: list[RecoveryReport] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    # (elapsed s, coordinator, workers)
    rss_mb: list[tuple[float, float, float]] = field(default_factory=list)

    @property
    def lost(self) -> int:
        """Answers that failed or differ from the fault-free answer."""
        return len(self.errors) + len(self.mismatches)

    def summary(self) -> str:
        lines = [
            f"soak: {self.seconds:.0f} s, {self.sessions} sessions, {self.answers} answers, "
            f"{self.tokens} tokens, "
            f"{len(self.kills)} kills, {len(self.recoveries)} recoveries, {self.lost} lost"
        ]
        for report in self.recoveries:
            lines.append(
                f"  {report.action:<9} {','.join(report.stages):<16} detect {report.detect:5.2f} s "
                " "
                f"relaunch {report.relaunch:5.2f} s  replay {report.replay:5.2f} s  "
                f"({report.sessions} sessions, {report.replayed_tokens} tokens)"
            )
        if self.recoveries:
            for name, values in (
                ("detect", [r.detect for r in self.recoveries]),
                ("relaunch", [r.relaunch for r in self.recoveries]),
                ("replay", [r.replay for r in self.recoveries]),
            ):
                lines.append(
                    f"  {name}: median {statistics.median(values):.2f} s, max {max(values):.2f} s"
                )
        if self.rss_mb:
            first, last = self.rss_mb[0], self.rss_mb[-1]
            lines.append(
                f"  RSS coordinator {first[1]:.0f} -> {last[1]:.0f} MB, workers {first[2]:.0f} -> "
                f"{last[2]:.0f} MB "
                f"(max {max(r[2] for r in self.rss_mb):.0f} MB)"
            )
        lines.extend(f"  error: {e}" for e in self.errors[:5])
        lines.extend(f"  mismatch: {m}" for m in self.mismatches[:5])
        return "\n".join(lines)


def _rss(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss / 2**20
        except psutil.Error:
            continue
    return total


async def soak(
    fleet: Fleet,
    seconds: float = 600.0,
    sessions: int = 8,
    kill_every: float = 60.0,
    max_tokens: int = 48,
    seed: int = 0,
    on_event: Callable[[ControllerEvent], None] | None = None,
    on_line: Callable[[str], None] | None = None,
) -> SoakReport:
    """Run the soak on `fleet` (use exact settings so answers can be compared token for token)."""
    from fleettui.control.controller import FleetController
    from fleettui.runtime.generation import GenerationParams

    say = on_line or (lambda line: None)
    # every user holds a session on every stage
    admitted = max(fleet.sessions.max_sessions, sessions)
    fleet = replace(fleet, sessions=replace(fleet.sessions, max_sessions=admitted))
    controller = FleetController(fleet, on_event=on_event)
    report = SoakReport(seconds, sessions)
    params = GenerationParams(max_tokens=max_tokens)
    chooser = random.Random(seed)
    try:
        coordinator = await controller.start()
        say("fault-free answers for every prompt ...")
        expected: dict[str, tuple[int, ...]] = {}
        for prompt in PROMPTS:
            session = await coordinator.open_session()
            try:
                expected[prompt] = (await coordinator.chat(session, prompt, params)).token_ids
            finally:
                await coordinator.close_session(session)
        started = time.monotonic()
        deadline = started + seconds

        def sample_memory() -> None:
            workers = list(controller.worker_pids().values())
            report.rss_mb.append((time.monotonic() - started, _rss([os.getpid()]), _rss(workers)))

        async def user(index: int) -> None:
            turn = 0
            while time.monotonic() < deadline:
                prompt = PROMPTS[(index + turn) % len(PROMPTS)]
                turn += 1
                try:
                    session = await coordinator.open_session()
                    try:
                        generation = await coordinator.chat(session, prompt, params)
                    finally:
                        await coordinator.close_session(session)
                except Exception as error:  # counted: the soak's verdict is that nothing is lost
                    report.errors.append(f"user {index}: {type(error).__name__}: {error}")
                    # as a client would: a failing fleet is not asked again at once
                    await asyncio.sleep(0.5)
                    continue
                report.answers += 1
                report.tokens += len(generation.token_ids)
                if generation.token_ids != expected[prompt]:
                    report.mismatches.append(
                        f"user {index}, {prompt!r}: {generation.token_ids[:8]}..."
                    )

        async def killer() -> None:
            while True:
                await asyncio.sleep(kill_every)
                if time.monotonic() >= deadline:
                    return
                sample_memory()
                pids = controller.worker_pids()
                if not pids:
                    continue
                victim = chooser.choice(sorted(pids))
                os.kill(pids[victim], signal.SIGKILL)
                report.kills.append(victim)
                say(f"{time.monotonic() - started:6.1f} s: killed {victim}")

        sample_memory()
        killing = asyncio.ensure_future(killer())
        await asyncio.gather(*(user(i) for i in range(sessions)))
        killing.cancel()
        sample_memory()
        report.seconds = time.monotonic() - started
        if controller.recovery is not None:
            await controller.recovery.idle.wait()
            report.recoveries = list(controller.recovery.reports)
        return report
    finally:
        await controller.stop()
