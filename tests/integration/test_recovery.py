"""Integration tests of recovery with the real parts: real shards, real worker processes, exact
settings.

A worker is killed (SIGKILL), frozen (SIGSTOP) or kept from coming back while answers stream; every
answer must complete and equal the uninterrupted run token for token. The fault is triggered from
the token callback after a few tokens, never by a sleep."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from fleettui.control import store
from fleettui.control.controller import FleetController
from fleettui.control.states import Lost, RecoveryReport, StageChanged
from fleettui.runtime.generation import GenerationParams
from fleettui.runtime.transport import LinkError
from tests.support.faults import PROMPTS, TOKENS, Fault, make_fleet, print_reports, run_with_fault

pytestmark = pytest.mark.slow


def kill(names: str, sig: int = signal.SIGKILL) -> Fault:
    """Signal the workers named in `names` ("stage-1+draft": both at once)."""

    def fault(controller: FleetController) -> None:
        for name in names.split("+"):
            os.kill(controller.worker_pids()[name], sig)

    return fault


def fleet_worker(process: psutil.Process, controller: FleetController) -> bool:
    """A process still running a worker of the controller's deployment."""
    deployment = controller.deployment
    command = " ".join(process.info["cmdline"] or ())
    return (
        deployment is not None
        and "remote_worker" in command
        and f"/runs/{deployment.id}/" in command
    )


@pytest.mark.parametrize(
    ("victim", "stages", "draft", "users"),
    [
        ("stage-0", 2, "none", 1),
        ("stage-0", 1, "none", 2),  # one stage: killed in the middle of runs
        ("stage-1", 2, "none", 3),
        ("draft", 2, "self-int4", 3),
        ("stage-1+draft", 2, "self-int4", 3),
    ],
)
def test_kill_9_mid_answer_completes_exactly(
    shard_cache: Path,
    recovery_reference: list[list[int]],
    victim: str,
    stages: int,
    draft: str,
    users: int,
) -> None:
    events: list[object] = []
    fleet = make_fleet(shard_cache, stages, draft, 3 if draft != "none" else "auto")
    tokens, controller, reports = asyncio.run(
        run_with_fault(fleet, PROMPTS[:users], kill(victim), events)
    )
    print_reports(reports)
    assert tokens == recovery_reference[:users]
    victims = victim.split("+")
    assert {r.action for r in reports} == {"relaunch"}
    assert sorted(name for r in reports for name in r.stages) == sorted(victims)
    assert all("signal 9" in reason for r in reports for reason in r.reasons)
    lost = [e for e in events if isinstance(e, StageChanged) and isinstance(e.state, Lost)]
    assert sorted(e.name for e in lost) == sorted(victims)
    # stop() took the relaunched ones too
    assert controller.launched == [] and store.load(fleet) is None
    assert not [p for p in psutil.process_iter(["cmdline"]) if fleet_worker(p, controller)]


def test_sigstop_for_ten_seconds_then_sigcont_completes_exactly(
    shard_cache: Path, recovery_reference: list[list[int]]
) -> None:
    stopped: list[int] = []

    def freeze(controller: FleetController) -> None:
        pid = controller.worker_pids()["stage-1"]
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)
        asyncio.get_running_loop().call_later(10.0, _wake, pid)

    fleet = make_fleet(shard_cache, 2)
    try:
        tokens, _, reports = asyncio.run(run_with_fault(fleet, PROMPTS[:2], freeze))
    finally:
        for pid in stopped:
            _wake(pid)
    print_reports(reports)
    assert tokens == recovery_reference[:2]
    assert len(reports) == 1 and "stopped" in reports[0].reasons[0]
    assert (
        not psutil.pid_exists(stopped[0])
        or psutil.Process(stopped[0]).status() == psutil.STATUS_ZOMBIE
    )


