"""Provides the rebalance measurement: tok/s before and after one stage is slowed, then after auto
rebalance.

`fleettui bench FLEET --rebalance` runs `rebalance_bench()` on a local fleet of two or more stages,
in three adjacent phases of the same load (`users` sessions of `tokens` tokens, EOS ignored):
1. before: as deployed;
2. slowed: the last stage's worker held to `share` of its CPU time (`Throttle`: a hot PC), rebalance
   off;
3. rebalanced: `rebalance = "auto"` on; the load runs until the fleet has compiled and switched to a
   split away from the slow stage, then the same load is measured again (the slowdown follows the
   host). The report gives each phase's tok/s, the ratios, both splits and how long the switch took.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from fleettui.bench.throttle import Throttle
from fleettui.config.fleet import Fleet
from fleettui.control.states import ControllerEvent, RebalanceProposal, RecoveryReport

PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about the sea at night.",
    "Give me three tips for learning to play the guitar.",
    "Describe how a bicycle works to a child.",
)
SWITCH_TIMEOUT = 600.0


@dataclass
class RebalanceReport:
    share: float
    users: int
    tokens: int
    rates: dict[str, float] = field(default_factory=dict)  # phase -> tok/s
    split_before: list[tuple[int, int]] = field(default_factory=list)
    split_after: list[tuple[int, int]] = field(default_factory=list)
    switch: RecoveryReport | None = None
    proposed_after: float = 0.0  # seconds of slowed load until the proposal
    applied_after: float = 0.0  # ... until the new split served

    def ratio(self, phase: str, baseline: str) -> float:
        return self.rates[phase] / self.rates[baseline] if self.rates.get(baseline) else 0.0

    def summary(self) -> str:
        lines = [
            f"rebalance: {self.users} users x {self.tokens} tokens, last stage held to "
            f"{self.share:.0%} of its CPU"
        ]
        for phase, rate in self.rates.items():
            lines.append(
                f"  {phase:<10} {rate:7.1f} tok/s  ({self.ratio(phase, 'before'):.2f}x before)"
            )
        if "rebalanced" in self.rates:
            lines.append(f"  rebalanced / slowed: {self.ratio('rebalanced', 'slowed'):.2f}x")
        lines.append(f"  split {self.split_before} -> {self.split_after or 'unchanged'}")
        if self.switch is not None:
            lines.append(
                f"  proposed after {self.proposed_after:.1f} s of slowed load, serving the new "
                "split after "
                f"{self.applied_after:.1f} s (switch {self.switch.relaunch:.2f} s, replay "
                f"{self.switch.replay:.2f} s)"
            )
        return "\n".join(lines)


async def rebalance_bench(
    fleet: Fleet,
    users: int = 2,
    tokens: int = 64,
    share: float = 0.4,
    on_line: Callable[[str], None] | None = None,
) -> RebalanceReport:
    """Measure before / slowed / rebalanced on `fleet` (local hosts; at least two stages)."""
    from fleettui.control.controller import FleetController
    from fleettui.runtime.generation import GenerationParams

    if len(fleet.hosts) < 2 or not all(host.is_local for host in fleet.hosts):
        raise ValueError("the rebalance bench needs a local fleet of at least two hosts")
    say = on_line or (lambda line: None)
    fleet = replace(fleet, resilience=replace(fleet.resilience, rebalance="off"), path=None)
    events: list[ControllerEvent] = []
    controller = FleetController(fleet, on_event=events.append, lease=0)
    report = RebalanceReport(share, users, tokens)
    params = GenerationParams(max_tokens=tokens, ignore_eos=True)
    try:
        coordinator = await controller.start(attach=False, record=False)
        assert controller.recovery is not None and controller.recovery.rebalancer is not None
        rebalancer = controller.recovery.rebalancer
        assert controller.deployment is not None
        last = controller.deployment.stages[-1].config.name

        async def load() -> float:
            sessions = [await coordinator.open_session() for _ in range(users)]
            started = time.perf_counter()
            try:
                answers = await asyncio.gather(
                    *(
                        coordinator.chat(s, PROMPTS[i % len(PROMPTS)], params)
                        for i, s in enumerate(sessions)
                    )
                )
            finally:
                for session in sessions:
                    await coordinator.close_session(session)
            return sum(len(a.token_ids) for a in answers) / (time.perf_counter() - started)

        await load()  # warm-up
        report.split_before = controller.deployment.ranges()
        report.rates["before"] = await load()
        say(f"before: {report.rates['before']:.1f} tok/s on {report.split_before}")
        with Throttle(lambda: controller.worker_pids().get(last), share):
            report.rates["slowed"] = await load()
            say(f"slowed: {report.rates['slowed']:.1f} tok/s ({last} at {share:.0%})")
            rebalancer.mode = "auto"
            rebalancer.reset(report.split_before)
            started = time.monotonic()
            while not any(isinstance(e, RebalanceProposal) and e.applied for e in events):
                if time.monotonic() - started > SWITCH_TIMEOUT:
                    say("no split was applied in time")
                    return report
                if not any(isinstance(e, RebalanceProposal) for e in events):
                    await load()
                    report.proposed_after = time.monotonic() - started
                else:
                    await asyncio.sleep(0.2)  # compiling in the background, then switching
            report.applied_after = time.monotonic() - started
            report.switch = next(
                (e for e in reversed(events) if isinstance(e, RecoveryReport)), None
            )
            report.split_after = controller.deployment.ranges()
            rebalancer.mode = "off"
            await load()  # warm-up of the new split
            report.rates["rebalanced"] = await load()
            say(f"rebalanced: {report.rates['rebalanced']:.1f} tok/s on {report.split_after}")
        return report
    finally:
        await controller.stop()
