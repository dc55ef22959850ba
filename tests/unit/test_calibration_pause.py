"""Unit tests of the calibration's pauses: each stage is timed after the pause it has in the live
pipeline.

A step costs more after a pause (on a shared Xeon the head took 1.7 ms back to back and 3.2 after 8
ms idle, a layer 0.31 and 0.40 ms); stepping the calibration split round-robin gave its stages
pauses no live pipeline has, and the plan came out 20/10 where 19/11 balanced."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fleettui.config.fleet import DEFAULT_FLEET, Host, load_fleet
from fleettui.planning.costs import MeasuredCosts

IDLE_PENALTY_S = 0.004  # the fake's steps cost twice as much after this long idle


class SimulatedClock:
    """Time that moves only when the timing sleeps or a fake step runs: the tests see no load."""

    def __init__(self) -> None:
        self.time = 0.0

    def now(self) -> float:
        return self.time

    def sleep(self, seconds: float) -> None:
        self.time += seconds


class _IdleEngine:
    """A stage engine stand-in: a 1-token step costs `cost_s` of the simulated clock, doubled when
    the engine has been idle longer than IDLE_PENALTY_S since its last step; it records the idle
    time before each step."""

    def __init__(
        self, clock: SimulatedClock, index: int, cost_s: float, last: bool = False
    ) -> None:
        self.clock = clock
        self.stage_index, self.is_first, self.cost_s = index, index == 0, cost_s
        self.manifest = SimpleNamespace(vocab_size=100, hidden_size=4)
        self.stage = SimpleNamespace(
            layers=SimpleNamespace(start=index, end=index + 1), is_first=index == 0, is_last=last
        )
        self.idle: list[float] = []
        self._ended = clock.now()

    def open(self, session: int) -> None: ...

    def close(self, session: int) -> None: ...

    def reset(self, session: int) -> None: ...

    def step(
        self, session: int, pos0: int, cache_len: int, ranges: object, data: Any, keep_last: int = 0
    ):
        idle = self.clock.now() - self._ended
        if len(data) == 1:
            self.idle.append(idle)
            self.clock.sleep(self.cost_s * (2 if idle > IDLE_PENALTY_S else 1))
        self._ended = self.clock.now()
        return None


def _trio(clock: SimulatedClock) -> list[_IdleEngine]:
    # the calibration split's shapes: 1 layer + embedding, the middle layers, 1 layer + head
    return [
        _IdleEngine(clock, 0, 0.0005),
        _IdleEngine(clock, 1, 0.009),
        _IdleEngine(clock, 2, 0.0026, last=True),
    ]


def test_the_calibration_times_every_stage_after_its_pipelines_pause() -> None:
    """In a 2-stage pipeline serving one user each stage waits about half the model's token between
    its steps: every timed step of every calibration stage follows that pause (round-robin gave the
    middle stage 3 ms and the others 10), and the penalised cost is what the profile reports."""
    from remote_worker.profile import time_stages

    clock = SimulatedClock()
    engines = _trio(clock)
    results = time_stages(
        engines, context=4, tokens=16, chunk=4, windows=2, gap=0.0, pipeline=2, clock=clock
    )
    # the model's token, each step penalised
    whole_ms = 2 * 1000 * sum(engine.cost_s for engine in engines)
    for engine, result in zip(engines, results, strict=True):
        assert 0.4 * whole_ms <= result["pause_ms"] <= 0.75 * whole_ms
        timed = engine.idle[-(16 // 2 + 2) :]  # the last window's decode steps
        assert min(timed) >= result["pause_ms"] / 1000 > IDLE_PENALTY_S
        assert result["decode_ms"] >= 1.9 * 1000 * engine.cost_s  # the cost after a pause


def test_a_single_stage_is_timed_back_to_back() -> None:
    """One stage (or a many-user load) has no pause between steps: the steps run back to back."""
    from remote_worker.profile import time_stages

    clock = SimulatedClock()
    engines = _trio(clock)
    results = time_stages(
        engines, context=4, tokens=8, chunk=4, windows=2, gap=0.0, pipeline=1, clock=clock
    )
    for engine, result in zip(engines, results, strict=True):
        assert result["pause_ms"] == 0.0 and max(engine.idle) < IDLE_PENALTY_S
        assert result["decode_ms"] < 1.5 * 1000 * engine.cost_s


def test_explicit_pauses_are_kept_per_stage() -> None:
    """`plan --profile` times a planned split with each stage after the others' predicted time."""
    from remote_worker.profile import time_stages

    clock = SimulatedClock()
    engines = _trio(clock)[:2]
    results = time_stages(
        engines, context=4, tokens=8, chunk=4, windows=2, gap=0.0, pauses_ms=[0.0, 6.0], clock=clock
    )
    assert [result["pause_ms"] for result in results] == [0.0, 6.0]
    assert max(engines[0].idle[-5:]) < IDLE_PENALTY_S and min(engines[1].idle[-5:]) >= 0.006 - 1e-9


