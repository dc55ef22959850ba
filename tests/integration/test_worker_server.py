"""Tests for the stage worker as real processes: `python -m remote_worker` over real ZeroMQ on
127.0.0.1.

Covers the daisy chain (Hello, Open, Step with speculative verify, Compact, Error forwarding),
malformed and unexpected frames (dropped and counted, the worker keeps serving), CurveZMQ refusal of
unknown keys, the draft's Propose, telemetry, exit codes, and clean shutdown leaving no process
behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import zmq

from remote_worker import protocol
from remote_worker.config import CurveKeys, Endpoint, StageConfig
from remote_worker.protocol import (
    Ack,
    Control,
    Decode,
    Error,
    Hello,
    Kind,
    Proposal,
    Propose,
    Result,
    Step,
)
from remote_worker.security import generate_keypair
from tests.support.workers import (
    NO_RANGES,
    Client,
    FakeEngine,
    Worker,
    fake_config,
    forwarding_server,
    free_port,
    shard_dir,
    stage_config,
)

ROOT = Path(__file__).resolve().parents[2]


def _garbage() -> list[list[bytes]]:
    valid = [bytes(frame) for frame in protocol.encode(Control(Kind.OPEN, 1, 1))]
    return [
        [b"hello"],
        [b"XXXX" + valid[0][4:]],
        [valid[0], b"unexpected payload"],
        [os.urandom(protocol.HEADER.size), os.urandom(100)],
        [
            bytes(f)
            for f in protocol.encode(Step(1, 1, 0, 0, NO_RANGES, tokens=np.array([1, 2], np.int64)))
        ][:-1],
    ]


def _assert_gone(pids: list[int]) -> None:
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, (
            pid
        )


@pytest.fixture(scope="module")
def two_stage_shards() -> Path:
    return shard_dir(2)


@pytest.fixture()
def chain(tmp_path: Path, two_stage_shards: Path):  # type: ignore[no-untyped-def]
    last = Worker(stage_config("stage-1", two_stage_shards, 1), tmp_path)
    first = Worker(
        stage_config("stage-0", two_stage_shards, 0, Endpoint("127.0.0.1", last.config.data_port)),
        tmp_path,
    )
    client = Client(first, last)
    try:
        yield first, last, client
    finally:
        client.close()
        for worker in (first, last):
            worker.stop()


@pytest.mark.slow
def test_chain_serves_steps_and_survives_malformed_frames(chain) -> None:  # type: ignore[no-untyped-def]
    first, last, client = chain
    for worker in (first, last):
        ping = client.wait_ready(worker)
        assert ping["stage"] == worker.config.stage_index and ping["role"] == "stage"
        assert "PLAINTEXT" in ping["warning"] and ping["security"] == "plaintext"
        assert "32" in ping["properties"]["INFERENCE_PRECISION_HINT"]
    assert client.control(first, {"op": "ping"})["layers"] == [0, 15]  # type: ignore[index]

    client.send(Hello(1))
    ack = client.receive()
    assert isinstance(ack, Ack) and ack.kind == Kind.HELLO and ack.value == 2
    assert len(ack.trace) == 2 * protocol.TRACE_FIELDS and list(
        ack.trace[:: protocol.TRACE_FIELDS]
    ) == [0, 1]

    garbage = _garbage()
    for frames in garbage:
        client.send_raw(frames)
    # well formed, but no stage expects a Result
    client.send(Result(1, 1, np.array([5], np.int64), 0))
    client.send(Control(Kind.OPEN, 1, 2))
    # a sound header with a bad body is answered (so the coordinator fails fast); the rest is
    # dropped
    refusals = [client.receive(), client.receive()]
    assert all(
        isinstance(r, Error) and r.stage == 0 and r.session == 1 and r.seq == 1 for r in refusals
    )
    assert "open" in refusals[0].message and "step" in refusals[1].message  # type: ignore[union-attr]
    assert (
        isinstance(opened := client.receive(), Ack)
        and opened.kind == Kind.OPEN
        and opened.session == 1
    )
    stats = client.control(first, {"op": "stats"})
    assert stats is not None and stats["dropped"] == len(garbage) - 2 + 1 and stats["rejected"] == 2

    # plain greedy decoding through both processes
    from tests.support.shards import chat_ids

    prompt = np.array(
        chat_ids(Path(first.config.shard_dir), "What is the capital of France?"), np.int64
    )
    client.send(Step(1, 3, 0, 0, NO_RANGES, tokens=prompt))
    result = client.receive()
    assert isinstance(result, Result) and result.accepted == 0 and len(result.tokens) == 1
    greedy = [int(result.tokens[0])]
    for index in range(6):
        position = len(prompt) + index
        client.send(
            Step(
                1, 4 + index, position, position, NO_RANGES, tokens=np.array([greedy[-1]], np.int64)
            )
        )
        reply = client.receive()
        assert isinstance(reply, Result), reply
        greedy.append(int(reply.tokens[0]))
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(
        str(Path(first.config.shard_dir) / "tokenizer" / "tokenizer.json")
    )
    assert "Paris" in tokenizer.decode(greedy)

    # the same answer with speculation in session 2: one verify of 3 drafts (2 right, 1 wrong), then
    # rollback
    client.send(Control(Kind.OPEN, 2, 20))
    assert isinstance(client.receive(), Ack)
    client.send(Step(2, 21, 0, 0, NO_RANGES, tokens=prompt))
    assert int(client.receive().tokens[0]) == greedy[0]  # type: ignore[union-attr]
    drafts = np.array([greedy[1], greedy[2], (greedy[3] + 1) % 49152], np.int64)
    start = len(prompt)
    client.send(
        Step(
            2,
            22,
            start,
            start,
            NO_RANGES,
            tokens=np.array([greedy[0], *drafts], np.int64),
            decode=Decode(draft_tokens=drafts, top_logprobs=3),
        )
    )
    verify = client.receive()
    assert isinstance(verify, Result)
    assert verify.accepted == 2 and verify.tokens.tolist() == greedy[1:4]
    assert verify.top_ids.shape == (3, 3) and verify.top_ids[:, 0].tolist() == greedy[1:4]
    # slot start+3 held the wrong draft: mask it, feed the correction at logical position start+3
    client.send(
        Step(
            2,
            23,
            start + 3,
            start + 4,
            np.array([[start + 3, start + 4]], np.int64),
            tokens=np.array([greedy[3]], np.int64),
        )
    )
    assert int(client.receive().tokens[0]) == greedy[4]  # type: ignore[union-attr]
    client.send(Control(Kind.COMPACT, 2, 24, cache_len=start + 5))
    compacted = client.receive()
    assert (
        isinstance(compacted, Ack)
        and compacted.kind == Kind.COMPACT
        and compacted.value == start + 4
    )
    client.send(
        Step(2, 25, start + 4, start + 4, NO_RANGES, tokens=np.array([greedy[4]], np.int64))
    )
    assert int(client.receive().tokens[0]) == greedy[5]  # type: ignore[union-attr]

    # a step the first stage refuses comes back as an Error through the second stage
    client.send(Step(1, 30, 0, 12345, NO_RANGES, tokens=np.array([1], np.int64)))
    error = client.receive()
    assert (
        isinstance(error, Error)
        and error.stage == 0
        and error.seq == 30
        and "12345" in error.message
    )
    stats = client.control(last, {"op": "stats"})
    assert stats is not None and stats["sessions"]["1"]["cache_len"] == len(prompt) + 6
    assert stats["handled"]["Error"] == 3 and stats["handled"]["Step"] == 11

    # telemetry: one JSON sample about once a second
    subscriber = client.context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(last.url(last.config.telemetry_port))
    assert subscriber.poll(5000), "no telemetry within 5 s"
    sample = json.loads(subscriber.recv())
    expected = {
        "name",
        "stage",
        "state",
        "time",
        "steps_per_s",
        "tokens_per_s",
        "busy",
        "queue",
        "last_step_ms",
        "rss_mb",
        "temp_c",
        "sessions",
        "cache_slots",
        "dropped",
        "errors",
    }
    assert expected <= set(sample) and sample["name"] == "stage-1" and sample["sessions"] == 2

    pids = [first.process.pid, last.process.pid]
    for worker in (first, last):
        assert client.control(worker, {"op": "shutdown"}) is not None
    for worker in (first, last):
        assert worker.process.wait(20) == 0
    _assert_gone(pids)


@pytest.mark.slow
def test_curve_chain_interleaves_sessions(tmp_path: Path, two_stage_shards: Path) -> None:
    """Stage 0 is a CURVE client of stage 1; steps of two sessions sent back to back are all
    served."""
    coordinator, keys0, keys1 = generate_keypair(), generate_keypair(), generate_keypair()
    last = Worker(
        stage_config(
            "curve-b", two_stage_shards, 1, curve=CurveKeys(*keys1, (coordinator[0], keys0[0]))
        ),
        tmp_path,
    )
    first_curve = CurveKeys(*keys0, (coordinator[0],), next_server_key=keys1[0])
    first = Worker(
        stage_config(
            "curve-a",
            two_stage_shards,
            0,
            Endpoint("127.0.0.1", last.config.data_port),
            curve=first_curve,
        ),
        tmp_path,
    )
    client = Client(first, last, coordinator)
    try:
        for worker in (first, last):
            assert client.wait_ready(worker)["security"] == "curve"
        client.send(Hello(1))
        hello = client.receive()
        assert isinstance(hello, Ack) and hello.value == 2

        from tests.support.shards import chat_ids

        prompts = [
            np.array(chat_ids(two_stage_shards, question), np.int64)
            for question in ("What is the capital of France?", "Write a haiku about the sea.")
        ]
        sampling = Decode(temperature=0.8, top_p=0.9, uniforms=np.array([0.3, 0.6]))

        def run(sessions: list[int], prompts: list[np.ndarray]) -> dict[int, list[int]]:
            """Prefill every session, then one sampled step each, all sent before any reply is
            read."""
            for session in sessions:
                client.send(Control(Kind.RESET if session in opened else Kind.OPEN, session, 0))
                opened.add(session)
            for session, prompt in zip(sessions, prompts, strict=True):
                client.send(Step(session, 1, 0, 0, NO_RANGES, tokens=prompt))
            for session, prompt in zip(sessions, prompts, strict=True):
                tail = np.array([7, 8], np.int64)
                client.send(
                    Step(
                        session,
                        2,
                        len(prompt),
                        len(prompt),
                        NO_RANGES,
                        tokens=tail,
                        decode=sampling,
                    )
                )
            results: dict[int, list[int]] = {session: [] for session in sessions}
            for _ in range(len(sessions) * 3):
                reply = client.receive()
                if isinstance(reply, Result):
                    results[reply.session] += reply.tokens.tolist()
                else:
                    assert isinstance(reply, Ack), reply
            return results

        opened: set[int] = set()
        together = run([1, 2], prompts)
        alone = {**run([3], prompts[:1]), **run([4], prompts[1:])}
        assert together[1] == alone[3] and together[2] == alone[4]
        assert len(together[1]) == len(together[2]) == 2
    finally:
        client.close()
        for worker in (first, last):
            worker.stop()


@pytest.mark.slow
def test_curve_refuses_a_client_with_an_unknown_key(tmp_path: Path, two_stage_shards: Path) -> None:
    server_public, server_secret = generate_keypair()
    coordinator = generate_keypair()
    intruder = generate_keypair()
    curve = CurveKeys(server_public, server_secret, (coordinator[0],))
    worker = Worker(stage_config("curve-1", two_stage_shards, 1, curve=curve), tmp_path)
    trusted, stranger = Client(worker, worker, coordinator), Client(worker, worker, intruder)
    try:
        ping = trusted.wait_ready(worker)
        assert ping["security"] == "curve" and "warning" not in ping
        hidden = np.zeros((2, 576), np.float32)
        for message in (Control(Kind.OPEN, 1, 1), Step(1, 2, 0, 0, NO_RANGES, hidden=hidden)):
            with contextlib.suppress(zmq.Again):  # once refused, the stranger has nowhere to send
                stranger.push.send_multipart(protocol.encode(message), zmq.NOBLOCK)
        # refused: no answer at all
        assert stranger.control(worker, {"op": "stats"}, timeout=2.0) is None
        with pytest.raises(AssertionError, match="no message"):
            stranger.receive(timeout=1.0)
        stats = trusted.control(worker, {"op": "stats"})
        assert (
            stats is not None
            and stats["steps"] == 0
            and stats["sessions"] == {}
            and stats["dropped"] == 0
        )
        # ZAP refusals fail the handshake too
        assert stats["refused_clients"] >= 1 and stats["refused"] >= 1

        # a peer with the wrong server key fails the CURVE handshake before ZAP: counted and logged
        # as well
        stranger.close()
        before = trusted.control(worker, {"op": "ping"})["refused"]  # type: ignore[index]
        impostor = zmq.Context()
        wrong = impostor.socket(zmq.PUSH)
        wrong.linger = 0
        wrong.curve_publickey, wrong.curve_secretkey = (key.encode() for key in coordinator)
        wrong.curve_serverkey = generate_keypair()[0].encode()
        wrong.connect(worker.url(worker.config.data_port))
        try:
            deadline = time.monotonic() + 30
            while (
                "HANDSHAKE_FAILED_PROTOCOL" not in worker.log.read_text()
                and time.monotonic() < deadline
            ):
                time.sleep(0.2)
            ping = trusted.control(worker, {"op": "ping"})
            assert ping is not None and ping["refused"] > before
            assert "refused a peer on data" in worker.log.read_text()
        finally:
            impostor.destroy(linger=0)

        trusted.send(Control(Kind.OPEN, 1, 1))
        trusted.send(Step(1, 2, 0, 0, NO_RANGES, hidden=hidden))
        assert isinstance(trusted.receive(), Ack)
        result = trusted.receive()
        assert isinstance(result, Result) and len(result.tokens) == 1
        assert trusted.control(worker, {"op": "stats"})["steps"] == 1  # type: ignore[index]

        pid = worker.process.pid
        worker.process.send_signal(signal.SIGTERM)
        assert worker.process.wait(20) == 0
        _assert_gone([pid])
    finally:
        trusted.close()
        stranger.close()
        worker.stop()


@pytest.mark.slow
def test_draft_proposes_greedy_and_sampled_tokens(tmp_path: Path) -> None:
    shards = shard_dir(1)
    worker = Worker(stage_config("draft", shards, 0, role="draft"), tmp_path)
    client = Client(worker, worker)
    try:
        client.wait_ready(worker)
        prompt = np.array(
            [
                1,
                9690,
                198,
                4093,
                198,
                1780,
                314,
                260,
                3575,
                282,
                4649,
                47,
                2,
                198,
                1,
                520,
                9531,
                198,
            ]
        )
        for session in (1, 2, 3):
            client.send(Control(Kind.OPEN, session, 0))
            assert isinstance(client.receive(), Ack)
        client.send(Step(1, 1, 0, 0, NO_RANGES, tokens=prompt))
        greedy = [int(client.receive().tokens[0])]  # type: ignore[union-attr]
        for index in range(4):
            position = len(prompt) + index
            client.send(
                Step(1, 2, position, position, NO_RANGES, tokens=np.array([greedy[-1]], np.int64))
            )
            greedy.append(int(client.receive().tokens[0]))  # type: ignore[union-attr]

        client.send(Propose(2, 5, 0, 0, NO_RANGES, prompt, k=4, support=0, decode=Decode()))
        proposal = client.receive()
        assert isinstance(proposal, Proposal) and proposal.tokens.tolist() == greedy[:4]
        stats = client.control(worker, {"op": "stats"})
        assert stats is not None and stats["sessions"]["2"]["cache_len"] == len(prompt) + 3

        sampled = []
        for session in (3, 1):
            client.send(Control(Kind.RESET, session, 6))
            assert isinstance(client.receive(), Ack)
            uniforms = np.array([0.1, 0.7, 0.3, 0.9])
            client.send(
                Propose(
                    session,
                    7,
                    0,
                    0,
                    NO_RANGES,
                    prompt,
                    k=4,
                    support=8,
                    decode=Decode(temperature=0.8, top_p=0.95, uniforms=uniforms),
                )
            )
            reply = client.receive()
            assert (
                isinstance(reply, Proposal)
                and reply.ids.shape == (4, 8)
                and reply.probs.shape == (4, 8)
            )
            np.testing.assert_allclose(reply.probs.sum(axis=1), 1.0, rtol=1e-5)
            assert all(
                token in row
                for token, row in zip(reply.tokens.tolist(), reply.ids.tolist(), strict=True)
            )
            sampled.append(reply.tokens.tolist())
        assert sampled[0] == sampled[1]  # the same uniforms give the same proposals

        client.send(Propose(2, 8, 0, 12, NO_RANGES, prompt, k=2, support=0, decode=Decode()))
        refused = client.receive()
        assert isinstance(refused, Error) and "12" in refused.message
    finally:
        client.close()
        worker.stop()


@pytest.mark.slow
def test_steps_that_arrive_together_share_one_inference_and_answer_as_alone(tmp_path: Path) -> None:
    """Three sessions' decode steps sent in one Batch are served as one inference (the worker's
    stats count it), and each session's greedy tokens equal those of a fourth session stepped
    alone."""
    worker = Worker(stage_config("stage-0", shard_dir(1), 0), tmp_path)
    client = Client(worker, worker)
    prompt = np.array(
        [1, 9690, 198, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    )
    try:
        client.wait_ready(worker)
        tokens: dict[int, list[int]] = {}
        for session in (1, 2, 3, 4):
            client.send(Control(Kind.OPEN, session, 0))
            assert isinstance(client.receive(), Ack)
            client.send(Step(session, 1, 0, 0, NO_RANGES, tokens=prompt))
            tokens[session] = [int(client.receive().tokens[0])]  # type: ignore[union-attr]
        for seq in range(2, 8):
            position = len(prompt) + seq - 2
            steps = [
                Step(
                    s,
                    seq,
                    position,
                    position,
                    NO_RANGES,
                    tokens=np.array([tokens[s][-1]], np.int64),
                )
                for s in (1, 2, 3)
            ]
            client.send_raw(
                [bytes(f) for f in protocol.batch_frames([protocol.encode(s) for s in steps])]
            )
            for _ in steps:
                reply = client.receive()
                assert isinstance(reply, Result), reply
                tokens[reply.session].append(int(reply.tokens[0]))
            client.send(
                Step(
                    4,
                    seq,
                    position,
                    position,
                    NO_RANGES,
                    tokens=np.array([tokens[4][-1]], np.int64),
                )
            )
            tokens[4].append(int(client.receive().tokens[0]))  # type: ignore[union-attr]
        stats = client.control(worker, {"op": "stats"})
        assert stats is not None and max(int(size) for size in stats["batches"]) >= 2, stats[
            "batches"
        ]
        # one prompt: every session answers alike
        assert tokens[1] == tokens[2] == tokens[3] == tokens[4]
    finally:
        client.close()
        worker.stop()


def _run_worker(tmp_path: Path, text: str) -> subprocess.CompletedProcess:
    path = tmp_path / "stage.json"
    path.write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "remote_worker", "--config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_bad_config_exits_2_with_one_line(tmp_path: Path) -> None:
    done = _run_worker(
        tmp_path,
        json.dumps(
            {
                "name": "x",
                "shard_dir": "/nowhere",
                "stage_index": 0,
                "data_port": 70000,
                "control_port": 1,
                "telemetry_port": 2,
                "result_port": 3,
            }
        ),
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("remote_worker: config") and "data_port" in lines[-1]
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_missing_shard_exits_3_with_one_line(tmp_path: Path) -> None:
    config = StageConfig(
        name="x",
        shard_dir=str(tmp_path / "none"),
        stage_index=0,
        data_port=free_port(),
        control_port=free_port(),
        telemetry_port=free_port(),
        result_port=free_port(),
    )
    done = _run_worker(tmp_path, config.to_json())
    assert done.returncode == 3
    assert (
        "manifest.json" in done.stderr.strip().splitlines()[-1] and "Traceback" not in done.stderr
    )


@pytest.mark.parametrize(("peak", "dtype"), [(3.0, np.float16), (1e6, np.float32)])
def test_hidden_states_travel_as_f16_unless_they_overflow_it(peak: float, dtype: type) -> None:
    output = np.full((2, 4), 0.5, np.float32)
    output[1, 2] = peak
    with forwarding_server(FakeEngine(output)) as (upstream, downstream):
        upstream.send_multipart(protocol.encode(Control(Kind.OPEN, 1, 1)))
        upstream.send_multipart(
            protocol.encode(Step(1, 2, 0, 0, NO_RANGES, tokens=np.array([5, 6], np.int64)))
        )
        assert isinstance(protocol.decode(downstream.recv_multipart()), Control)
        assert downstream.poll(10_000)
        forwarded = protocol.decode(downstream.recv_multipart())
        assert isinstance(forwarded, Step) and forwarded.hidden is not None
        assert forwarded.hidden.dtype == dtype and float(forwarded.hidden.max()) == pytest.approx(
            peak
        )
        assert forwarded.trace.shape == (protocol.TRACE_FIELDS,) and forwarded.trace[0] == 0


def test_a_message_is_counted_as_handled_before_its_answer_leaves() -> None:
    """Whoever an answer reaches may ask for the stats at once: the served message is counted by
    then; a failed one counts as an error, never as handled."""
    from collections import Counter

    from remote_worker.server import StageServer

    config = fake_config(free_port())
    server = StageServer(config, FakeEngine(np.zeros((2, 4), np.float32)))
    seen: list[tuple[str, Counter[str], int]] = []

    class Output:
        def send_multipart(self, frames: list[Any], flags: int = 0, copy: bool = True) -> None:
            sent = protocol.decode([bytes(frame) for frame in frames])
            seen.append((type(sent).__name__, Counter(server.stats.handled), server.stats.errors))

    server.output = Output()  # type: ignore[assignment]
    try:
        server._serve(time.time(), Control(Kind.OPEN, 1, 1))
        server._serve(time.time(), Step(1, 2, 0, 0, NO_RANGES, tokens=np.array([5, 6], np.int64)))
        # not open
        server._serve(time.time(), Step(7, 3, 0, 0, NO_RANGES, tokens=np.array([5], np.int64)))
        server._serve(time.time(), Error(1, 4, 1, "upstream failed"))
    finally:
        server.close()
    assert [(kind, dict(counts), errors) for kind, counts, errors in seen] == [
        ("Control", {"Control": 1}, 0),
        ("Step", {"Control": 1, "Step": 1}, 0),
        ("Error", {"Control": 1, "Step": 1}, 1),
        ("Error", {"Control": 1, "Step": 1, "Error": 1}, 1),
    ]
