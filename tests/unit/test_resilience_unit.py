"""Unit tests of the resilience logic: loss verdicts, pause/rebuild/retry in the coordinator,
throttling, split proposals from measured costs, and the [resilience] fleet table."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from fleettui.config.fleet import ResilienceSettings, load_fleet
from fleettui.control.balance import (
    Balancer,
    best_split,
    propose_split,
    relative_slowdown,
    stage_costs,
    throttle_reason,
)
from fleettui.errors import FleetConfigError
from fleettui.runtime.coordinator import Coordinator
from fleettui.runtime.generation import GenerationParams
from fleettui.runtime.speculation import Draft
from fleettui.runtime.transport import LinkError, StageLost
from fleettui.runtime.watch import ProcessStatus, WatchSettings, verdict
from remote_worker import protocol
from tests.unit.test_coordinator_unit import PROMPTS, VOCAB, FakePipeline, _model

SETTINGS = WatchSettings(heartbeat_seconds=0.5, detect_seconds=2.0)


# -- verdict
# ------------------------------------------------------------------------------------------
def test_an_exited_process_is_lost_at_once() -> None:
    assert (
        verdict(0.1, ProcessStatus("exited", "signal 9"), None, SETTINGS)
        == "process exited (signal 9)"
    )


def test_a_stopped_process_is_lost_after_the_detection_time() -> None:
    assert verdict(1.9, ProcessStatus("stopped", "SIGSTOP"), None, SETTINGS) is None
    assert "stopped (SIGSTOP)" in str(
        verdict(2.1, ProcessStatus("stopped", "SIGSTOP"), None, SETTINGS)
    )


def test_a_running_but_silent_process_is_stuck_after_the_detection_time() -> None:
    """Workers answer pings on their I/O thread even mid-step: a silent running worker is not
    just busy."""
    running = ProcessStatus("running")
    assert verdict(1.9, running, {"busy_since": 123.0}, SETTINGS) is None
    assert "stuck: not answering for 2.1 s" in str(
        verdict(2.1, running, {"busy_since": 123.0}, SETTINGS)
    )


def test_a_remote_stage_is_unreachable_after_the_detection_time_busy_or_not() -> None:
    remote = ProcessStatus("unknown")
    assert verdict(1.0, remote, None, SETTINGS) is None
    assert "unreachable" in str(verdict(2.5, remote, {"state": "ready"}, SETTINGS))
    assert "unreachable" in str(verdict(2.5, remote, {"busy_since": 123.0}, SETTINGS))


def test_a_recorded_worker_is_seen_by_pid_and_start_time() -> None:
    """An attached fleet's workers were started elsewhere: status from the pid, a reused pid
    counts as exited."""
    import os

    import psutil

    from fleettui.runtime.watch import recorded_process_status

    started = psutil.Process().create_time()
    assert recorded_process_status(os.getpid(), started).kind == "running"
    assert recorded_process_status(os.getpid(), started - 100.0) == ProcessStatus(
        "exited", "pid reused"
    )


# -- coordinator: pause, rebuild, retry
# ---------------------------------------------------------------
class LosingPipeline(FakePipeline):
    """Forgets every session's cache at step `lose_at` (a relaunched stage) and fails that step
    as lost."""

    def __init__(self, lose_at: int) -> None:
        super().__init__()
        self.lose_at = lose_at
        self.coordinator: Coordinator | None = None
        self.losses = 0

    async def request(
        self, message: protocol.Message, timeout: float | None = None
    ) -> protocol.Message:
        if (
            isinstance(message, protocol.Step)
            and self.steps + 1 >= self.lose_at
            and not self.losses
        ):
            self.losses += 1
            assert self.coordinator is not None
            self.coordinator.resume.clear()
            self.coordinator.target_epoch += 1
            self.slots.clear()
            asyncio.get_running_loop().call_later(0.05, self.coordinator.resume.set)
            raise StageLost("stage-0 lost: test")
        losses = self.losses
        message = protocol.decode(protocol.encode(message))
        await asyncio.sleep(0)
        if (
            self.losses != losses
        ):  # in flight when the stage was lost: failed fast, like ZmqLink.block()
            raise StageLost("stage-0 lost: test")
        return self._serve(message)


class CloseLostPipeline(FakePipeline):
    """The first CLOSE finds a stage lost (its relaunch is a new epoch); the survivors keep the
    session."""

    def __init__(self) -> None:
        super().__init__()
        self.coordinator: Coordinator | None = None
        self.controls: list[tuple[str, int]] = []
        self.lose_close = True

    async def request(
        self, message: protocol.Message, timeout: float | None = None
    ) -> protocol.Message:
        if isinstance(message, protocol.Control):
            self.controls.append((message.kind.name, message.session))
            if message.kind == protocol.Kind.CLOSE and self.lose_close:
                self.lose_close = False
                assert self.coordinator is not None
                self.coordinator.target_epoch += 1
                raise StageLost("stage-0 lost: test")
        return await super().request(message, timeout)


def test_a_close_lost_with_a_stage_reaches_the_surviving_stages_before_the_rebuild() -> None:
    """Otherwise the survivors keep the closed session and count it against max_sessions for
    ever."""

    async def scenario() -> tuple[list[tuple[str, int]], int, int, set[int]]:
        pipeline = CloseLostPipeline()
        coordinator = Coordinator(pipeline, None, None)  # type: ignore[arg-type]
        pipeline.coordinator = coordinator
        gone, kept = await coordinator.open_session(), await coordinator.open_session()
        await coordinator.close_session(gone)
        assert coordinator.unclosed == {gone.id} and gone.id in pipeline.slots
        await coordinator.generate(kept, PROMPTS[0][:20], GenerationParams(max_tokens=2))
        return pipeline.controls, gone.id, kept.id, coordinator.unclosed

    controls, gone, kept, unclosed = asyncio.run(scenario())
    assert controls[-2:] == [("CLOSE", gone), ("OPEN", kept)] and unclosed == set()


class PositionalDrafter:
    """Greedy drafts corrupted at fixed positions: a retried round is proposed exactly the same
    draft."""

    name = "positional"
    costs_time = True

    async def open(self, session: int) -> None:
        return None

    async def close(self, session: int) -> None:
        return None

    async def propose(self, session, history, k, sampling, rng) -> Draft:  # type: ignore[no-untyped-def]
        tokens, sequence = [], list(history)
        for _ in range(k):
            best = int(np.argmax(_model(list(enumerate(sequence)))))
            if len(sequence) % 3 == 0:
                best = (best + 1) % VOCAB
            tokens.append(best)
            sequence.append(best)
        return Draft.deterministic(tokens)


async def _answers(
    pipeline: FakePipeline, params: GenerationParams, drafter: object = None, stages: int = 1
) -> list[list[int]]:
    coordinator = Coordinator(pipeline, None, drafter)  # type: ignore[arg-type]
    # prefill chunks in flight at once (the fake chain answers Hello with 1)
    coordinator.stages = stages
    if isinstance(pipeline, LosingPipeline):
        pipeline.coordinator = coordinator
    sessions = [await coordinator.open_session(seed=5) for _ in PROMPTS]
    generations = await asyncio.gather(
        *(coordinator.generate(s, p, params) for s, p in zip(sessions, PROMPTS, strict=True))
    )
    return [list(g.token_ids) for g in generations]


@pytest.mark.parametrize("lose_at", [1, 3, 9, 20])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
# 3: the 300-token prompt's two prefill chunks go in flight together
@pytest.mark.parametrize("stages", [1, 3])
def test_a_lost_round_is_replayed_and_the_output_does_not_change(
    lose_at: int, temperature: float, stages: int
) -> None:
    params = GenerationParams(max_tokens=24, temperature=temperature, spec_k=3)
    expected = asyncio.run(_answers(FakePipeline(), params, PositionalDrafter()))
    pipeline = LosingPipeline(lose_at)
    assert asyncio.run(_answers(pipeline, params, PositionalDrafter(), stages)) == expected
    assert pipeline.losses == 1


def test_recovery_impossible_ends_the_session_with_the_reason() -> None:
    async def scenario() -> None:
        pipeline = FakePipeline()
        coordinator = Coordinator(pipeline, None)  # type: ignore[arg-type]
        session = await coordinator.open_session()
        coordinator.fatal = "degraded: needs 1.2 GB more"
        with pytest.raises(LinkError, match="degraded: needs 1.2 GB more"):
            await coordinator.generate(session, [1, 2, 3], GenerationParams(max_tokens=4))

    asyncio.run(scenario())


# -- throttling and rebalancing
# ------------------------------------------------------------------------
def test_throttle_reasons() -> None:
    assert throttle_reason(0.010, 0.011, 1.5) is None
    ratio, why = throttle_reason(0.010, 0.020, 1.5)  # type: ignore[misc]
    assert ratio == pytest.approx(2.0) and "2.0x" in why
    assert "95 °C" in throttle_reason(0.010, 0.010, 1.5, temp_c=95.0)[1]  # type: ignore[index]
    assert "clock at 50%" in throttle_reason(None, None, 1.5, freq_ratio=0.5)[1]  # type: ignore[index]


def test_a_split_cut_inside_a_layer_is_costed_with_the_mlp_it_moved() -> None:
    """[0, 12.5) / [12.5, 16): the KV ranges say 13 / 3 layers, the compute is 12.17 / 3.83 (+
    the head)."""
    share, layer, head = 0.83, 3.9, 9.3
    seconds = [(13 - share) * layer, (3 + share + head) * layer]
    moved = [-share, share]
    assert stage_costs([(0, 13), (13, 16)], seconds, head, moved) == [pytest.approx(layer)] * 2
    # the whole split 13 / 3 (the same KV ranges) is another split: 0.9 % faster here, not worth a
    # switch
    split, gain = propose_split([(0, 13), (13, 16)], seconds, head, min_gain=0.0, moved=moved)  # type: ignore[misc]
    assert split == [(0, 13), (13, 16)] and gain == pytest.approx(1 - 13 / (3 + share + head))
    # under the 10 % bar
    assert propose_split([(0, 13), (13, 16)], seconds, head, moved=moved) is None


def test_stage_costs_count_the_head_on_the_last_stage() -> None:
    assert stage_costs([(0, 10), (10, 20)], [1.0, 1.7], head_layers=7.0) == [
        0.1,
        pytest.approx(0.1),
    ]


def test_the_rebalancer_counts_the_head_as_the_last_hosts_profile_measured_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The live rebalancer weighs the lm_head by the last host's measured costs once it has a
    profile (the deploy's calibration), by weight size before."""
    import json
    from dataclasses import asdict

    from fleettui.config.fleet import DEFAULT_FLEET
    from fleettui.control.rebalance import head_layers
    from fleettui.planning.costs import MeasuredCosts
    from fleettui.planning.profiles import profile_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fleet = load_fleet(DEFAULT_FLEET)
    by_bytes = head_layers(fleet)
    assert 7.5 < by_bytes < 8.5  # SmolLM2: 49152 x 576 against a layer's weights
    path = profile_path(fleet, fleet.hosts[-1])
    path.parent.mkdir(parents=True)
    costs = MeasuredCosts(layer_ms=0.25, head_ms=2.75, call_ms=0.2)
    path.write_text(json.dumps({"costs": asdict(costs)}))
    assert head_layers(fleet) == pytest.approx(11.0)


