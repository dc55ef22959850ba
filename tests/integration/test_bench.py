"""Tests of `fleettui --bench`: the hop-delay proxy, the time split, the rows' table/JSON, and a
real quick run."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from fleettui.bench.hop_delay import HopDelay
from fleettui.bench.report import (
    JSON_FIELDS,
    Row,
    Trip,
    add_ratios,
    document,
    format_table,
    format_targets,
    plot,
    short_precision,
    stage_breakdown,
    targets,
)
from fleettui.bench.runner import RowSpec, plan_rows
from fleettui.bench.targets import GOALS_FILE, load_goals
from fleettui.config.fleet import DEFAULT_FLEET, load_fleet
from remote_worker.config import Endpoint

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------- hop
# delay
async def _sink(
    arrivals: list[tuple[float, bytes]], echo: bool
) -> tuple[asyncio.AbstractServer, int]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while chunk := await reader.read(1 << 16):
            arrivals.append((time.monotonic(), chunk))
            if echo:
                writer.write(chunk)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_proxy_delays_every_chunk_and_keeps_order() -> None:
    arrivals: list[tuple[float, bytes]] = []
    server, port = await _sink(arrivals, echo=False)
    with HopDelay(80) as hops:
        endpoint = hops.route(Endpoint("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(endpoint.address, endpoint.port)
        sent = []
        for index in range(40):
            payload = f"<{index}>".encode() * (1 + index * 97)
            sent.append((time.monotonic(), payload))
            writer.write(payload)
            await writer.drain()
            await asyncio.sleep(0.002)
        expected = sum(len(p) for _, p in sent)
        for _ in range(500):  # polling: the sink has no completion signal of its own
            if sum(len(c) for _, c in arrivals) >= expected:
                break
            await asyncio.sleep(0.01)
        writer.close()
    server.close()
    # nothing lost, nothing reordered
    assert b"".join(c for _, c in arrivals) == b"".join(p for _, p in sent)
    # the first byte arrives no earlier than the delay after it was sent
    assert arrivals[0][0] - sent[0][0] >= 0.075
    # pipelined: 40 chunks over ~100 ms of sending arrive within delay + sending time, not 40 x
    # delay
    assert arrivals[-1][0] - sent[0][0] < 0.08 + (sent[-1][0] - sent[0][0]) + 0.5


async def test_proxy_delays_both_directions() -> None:
    arrivals: list[tuple[float, bytes]] = []
    server, port = await _sink(arrivals, echo=True)
    with HopDelay(60) as hops:
        endpoint = hops.route(Endpoint("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(endpoint.address, endpoint.port)
        started = time.monotonic()
        writer.write(b"ping")
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
        round_trip = time.monotonic() - started
        writer.close()
    server.close()
    assert round_trip >= 0.115


def test_proxy_is_transparent_to_curve_zmq() -> None:
    import zmq

    context = zmq.Context()
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    pull = context.socket(zmq.PULL)
    pull.curve_server = True
    pull.curve_secretkey = server_secret
    pull.curve_publickey = server_public
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    with HopDelay(50) as hops:
        endpoint = hops.route(Endpoint("127.0.0.1", port))
        push = context.socket(zmq.PUSH)
        push.curve_serverkey = server_public
        push.curve_publickey = client_public
        push.curve_secretkey = client_secret
        push.connect(endpoint.url())
        received = []
        latencies = []
        for index in range(5):
            started = time.monotonic()
            push.send_multipart(
                [b"frame", np.arange(1000, dtype=np.int64).tobytes(), str(index).encode()]
            )
            assert pull.poll(5000)
            received.append(pull.recv_multipart()[2])
            latencies.append(time.monotonic() - started)
        push.close(0)
    pull.close(0)
    context.term()
    assert received == [str(i).encode() for i in range(5)]
    assert min(latencies[1:]) >= 0.045  # after the handshake, each message pays the one-way delay


# ------------------------------------------------------------------------------------- time split
def test_stage_breakdown_splits_the_round_trip() -> None:
    # coordinator sends at 100.000; stage 0: received .002, started .003, finished .013, sent .014;
    # stage 1: received .016, started .020, finished .040, sent .041; the reply arrives at .045
    trace = np.array([0, 100.002, 100.003, 100.013, 100.014, 1, 100.016, 100.020, 100.040, 100.041])
    trips = [Trip(100.0, 100.045, trace)] * 2
    parts = stage_breakdown(trips, tokens=4)
    assert parts is not None and [p["stage"] for p in parts] == [0, 1]
    assert math.isclose(parts[0]["compute_ms"], 2 * 10 / 4, abs_tol=1e-6)
    assert math.isclose(parts[0]["queue_ms"], 2 * 1 / 4, abs_tol=1e-6)
    assert math.isclose(parts[0]["wire_ms"], 2 * (2 + 1) / 4, abs_tol=1e-6)
    assert math.isclose(parts[1]["compute_ms"], 2 * 20 / 4, abs_tol=1e-6)
    assert math.isclose(parts[1]["queue_ms"], 2 * 4 / 4, abs_tol=1e-6)
    assert math.isclose(parts[1]["wire_ms"], 2 * (2 + 4) / 4, abs_tol=1e-6)
    # the last stage's finished -> sent is apart: a run's Result may wait there for its burst
    assert math.isclose(parts[1]["held_ms"], 2 * 1 / 4, abs_tol=1e-6) and "held_ms" not in parts[0]
    total = sum(
        p["compute_ms"] + p["queue_ms"] + p["wire_ms"] + p.get("held_ms", 0.0) for p in parts
    )
    assert math.isclose(total, 2 * 45 / 4, abs_tol=1e-6)  # the parts add up to the round trips
    assert stage_breakdown([], tokens=4) is None


def test_a_pair_is_taken_at_the_rows_own_time_so_drift_is_not_a_ratio() -> None:
    """The machine slows 10 % a minute: a baseline at t = 0/10/20 s (100, 90, 80 tok/s) and a row
    exactly as fast, measured 5 s after each, pair 1:1; by index they would pair 0.95 / 0.94 /
    0.94."""
    from fleettui.bench.results import paired_rates

    rates, times = [95.0, 85.0, 75.0], [5.0, 15.0, 25.0]
    pairs = paired_rates(rates, times, [100.0, 90.0, 80.0], [0.0, 10.0, 20.0])
    # after the last: the nearest
    assert [round(a / b, 4) for a, b in pairs] == [
        1.0,
        1.0,
        round(75 / 80, 4),
    ]
    # before the first
    assert paired_rates([90.0], [-1.0], [100.0, 80.0], [0.0, 10.0]) == [(90.0, 100.0)]
    # without times: measurement i with i
    assert paired_rates(rates, [None] * 3, [100.0, 90.0, 80.0], [None] * 3) == list(
        zip(rates, [100.0, 90.0, 80.0], strict=True)
    )
    # failed runs out
    assert paired_rates([0.0, 50.0], [1.0, 2.0], [100.0, 0.0], [0.0, 3.0]) == [(50.0, 100.0)]


# --------------------------------------------------------------------------------- rows, table,
# JSON
def _rows() -> list[Row]:
    precision = {"weights": "int4", "inference": "bf16", "kv_cache": "u8"}
    mono = Row(
        "mono",
        "mono",
        precision=precision,
        tokens=32,
        seconds=1.0,
        aggregate_tok_s=32.0,
        per_user_tok_s=32.0,
    )
    genai = Row(
        "genai",
        "genai",
        precision=precision,
        tokens=32,
        seconds=0.8,
        aggregate_tok_s=40.0,
        per_user_tok_s=40.0,
    )
    fleet = Row(
        "fleet 2st 2u spec auto",
        "fleet",
        2,
        2,
        "auto",
        0.0,
        precision=precision,
        tokens=64,
        seconds=1.0,
        aggregate_tok_s=64.0,
        per_user_tok_s=32.0,
        ttft_s=0.05,
        acceptance_rate=0.5,
        stage_breakdown=[{"stage": 0, "compute_ms": 10.0, "queue_ms": 1.0, "wire_ms": 2.0}],
    )
    plain = Row(
        "fleet 2st 2u nospec",
        "fleet",
        2,
        2,
        0,
        0.0,
        precision=precision,
        tokens=64,
        seconds=1.6,
        aggregate_tok_s=40.0,
        per_user_tok_s=20.0,
        ttft_s=0.05,
    )
    gpu = Row(
        "mono GPU",
        "mono",
        status="skipped: device GPU is not available here",
        details={"device": "GPU"},
    )
    return [mono, genai, fleet, plain, gpu]


def test_ratios_table_and_json() -> None:
    rows = _rows()
    add_ratios(rows)
    assert rows[2].vs_mono == pytest.approx(2.0) and rows[2].vs_genai == pytest.approx(1.6)
    assert rows[4].vs_mono is None
    table = format_table(rows)
    lines = table.splitlines()
    assert "tok/s" in lines[0] and len(lines) == 2 + len(rows)
    assert "int4/bf16/u8" in table and "2.00x" in table and "10.0/2.0/1.0" in table
    assert "skipped: device GPU is not available here" in table  # never dropped
    doc = json.loads(json.dumps(document(rows, {"cpu": "test"}, {"profile": "quick"})))
    assert doc["machine"] == {"cpu": "test"} and len(doc["rows"]) == len(rows)
    for row in doc["rows"]:
        assert set(JSON_FIELDS) <= set(row)
    spec_target = [t for t in doc["targets"] if t["target"].startswith("adaptive spec >= 0.98x")]
    assert (
        spec_target
        and spec_target[0]["ratio"] == pytest.approx(1.6)
        and spec_target[0]["met"] is True
    )
    assert "fleet 2st 2u spec auto" in plot(rows)


def test_targets_without_rows_say_so() -> None:
    found = targets([_rows()[0]])
    assert found[0]["ratio"] is None and found[0]["met"] is None


def test_the_goals_come_from_the_bench_targets_file(tmp_path: Path) -> None:
    goals = load_goals()
    assert goals == load_goals(GOALS_FILE) and goals.adaptive_speculation_lan_vs_none == 0.98
    stricter = dataclasses.replace(goals, adaptive_speculation_lan_vs_none=1.7)
    found = [t for t in targets(_rows(), stricter) if t["target"].startswith("adaptive spec >=")]
    assert found[0]["target"].startswith("adaptive spec >= 1.7x") and found[0]["goal"] == 1.7
    assert found[0]["ratio"] == pytest.approx(1.6) and found[0]["met"] is False
    wrong = tmp_path / "targets.toml"
    wrong.write_text(GOALS_FILE.read_text().replace("stage_compute_balance", "stage_balance"))
    with pytest.raises(
        ValueError, match="unknown goals \\['stage_balance'\\], missing .*stage_compute_balance"
    ):
        load_goals(wrong)


def test_short_precision_names() -> None:
    assert short_precision("<Type: 'bfloat16'>") == "bf16"
    assert short_precision("<Type: 'uint8_t'>") == "u8"
    assert short_precision("f32") == "f32"


def test_profiles() -> None:
    fleet = load_fleet(DEFAULT_FLEET)
    quick = plan_rows(fleet, quick=True)
    assert [r.kind for r in quick[:2]] == ["mono", "genai"]
    assert any(r.stages == len(fleet.hosts) and r.users > 1 and r.spec_k for r in quick)
    assert any(r.hop_delay_ms for r in quick) and len(quick) <= 8
    full = plan_rows(fleet, quick=False)
    names = [r.name for r in full]
    assert len(names) == len(set(names))
    assert {0.0, 10.0, 50.0} <= {r.hop_delay_ms for r in full}
    assert any(r.pinned and r.kind == "mono" for r in full) and any(
        r.pinned and r.stages == 2 for r in full
    )
    assert any(isinstance(r.spec_k, int) and r.spec_k > 0 for r in full)  # the fixed-K sweep
    assert RowSpec("mono", device="GPU") in full
    assert not any(r.spec_k for r in plan_rows(fleet, quick=False, no_spec=True))


# ------------------------------------------------------------------------------------- a real run
@pytest.mark.slow
def test_quick_bench_produces_tokens_in_every_row(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fleettui",
            "--bench",
            "--quick",
            str(ROOT / "fleets/local.toml"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    doc = json.loads(out.read_text())
    assert doc["machine"]["versions"]["openvino"] and doc["settings"]["profile"] == "quick"
    assert len(doc["rows"]) == len(plan_rows(load_fleet(DEFAULT_FLEET), quick=True))
    for row in doc["rows"]:
        assert row["status"] == "ok", row
        assert set(JSON_FIELDS) <= set(row)
        assert row["tokens"] >= doc["settings"]["tokens_per_user"] * row["users"], row
        assert row["seconds"] > 0 and row["aggregate_tok_s"] > 0 and row["per_user_tok_s"] > 0
        assert row["ttft_s"] is not None and 0 < row["ttft_s"] <= row["seconds"]
        assert set(row["precision"]) == {"weights", "inference", "kv_cache"}
        if row["kind"] == "fleet":
            assert row["stage_breakdown"] and len(row["stage_breakdown"]) == row["stages"]
            for part in row["stage_breakdown"]:
                assert part["compute_ms"] > 0 and part["queue_ms"] >= 0 and part["wire_ms"] >= 0
            if row["spec_k"] != 0:
                assert row["acceptance_rate"] is None or 0 <= row["acceptance_rate"] <= 1
            if (
                row["spec_k"] == "auto"
            ):  # its policy's first, untimed reply (it explores): kept apart
                assert row["details"]["cold_tok_s"] > 0, row
            if row["hop_delay_ms"] and row["users"] == 1 and row["spec_k"] == 0:
                # one round trip per token crosses the N + 1 delayed links of the ring
                wire = sum(part["wire_ms"] for part in row["stage_breakdown"])
                assert wire >= 0.9 * (row["stages"] + 1) * row["hop_delay_ms"], row
    assert "tok/s" in done.stdout  # the table


@pytest.mark.slow
def test_startup_restarts_load_the_compiled_model_and_leave_nothing_behind(tmp_path: Path) -> None:
    """`bench --startup`: every start reaches READY warmed up; the restart (and only it) loads its
    compiled model; the whole fleet then starts and answers twice."""
    from fleettui.bench.startup import MODES, startup_bench
    from fleettui.control.running import run

    before = set(Path(tempfile.gettempdir()).glob("fleettui-startup-*"))
    report = run(lambda: startup_bench(load_fleet(DEFAULT_FLEET), rounds=1))
    assert len(report.starts) == len(report.split) * len(MODES)
    for start in report.starts:
        assert start.seconds > 0 and start.compile_seconds > 0 and start.warm_up_seconds > 0
        assert start.from_cache == (start.mode == "again"), start
    assert "again/off" in report.summary() and "not loaded" not in report.summary()
    # a fresh fleet asked twice
    assert len(report.answers) == 1 and all(ttft > 0 for ttft in report.answers[0])
    assert "first answer after the fleet started" in report.summary()
    assert set(Path(tempfile.gettempdir()).glob("fleettui-startup-*")) == before


@pytest.mark.slow
def test_prefill_bench_measures_both_arms_alone_and_beside_a_user_and_they_answer_alike() -> None:
    """`bench --prefill`: the serial and the pipelined prefill in alternated rounds; under f32 both
    arms give the same first tokens, and the generating user's tokens are counted during the
    prefill."""
    from fleettui.bench.prefill_bench import ARMS, prefill_bench
    from fleettui.control.running import run
    from fleettui.control.settings import with_overrides

    fleet = with_overrides(load_fleet(DEFAULT_FLEET), exact=True, draft="none")
    report = run(lambda: prefill_bench(fleet, tokens=400, rounds=2))
    assert report.stages == 2 and report.prompt_tokens > 400
    for arm in ARMS:
        assert len(report.ttft[arm]) == len(report.shared_ttft[arm]) == 2
        assert min(report.ttft[arm]) > 0 and min(report.other_rate[arm]) > 0
    assert report.same_tokens
    summary = report.summary()
    assert "first token alone: pipelined" in summary and "same tokens in both arms: yes" in summary


# ------------------------------------------------------------------------ groups and paired ratios
def test_only_keeps_one_group_and_its_partners() -> None:
    fleet = load_fleet(DEFAULT_FLEET)
    pcs = plan_rows(fleet, quick=False, only="pcs")
    assert [r.name for r in pcs][0] == "mono 1core" and all(r.pinned for r in pcs)
    assert {r.versus for r in pcs if r.kind == "fleet" and r.spec_k == 0} == {"mono 1core"}
    # speculation on the PCs is paired with no speculation on the same PCs (a LAN row of the spec
    # target)
    assert {r.versus for r in pcs if r.kind == "fleet" and r.spec_k} == {"pcs 2st 2u nospec"}
    scale = plan_rows(fleet, quick=False, only="scale")
    assert {r.model for r in scale} == {"synthetic:llama-3.2-1b"}
    assert sorted(r.users for r in scale if r.kind == "fleet") == [1, 2, 4]
    spec = plan_rows(fleet, quick=False, only="spec")
    names = {r.name for r in spec}
    # pairs run together
    assert all(r.versus in names for r in spec if r.group == "spec" and r.versus)
    assert plan_rows(fleet, quick=True, only="scale") == []
    batch = plan_rows(fleet, quick=False, only="batch")
    assert {(r.stages, r.users) for r in batch} == {(s, u) for s in (1, 2, 3) for u in (1, 2, 4, 8)}
    assert all(r.pinned and r.spec_k == 0 for r in batch)
    on = [r for r in batch if r.batching == "on"]
    assert len(on) == len(batch) // 2 and all(
        r.versus == dataclasses.replace(r, batching="off").name for r in on
    )
    assert [(r.stages, r.users) for r in plan_rows(fleet, quick=True, only="batch")][::2] == [
        (1, 1),
        (1, 4),
        (2, 1),
        (2, 4),
    ]


def test_lan_groups_pairing_speculation_with_none_get_more_rounds() -> None:
    from fleettui.bench.rows import PAIRED_REPEATS, group_repeats, measurement_count, schedule

    fleet = load_fleet(DEFAULT_FLEET)
    groups = schedule(plan_rows(fleet, quick=False)).groups
    rounds = {key: group_repeats(members, 3) for key, members in groups.items()}
    # speculation against none on a LAN: its margins are a few %, so more pairs decide them
    assert rounds[("", 2, False, 0.0)] == rounds[("", 1, False, 0.0)] == PAIRED_REPEATS > 3
    assert rounds[("", 2, True, 0.0)] == PAIRED_REPEATS  # the emulated PCs' spec row too
    # behind slow hops the ratios are several x; the scale group pairs with monos only
    assert rounds[("", 2, False, 50.0)] == 3
    assert rounds[("synthetic:llama-3.2-1b", 2, True, 0.0)] == 3
    assert all(group_repeats(members, 1) == 1 for members in groups.values())  # --quick: one round
    # the progress counter announces the measurements made as rows: the spec group's 16 fleet rows
    # in 5 rounds each; the PCs' lone 1-stage row 3 rounds, its 2-stage rows 5 (their mono partners
    # run inside)
    spec = plan_rows(fleet, quick=False, only="spec")
    assert sum(1 for r in spec if r.kind == "fleet") == 16 and measurement_count(spec, 3) == 16 * 5
    assert measurement_count(plan_rows(fleet, quick=False, only="pcs"), 3) == 1 * 3 + 3 * 5
    assert measurement_count(plan_rows(fleet, quick=False, only="anchors"), 3) == 5 * 3  # all alone
    # one round; genai is measured inside its fleet row's group
    quick = plan_rows(fleet, quick=True)
    assert measurement_count(quick, 1) == len(quick) - 1 and any(r.versus == "genai" for r in quick)


def test_each_round_asks_other_prompts_and_every_row_of_a_round_the_same() -> None:
    from fleettui.bench.runner import round_prompts

    prompts = [[index] for index in range(8)]
    assert round_prompts(prompts, 1, 0) == [[0]] and round_prompts(prompts, 1, 4) == [[4]]
    assert round_prompts(prompts, 4, 2) == [[2], [3], [4], [5]]  # each user its own prompt
    # the untimed first reply: not round 0's prompt
    assert round_prompts(prompts, 2, -1) == [
        [7],
        [0],
    ]
    assert round_prompts(prompts, 2, 7) == [[7], [0]]  # wraps around
    # five rounds of a 1-user row span five prompts, not one prompt five times
    assert len({tuple(round_prompts(prompts, 1, r)[0]) for r in range(5)}) == 5


def test_paired_ratio_is_per_round_and_reports_its_spread() -> None:
    from fleettui.bench.runner import _pair

    plain = Row("fleet 2st 2u nospec", "fleet", 2, 2, 0, details={"runs_tok_s": [40.0, 20.0, 40.0]})
    spec = Row(
        "fleet 2st 2u spec auto",
        "fleet",
        2,
        2,
        "auto",
        versus=plain.name,
        details={"runs_tok_s": [44.0, 22.0, 40.0]},
    )
    spec.aggregate_tok_s, plain.aggregate_tok_s = 44.0, 40.0
    _pair([plain, spec], {})
    # a slow round (another program ran) slows both: the per-round ratio stays ~1.1, best/best would
    # say 1.1
    assert spec.details["paired_ratios"] == [1.1, 1.1, 1.0]
    assert spec.paired_ratio == pytest.approx(1.1) and spec.ratio_spread == pytest.approx(0.1 / 1.1)
    found = [t for t in targets([plain, spec]) if "adaptive" in t["target"]]
    assert found[0]["ratio"] == pytest.approx(1.1) and found[0]["ratio_spread"] == pytest.approx(
        0.1 / 1.1
    )
    mono = Row("mono 1core", "mono", pinned=True)
    pcs = Row("pcs 2st 2u nospec", "fleet", 2, 2, 0, pinned=True, versus=mono.name)
    pcs.details["runs_tok_s"] = [30.0, 36.0]
    _pair([pcs], {mono.name: [Row("mono 1core", "mono", aggregate_tok_s=v) for v in (20.0, 20.0)]})
    assert pcs.details["paired_ratios"] == [1.5, 1.8] and "1.65x" in format_table([pcs])
    pcs_spec = Row("pcs 2st 2u spec auto", "fleet", 2, 2, "auto", pinned=True, versus=pcs.name)
    pcs.details["runs_tok_s"], pcs_spec.details["runs_tok_s"] = (
        [30.0, 36.0, 36.0],
        [27.0, 36.0, 34.2],
    )
    _pair([pcs, pcs_spec], {mono.name: [Row("mono 1core", "mono", aggregate_tok_s=20.0)] * 3})
    lan = [
        t
        for t in targets([plain, spec, pcs, pcs_spec])
        if t["target"].startswith("adaptive spec >=")
    ]
    assert [t["rows"] for t in lan] == [[spec.name, plain.name], [pcs_spec.name, pcs.name]]
    assert "emulated PCs" in lan[1]["target"] and lan[1]["ratio"] == pytest.approx(0.95)
    assert lan[1]["met"] is False  # a loss on the PCs is reported, not left out


# ------------------------------------------------------------------------ the ceiling of n emulated
# PCs
def test_the_pcs_ceiling_is_measured_in_the_pcs_rounds() -> None:
    from fleettui.bench.rows import group_partners

    fleet = load_fleet(DEFAULT_FLEET)
    full = plan_rows(fleet, quick=False)
    pcs = plan_rows(fleet, quick=False, only="pcs")
    ceiling = next(r for r in pcs if r.copies > 1)
    assert ceiling.name == "mono 1core x2" and ceiling.versus == "mono 1core" and ceiling.pinned
    baselines = [r for r in full if r.kind != "fleet"]
    two = [r for r in pcs if r.kind == "fleet" and r.stages == 2]
    one = [r for r in pcs if r.kind == "fleet" and r.stages == 1]
    assert [p.name for p in group_partners(two, baselines)] == ["mono 1core", "mono 1core x2"]
    assert [p.name for p in group_partners(one, baselines)] == ["mono 1core"]
    scale = plan_rows(fleet, quick=False, only="scale")
    synth = [r for r in scale if r.kind == "fleet"]
    assert [p.name for p in group_partners(synth, baselines)] == [
        "mono 1core synth-1b",
        "mono 1core x2 synth-1b",
    ]


def test_the_ceiling_is_reported_beside_the_pcs_target() -> None:
    mono = Row("mono 1core", "mono", pinned=True, aggregate_tok_s=50.0)
    top = Row(
        "mono 1core x2", "mono", pinned=True, copies=2, versus=mono.name, aggregate_tok_s=90.0
    )
    top.details["paired_ratios"] = [1.7, 1.8, 1.9]
    pcs = Row(
        "pcs 2st 2u nospec", "fleet", 2, 2, 0, pinned=True, versus=mono.name, aggregate_tok_s=72.0
    )
    pcs.details["paired_ratios"] = [1.4, 1.44, 1.5]
    rows = [top, mono, pcs]  # the ceiling first: it must never stand in for the one-PC baseline
    add_ratios(rows)
    assert pcs.vs_mono == pytest.approx(72.0 / 50.0) and top.vs_mono == pytest.approx(1.8)
    found = next(t for t in targets(rows) if "emulated PCs x 2 users" in t["target"])
    assert found["ratio"] == pytest.approx(1.44) and found["ceiling"] == pytest.approx(1.8)
    assert "ceiling here 1.80x" in format_targets([found]) and "80% of it" in format_targets(
        [found]
    )


async def test_copies_start_together_and_none_outlives_a_timeout() -> None:
    import psutil

    from fleettui.bench.baseline import run_children

    child = (
        "import json, sys, time; print(json.dumps({'ready': True}), flush=True); "
        "sys.stdin.readline(); t = time.time(); time.sleep(float(sys.argv[1])); "
        "print(json.dumps({'started_at': t}))"
    )
    together = [[sys.executable, "-c", child, "0.3"], [sys.executable, "-c", child, "0.3"]]
    outputs = await run_children(together, together=True)
    starts = [json.loads(out.strip().splitlines()[-1])["started_at"] for _, out, _ in outputs]
    assert [code for code, _, _ in outputs] == [0, 0] and abs(starts[0] - starts[1]) < 0.25
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(
            run_children([[sys.executable, "-c", child, "60"]] * 2, together=True), 3.0
        )
    with pytest.raises(TimeoutError):  # one child, not released: the same
        await asyncio.wait_for(
            run_children([[sys.executable, "-c", "import time; time.sleep(60)"]]), 3.0
        )
    left = [
        p for p in psutil.Process().children(recursive=True) if "sleep" in " ".join(p.cmdline())
    ]
    assert left == []


@pytest.mark.slow
def test_two_monos_at_once_decode_in_overlapping_windows(shard_cache: Path) -> None:
    from dataclasses import replace

    from fleettui.bench.baseline import run_baseline
    from shard_compiler.compiler import compile_shards

    unsplit = compile_shards(
        "smollm2-135m-instruct", stages=1, precision="fp32", cache_root=shard_cache
    )
    fleet = load_fleet(DEFAULT_FLEET)
    fleet = replace(fleet, runtime=replace(fleet.runtime, inference_precision="f32"))
    spec = RowSpec("mono", pinned=True, copies=2)
    row = asyncio.run(run_baseline(spec, unsplit, [1, 9690, 314, 253], 24, fleet))
    assert row.ok, row.status
    assert (
        row.name == "mono 1core x2" and row.tokens == 48 and len(row.details["copies_tok_s"]) == 2
    )
    assert row.aggregate_tok_s == pytest.approx(sum(row.details["copies_tok_s"]), rel=1e-3)
    (a0, a1), (b0, b1) = row.details["copies_windows"]
    assert max(a0, b0) < min(a1, b1)  # released together: their timed decodes overlap
    cores = sorted(os.sched_getaffinity(0))
    assert row.details["cores"] == [cores[0], cores[1 % len(cores)]]


@pytest.mark.slow
def test_a_genai_baseline_killed_mid_run_leaves_no_model_folder(
    shard_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancelled bench (SIGTERM, a row timeout) kills its GenAI child, which cannot remove the
    model folder it assembled: the folder lives in one the bench made and removes itself."""
    from dataclasses import replace

    from fleettui.bench.baseline import run_baseline
    from shard_compiler.compiler import compile_shards

    unsplit = compile_shards(
        "smollm2-135m-instruct", stages=1, precision="fp32", cache_root=shard_cache
    )
    fleet = load_fleet(DEFAULT_FLEET)
    fleet = replace(fleet, runtime=replace(fleet.runtime, inference_precision="f32"))
    (tmp_path / "child").mkdir()
    # where the child's own temp folders would go
    monkeypatch.setenv("TMPDIR", str(tmp_path / "child"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "bench"))
    (tmp_path / "bench").mkdir()

    def folders(pattern: str) -> list[Path]:
        return list(tmp_path.glob(pattern))

    async def cancelled_mid_run() -> None:
        task = asyncio.ensure_future(
            run_baseline(RowSpec("genai"), unsplit, [1, 9690, 314, 253], 4000, fleet)
        )
        deadline = time.monotonic() + 300
        while not folders("**/fleettui-genai-*/model"):
            assert not task.done() and time.monotonic() < deadline, (
                "the GenAI child never assembled a model"
            )
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled_mid_run())
    assert folders("**/fleettui-genai-*") == []


