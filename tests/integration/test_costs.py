"""Unit tests of placement from measured costs: the fit of a calibration profile and the balanced
split."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from fleettui.config.fleet import DEFAULT_FLEET, load_fleet
from fleettui.errors import PlanError
from fleettui.planning.costs import (
    MeasuredCosts,
    StageTiming,
    balanced_cuts,
    balanced_split,
    fit_costs,
    imbalance,
    predicted_ms,
)
from fleettui.planning.planner import plan_fleet
from fleettui.planning.profiles import fleet_costs, profile_path

# SmolLM2 on this kind of CPU, roughly: 0.3 ms per layer, a head worth ~7 layers, 0.2 ms per call
SMOLLM = MeasuredCosts(layer_ms=0.3, head_ms=2.1, call_ms=0.2)


def test_fit_recovers_the_costs_from_the_calibration_split() -> None:
    truth = MeasuredCosts(
        layer_ms=0.3, head_ms=2.1, call_ms=0.2, prefill_layer_ms=4.0, prefill_head_ms=30.0
    )
    calibration = [(1, False), (28, False), (1, True)]  # the split [0, 1, 29, 30]
    timings = [
        StageTiming(n, last, truth.stage_ms(n, last), 1.0 + n * 4.0 + (30.0 if last else 0.0))
        for n, last in calibration
    ]
    fitted = fit_costs(timings)
    assert fitted.layer_ms == pytest.approx(0.3) and fitted.head_ms == pytest.approx(2.1)
    assert fitted.call_ms == pytest.approx(0.2)
    assert fitted.prefill_layer_ms == pytest.approx(
        4.0
    ) and fitted.prefill_head_ms == pytest.approx(30.0)
    with pytest.raises(PlanError, match="three stages"):
        fit_costs(timings[:2])


def test_split_charges_the_measured_head() -> None:
    # equal hosts: the last stage gets fewer layers, by about the head's worth of layers / 2
    counts = balanced_split(30, [SMOLLM, SMOLLM], [30, 30])
    times = predicted_ms(counts, [SMOLLM, SMOLLM])
    assert counts in ([18, 12], [19, 11]) and imbalance(times) < 0.10  # 5.9 vs 5.6 ms either way
    # the byte-count split of main (23/7) leaves them far apart under the same costs
    assert imbalance(predicted_ms([23, 7], [SMOLLM, SMOLLM])) > 0.3


def test_split_follows_host_speed_and_capacity() -> None:
    slow = replace(SMOLLM, layer_ms=0.6, head_ms=4.2)
    counts = balanced_split(30, [SMOLLM, slow], [30, 30])
    # the slow host (last, with the head) gets far fewer layers
    assert counts[0] > 2 * counts[1] - 8
    # optimal
    assert max(predicted_ms(counts, [SMOLLM, slow])) <= min(
        max(predicted_ms([a, 30 - a], [SMOLLM, slow])) for a in range(1, 30)
    )
    capped = balanced_split(30, [SMOLLM, SMOLLM], [15, 30])
    assert capped[0] == 15 and sum(capped) == 30
    three = balanced_split(30, [SMOLLM] * 3, [30] * 3)
    assert sum(three) == 30 and min(three) >= 1 and three[2] < three[0]
    with pytest.raises(PlanError):
        balanced_split(30, [SMOLLM, SMOLLM], [10, 10])


# The synthetic Llama-3.2-1B shape on one core: ~3.9 ms a layer, its INT8 head worth ~8.7 INT4
# layers
ONE_B = MeasuredCosts(layer_ms=3.9, head_ms=8.7 * 3.9, call_ms=0.3)
ONE_B_ATTENTION = 0.173  # of a layer's weights (q, k, v, o against gate, up, down)


def _cut_times(
    ends: list[tuple[int, bool]], costs: list[MeasuredCosts], share: float
) -> list[float]:
    times, start = [], 0
    for index, (end, mid) in enumerate(ends):
        units = range(start, 2 * end - mid)
        attention = sum(1 for unit in units if unit % 2 == 0)
        layers = attention * share + (len(units) - attention) * (1 - share)
        times.append(costs[index].stage_ms(layers, index == len(ends) - 1))
        start = 2 * end - mid
    return times


def test_a_split_may_cut_a_layer_between_attention_and_mlp_when_whole_layers_balance_badly() -> (
    None
):
    # 16 layers + a head of 8.7: whole layers give 12/4 (46.8 vs 49.2 ms); cutting layer 12 after
    # its attention moves 17 % of a layer off the bottleneck
    whole = balanced_split(16, [ONE_B, ONE_B], [16, 16])
    assert whole == [12, 4]
    ends = balanced_cuts(16, [ONE_B, ONE_B], [16, 16], ONE_B_ATTENTION)
    assert ends == [(13, True), (16, False)]
    cut, plain = _cut_times(ends, [ONE_B] * 2, ONE_B_ATTENTION), predicted_ms(whole, [ONE_B] * 2)
    assert max(cut) < 0.99 * max(plain) and imbalance(cut) < imbalance(plain)
    # optimal over every split into half layers (brute force), three stages too
    for hosts in (2, 3):
        best = min(
            max(
                _cut_times(
                    [(-(-u // 2), u % 2 == 1) for u in cuts] + [(16, False)], [ONE_B] * hosts, 0.173
                )
            )
            for cuts in _increasing(hosts - 1, 32)
        )
        ends = balanced_cuts(16, [ONE_B] * hosts, [16] * hosts, ONE_B_ATTENTION)
        assert max(_cut_times(ends, [ONE_B] * hosts, ONE_B_ATTENTION)) == pytest.approx(best)
    # a gain under 1 % keeps whole layers (no shards to compile for nothing); so does no attention
    # share
    even = replace(SMOLLM, head_ms=2.4)  # a head of 8 layers: 19/11 is balanced to the microsecond
    assert balanced_cuts(30, [even, even], [30, 30], 0.28) == [(19, False), (30, False)]
    assert balanced_cuts(16, [ONE_B, ONE_B], [16, 16], 0.0) == [(12, False), (16, False)]
    # a stage starting with the MLP of the layer before it needs room for one more layer's weights
    assert balanced_cuts(16, [ONE_B, ONE_B], [16, 3], ONE_B_ATTENTION) == [(13, False), (16, False)]


def _increasing(count: int, units: int) -> list[tuple[int, ...]]:
    """Every strictly increasing tuple of COUNT cut points in (0, UNITS) leaving each stage an
    attention."""
    from itertools import combinations

    found = []
    for cuts in combinations(range(1, units), count):
        bounds = (0, *cuts, units)
        if all((b + 1) // 2 - (a + 1) // 2 >= 1 for a, b in zip(bounds, bounds[1:], strict=False)):
            found.append(cuts)
    return found


def test_planner_uses_a_cached_profile_for_every_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json
    from dataclasses import asdict

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fleet = load_fleet(DEFAULT_FLEET)
    assert fleet_costs(fleet) is None
    before = plan_fleet(fleet)
    assert before.costs is None
    for host in fleet.hosts:
        path = profile_path(fleet, host)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"costs": asdict(SMOLLM)}))
    after = plan_fleet(fleet)
    assert after.costs is not None and [s.count for s in after.stages] in ([18, 12], [19, 11])
    assert [s.count for s in plan_fleet(fleet, use_profile=False).stages] == [
        s.count for s in before.stages
    ]


def test_a_replan_around_a_lost_host_uses_the_costs_measured_with_another_stage_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three SSH PCs calibrated as a 3-stage fleet, the slow one twice as slow per layer: the
    2-stage fleet left after losing a fast one plans from those costs (not bytes), and a deploy of
    it still calibrates."""
    import json
    from dataclasses import asdict

    from fleettui.config.fleet import Host
    from fleettui.control.calibration import wants_calibration

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    base = load_fleet(DEFAULT_FLEET)
    hosts = tuple(
        Host(name=f"pc-{i}", transport="ssh", address=f"10.0.0.{i + 1}", user="u") for i in range(3)
    )
    fleet = replace(base, hosts=hosts, path=None)
    slow = replace(SMOLLM, layer_ms=SMOLLM.layer_ms * 2)
    for host, costs in zip(hosts, (slow, SMOLLM, SMOLLM), strict=True):
        path = profile_path(fleet, host)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"costs": asdict(costs)}))
    left = replace(fleet, hosts=(hosts[0], hosts[2]))
    assert fleet_costs(left, nearest=False) is None  # no profile of this stage count
    assert fleet_costs(left) == [slow, SMOLLM]
    measured, by_bytes = plan_fleet(left), plan_fleet(left, use_profile=False)
    assert measured.costs is not None and by_bytes.costs is None
    assert measured.stages[0].count < by_bytes.stages[0].count  # the slow PC gets fewer layers
    assert wants_calibration(left)  # a fresh deploy of it measures its own stage count
    assert (
        fleet_costs(replace(left, hosts=(hosts[0], replace(hosts[2], address="10.0.0.9")))) is None
    )


