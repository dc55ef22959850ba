"""Stage workers as real processes for tests: free ports, stage configs, a worker process, the
coordinator's sockets (`Client`), and a compute stand-in (`FakeEngine`) for the server's forwarding
logic."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from remote_worker import protocol
from remote_worker.config import CurveKeys, Endpoint, StageConfig

ROOT = Path(__file__).resolve().parents[2]
NO_RANGES = np.zeros((0, 2), np.int64)
START_TIMEOUT = 180.0
REPLY_TIMEOUT = 30.0
_USED_PORTS: set[int] = set()


def free_port() -> int:
    """A TCP port nobody listens on right now (probed by binding), never handed out twice in this
    run."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in _USED_PORTS:
            _USED_PORTS.add(port)
            return port


def shard_dir(stages: int) -> Path:
    from tests.support.shards import compiled

    return compiled(stages, "fp32")


def stage_config(
    name: str,
    shards: Path,
    index: int,
    next_endpoint: Endpoint | None = None,
    role: str = "stage",
    curve: CurveKeys | None = None,
) -> StageConfig:
    return StageConfig(
        name=name,
        shard_dir=str(shards),
        stage_index=index,
        data_port=free_port(),
        control_port=free_port(),
        telemetry_port=free_port(),
        result_port=None if next_endpoint else free_port(),
        role=role,
        next=next_endpoint,
        inference_precision="f32",
        kv_cache_precision="f32",
        wire_dtype="f32",
        curve=curve,
        verify_hashes=True,
    )


class Worker:
    """One `python -m remote_worker` process."""

    def __init__(self, config: StageConfig, directory: Path) -> None:
        self.config = config
        self.path = directory / f"{config.name}.json"
        self.path.write_text(config.to_json())
        self.log = directory / f"{config.name}.log"
        self.stdout = open(directory / f"{config.name}.out", "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "remote_worker",
                "--config",
                str(self.path),
                "--log",
                str(self.log),
            ],
            cwd=ROOT,
            stdout=self.stdout,
            stderr=subprocess.DEVNULL,
        )

    def url(self, port: int) -> str:
        return f"tcp://127.0.0.1:{port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.stdout.close()

    def log_tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else "(no log)"


class Client:
    """The coordinator's side of the chain: PUSH into the first stage, PULL from the last, REQ
    for control."""

    def __init__(self, first: Worker, last: Worker, keys: tuple[str, str] | None = None) -> None:
        self.context = zmq.Context()
        self.keys = keys
        self.push = self._socket(zmq.PUSH, first)
        # a refused CURVE client loses its pipe: a send would block forever
        self.push.sndtimeo = 10_000
        self.push.connect(first.url(first.config.data_port))
        self.pull = self._socket(zmq.PULL, last)
        assert last.config.result_port is not None
        self.pull.connect(last.url(last.config.result_port))
        self.waiting: list[protocol.Message] = []

    def _socket(self, kind: int, server: Worker) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.linger = 0
        if self.keys is not None:
            assert server.config.curve is not None
            sock.curve_publickey, sock.curve_secretkey = (key.encode() for key in self.keys)
            sock.curve_serverkey = server.config.curve.public_key.encode()
        return sock

    def control(
        self, worker: Worker, request: dict[str, Any], timeout: float = REPLY_TIMEOUT
    ) -> dict[str, Any] | None:
        """One control request with a poll timeout (None when no answer came)."""
        req = self._socket(zmq.REQ, worker)
        req.connect(worker.url(worker.config.control_port))
        try:
            req.send_json(request)
            if req.poll(int(timeout * 1000)):
                return req.recv_json()
            return None
        finally:
            req.close(linger=0)

    def wait_ready(self, worker: Worker) -> dict[str, Any]:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if worker.process.poll() is not None:
                pytest.fail(
                    f"{worker.config.name} exited with "
                    f"{worker.process.returncode}:\n{worker.log_tail()}"
                )
            answer = self.control(worker, {"op": "ping"}, timeout=1.0)
            if answer is not None and answer.get("state") == "ready":
                return answer
        pytest.fail(f"{worker.config.name} never became ready:\n{worker.log_tail()}")

    def send(self, message: protocol.Message) -> None:
        self.push.send_multipart(protocol.encode(message), copy=False)

    def send_raw(self, frames: list[bytes]) -> None:
        self.push.send_multipart(frames)

    def receive(self, timeout: float = REPLY_TIMEOUT) -> protocol.Message:
        """The next message from the last stage (those of a Batch one by one, in order)."""
        if not self.waiting:
            if not self.pull.poll(int(timeout * 1000)):
                raise AssertionError("no message from the last stage")
            self.waiting.extend(
                protocol.decode(part) for part in protocol.split(self.pull.recv_multipart())
            )
        return self.waiting.pop(0)

    def close(self) -> None:
        self.context.destroy(linger=0)