@pytest.mark.slow
def test_sigterm_to_the_bench_stops_its_fleet_at_once() -> None:
    """A SIGTERM mid-run (a cancelled job, `timeout`) stops the bench cleanly: its workers go with
    it, well before their 30 s lease would end them, and it says so in one line."""
    import psutil

    state = os.environ["XDG_STATE_HOME"]

    def workers() -> list[psutil.Process]:
        found = []
        for process in psutil.process_iter(["cmdline"]):
            line = " ".join(process.info["cmdline"] or [])
            if "remote_worker" in line and (state in line or "remote_worker.mono" in line):
                found.append(process)
        return found

    process = subprocess.Popen(
        [sys.executable, "-m", "fleettui", "bench", "--quick", str(ROOT / "fleets/local.toml")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 900  # the first run of the tests may compile the shards
        while not any(state in " ".join(p.info["cmdline"] or []) for p in workers()):
            assert process.poll() is None and time.monotonic() < deadline, (
                "the bench never started a fleet"
            )
            time.sleep(0.2)
        time.sleep(2.0)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "fleettui: SIGTERM, stopping" in stderr
    left = time.monotonic() + 10
    while workers() and time.monotonic() < left:
        time.sleep(0.2)
    assert workers() == [], [p.info["cmdline"] for p in workers()]
