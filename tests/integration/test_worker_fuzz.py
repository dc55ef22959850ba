"""Fuzz test: a real worker (the whole real model in one shard, plaintext) under >= 10,000 hostile
frames.

Every socket gets garbage: the data socket random bytes, truncated and mutated valid messages, wrong
versions, huge declared lengths, NaN payloads and wrong dtypes; the control socket malformed
requests; the telemetry socket random subscriptions; every port raw TCP garbage and peers of the
wrong socket type. The worker must stay up, account for every message it received (served, refused
with an Error, or dropped and counted), keep its memory bounded, and answer a real prompt afterwards
exactly as before."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import zmq

from remote_worker import protocol
from remote_worker.protocol import Ack, Control, Decode, Hello, Kind, Propose, Result, Step
from tests.support.workers import NO_RANGES, Client, Worker, shard_dir, stage_config

pytestmark = pytest.mark.slow
DATA_MESSAGES = 10_000
CONTROL_REQUESTS = 600
ANSWER_TOKENS = 6


def _mine(client: Client, session: int) -> protocol.Message:
    """The next reply for `session` (a late answer to a fuzz frame is skipped)."""
    while True:
        reply = client.receive()
        if getattr(reply, "session", None) == session and reply.seq < 100:
            return reply


def answer(client: Client, prompt: np.ndarray, session: int) -> list[int]:
    """Greedy tokens for `prompt` in a fresh session (prefill, then one token per step)."""
    client.send(Control(Kind.CLOSE, session, 1))
    client.send(Control(Kind.OPEN, session, 2))
    client.send(Step(session, 3, 0, 0, NO_RANGES, tokens=prompt, decode=Decode(top_logprobs=2)))
    replies = [_mine(client, session) for _ in range(3)]
    assert [type(r) for r in replies] == [Ack, Ack, Result], replies
    tokens = [int(replies[2].tokens[0])]  # type: ignore[union-attr]
    for index in range(ANSWER_TOKENS - 1):
        position = len(prompt) + index
        step = Step(
            session,
            4 + index,
            position,
            position,
            NO_RANGES,
            tokens=np.array([tokens[-1]], np.int64),
        )
        client.send(step)
        reply = _mine(client, session)
        assert isinstance(reply, Result), reply
        tokens.append(int(reply.tokens[0]))
    return tokens


def _valid_messages(rng: np.random.Generator) -> list[list[bytes]]:
    """Well-formed requests the fuzzer starts from (sessions that are never opened: nothing heavy
    runs)."""
    session = int(rng.integers(1000, 2000))
    tokens = rng.integers(0, 49152, 3).astype(np.int64)
    messages = [
        Step(session, 1, 0, 0, NO_RANGES, tokens=tokens),
        Step(
            session,
            2,
            5,
            5,
            np.array([[1, 3]], np.int64),
            tokens=tokens,
            decode=Decode(top_logprobs=3),
        ),
        Step(
            session,
            3,
            0,
            0,
            NO_RANGES,
            tokens=tokens,
            decode=Decode(
                temperature=0.7,
                top_p=0.9,
                draft_tokens=tokens[:2],
                draft_ids=tokens[:2].reshape(2, 1),
                draft_probs=np.ones((2, 1), np.float32),
                uniforms=rng.random(6),
                presence_penalty=0.5,
                penalty_ids=np.array([4, 9], np.int64),
                penalty_counts=np.array([1, 2], np.int32),
            ),
        ),
        Step(session, 4, 0, 0, NO_RANGES, hidden=rng.normal(size=(2, 576)).astype(np.float16)),
        Propose(session, 5, 0, 0, NO_RANGES, tokens, k=2, support=0, decode=Decode()),
        Hello(6),
        Control(Kind.RESET, session, 7),
        protocol.Error(session, 8, 0, "upstream failure"),
    ]
    return [[bytes(frame) for frame in protocol.encode(message)] for message in messages]


def _mutations(rng: np.random.Generator, count: int) -> list[list[bytes]]:
    out: list[list[bytes]] = []
    while len(out) < count:
        base = _valid_messages(rng)
        frames = [bytearray(f) for f in base[int(rng.integers(len(base)))]]
        choice = int(rng.integers(9))
        if choice == 0:  # random bytes
            out.append([rng.bytes(int(rng.integers(0, 200)))])
            continue
        if choice == 1:  # a random multipart
            out.append(
                [rng.bytes(int(rng.integers(0, 64))) for _ in range(int(rng.integers(1, 12)))]
            )
            continue
        if choice == 2 and len(frames) > 1:  # truncated: a frame missing or cut short
            index = int(rng.integers(len(frames)))
            if rng.random() < 0.5:
                del frames[index]
            else:
                frames[index] = frames[index][: int(rng.integers(0, max(1, len(frames[index]))))]
        elif choice == 3:  # flipped bytes anywhere
            for _ in range(int(rng.integers(1, 4))):
                index = int(rng.integers(len(frames)))
                if frames[index]:
                    frames[index][int(rng.integers(len(frames[index])))] ^= int(
                        rng.integers(1, 256)
                    )
        elif choice == 4:  # a wrong protocol version
            frames[0][4:6] = struct.pack("<H", int(rng.choice([0, 1, 3, 0xFFFF])))
        elif choice == 5:  # huge declared lengths: n, width, counts
            offset = int(rng.choice([24, 28, 32, 36]))  # n, width, count_a, count_b
            frames[0][offset : offset + 4] = struct.pack(
                "<I", int(rng.choice([0xFFFFFFFF, 1 << 20, 1 << 31]))
            )
        elif (
            choice == 6 and len(frames) > 3
        ):  # NaN payloads: hidden states, decode floats, uniforms
            index = int(rng.integers(1, len(frames)))
            if len(frames[index]) >= 4:
                at = int(rng.integers(0, len(frames[index]) // 4)) * 4
                frames[index][at : at + 4] = np.float32(np.nan).tobytes()
        elif choice == 7 and len(frames) > 2:  # wrong dtypes: the payload reinterpreted or re-typed
            values = np.frombuffer(bytes(frames[2][: len(frames[2]) // 8 * 8]), np.int64)
            frames[2] = bytearray(
                values.astype(rng.choice([np.float32, np.float64, np.int16])).tobytes()
            )
        else:  # flags: hidden states claimed float16/float32 the other way round
            frames[0][7] ^= protocol.FLAG_F16
        out.append([bytes(f) for f in frames])
    return out


def _control_garbage(rng: np.random.Generator) -> list[list[bytes]]:
    requests: list[list[bytes]] = []
    for index in range(CONTROL_REQUESTS):
        kind = index % 6
        if kind == 0:
            requests.append([rng.bytes(int(rng.integers(0, 300)))])
        elif kind == 1:
            requests.append([b"[" * int(rng.integers(1000, 200_000))])
        elif kind == 2:
            requests.append([rng.bytes(8) for _ in range(int(rng.integers(2, 5)))])
        elif kind == 3:
            requests.append([json.dumps(rng.normal(size=3).tolist()).encode()])
        elif kind == 4:
            requests.append([json.dumps({"op": rng.bytes(6).hex()}).encode()])
        else:
            requests.append(
                [json.dumps({"op": "lease", "seconds": float(rng.normal() * 1e6) - 1e7}).encode()]
            )
    return requests


class Drain:
    """Reads everything the worker sends to its result socket while the fuzzer runs, by kind."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.kinds: Counter[str] = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.client.pull.poll(100):
                for part in protocol.split(self.client.pull.recv_multipart()):
                    self.kinds[type(protocol.decode(part)).__name__] += 1

    def finish(self) -> Counter[str]:
        self.stop.set()
        self.thread.join(10)
        return self.kinds