def _wake(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def lose_and_hold_its_port(controller: FleetController, squatters: list[socket.socket]) -> None:
    """SIGKILL stage-1 and listen on its data port, so it cannot be started there again (a PC that
    is gone) until the socket added to `squatters` is closed."""
    worker = next(e for e in controller.launched if e.placement.config.name == "stage-1")
    assert worker.popen is not None
    os.kill(worker.popen.pid, signal.SIGKILL)
    worker.popen.wait()
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", worker.placement.config.data_port))
    squatter.listen()
    squatters.append(squatter)


def test_host_that_does_not_come_back_is_planned_around(
    shard_cache: Path, recovery_reference: list[list[int]]
) -> None:
    """Stage 1 of 3 dies and its ports stay taken: after the grace period the model moves onto
    two hosts."""
    squatters: list[socket.socket] = []

    def lose_for_good(controller: FleetController) -> None:
        lose_and_hold_its_port(controller, squatters)

    fleet = make_fleet(shard_cache, 3, grace_seconds=3.0)
    try:
        tokens, controller, reports = asyncio.run(run_with_fault(fleet, PROMPTS, lose_for_good))
    finally:
        for squatter in squatters:
            squatter.close()
    print_reports(reports)
    assert tokens == recovery_reference
    assert [r.action for r in reports] == ["replan"]
    assert [h.name for h in controller.fleet.hosts] == ["stage-0", "stage-2"]
    assert controller.deployment is not None and len(controller.deployment.stages) == 2
    # three local stages on this machine's CPUs shared nothing out (2 CPUs here); the two left share
    # them anew
    from fleettui.config.local_cores import share_local_cores

    survivors = tuple(host for host in fleet.hosts if host.name != "stage-1")
    wanted = share_local_cores(replace(fleet, hosts=survivors)).hosts
    assert [(h.cores, h.threads) for h in controller.fleet.hosts] == [
        (h.cores, h.threads) for h in wanted
    ]
    assert [tuple(p.config.cpu_cores) for p in controller.deployment.stages] == [
        h.cores for h in wanted
    ]


def test_a_host_planned_around_rejoins_when_it_is_back_and_answers_stay_exact(
    shard_cache: Path, recovery_reference: list[list[int]]
) -> None:
    """Stage 1 of 3 is lost for good (its port held) and the model moves onto two hosts; once the
    port is free again (a PC that woke up) the model moves back onto all three, between rounds, and
    answers stay exact."""
    squatters: list[socket.socket] = []

    fleet = make_fleet(shard_cache, 3, grace_seconds=3.0, rejoin_seconds=1.0)

    async def scenario() -> tuple[list[list[int]], list[int], list[RecoveryReport], list[str], int]:
        controller = FleetController(fleet)
        try:
            coordinator = await controller.start()
            sessions = [await coordinator.open_session() for _ in PROMPTS]
            fired: list[bool] = []

            def on_tokens(tokens: list[int], _text: str) -> None:
                if not fired and len(tokens) > 0:
                    fired.append(True)
                    lose_and_hold_its_port(controller, squatters)

            params = GenerationParams(max_tokens=TOKENS)
            first = await asyncio.gather(
                *(
                    coordinator.chat(session, prompt, params, on_tokens if index == 0 else None)
                    for index, (session, prompt) in enumerate(zip(sessions, PROMPTS, strict=True))
                )
            )
            assert controller.recovery is not None and controller.recovery.away == ["stage-1"]
            squatters.pop().close()  # the PC is back
            for _ in range(600):  # the rejoin: a compile of the 3-stage split (cached) and a switch
                if not controller.recovery.away:
                    break
                await asyncio.sleep(0.1)
            again = await controller.ask(PROMPTS[0], params)
            names = (
                [p.config.name for p in controller.deployment.stages]
                if controller.deployment
                else []
            )
            record = store.load(fleet)
            return (
                [list(g.token_ids) for g in first],
                list(again.token_ids),
                list(controller.recovery.reports),
                names,
                len(record.pids()) if record else 0,
            )
        finally:
            await controller.stop()

    try:
        first, again, reports, names, recorded = asyncio.run(scenario())
    finally:
        for squatter in squatters:
            squatter.close()
    print_reports(reports)
    assert first == recovery_reference and again == recovery_reference[0]
    assert [r.action for r in reports] == ["replan", "rejoin"] and reports[1].stages == ("stage-1",)
    assert names == ["stage-0", "stage-1", "stage-2"] and recorded == 3  # (no draft in this fleet)
    assert store.load(fleet) is None


def stage_0_cannot_come_back(controller: FleetController) -> Callable[[list[int], str], None]:
    """A token callback that SIGKILLs stage-0 once and points the recovery at an interpreter that
    does not exist, so the stage cannot be started again until `recovery.python` is set back (a host
    that is away)."""
    blocked = next(e.popen for e in controller.launched if e.placement.config.name == "stage-0")
    assert blocked is not None and controller.recovery is not None
    recovery = controller.recovery

    def on_tokens(tokens: list[int], _text: str) -> None:
        if blocked.poll() is None:
            os.kill(blocked.pid, signal.SIGKILL)
            recovery.python = "/nonexistent/python"

    return on_tokens


def test_recovery_impossible_gives_every_session_a_clear_error(shard_cache: Path) -> None:
    """One host cannot hold the model alone: losing the other ends each session with `degraded:
    needs`."""
    from fleettui.planning.planner import plan_fleet

    fleet = make_fleet(shard_cache, 2, grace_seconds=1.0, rejoin_seconds=1.0, hold_seconds=1.0)
    need = sum(stage.total_bytes for stage in plan_fleet(fleet).stages) / 2**30
    hosts = tuple(replace(host, memory_gb=round(need * 0.6, 2)) for host in fleet.hosts)
    fleet = replace(fleet, hosts=hosts)
    plan_fleet(fleet)  # the pair still holds it

    async def scenario() -> list[BaseException | object]:
        controller = FleetController(fleet)
        try:
            coordinator = await controller.start()
            sessions = [await coordinator.open_session() for _ in PROMPTS[:2]]
            on_tokens = stage_0_cannot_come_back(controller)
            params = GenerationParams(max_tokens=TOKENS)
            calls = [
                coordinator.chat(sessions[0], PROMPTS[0], params, on_tokens),
                coordinator.chat(sessions[1], PROMPTS[1], params),
            ]
            return list(await asyncio.gather(*calls, return_exceptions=True))
        finally:
            await controller.stop()

    outcomes = asyncio.run(scenario())
    for (
        outcome
    ) in outcomes:  # each answer waited `hold_seconds` for the host, then ended in one line
        assert isinstance(outcome, LinkError), outcome
        assert "degraded: needs" in str(outcome) and "GB more" in str(outcome)
        assert str(outcome).endswith("(waited 1 s for it to be whole again)")


def test_a_degraded_fleet_is_whole_again_when_its_host_is_back(
    shard_cache: Path, recovery_reference: list[list[int]]
) -> None:
    """Neither host holds the model alone: losing stage-0 for good ends the sessions `degraded` (no
    hold); once its host can run it again (here: the interpreter is back) the stage is relaunched
    and new answers are exact."""
    import sys

    from fleettui.planning.planner import plan_fleet

    fleet = make_fleet(shard_cache, 2, grace_seconds=1.0, rejoin_seconds=1.0, hold_seconds=0.0)
    need = sum(stage.total_bytes for stage in plan_fleet(fleet).stages) / 2**30
    fleet = replace(
        fleet, hosts=tuple(replace(host, memory_gb=round(need * 0.6, 2)) for host in fleet.hosts)
    )

    async def scenario() -> tuple[list[BaseException | object], list[int], list[RecoveryReport]]:
        controller = FleetController(fleet)
        try:
            coordinator = await controller.start()
            session = await coordinator.open_session()
            on_tokens = stage_0_cannot_come_back(controller)
            assert controller.recovery is not None
            recovery = controller.recovery
            params = GenerationParams(max_tokens=TOKENS)
            first = await asyncio.gather(
                coordinator.chat(session, PROMPTS[0], params, on_tokens), return_exceptions=True
            )
            assert recovery.down == ["stage-0"]
            recovery.python = sys.executable  # the host is back
            for _ in range(600):
                if not recovery.down:
                    break
                await asyncio.sleep(0.1)
            again = await controller.ask(PROMPTS[0], params)
            return list(first), list(again.token_ids), list(recovery.reports)
        finally:
            await controller.stop()

    first, again, reports = asyncio.run(scenario())
    print_reports(reports)
    assert isinstance(first[0], LinkError) and "degraded: needs" in str(first[0])
    assert [r.action for r in reports] == ["degraded", "rejoin"] and reports[1].stages == (
        "stage-0",
    )
    assert again == recovery_reference[0]
    assert store.load(fleet) is None


@pytest.mark.parametrize("ending", ["host back", "fleet stopped"])
def test_answers_held_by_a_degraded_fleet_resume_exactly_when_it_is_whole_again(
    shard_cache: Path, recovery_reference: list[list[int]], ending: str
) -> None:
    """Neither host holds the model alone and stage-0 is lost for good mid-answer: the two answers
    in flight are held (`hold_seconds`), not ended; once its host is back the stage is relaunched,
    both sessions replayed, and each answer goes on from where it stopped, equal to the
    uninterrupted one. Stopping the fleet instead ends both at once with the degraded line (no wait
    for the rest of the hold)."""
    import sys

    from fleettui.planning.planner import plan_fleet

    fleet = make_fleet(shard_cache, 2, grace_seconds=1.0, rejoin_seconds=1.0, hold_seconds=120.0)
    need = sum(stage.total_bytes for stage in plan_fleet(fleet).stages) / 2**30
    fleet = replace(
        fleet, hosts=tuple(replace(host, memory_gb=round(need * 0.6, 2)) for host in fleet.hosts)
    )
    lines: list[str] = []

    async def scenario() -> tuple[list[list[int]], list[RecoveryReport], float]:
        controller = FleetController(fleet, on_event=lambda event: lines.append(str(event)))
        try:
            coordinator = await controller.start()
            sessions = [await coordinator.open_session() for _ in PROMPTS[:2]]
            on_tokens = stage_0_cannot_come_back(controller)
            assert controller.recovery is not None
            recovery = controller.recovery
            params = GenerationParams(max_tokens=TOKENS)
            calls = asyncio.gather(
                coordinator.chat(sessions[0], PROMPTS[0], params, on_tokens),
                coordinator.chat(sessions[1], PROMPTS[1], params),
            )
            for _ in range(600):  # the fleet is degraded, the answers wait
                if recovery.down:
                    break
                await asyncio.sleep(0.05)
            assert recovery.down == ["stage-0"] and not calls.done()
            await asyncio.sleep(2.0)  # two rejoin tries find the host still away
            assert not calls.done() and recovery.down == ["stage-0"]
            back = time.monotonic()
            if ending == "fleet stopped":
                await controller.stop()
                outcomes = await asyncio.wait_for(asyncio.gather(calls, return_exceptions=True), 30)
                assert isinstance(outcomes[0], LinkError) and "degraded: needs" in str(
                    outcomes[0]
                ), outcomes
                return [], list(recovery.reports), time.monotonic() - back
            recovery.python = sys.executable  # the host is back
            generations = await calls
            return (
                [list(g.token_ids) for g in generations],
                list(recovery.reports),
                time.monotonic() - back,
            )
        finally:
            await controller.stop()

    tokens, reports, waited = asyncio.run(scenario())
    print_reports(reports)
    assert any("answers wait up to 120 s for stage-0 to be back" in line for line in lines)
    if ending == "fleet stopped":
        assert [r.action for r in reports] == ["degraded"] and waited < 30
        assert store.load(fleet) is None
        return
    assert tokens == recovery_reference[:2]
    assert [r.action for r in reports] == ["degraded", "rejoin"] and reports[1].stages == (
        "stage-0",
    )
    # both held sessions were replayed
    assert reports[1].sessions == 2 and reports[1].replayed_tokens > 0
    print(f"answers resumed {waited:.1f} s after the host was back")
    assert store.load(fleet) is None


def quick_rebalancer(controller: FleetController) -> None:
    """Windows of 12 steps and a patience of 2: a proposal within one or two answers instead of
    minutes."""
    from fleettui.control.balance import Balancer

    assert controller.recovery is not None and controller.recovery.rebalancer is not None
    rebalancer = controller.recovery.rebalancer
    rebalancer.balancer = Balancer(
        rebalancer.balancer.ranges, rebalancer.head, 1.5, window=12, patience=2
    )


def test_auto_rebalance_moves_layers_off_a_slowed_stage_and_every_answer_stays_exact(
    shard_cache: Path, recovery_reference: list[list[int]]
) -> None:
    """`rebalance = "auto"` end to end: slowed stage 1 -> proposal -> background compile ->
    switch -> exact."""
    import time

    from fleettui.bench.throttle import Throttle
    from fleettui.control.states import RebalanceProposal, Throttled

    events: list[object] = []

    def applied() -> bool:
        return any(isinstance(e, RebalanceProposal) and e.applied for e in events)

    async def scenario() -> tuple[list[tuple[int, int]], list[tuple[int, int]], int]:
        # Two emulated PCs, one core and one thread each: stopping stage 1 then slows stage 1 alone.
        # Unpinned on 2 cores the throttle mostly hands stage 1's CPU to stage 0's threads, whose
        # steps then measure about as long as the throttled stage's, and the split moved either way.
        fleet = make_fleet(shard_cache, 2, rebalance="auto")
        cores = sorted(os.sched_getaffinity(0))
        pcs = tuple(
            replace(h, cores=(cores[i % len(cores)],), threads=1) for i, h in enumerate(fleet.hosts)
        )
        controller = FleetController(replace(fleet, hosts=pcs), on_event=events.append)
        try:
            coordinator = await controller.start()
            quick_rebalancer(controller)
            assert controller.deployment is not None
            before = controller.deployment.ranges()

            async def answer_all() -> list[list[int]]:
                sessions = [await coordinator.open_session() for _ in PROMPTS]
                params = GenerationParams(max_tokens=TOKENS)
                try:
                    answers = await asyncio.gather(
                        *(
                            coordinator.chat(s, p, params)
                            for s, p in zip(sessions, PROMPTS, strict=True)
                        )
                    )
                finally:
                    for session in sessions:
                        await coordinator.close_session(session)
                return [list(a.token_ids) for a in answers]

            assert controller.recovery is not None and controller.recovery.rebalancer is not None
            rebalancer = controller.recovery.rebalancer
            rebalancer.mode = "off"  # a first round at full speed: each stage's baseline step time
            assert await answer_all() == recovery_reference
            rebalancer.mode = "auto"
            rounds = 1
            # 15 % of its core: stage 1 reads as several times its baseline even while another
            # test's processes load both cores (they slow stage 0 as well, by far less)
            with Throttle(lambda: controller.worker_pids().get("stage-1"), 0.15):
                deadline = time.monotonic() + 600
                while (
                    not applied()
                ):  # answers keep flowing while the new split compiles and is switched to
                    assert time.monotonic() < deadline, "no split was applied within 10 minutes"
                    assert await answer_all() == recovery_reference
                    rounds += 1
                assert await answer_all() == recovery_reference  # on the new split
            assert controller.deployment is not None
            after = controller.deployment.ranges()
            return before, after, rounds
        finally:
            await controller.stop()

    before, after, rounds = asyncio.run(scenario())
    throttled = [e for e in events if isinstance(e, Throttled) and e.reason]
    print(
        f"split {before} -> {after} after {rounds} rounds; flags "
        f"{[(e.name, round(e.ratio, 2)) for e in throttled]}"
    )
    # (load can slow stage 0 too)
    assert any(e.name == "stage-1" and e.ratio >= 1.5 for e in throttled)
    proposals = [e for e in events if isinstance(e, RebalanceProposal)]
    assert [p.applied for p in proposals] == [False, True] and proposals[0].ranges == proposals[
        1
    ].ranges
    # layers moved off stage 1
    assert after == list(proposals[1].ranges) and after[0][1] > before[0][1]
    reports = [e for e in events if isinstance(e, RecoveryReport)]
    assert [r.action for r in reports] == ["rebalance"]
    assert not [e for e in events if isinstance(e, StageChanged) and isinstance(e.state, Lost)]


def test_switching_the_split_between_rounds_keeps_answers_exact(
    shard_cache: Path, recovery_reference: list[list[int]]
) -> None:
    """What `rebalance = "auto"` does with a proposal: compile it while serving, switch between
    rounds, replay."""
    from fleettui.control.controller import compile_model

    switching: list[asyncio.Task[None]] = []
    fleet = make_fleet(shard_cache, 2)
    split = [(0, 22), (22, 30)]

    async def scenario() -> tuple[list[list[int]], list[RecoveryReport], list[tuple[int, int]]]:
        model = fleet.model
        # the background part
        compiled = await compile_model(model.name, split, model.precision, model.shards)

        def switch(controller: FleetController) -> None:
            assert controller.recovery is not None
            current = controller.deployment.ranges()  # type: ignore[union-attr]
            assert current[0] != split[0]
            switching.append(
                asyncio.ensure_future(controller.recovery.switch_split(split, compiled))
            )

        tokens, controller, reports = await run_with_fault(fleet, PROMPTS, switch)
        await switching[0]
        return tokens, reports, controller.deployment.ranges()  # type: ignore[union-attr]

    tokens, reports, running = asyncio.run(scenario())
    print_reports(reports)
    assert tokens == recovery_reference
    assert running == split
    assert [r.action for r in reports] == ["rebalance"]


def test_an_attached_fleet_relaunches_a_lost_worker_from_the_record(
    shard_cache: Path, recovery_reference: list[list[int]]
) -> None:
    """A deployment launched by another controller: its lost worker comes back from the recorded
    config, the record names the new process, and a later stop ends it."""
    fleet = make_fleet(shard_cache, 2)
    killed: list[int] = []

    async def scenario() -> tuple[list[int], list[RecoveryReport], dict[str, int]]:
        await FleetController(fleet).deploy()  # launched, recorded and handed over
        attached = FleetController(fleet)
        try:
            await attached.start()
            assert attached.attached and attached.launched == []

            def on_tokens(tokens: list[int], _text: str) -> None:
                if not killed and len(tokens) > 0:
                    killed.append(attached.worker_pids()["stage-1"])
                    os.kill(killed[0], signal.SIGKILL)

            generation = await attached.ask(
                PROMPTS[0], GenerationParams(max_tokens=TOKENS), on_tokens
            )
            reports = list(attached.recovery.reports) if attached.recovery else []
            await attached.detach()
        except BaseException:
            await attached.stop()
            raise
        recorded = store.load(fleet)
        assert recorded is not None
        last = FleetController(fleet)
        await last.start()  # attaches to the relaunched worker
        assert last.attached
        await last.stop()
        return list(generation.token_ids), reports, recorded.pids()

    tokens, reports, pids = asyncio.run(scenario())
    print_reports(reports)
    assert tokens == recovery_reference[0]
    assert [r.action for r in reports] == ["relaunch"] and reports[0].stages == ("stage-1",)
    assert pids["stage-1"] != killed[0]
    assert not any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids.values()
    )
    assert store.load(fleet) is None