def test_the_profile_command_refuses_pauses_it_cannot_pair_with_stages(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from remote_worker.profile import main

    for argv, message in [
        (["--shard", "x", "--pauses-ms", "1,2"], "one pause per stage"),
        (["--shard", "x", "--stages", "0", "--pauses-ms", "1,2"], "one pause per stage"),
        (["--shard", "x", "--stages", "0", "--pauses-ms", "-1"], "within [0, 10000] ms"),
        (["--shard", "x", "--pipeline", "-2"], "at least 1 stage"),
        (["--shard", "x", "--pipeline", "2", "--pauses-ms", "1"], "not allowed with"),
    ]:
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_a_profile_is_kept_per_pipeline_length(tmp_path: Path) -> None:
    """The same host in a 2- and a 3-stage fleet pauses differently between steps: separate
    profiles."""
    from fleettui.planning.profiles import profile_path

    base = load_fleet(DEFAULT_FLEET)
    two = replace(base, hosts=(Host(name="a"), Host(name="b")))
    three = replace(base, hosts=(Host(name="a"), Host(name="b"), Host(name="c")))
    assert profile_path(two, two.hosts[0], tmp_path) != profile_path(
        three, three.hosts[0], tmp_path
    )
    assert profile_path(two, two.hosts[0], tmp_path) == profile_path(two, two.hosts[1], tmp_path)


def test_plan_profile_times_each_planned_stage_after_the_rest_of_the_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured vs predicted: each stage of the planned split is timed after the others'
    predicted time."""
    import io

    from fleettui.planning import plan_profile, profiles

    costs = MeasuredCosts(layer_ms=0.4, head_ms=3.2, call_ms=0.2)
    base = load_fleet(DEFAULT_FLEET)
    fleet = replace(base, hosts=(Host(name="a", threads=1), Host(name="b", threads=1)))
    asked: list[tuple[Any, Any]] = []

    def fake_time(
        fleet: object,
        host: object,
        shard_dir: Path,
        stages: Any = None,
        children: Any = None,
        pauses_ms: Any = None,
    ) -> list[dict[str, float]]:
        asked.append((stages, pauses_ms))
        return [{"decode_ms": 7.8} for _ in stages]

    monkeypatch.setattr(plan_profile, "calibrate", lambda *args, **kwargs: {"a": costs, "b": costs})
    monkeypatch.setattr(profiles, "fleet_costs", lambda fleet: [costs, costs])
    monkeypatch.setattr(plan_profile, "time_stages", fake_time)
    monkeypatch.setattr(
        plan_profile, "compile_split", lambda fleet, splits, children=None: tmp_path
    )
    shown = io.StringIO()
    assert plan_profile.run_plan_profile(fleet, None, shown) == 0
    ((stages, pauses),) = asked
    # 19/11 on SmolLM2's 30 layers: stage 0 = 0.2 + 19 x 0.4 = 7.8 ms, stage 1 = 0.2 + 11 x 0.4 +
    # 3.2 = 7.8
    assert stages == [0, 1] and pauses == pytest.approx([7.8, 7.8])
    assert "measured 0%" in shown.getvalue()


def test_hosts_on_alike_cores_share_the_mean_of_their_costs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two emulated PCs on identical cores, timed at once, differ only by noise: 3.6 % per layer
    once tipped the plan from 19/11 (ran 0.97) to 20/10 (0.88). They share the mean; unlike cores
    keep their own."""
    from fleettui.config import local_cores
    from fleettui.planning import profiles

    # first stage, layer, head, call
    per_core = {
        0: (0.8, 0.409, 3.47, 0.33),
        1: (0.8, 0.424, 3.68, 0.37),
    }

    def fake_time(
        fleet: object, host: Host, shard_dir: Path, *rest: object
    ) -> list[dict[str, object]]:
        first, layer, head, call = per_core[host.cores[0]]
        return [
            {"layers": [0, 1], "last": False, "decode_ms": call + layer, "prefill_ms": 5.0},
            {"layers": [1, 29], "last": False, "decode_ms": call + 28 * layer, "prefill_ms": 112.0},
            {
                "layers": [29, 30],
                "last": True,
                "decode_ms": call + layer + head,
                "prefill_ms": 34.0,
            },
        ]

    monkeypatch.setattr(profiles, "time_stages", fake_time)
    monkeypatch.setattr(profiles, "compile_split", lambda fleet, splits, children=None: tmp_path)
    base = load_fleet(DEFAULT_FLEET)
    fleet = replace(
        base,
        hosts=(Host(name="pc-0", threads=1, cores=(0,)), Host(name="pc-1", threads=1, cores=(1,))),
        model=replace(base.model, shards=tmp_path / "shards"),
    )
    kinds = {0: ("1024", ""), 1: ("1024", "")}
    monkeypatch.setattr(local_cores, "core_kind", lambda cpu: kinds[cpu])
    alike = profiles.calibrate(fleet, 30, root=tmp_path / "alike")
    assert alike["pc-0"] == alike["pc-1"]
    assert alike["pc-0"].layer_ms == pytest.approx((0.409 + 0.424) / 2)
    assert alike["pc-0"].head_ms == pytest.approx((3.47 + 3.68) / 2)
    kinds[1] = ("512", "")  # an efficient core beside a performance core
    unlike = profiles.calibrate(fleet, 30, root=tmp_path / "unlike")
    assert unlike["pc-0"].layer_ms == pytest.approx(0.409) and unlike[
        "pc-1"
    ].layer_ms == pytest.approx(0.424)


def test_core_kind_reads_capacity_clock_and_hybrid_core_type(tmp_path: Path) -> None:
    from fleettui.config.local_cores import core_kind

    cpu = tmp_path / "system" / "cpu"
    for index, (capacity, clock) in enumerate(
        [("1024", "5400000"), ("1024", "5400000"), ("512", "4200000")]
    ):
        (cpu / f"cpu{index}" / "cpufreq").mkdir(parents=True)
        (cpu / f"cpu{index}" / "cpu_capacity").write_text(capacity + "\n")
        (cpu / f"cpu{index}" / "cpufreq" / "cpuinfo_max_freq").write_text(clock + "\n")
    (tmp_path / "cpu_core").mkdir()
    (tmp_path / "cpu_core" / "cpus").write_text("0-1\n")
    (tmp_path / "cpu_atom").mkdir()
    (tmp_path / "cpu_atom" / "cpus").write_text("2\n")
    assert core_kind(0, tmp_path) == core_kind(1, tmp_path) == ("1024", "5400000", "cpu_core")
    assert core_kind(2, tmp_path) == ("512", "4200000", "cpu_atom")
    assert core_kind(7, tmp_path / "missing") == ("", "")  # a VM that tells nothing: all alike