def test_fuzz_every_socket_then_the_answer_is_unchanged(tmp_path: Path) -> None:
    import psutil

    from tests.support.shards import chat_ids

    shards = shard_dir(1)
    worker = Worker(stage_config("fuzzed", shards, 0), tmp_path)
    client = Client(worker, worker)
    rng = np.random.default_rng(20261130)
    try:
        client.wait_ready(worker)
        prompt = np.array(chat_ids(shards, "What is the capital of France?"), np.int64)
        before = answer(client, prompt, 1)
        start = client.control(worker, {"op": "stats"})
        assert start is not None
        rss_before = psutil.Process(worker.process.pid).memory_info().rss

        drain = Drain(client)
        client.push.sndtimeo = 60_000
        messages = _mutations(rng, DATA_MESSAGES)
        for frames in messages:
            client.send_raw(frames)
        control = _control_garbage(rng)
        requester = client.context.socket(zmq.REQ)
        requester.linger = 0
        requester.connect(worker.url(worker.config.control_port))
        for index, frames in enumerate(control):
            requester.send_multipart(frames)
            assert requester.poll(30_000), f"control request {index} unanswered"
            reply = json.loads(requester.recv())
            assert isinstance(reply, dict) and "error" in reply
        subscriber = client.context.socket(zmq.XSUB)
        subscriber.linger = 0
        subscriber.connect(worker.url(worker.config.telemetry_port))
        for _ in range(300):
            subscriber.send(rng.bytes(int(rng.integers(0, 100))))
        # peers of the wrong socket type and raw TCP garbage (refused by libzmq before any message)
        wrong = []
        for kind, port in (
            (zmq.PULL, worker.config.data_port),
            (zmq.REP, worker.config.control_port),
            (zmq.PUSH, worker.config.result_port),
        ):
            peer = client.context.socket(kind)
            peer.linger = 0
            peer.connect(worker.url(port))
            wrong.append(peer)
        ports = [worker.config.data_port, worker.config.control_port, worker.config.telemetry_port]
        for port in [*ports, worker.config.result_port] * 5:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                raw.sendall(rng.bytes(int(rng.integers(1, 4096))))

        # wait until everything sent has been taken in and served
        deadline = time.monotonic() + 120
        while True:
            stats = client.control(worker, {"op": "stats"})
            assert stats is not None and worker.process.poll() is None
            served = sum(stats["handled"].values())
            accounted = (
                stats["dropped"] + stats["rejected"] + stats["overflow"] + stats["errors"] + served
            )
            settled = (
                stats["queue"] == 0
                and stats["busy_since"] is None
                and accounted == stats["received"]
            )
            if settled and stats["received"] - start["received"] >= DATA_MESSAGES:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.5)
        time.sleep(1.0)
        kinds = drain.finish()
        for peer in [requester, subscriber, *wrong]:
            peer.close(0)

        final = client.control(worker, {"op": "stats"})
        assert final is not None
        # every message is accounted for: served, refused with an Error, or dropped and counted
        served = sum(final["handled"].values())
        parts = ("dropped", "rejected", "overflow", "errors")
        assert final["received"] == sum(final[part] for part in parts) + served, final
        # raw garbage may add ZMTP/1.0 messages
        assert final["received"] - start["received"] >= DATA_MESSAGES
        garbage = sum(final[part] - start[part] for part in ("dropped", "rejected"))
        assert garbage >= DATA_MESSAGES // 2, final
        assert final["control_errors"] - start["control_errors"] == len(control)
        # each refusal and failure went down the chain to the coordinator's socket (unless it could
        # not)
        answered = final["rejected"] - start["rejected"] + final["errors"] - start["errors"]
        assert kinds["Error"] + final["unsent"] >= answered
        rss_after = psutil.Process(worker.process.pid).memory_info().rss
        assert rss_after < rss_before + (400 << 20), (rss_before, rss_after)

        assert answer(client, prompt, 1) == before  # still exact
    finally:
        client.close()
        worker.stop()