@pytest.mark.parametrize("how", ["launch", "attach"])
def test_a_stage_killed_while_the_command_connects_is_relaunched_and_the_answer_is_exact(
    shard_cache: Path,
    recovery_reference: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    """stage-1 dies after it answered its ready check (or the attach's ping) but before the Hello
    crossed the chain: the handshake waits for the recovery's relaunch and sends Hello again,
    instead of failing."""
    from fleettui.control import controller as controller_module

    fleet = make_fleet(shard_cache, 2)
    real_connect = controller_module.connect
    killed: list[int] = []

    async def connect_after_a_kill(*args: object, **kwargs: object) -> object:
        if not killed:
            killed.append(active.worker_pids()["stage-1"])
            os.kill(killed[0], signal.SIGKILL)
        return await real_connect(*args, **kwargs)  # type: ignore[arg-type]

    async def scenario() -> tuple[list[int], list[RecoveryReport], bool]:
        nonlocal active
        if how == "attach":
            await FleetController(fleet).deploy()  # launched, recorded and handed over
        monkeypatch.setattr(controller_module, "connect", connect_after_a_kill)
        active = FleetController(fleet)
        try:
            await active.start()
            generation = await active.ask(PROMPTS[0], GenerationParams(max_tokens=TOKENS))
            reports = list(active.recovery.reports) if active.recovery else []
            return list(generation.token_ids), reports, active.attached
        finally:
            await active.stop()

    active = FleetController(fleet)
    tokens, reports, attached = asyncio.run(scenario())
    print_reports(reports)
    assert killed and attached == (how == "attach")
    assert tokens == recovery_reference[0]
    assert [r.action for r in reports] == ["relaunch"] and reports[0].stages == ("stage-1",)
    assert (
        not psutil.pid_exists(killed[0])
        or psutil.Process(killed[0]).status() == psutil.STATUS_ZOMBIE
    )
    assert store.load(fleet) is None


def test_a_stage_killed_while_it_loads_is_started_again_and_the_answer_is_exact(
    shard_cache: Path, recovery_reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """stage-1 is SIGKILLed right after it was spawned, before it is ready (the OOM killer, a stray
    kill): the launch starts it once more instead of failing the deploy, and the record names the
    new process."""
    from fleettui.control import launcher as launcher_module

    fleet = make_fleet(shard_cache, 2)
    real_spawn = launcher_module.spawn
    killed: list[int] = []

    def spawn_then_kill(placement: object, *args: object) -> launcher_module.Launched:
        launched = real_spawn(placement, *args)  # type: ignore[arg-type]
        if launched.placement.config.name == "stage-1" and not killed:
            assert launched.popen is not None
            os.kill(launched.popen.pid, signal.SIGKILL)
            killed.append(launched.popen.pid)
        return launched

    monkeypatch.setattr(launcher_module, "spawn", spawn_then_kill)

    async def scenario() -> tuple[list[int], int, list[RecoveryReport]]:
        controller = FleetController(fleet)
        try:
            await controller.start()
            record = store.load(fleet)
            assert record is not None
            generation = await controller.ask(PROMPTS[0], GenerationParams(max_tokens=TOKENS))
            reports = list(controller.recovery.reports) if controller.recovery else []
            return list(generation.token_ids), record.pids()["stage-1"], reports
        finally:
            await controller.stop()

    tokens, recorded, reports = asyncio.run(scenario())
    assert killed and recorded != killed[0]
    assert tokens == recovery_reference[0] and reports == []
    assert store.load(fleet) is None


def test_a_stage_that_exits_with_an_error_while_it_loads_fails_the_launch_at_once(
    shard_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exit code (a bad shard or config: the worker says why and exits) is not retried: the
    launch fails in one line naming the stage, the code and the end of its log (each line once), and
    no worker is left."""
    from fleettui.control import launcher as launcher_module

    failing = tmp_path / "python-that-fails"
    failing.write_text(
        "#!/bin/sh\necho 'remote_worker: stage_1/openvino_model.bin: missing'\nexit 3\n"
    )
    failing.chmod(0o755)
    real_spawn = launcher_module.spawn
    spawned: list[str] = []

    def spawn(placement: object, *args: object) -> launcher_module.Launched:
        name = placement.config.name  # type: ignore[attr-defined]
        spawned.append(name)
        return (
            real_spawn(placement, str(failing))
            if name == "stage-1"
            else real_spawn(placement, *args)
        )  # type: ignore[arg-type]

    monkeypatch.setattr(launcher_module, "spawn", spawn)
    fleet = make_fleet(shard_cache, 2)

    async def scenario() -> str:
        controller = FleetController(fleet)
        try:
            with pytest.raises(Exception) as caught:
                await controller.start()
            return str(caught.value)
        finally:
            await controller.stop()

    message = asyncio.run(scenario())
    assert (
        message == "stage-1: exited with code 3: remote_worker: stage_1/openvino_model.bin: missing"
    )
    assert spawned.count("stage-1") == 1  # not started again
    assert store.load(fleet) is None
