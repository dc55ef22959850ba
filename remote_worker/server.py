"""Provides the ZeroMQ loop of one stage worker: receive, run on the engine, forward down the chain (one thread).

Sockets: data PULL (bound; the previous stage or the coordinator pushes into it), an outgoing PUSH (connected
to the next stage, or bound at `result_port` for the last stage and the draft, where the coordinator pulls),
a control REP (JSON ping/stats/shutdown) and a telemetry PUB (one JSON sample about once a second).
Sockets are bound only after the model compiled, so a "ready" answer to ping means ready to serve.
Messages are served in arrival order, so steps of different sessions interleave naturally. A message
that cannot be served becomes an `Error` sent down the chain; a malformed or unexpected frame is dropped
and counted, and the worker keeps serving.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import time
from collections import deque
from typing import Any

import numpy as np
import zmq

from remote_worker import protocol
from remote_worker.config import StageConfig
from remote_worker.decoding import propose_distribution, sample, score
from remote_worker.security import PLAINTEXT_WARNING, LinkSecurity
from remote_worker.telemetry import StageStats, encode_sample, rss_megabytes

logger = logging.getLogger(__name__)

MAX_QUEUE = 4096  # messages waiting; beyond this new ones are dropped and counted
MAX_MESSAGE_BYTES = 512 << 20  # larger multiparts are refused by ZeroMQ itself
SEND_TIMEOUT_MS = 10_000  # a send that cannot complete (no coordinator) errors instead of hanging
POLL_CEILING_MS = 200  # the loop wakes at least this often to notice signals
_GREEDY = protocol.Decode()
_NO_RANGES = np.zeros((0, 2), np.int64)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


class StageServer:
    """Serves one engine over ZeroMQ per its StageConfig; `serve_forever()` returns after shutdown."""

    def __init__(self, config: StageConfig, engine: Any) -> None:
        self.config = config
        self.engine = engine
        self.context = zmq.Context()
        self.security = LinkSecurity(self.context, config.curve)
        self.stats = StageStats(config.name, config.stage_index, config.role)
        self.queue: deque[tuple[float, protocol.Message]] = deque()
        self.running = False
        self._stop_requested = False
        self.state = "starting"
        self._sockets: list[zmq.Socket] = []
        self.data: zmq.Socket | None = None
        self.output: zmq.Socket | None = None
        self.control: zmq.Socket | None = None
        self.telemetry: zmq.Socket | None = None

    # --------------------------------------------------------------------------------------- sockets
    def _socket(self, kind: int) -> zmq.Socket:
        socket = self.context.socket(kind)
        socket.linger = 0
        self._sockets.append(socket)
        return socket

    def _url(self, port: int) -> str:
        host = self.config.bind_address
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

    def bind(self) -> None:
        """Create and bind/connect every socket (call after the engine compiled)."""
        config = self.config
        self.data = self._socket(zmq.PULL)
        self.data.maxmsgsize = MAX_MESSAGE_BYTES
        self.security.server(self.data)
        self.data.bind(self._url(config.data_port))
        self.control = self._socket(zmq.REP)
        self.security.server(self.control)
        self.control.bind(self._url(config.control_port))
        self.telemetry = self._socket(zmq.PUB)
        self.security.server(self.telemetry)
        self.telemetry.bind(self._url(config.telemetry_port))
        self.output = self._socket(zmq.PUSH)
        self.output.sndtimeo = SEND_TIMEOUT_MS
        if config.next is not None:
            self.security.client(self.output)
            self.output.connect(config.next.url())
        else:
            assert config.result_port is not None  # StageConfig guarantees it
            self.security.server(self.output)
            self.output.bind(self._url(config.result_port))
        self.state = "ready"

    def urls(self) -> dict[str, str]:
        config = self.config
        urls = {
            "data": self._url(config.data_port),
            "control": self._url(config.control_port),
            "telemetry": self._url(config.telemetry_port),
        }
        urls["next" if config.next else "result"] = (
            config.next.url() if config.next else self._url(config.result_port or 0)
        )
        return urls

    def close(self) -> None:
        for socket in self._sockets:
            socket.close(linger=0)
        self._sockets.clear()
        self.security.stop()
        self.context.term()

    def stop(self) -> None:
        """Ask the loop to finish (safe from a signal handler, also before the loop started)."""
        self._stop_requested = True
        self.running = False

    # ------------------------------------------------------------------------------------------ loop
    def serve_forever(self) -> None:
        if self.data is None:
            self.bind()
        assert self.data is not None and self.control is not None
        poller = zmq.Poller()
        poller.register(self.data, zmq.POLLIN)
        poller.register(self.control, zmq.POLLIN)
        self.running = not self._stop_requested
        while self.running:
            timeout = 0 if self.queue else min(POLL_CEILING_MS, int(self.stats.seconds_to_sample() * 1e3) + 1)
            try:
                events = dict(poller.poll(timeout))
            except zmq.ZMQError as error:
                if error.errno == errno.EINTR:
                    continue
                raise
            if self.data in events:
                self._drain()
            if self.control in events:
                self._answer_control()
            if self.queue and self.running:
                received, message = self.queue.popleft()
                self._serve(received, message)
            if self.stats.due():
                self._publish()
        self.state = "stopping"
        self._publish()

    def _drain(self) -> None:
        assert self.data is not None
        while True:
            try:
                frames: list[bytes | memoryview] = list(self.data.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            received = time.time()
            try:
                message = protocol.decode(frames)
            except protocol.ProtocolError as error:
                self._drop(f"malformed message: {error}")
                continue
            if len(self.queue) >= MAX_QUEUE:
                self._drop(f"queue full ({MAX_QUEUE})")
                continue
            self.queue.append((received, message))

    def _drop(self, reason: str) -> None:
        self.stats.dropped += 1
        if self.stats.dropped <= 20 or self.stats.dropped % 1000 == 0:  # a flood must not flood the log too
            logger.warning("dropped #%d: %s", self.stats.dropped, reason)

    def _publish(self) -> None:
        if self.telemetry is None:
            return
        sample_dict = self.stats.sample(
            self.state, len(self.queue), len(self.engine.sessions), self.engine.cache_slots()
        )
        with contextlib.suppress(zmq.Again):  # no subscriber keeping up: this sample is simply lost
            self.telemetry.send(encode_sample(sample_dict), zmq.NOBLOCK)

    # --------------------------------------------------------------------------------------- control
    def describe(self) -> dict[str, Any]:
        """The ping answer: who this worker is and how it computes."""
        layers = self.engine.stage.layers
        answer = {
            "state": self.state,
            "stage": self.config.stage_index,
            "name": self.config.name,
            "pid": os.getpid(),
            "role": self.config.role,
            "deployment": self.config.deployment,
            "properties": self.engine.effective_properties(),
            "layers": [layers.start, layers.end],
            "is_first": self.engine.is_first,
            "is_last": self.engine.is_last,
            "dropped": self.stats.dropped,
            "security": self.security.mode,
            "urls": self.urls(),
        }
        if self.security.mode == "plaintext":
            answer["warning"] = PLAINTEXT_WARNING
        return answer

    def _answer_control(self) -> None:
        assert self.control is not None
        while True:
            try:
                raw = self.control.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                request = json.loads(raw)
                operation = request["op"]
            except (ValueError, TypeError, KeyError):
                self.control.send_json({"error": "expected a JSON object with an 'op'"})
                continue
            if operation == "ping":
                self.control.send_json(self.describe())
            elif operation == "stats":
                self.control.send_json(self._statistics())
            elif operation == "shutdown":
                logger.info("shutdown requested")
                self.running = False
                self.control.send_json({"state": "stopping", "pid": os.getpid()})
            else:
                self.control.send_json({"error": f"unknown op {operation!r}"})

    def _statistics(self) -> dict[str, Any]:
        sessions = {
            str(session): {
                "cache_len": self.engine.cache_len(session),
                "masked": self.engine.masked_slots(session),
            }
            for session in sorted(self.engine.sessions)
        }
        return {
            **self.describe(),
            **self.stats.totals(),
            "queue": len(self.queue),
            "sessions": sessions,
            "cache_slots": self.engine.cache_slots(),
            "kv_bytes": self.engine.session_bytes(),
            "refused_clients": self.security.refused,
            "rss_mb": round(rss_megabytes(), 1),
        }

    # ------------------------------------------------------------------------------------------ serve
    def _send(self, message: protocol.Message) -> None:
        assert self.output is not None
        try:
            self.output.send_multipart(protocol.encode(message), copy=False)
        except zmq.Again:
            self.stats.errors += 1
            logger.error("could not send %s downstream within %d ms", type(message).__name__, SEND_TIMEOUT_MS)

    def _serve(self, received: float, message: protocol.Message) -> None:
        started = time.time()
        kind = type(message).__name__
        try:
            if isinstance(message, protocol.Step):
                self._step(received, started, message)
            elif isinstance(message, protocol.Control):
                self._control(message)
            elif isinstance(message, protocol.Hello):
                self._hello(received, started, message)
            elif isinstance(message, protocol.Propose) and self.config.role == "draft":
                self._propose(received, started, message)
            elif isinstance(message, protocol.Error):
                self._send(message)  # an upstream failure travels on to the coordinator
            else:
                self._drop(f"unexpected {kind} at stage {self.config.stage_index}")
                return
            self.stats.handled[kind] += 1
        except Exception as error:  # noqa: BLE001 - any failure must reach the coordinator as an Error
            self.stats.errors += 1
            reason = _one_line(error)
            session = getattr(message, "session", 0)
            logger.error("%s session %d seq %d failed: %s", kind, session, message.seq, reason)
            self._send(protocol.Error(session, message.seq, self.config.stage_index, reason))
        finally:
            self.stats.busy_seconds += time.time() - started

    def _trace(self, trace: np.ndarray, received: float, started: float) -> np.ndarray:
        finished = time.time()
        return protocol.append_trace(trace, self.config.stage_index, received, started, finished, time.time())

    def _step(self, received: float, started: float, step: protocol.Step) -> None:
        data = step.tokens if step.tokens is not None else step.hidden
        assert data is not None
        clock = time.perf_counter()
        decode = step.decode if step.decode is not None else _GREEDY
        keep = decode.n_score if self.engine.is_last else 0
        if decode.n_score > step.n:
            raise ValueError(f"decode scores {decode.n_score} positions, the step has {step.n}")
        output = self.engine.step(
            step.session, step.pos0, step.cache_len, step.mask_ranges, data, keep_last=keep
        )
        if not self.engine.is_last:
            # astype copies: the engine's output buffer is reused by the session's next step
            with np.errstate(over="ignore"):  # an overflow is detected just below
                hidden = output.astype(np.float16 if self.config.wire_dtype == "f16" else np.float32)
            if hidden.dtype == np.float16 and not bool(np.isfinite(hidden).all()):
                hidden = output.astype(
                    np.float32
                )  # an activation beyond float16's range: send this one as f32
            self.stats.record_step(step.n, time.perf_counter() - clock)
            self._send(
                protocol.Step(
                    step.session,
                    step.seq,
                    step.pos0,
                    step.cache_len,
                    step.mask_ranges,
                    hidden=hidden,
                    decode=step.decode,
                    trace=self._trace(step.trace, received, started),
                )
            )
            return
        tokens, accepted, top_ids, top_logprobs = score(output, decode)
        self.stats.record_step(step.n, time.perf_counter() - clock)
        self._send(
            protocol.Result(
                step.session,
                step.seq,
                tokens,
                accepted,
                top_ids,
                top_logprobs,
                self._trace(step.trace, received, started),
            )
        )

    def _control(self, control: protocol.Control) -> None:
        session, value = control.session, 0
        if control.kind == protocol.Kind.OPEN:
            if not self.engine.has(session) and len(self.engine.sessions) >= self.config.max_sessions:
                raise ValueError(f"max_sessions ({self.config.max_sessions}) reached")
            self.engine.open(session)
        elif control.kind == protocol.Kind.CLOSE:
            self.engine.close(session)
        elif control.kind == protocol.Kind.RESET:
            self.engine.reset(session)
        elif control.kind == protocol.Kind.COMPACT:
            clock = time.perf_counter()
            value = self.engine.compact(session, control.cache_len)
            logger.info(
                "session %d compacted %d -> %d slots in %.1f ms",
                session,
                control.cache_len,
                value,
                (time.perf_counter() - clock) * 1e3,
            )
        if self.config.next is not None:
            self._send(control)
        else:
            self._send(protocol.Ack(control.kind, session, control.seq, value))

    def _hello(self, received: float, started: float, hello: protocol.Hello) -> None:
        trace = self._trace(hello.trace, received, started)
        if self.config.next is not None:
            self._send(protocol.Hello(hello.seq, trace))
        else:
            stages = len(trace) // protocol.TRACE_FIELDS
            self._send(protocol.Ack(protocol.Kind.HELLO, 0, hello.seq, stages, trace))

    def _propose(self, received: float, started: float, propose: protocol.Propose) -> None:
        """Draft: feed the tokens, then propose k tokens, feeding each proposal but the last."""
        decode = propose.decode
        if not decode.greedy and propose.support <= 0:
            raise ValueError("propose: sampling needs support > 0")
        clock = time.perf_counter()
        session, position = propose.session, propose.pos0
        output = self.engine.step(
            session, position, propose.cache_len, propose.mask_ranges, propose.tokens, keep_last=1
        )
        position += len(propose.tokens)
        uniforms = (
            decode.uniforms
            if len(decode.uniforms) >= propose.k
            else np.random.default_rng().random(propose.k)
        )
        tokens = np.zeros(propose.k, np.int64)
        support = 0 if decode.greedy else propose.support
        ids = np.zeros((propose.k, support), np.int64)
        probs = np.zeros((propose.k, support), np.float32)
        for index in range(propose.k):
            logits = output[-1]
            if decode.greedy:
                tokens[index] = int(np.argmax(logits))
            else:
                row_ids, row_probs = propose_distribution(logits, decode, support)
                ids[index, : len(row_ids)], probs[index, : len(row_probs)] = row_ids, row_probs
                tokens[index] = sample(row_ids, row_probs, float(uniforms[index]))
            if index < propose.k - 1:
                output = self.engine.step(
                    session, position, self.engine.cache_len(session), _NO_RANGES, tokens[index : index + 1]
                )
                position += 1
        self.stats.record_step(len(propose.tokens) + propose.k - 1, time.perf_counter() - clock)
        self._send(
            protocol.Proposal(
                session,
                propose.seq,
                tokens,
                ids,
                probs,
                self._trace(np.zeros(0, np.float64), received, started),
            )
        )