def test_best_split_balances_hosts_of_different_speed() -> None:
    assert best_split(30, [1.0, 1.0]) == [(0, 15), (15, 30)]
    assert best_split(30, [1.0, 2.0]) == [(0, 20), (20, 30)]
    # a head worth 6 layers on the last host moves layers to the first
    assert best_split(30, [1.0, 1.0], head_layers=6.0) == [(0, 18), (18, 30)]
    assert best_split(30, [1.0, 1.0], capacity=[10, 30]) == [(0, 10), (10, 30)]
    with pytest.raises(ValueError):
        best_split(2, [1.0, 1.0, 1.0])


def test_a_slowed_stage_gets_fewer_layers_and_a_balanced_one_keeps_its_split() -> None:
    ranges = [(0, 15), (15, 30)]
    assert propose_split(ranges, [0.15, 0.15]) is None
    proposed, gain = propose_split(ranges, [0.15, 0.45])  # type: ignore[misc]
    assert proposed == [(0, 23), (23, 30)] and gain > 0.4


def _result(times: list[float]) -> protocol.Result:
    rows = [(i, 0.0, 0.0, t, t) for i, t in enumerate(times)]
    trace = np.array(rows, dtype=np.float64).reshape(-1)
    return protocol.Result(1, 1, np.array([5], np.int64), 0, trace=trace)