def fake_config(downstream_port: int) -> StageConfig:
    """A first stage that forwards to DOWNSTREAM_PORT, for a server around `FakeEngine` (no
    shard)."""
    return StageConfig(
        name="fake",
        shard_dir="/unused",
        stage_index=0,
        data_port=free_port(),
        control_port=free_port(),
        telemetry_port=free_port(),
        next=Endpoint("127.0.0.1", downstream_port),
    )


class FakeEngine:
    """Compute stand-in for the server's forwarding logic: a first, non-last stage whose output
    is chosen."""

    is_first, is_last = True, False
    hidden_size = 4
    compile_seconds, loaded_from_cache = 0.0, False
    batch_max = 1  # each step alone: the fake's steps are served one by one through `step`

    def __init__(self, output: np.ndarray) -> None:
        from remote_worker.manifest import LayerRange

        self.output = output
        self.sessions: dict[int, int] = {}
        self.stage = type("Stage", (), {"layers": LayerRange(0, 15)})()

    def effective_properties(self) -> dict[str, str]:
        return {"INFERENCE_PRECISION_HINT": "f32"}

    def open(self, session: int) -> None:
        self.sessions[session] = 0

    def has(self, session: int) -> bool:
        return session in self.sessions

    def mark_broken(self, session: int, reason: str) -> None:
        self.broken = reason

    def step(
        self,
        session: int,
        pos0: int,
        cache_len: int,
        ranges: np.ndarray,
        data: np.ndarray,
        keep_last: int = 0,
    ):  # noqa: ANN201
        self.sessions[session] += len(data)
        return self.output[: len(data)]

    def step_many(self, requests: list[Any]) -> list[Any]:
        results: list[Any] = []
        for r in requests:
            try:
                results.append(
                    self.step(r.session, r.pos0, r.cache_len, r.mask_ranges, r.data, r.keep_last)
                )
            except Exception as error:  # noqa: BLE001 - the engine's contract: an error per step
                results.append(error)
        return results

    def set_batching(self, max_batch: int) -> int:
        return 1

    def cache_len(self, session: int) -> int:
        return self.sessions[session]

    def masked_slots(self, session: int) -> int:
        return 0

    def cache_slots(self) -> int:
        return sum(self.sessions.values())

    def session_bytes(self) -> int:
        return 0


@contextlib.contextmanager
def forwarding_server(engine: FakeEngine) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """A first stage around ENGINE serving on a thread: (upstream PUSH into it, downstream PULL of
    what it forwards); stopped and closed on exit."""
    from remote_worker.server import StageServer

    downstream_port = free_port()
    config = fake_config(downstream_port)  # wire_dtype f16, the default
    server = StageServer(config, engine)
    context = zmq.Context()
    downstream = context.socket(zmq.PULL)
    downstream.bind(f"tcp://127.0.0.1:{downstream_port}")
    upstream = context.socket(zmq.PUSH)
    upstream.connect(f"tcp://127.0.0.1:{config.data_port}")
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield upstream, downstream
    finally:
        server.stop()
        thread.join(10)
        server.close()
        context.destroy(linger=0)
