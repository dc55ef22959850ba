"""Provides the prefill measurement: a long prompt's time to first token, alone and while another
user generates, with the pipelined prefill against the serial one, in alternated rounds on one
running fleet.

`fleettui bench FLEET --prefill [TOKENS]` runs `prefill_bench()`. Each round measures both arms, in
turn order reversed every other round (adjacent windows: this machine drifts):
- "serial": the prefill as it was, one 128-token chunk at a time (`Coordinator.prefill_serial`);
- "pipelined": one chunk in flight per stage, 32-token chunks while another session generates. Per
  arm: the TTFT of a fresh session's prompt of about TOKENS tokens alone, then the same while
  another session generates (started a second before), with that session's tok/s during the prefill.
  Every answer of the two arms must be the same tokens (greedy; exact only under f32, so it is
  reported, not required)."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fleettui.config.fleet import Fleet

if TYPE_CHECKING:
    from fleettui.runtime.coordinator import Coordinator

ARMS = ("serial", "pipelined")
OTHER_PROMPT = "Write a long story about a lighthouse keeper."
OTHER_TOKENS = 3000  # more than it can make while the prompt is prefilled (EOS ignored)


def long_prompt(tokens: int, round_: int) -> str:
    """About TOKENS tokens of plain text (a list of facts and a question), different every round."""
    facts = ". ".join(
        f"Fact {i}: the {i}th lamp is {('red', 'green', 'blue')[i % 3]}"
        for i in range(tokens // 10)
    )
    return f"Round {round_}. {facts}. Which colour is the 40th lamp?"


@dataclass
class PrefillReport:
    prompt_tokens: int = 0
    stages: int = 0
    # alone, s
    ttft: dict[str, list[float]] = field(default_factory=lambda: {arm: [] for arm in ARMS})
    shared_ttft: dict[str, list[float]] = field(default_factory=lambda: {arm: [] for arm in ARMS})
    # tok/s
    other_rate: dict[str, list[float]] = field(default_factory=lambda: {arm: [] for arm in ARMS})
    same_tokens: bool = True

    @staticmethod
    def _ratio(before: list[float], after: list[float]) -> str:
        ratios = [b / a for b, a in zip(before, after, strict=True) if a > 0]
        if not ratios:
            return "-"
        median = statistics.median(ratios)
        return f"{median:.2f}x ({min(ratios):.2f}-{max(ratios):.2f} per round)"

    def summary(self) -> str:
        def med(values: list[float], scale: float = 1.0) -> str:
            return f"{statistics.median(values) * scale:7.1f}" if values else "      -"

        lines = [
            f"prefill: a {self.prompt_tokens}-token prompt on {self.stages} stage(s), "
            f"{len(self.ttft['serial'])} rounds"
        ]
        lines.append(
            f"  {'arm':<10} {'TTFT alone ms':>14} {'TTFT shared ms':>15} {'other user tok/s':>17}"
        )
        for arm in ARMS:
            lines.append(
                f"  {arm:<10} {med(self.ttft[arm], 1000):>14} "
                f"{med(self.shared_ttft[arm], 1000):>15} "
                f"{med(self.other_rate[arm]):>17}"
            )
        lines.append(
            "  first token alone: pipelined "
            f"{self._ratio(self.ttft['serial'], self.ttft['pipelined'])} sooner"
        )
        lines.append(
            f"  first token beside another user: "
            f"{self._ratio(self.shared_ttft['serial'], self.shared_ttft['pipelined'])} sooner; "
            "that user's tokens "
            f"meanwhile {self._ratio(self.other_rate['pipelined'], self.other_rate['serial'])} "
            "faster"
        )
        lines.append(
            f"  same tokens in both arms: {'yes' if self.same_tokens else 'no (not f32: rounding)'}"
        )
        return "\n".join(lines)


async def prefill_bench(
    fleet: Fleet, tokens: int = 2000, rounds: int = 4, on_line: Callable[[str], None] | None = None
) -> PrefillReport:
    from fleettui.control.controller import FleetController
    from fleettui.runtime.generation import GenerationParams

    say = on_line or (lambda line: None)
    report = PrefillReport()
    controller = FleetController(fleet)
    try:
        coordinator = await controller.start()
        report.stages = coordinator.stages
        answers: dict[
            int, int
        ] = {}  # the first token of each prompt, from whichever arm came first

        async def first_token(prompt: str, arm: str) -> tuple[float, int]:
            session = await coordinator.open_session()
            coordinator.prefill_serial = arm == "serial"
            try:
                started = time.perf_counter()
                answer = await coordinator.chat(session, prompt, GenerationParams(max_tokens=1))
                elapsed = time.perf_counter() - started
            finally:
                coordinator.prefill_serial = False
                await coordinator.close_session(session)
            report.prompt_tokens = answer.stats.prompt_tokens
            token = answer.token_ids[0] if answer.token_ids else -1
            return elapsed, token

        for round_ in range(rounds):
            for arm in ARMS if round_ % 2 == 0 else ARMS[::-1]:
                prompt = long_prompt(tokens, round_)
                alone, token = await first_token(prompt, arm)
                shared, rate, other_token = await _beside_another(
                    coordinator, first_token, prompt + " ", arm
                )
                report.ttft[arm].append(alone)
                report.shared_ttft[arm].append(shared)
                report.other_rate[arm].append(rate)
                for key, value in ((2 * round_, token), (2 * round_ + 1, other_token)):
                    if answers.setdefault(key, value) != value:
                        report.same_tokens = False
                say(
                    f"round {round_ + 1} {arm}: TTFT {alone * 1000:.0f} ms alone, "
                    f"{shared * 1000:.0f} ms beside a "
                    f"user who got {rate:.1f} tok/s meanwhile"
                )
        return report
    finally:
        await controller.stop()


async def _beside_another(
    coordinator: Coordinator,
    first_token: Callable[[str, str], Awaitable[tuple[float, int]]],
    prompt: str,
    arm: str,
) -> tuple[float, float, int]:
    """TTFT of `prompt` while another session generates, and that session's tok/s during the
    prefill."""
    from fleettui.runtime.generation import GenerationParams

    other = await coordinator.open_session()
    arrivals: list[tuple[float, int]] = []
    params = GenerationParams(max_tokens=OTHER_TOKENS, ignore_eos=True)
    talking = asyncio.ensure_future(
        coordinator.chat(
            other,
            OTHER_PROMPT,
            params,
            lambda tokens, _: arrivals.append((time.perf_counter(), len(tokens))),
        )
    )
    try:
        await asyncio.sleep(1.0)
        started = time.perf_counter()
        elapsed, token = await first_token(prompt, arm)
        finished = started + elapsed
    finally:
        talking.cancel()
        # cancelled: the expected end
        (ended,) = await asyncio.gather(talking, return_exceptions=True)
        if isinstance(ended, Exception):  # it failed before: its failure, not a rate of 0
            raise ended
        await coordinator.close_session(other)
    got = sum(count for when, count in arrivals if started <= when <= finished)
    return elapsed, got / elapsed if elapsed > 0 else 0.0, token