def test_balancer_flags_a_throttled_stage_and_proposes_after_patience() -> None:
    balancer = Balancer([(0, 15), (15, 30)], window=8, patience=2)
    for _ in range(8):
        balancer.observe(_result([0.010, 0.010]))
    assert balancer.proposal() is None and balancer.throttled() == {}
    proposals = []
    for _ in range(3):
        for _ in range(8):
            balancer.observe(_result([0.010, 0.030]))  # stage 1 slows down threefold
        proposals.append(balancer.proposal())
    assert 1 in balancer.throttled() and balancer.throttled()[1][0] == pytest.approx(3.0)
    assert proposals[0] is None and proposals[1] is not None
    assert proposals[1][0] == [(0, 23), (23, 30)]


def test_a_slowdown_of_some_steps_only_is_flagged_with_its_full_weight() -> None:
    """A duty-cycle throttle delays one step in three: the median step time does not move, the
    share does."""
    balancer = Balancer([(0, 15), (15, 30)], window=8, patience=2)
    for _ in range(8):
        balancer.observe(_result([0.010, 0.010]))
    slowed = [0.060 if index % 3 == 0 else 0.010 for index in range(48)]
    for spent in slowed:
        balancer.observe(_result([0.010, spent]))
    flagged = balancer.throttled()
    assert list(flagged) == [1]
    window = slowed[-32:]  # the running comparison's steps: the mean slowdown, not the median's 1.0
    assert flagged[1][0] == pytest.approx(sum(window) / len(window) / 0.010)