def test_local_survivors_of_a_replan_plan_from_costs_measured_with_another_share_of_the_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three stages on this machine, one core each, calibrated; the two left after a loss share the
    cores anew (two each), a setting never timed: they plan from the 3-stage profiles (all alike, so
    comparable), not from bytes; a deploy of them still calibrates; a fleet with an SSH host does
    not mix them in."""
    import json
    from dataclasses import asdict

    from fleettui.config.fleet import Host
    from fleettui.control.calibration import wants_calibration
    from fleettui.planning.profiles import _material

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    base = load_fleet(DEFAULT_FLEET)
    three = replace(
        base,
        hosts=tuple(Host(name=f"stage-{i}", threads=1, cores=(i,)) for i in range(3)),
        path=None,
    )
    heavy_head = replace(SMOLLM, head_ms=SMOLLM.layer_ms * 20)  # the head as dear as 20 layers
    for host in three.hosts:
        path = profile_path(three, host)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps({"settings": _material(three, host), "costs": asdict(heavy_head)})
        )
    left = replace(
        three, hosts=tuple(Host(name=f"stage-{i}", threads=2, cores=(0, 1)) for i in (0, 2))
    )
    assert fleet_costs(left) == [heavy_head, heavy_head]
    measured, by_bytes = plan_fleet(left), plan_fleet(left, use_profile=False)
    assert measured.costs is not None and by_bytes.costs is None
    assert measured.stages[1].count < by_bytes.stages[1].count  # the head's stage gets fewer layers
    assert wants_calibration(left)  # a fresh deploy of them measures their own setting
    other_model = replace(left, model=replace(left.model, name="synthetic:llama-tiny"))
    assert fleet_costs(other_model) is None  # another model's profiles are not taken
    mixed = replace(
        left, hosts=(left.hosts[0], Host(name="pc", transport="ssh", address="10.0.0.5", user="u"))
    )
    assert fleet_costs(mixed) is None


@pytest.mark.slow
def test_calibration_of_real_shards_gives_a_profile_the_planner_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real shards (synthetic tiny Llama), real OpenVINO timing in a child process, cached, then
    planned."""
    from fleettui.config.fleet import Host
    from fleettui.planning.profiles import calibrate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    base = load_fleet(DEFAULT_FLEET)
    fleet = replace(
        base,
        hosts=(Host(name="a", threads=1), Host(name="b", threads=1)),
        model=replace(base.model, name="synthetic:llama-tiny", shards=tmp_path / "shards"),
    )
    found = calibrate(fleet, 4)
    assert set(found) == {"a", "b"} and found["a"] == found["b"]  # one machine, one settings key
    costs = found["a"]
    assert costs.layer_ms > 0 and costs.head_ms >= 0 and costs.prefill_layer_ms > 0
    assert fleet_costs(fleet) == [costs, costs]  # cached under the cache dir
    planned = plan_fleet(fleet)
    assert planned.costs is not None and sum(s.count for s in planned.stages) == 4
    assert calibrate(fleet, 4) == found  # a second call reads the cache