def test_the_mix_of_step_sizes_and_a_slowdown_of_every_stage_are_not_mistaken() -> None:
    """Prefills in the baseline and only decodes later change no stage's share: nobody is flagged.
    When every stage slows down alike (a busier machine), each is flagged by its own median, none by
    its share."""
    mixed = Balancer([(0, 15), (15, 30)], window=8, patience=2)
    for index in range(8):
        mixed.observe(_result([0.100, 0.050] if index % 2 == 0 else [0.010, 0.005]))
    for _ in range(32):
        mixed.observe(_result([0.010, 0.005]))
    assert mixed.throttled() == {}
    # A real prefill: the last stage's head scores one position, so its share is smaller than in a
    # decode. By sums the long prefills would dominate the baseline and the decodes after it read as
    # 1.6x.
    prefills = Balancer([(0, 19), (19, 30)], window=8, patience=2)
    for index in range(8):
        prefills.observe(_result([0.190, 0.110] if index < 3 else [0.010, 0.010]))
    for _ in range(32):
        prefills.observe(_result([0.010, 0.010]))
    assert relative_slowdown(prefills.baseline_rows, prefills.recent_rows, 1) == pytest.approx(
        8 / (3 * 11 / 19 + 5)
    )
    assert prefills.throttled() == {}
    alike = Balancer([(0, 15), (15, 30)], window=8, patience=2)
    for _ in range(8):
        alike.observe(_result([0.010, 0.005]))
    for _ in range(32):
        alike.observe(_result([0.020, 0.010]))
    assert relative_slowdown(alike.baseline_rows, alike.recent_rows, 1) == pytest.approx(1.0)
    flagged = alike.throttled()
    assert sorted(flagged) == [0, 1] and all(
        ratio == pytest.approx(2.0) for ratio, _ in flagged.values()
    )


@pytest.mark.parametrize("mode", ["propose", "auto"])
def test_rebalancer_flags_then_proposes_and_applies_only_in_auto_mode(mode: str) -> None:
    """`propose` reports a split and leaves the fleet alone; `auto` hands the same split to
    `apply`."""
    from fleettui.control.rebalance import Rebalancer
    from fleettui.control.states import RebalanceProposal, Throttled

    events: list[object] = []
    applied: list[list[tuple[int, int]]] = []

    async def apply(ranges: list[tuple[int, int]]) -> None:
        applied.append(ranges)

    async def scenario() -> None:
        rebalancer = Rebalancer(
            [(0, 15), (15, 30)], ["pc-a", "pc-b"], mode, 1.5, 0.0, events.append, apply, 8, 2
        )
        for _ in range(8):
            rebalancer.observe(_result([0.010, 0.010]), 0.0)
        for _ in range(24):
            rebalancer.observe(_result([0.010, 0.030]), 0.0)
        if rebalancer.task is not None:
            await rebalancer.task

    asyncio.run(scenario())
    throttled = [e for e in events if isinstance(e, Throttled)]
    assert (
        throttled
        and {e.name for e in throttled} == {"pc-b"}
        and throttled[-1].ratio == pytest.approx(3.0)
    )
    proposals = [e for e in events if isinstance(e, RebalanceProposal)]
    assert proposals[0].current == ((0, 15), (15, 30)) and proposals[0].ranges == (
        (0, 23),
        (23, 30),
    )
    assert [p.applied for p in proposals] == ([False] if mode == "propose" else [False, True])
    assert applied == ([] if mode == "propose" else [[(0, 23), (23, 30)]])


# -- the [resilience] table
# ----------------------------------------------------------------------------
def _fleet(tmp_path: Path, table: str) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(f'{table}\n[[hosts]]\nname = "a"\n')
    return path


def test_resilience_table_is_read_and_defaults_apply(tmp_path: Path) -> None:
    assert load_fleet(_fleet(tmp_path, "")).resilience == ResilienceSettings()
    fleet = load_fleet(
        _fleet(tmp_path, '[resilience]\ndetect_seconds = 3\ngrace_seconds = 60\nrebalance = "auto"')
    )
    assert fleet.resilience.detect_seconds == 3.0 and fleet.resilience.grace_seconds == 60.0
    assert fleet.resilience.rebalance == "auto" and fleet.resilience.calibrate == "auto"
    assert (
        load_fleet(_fleet(tmp_path, '[resilience]\ncalibrate = "off"')).resilience.calibrate
        == "off"
    )
    assert fleet.resilience.rejoin_seconds == 10.0
    assert (
        load_fleet(_fleet(tmp_path, "[resilience]\nrejoin_seconds = 0")).resilience.rejoin_seconds
        == 0.0
    )
    assert fleet.resilience.hold_seconds == 60.0
    assert (
        load_fleet(_fleet(tmp_path, "[resilience]\nhold_seconds = 0")).resilience.hold_seconds
        == 0.0
    )


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("[resilience]\ndetect = 3", "resilience.detect: unknown key"),
        ('[resilience]\nrebalance = "sometimes"', "resilience.rebalance"),
        ("[resilience]\ncalibrate = true", "resilience.calibrate"),
        (
            "[resilience]\nheartbeat_seconds = 2\ndetect_seconds = 3",
            "at least twice heartbeat_seconds",
        ),
        ("[resilience]\nthrottle_ratio = 1.0", "resilience.throttle_ratio"),
        ("[resilience]\nrejoin_seconds = 0.5", "resilience.rejoin_seconds.*0 or 1..3600"),
        ("[resilience]\nhold_seconds = -1", "resilience.hold_seconds.*0..3600"),
        ("[resilience]\nunresponsive_seconds = 30", "resilience.unresponsive_seconds: unknown key"),
        ('[resilience]\ngrace_seconds = "soon"', "expected a number"),
    ],
)
def test_bad_resilience_keys_are_refused_with_the_key(
    tmp_path: Path, table: str, message: str
) -> None:
    with pytest.raises(FleetConfigError, match=message):
        load_fleet(_fleet(tmp_path, table))


def test_a_lost_or_degraded_stage_means_recover_and_a_recovering_one_wait() -> None:
    from fleettui.control.states import Degraded, Lost, Ready, Recovering, next_step

    assert next_step({"a": Ready(), "b": Lost("process exited (signal 9)")}) == "recover"
    assert next_step({"a": Ready(), "b": Degraded("needs 1.0 GB more")}) == "recover"
    assert next_step({"a": Ready(), "b": Recovering("replay")}) == "wait"