def test_fit_pins_a_noisy_negative_term_at_zero() -> None:
    # a tiny model on a busy machine: the middle stage (2 layers) measured faster than the 1-layer
    # one
    timings = [StageTiming(1, False, 0.50), StageTiming(2, False, 0.48), StageTiming(1, True, 0.90)]
    fitted = fit_costs(timings)
    assert fitted.layer_ms > 0 and fitted.head_ms >= 0 and fitted.call_ms >= 0


def test_hosts_on_their_own_cores_are_calibrated_at_the_same_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Emulated PCs pinned to disjoint cores are timed in one window (load from other programs then
    skews none of them against another: timed one after the other, two identical cores came out
    34-43 % apart); hosts whose cores overlap are timed one after the other (so are hosts whose
    calibrations would not fit in memory together), and hosts with the same settings once."""
    import threading
    import time

    from fleettui.config.fleet import Host
    from fleettui.planning import profiles

    windows: dict[str, tuple[float, float]] = {}
    lock = threading.Lock()

    def fake_time(
        fleet: object, host: Host, shard_dir: Path, stages: object = None, children: object = None
    ) -> list[dict[str, object]]:
        started = time.monotonic()
        time.sleep(0.3)
        with lock:
            windows[host.name] = (started, time.monotonic())
        return [
            {"layers": [0, 1], "last": False, "decode_ms": 0.5, "prefill_ms": 5.0},
            {"layers": [1, 29], "last": False, "decode_ms": 8.6, "prefill_ms": 112.0},
            {"layers": [29, 30], "last": True, "decode_ms": 2.6, "prefill_ms": 34.0},
        ]

    monkeypatch.setattr(profiles, "time_stages", fake_time)
    shard = {"dir": tmp_path}
    monkeypatch.setattr(
        profiles, "compile_split", lambda fleet, splits, children=None: shard["dir"]
    )
    base = load_fleet(DEFAULT_FLEET)

    def calibrated(*hosts: Host) -> dict[str, MeasuredCosts]:
        windows.clear()
        fleet = replace(base, hosts=hosts, model=replace(base.model, shards=tmp_path / "shards"))
        return profiles.calibrate(fleet, 30, root=tmp_path / "cache", force=True)

    def overlap(a: str, b: str) -> bool:
        return windows[a][0] < windows[b][1] and windows[b][0] < windows[a][1]

    found = calibrated(
        Host(name="pc-0", threads=1, cores=(0,)), Host(name="pc-1", threads=1, cores=(1,))
    )
    assert set(found) == {"pc-0", "pc-1"} and overlap("pc-0", "pc-1")
    assert calibrated(Host(name="x", cores=(0,)), Host(name="y", cores=(0, 1))) and not overlap(
        "x", "y"
    )
    assert calibrated(Host(name="u", threads=2), Host(name="v", threads=1)) and not overlap(
        "u", "v"
    )
    shared = calibrated(Host(name="s"), Host(name="t"))  # the same settings: timed once, shared
    assert set(windows) == {"s"} and shared["s"] == shared["t"]
    # weights of 1 TiB (a sparse file): two copies at once would not fit
    shard["dir"] = tmp_path / "huge"
    shard["dir"].mkdir()
    with open(shard["dir"] / "stage0.bin", "wb") as weights:
        weights.truncate(1 << 40)
    try:
        calibrated(
            Host(name="pc-0", threads=1, cores=(0,)), Host(name="pc-1", threads=1, cores=(1,))
        )
    finally:
        (shard["dir"] / "stage0.bin").unlink()
    assert not overlap("pc-0", "pc-1")


def test_a_stopped_calibration_kills_its_child_and_starts_no_other(tmp_path: Path) -> None:
    """A bench cancelled (SIGTERM) during calibration stops its timing children at once: the running
    one is killed, the next host's is never started, and the calibration ends with a one-line
    PlanError."""
    import sys
    import threading
    import time

    from fleettui.planning.profiles import Children

    children = Children()
    marker = tmp_path / "started"
    sleeper = [
        sys.executable,
        "-c",
        f"import pathlib, time; pathlib.Path({str(marker)!r}).touch(); time.sleep(60)",
    ]
    failures: list[str] = []

    def calibrating() -> None:
        for what in ("profile of pc-0", "profile of pc-1"):
            try:
                children.run(sleeper, what)
            except PlanError as error:
                failures.append(str(error))

    thread = threading.Thread(target=calibrating)
    started = time.monotonic()
    thread.start()
    while not marker.exists():
        assert time.monotonic() - started < 30, "the child did not start"
        time.sleep(0.05)
    marker.unlink()
    children.stop()
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - started < 30
    assert (
        failures == ["profile of pc-0: stopped", "profile of pc-1: stopped"] and not marker.exists()
    )


class _TimedEngine:
    """A stage engine stand-in for `remote_worker.profile.time_stages`: each 1-token step sleeps
    `slow_s` while `slow(calls)` holds (a burst of load on its core), else `fast_s`."""

    def __init__(
        self, index: int, slow: Callable[[int], bool], fast_s: float = 0.001, slow_s: float = 0.006
    ):
        self.stage_index, self.is_first, self.calls = index, index == 0, 0
        self.slow, self.fast_s, self.slow_s = slow, fast_s, slow_s
        self.manifest = SimpleNamespace(vocab_size=100, hidden_size=4)
        layers = SimpleNamespace(start=index, end=index + 1)
        self.stage = SimpleNamespace(layers=layers, is_first=index == 0, is_last=False)

    def open(self, session: int) -> None: ...
    def close(self, session: int) -> None: ...
    def reset(self, session: int) -> None: ...

    def step(
        self,
        session: int,
        pos0: int,
        cache_len: int,
        ranges: object,
        data: object,
        keep_last: int = 0,
    ):
        if len(data) == 1:  # type: ignore[arg-type]
            self.calls += 1
            time.sleep(self.slow_s if self.slow(self.calls) else self.fast_s)
        return None


def test_calibration_times_a_stage_at_its_quietest_window() -> None:
    """Other programs only make a step slower: a burst that slows one stage's core for 7/8 of its
    decode steps (all windows but the last half of the final one) must not make that stage look
    slower than its twin. A single window's 20th percentile would have reported the burst (5 fast
    steps of 32)."""
    from remote_worker.profile import time_stages

    tokens, windows = 32, 4
    steps = windows * (tokens // windows + 2)  # 2 warm-up steps a window
    bursty = _TimedEngine(0, lambda call: call <= steps - 5)
    quiet = _TimedEngine(1, lambda call: False)
    results = time_stages(
        [bursty, quiet], context=4, tokens=tokens, chunk=4, windows=windows, gap=0.0
    )
    assert bursty.calls == quiet.calls == steps
    burst, calm = results
    assert burst["decode_ms"] < 3.0 and calm["decode_ms"] < 3.0  # both ~1 ms
    # the burst, seen
    assert min(burst["decode_windows_ms"][:3]) > 4.5 and burst["decode_median_ms"] > 4.5


def test_the_bench_calibrates_its_fleet_as_the_controller_runs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bench's 2-stage fleet runs with its local stages on their own cores
    (`share_local_cores`); its calibration must time those settings, or the plan finds no profile
    and falls back to the byte counts (on a machine without older profiles the fleet ran 23/7: 11.2
    vs 8.5 ms per token)."""
    import asyncio
    import os

    from fleettui.bench.calibration import calibrate_hosts
    from fleettui.bench.runner import bench_fleet
    from fleettui.control.settings import apply
    from fleettui.control.store import Settings
    from fleettui.planning import profiles

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    timed: list[tuple[int, ...]] = []

    def fake_time(
        fleet: object, host: object, shard_dir: Path, *rest: object
    ) -> list[dict[str, object]]:
        timed.append(host.cores)  # type: ignore[attr-defined]
        return [
            {"layers": [0, 1], "last": False, "decode_ms": 0.5, "prefill_ms": 5.0},
            {"layers": [1, 29], "last": False, "decode_ms": 8.6, "prefill_ms": 112.0},
            {"layers": [29, 30], "last": True, "decode_ms": 2.6, "prefill_ms": 34.0},
        ]

    monkeypatch.setattr(profiles, "time_stages", fake_time)
    monkeypatch.setattr(profiles, "compile_split", lambda fleet, splits, children=None: tmp_path)
    base = load_fleet(DEFAULT_FLEET)
    variant = bench_fleet(
        replace(base, model=replace(base.model, shards=tmp_path / "shards")), 2, False
    )
    asyncio.run(calibrate_hosts(variant, lambda text: None, set()))
    running = apply(variant, Settings())  # the fleet the controller starts
    if len(os.sched_getaffinity(0)) >= 2:
        assert sorted(timed) == sorted(host.cores for host in running.hosts) and all(timed)
    assert plan_fleet(running).costs is not None