# -- the lease's end
# ----------------------------------------------------------------------------------
async def test_ending_the_lease_retries_until_each_worker_confirms_and_names_those_that_never_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A deployed worker that missed the lease's end would exit once the lease ran out: retried,
    reported."""
    from types import SimpleNamespace
    from typing import Any

    from fleettui.control import connection

    asked: dict[str, int] = {}

    async def control_request(
        url: str, request: dict[str, Any], *_args: object
    ) -> dict[str, Any] | None:
        asked[url] = asked.get(url, 0) + 1
        assert request == {"op": "lease", "seconds": 0.0}
        if url == "lossy" and asked[url] < 3:  # two requests lost, the third answered
            return None
        if url == "gone":
            return None
        return {"lease": 0.0, "lease_left": None}

    monkeypatch.setattr(connection, "control_request", control_request)
    placements = [
        SimpleNamespace(
            control_url=url, server_key=None, config=SimpleNamespace(name=f"stage-{url}")
        )
        for url in ("fine", "lossy", "gone")
    ]
    deployment = SimpleNamespace(placements=placements, keys=None)
    lease = connection.Lease(lambda: deployment, 30.0)  # type: ignore[arg-type,return-value]
    [warning] = await lease.end()
    assert "stage-gone did not confirm" in warning and "exits within 30 s" in warning
    assert asked == {"fine": 1, "lossy": 3, "gone": 5}


def test_a_watcher_cancelled_just_as_its_ping_is_answered_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cancel that arrives in the same turn as the worker's answer must still end the watch
    (Python 3.11's `wait_for` returned the answer and dropped the cancel: the watcher pinged on and
    `stop()` hung)."""
    from fleettui.runtime import watch
    from fleettui.runtime.watch import Target, Watcher, WatchSettings

    async def scenario() -> bool:
        watcher = Watcher(
            None, WatchSettings(heartbeat_seconds=0.05, detect_seconds=5.0), lambda *_: None
        )

        async def answered_as_cancelled(self: object) -> dict[str, str]:
            watcher._tasks[
                "stage-0"
            ].cancel()  # the cancel and the answer in the same turn of the loop
            return {"state": "ready"}

        monkeypatch.setattr(watch._Pinger, "_exchange", answered_as_cancelled)
        watcher.watch(Target("stage-0", "tcp://127.0.0.1:9", None))
        task = watcher._tasks["stage-0"]
        done, _ = await asyncio.wait([task], timeout=5.0)
        await asyncio.wait_for(watcher.stop(), 5.0)
        return task in done and task.cancelled()

    assert asyncio.run(scenario())


def test_stop_cancels_again_a_watch_that_dropped_its_first_cancel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fleettui.runtime import watch
    from fleettui.runtime.watch import Target, Watcher, WatchSettings

    dropped: list[bool] = []

    async def drops_one_cancel(self: object) -> dict[str, str]:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            if dropped:
                raise
            dropped.append(True)  # a library call that swallows the cancel
        return {"state": "ready"}

    async def scenario() -> tuple[bool, asyncio.Task[None]]:
        monkeypatch.setattr(watch._Pinger, "_exchange", drops_one_cancel)
        watcher = Watcher(
            None, WatchSettings(heartbeat_seconds=5.0, detect_seconds=60.0), lambda *_: None
        )
        watcher.watch(Target("stage-0", "tcp://127.0.0.1:9", None))
        task = watcher._tasks["stage-0"]
        await asyncio.sleep(0.05)  # the watch is in its first ping (its timeout 5 s away)
        stopping = asyncio.ensure_future(watcher.stop())
        # waited on, never cancelled from here
        done, _ = await asyncio.wait([stopping], timeout=15.0)
        if not done:
            task.cancel()
            await asyncio.wait([stopping])
        return bool(done), task

    stopped, task = asyncio.run(scenario())
    assert dropped and stopped and task.cancelled()


def test_a_hold_waits_for_the_fleet_to_be_whole_and_says_how_long_it_waited_in_vain() -> None:
    from fleettui.runtime.hold import Hold

    async def scenario() -> None:
        hold = Hold()
        assert await hold.wait() is False and hold.note == ""  # nothing held: at once
        hold.begin(0.05)
        assert await hold.wait() is False
        assert hold.note == " (waited 0.05 s for it to be whole again)"
        hold.begin(30.0)
        assert hold.note == ""
        asyncio.get_running_loop().call_later(0.05, hold.end)
        started = asyncio.get_running_loop().time()
        assert await hold.wait() is True and asyncio.get_running_loop().time() - started < 5.0
        hold.begin(0.0)  # hold_seconds = 0: degraded answers end at once
        assert await hold.wait() is False and hold.note == ""

    asyncio.run(scenario())
