"""Provides the ZeroMQ side of one stage worker: an I/O thread that receives and answers, a compute
loop.

Sockets: data PULL (bound; the previous stage or the coordinator pushes into it), an outgoing PUSH
(connected to the next stage, or bound at `result_port` for the last stage and the draft, where the
coordinator pulls), a control REP (JSON ping/stats/lease/shutdown) and a telemetry PUB (one JSON
sample about once a second). Sockets are bound only after the model compiled and ran its warm-up
step, so a "ready" answer to ping means ready to serve at full speed.

Two threads, each socket used by one of them only: the I/O thread owns data, control, telemetry and
the handshake monitors — it validates every frame as it arrives, queues work in a byte-bounded inbox
and answers control requests within milliseconds even while a long prefill runs; the compute thread
(the caller of `serve_forever`) owns the outgoing PUSH and serves the inbox in arrival order, so
steps of different sessions interleave naturally. A message that cannot be served becomes an `Error`
sent down the chain: a failed step, a request whose header is sound but whose body, parameters or
shape are not, a request refused because the inbox is full. Only frames with no header to answer to
are dropped (and counted). With a lease the worker exits by itself when its coordinator stops
talking to it."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import threading
import time
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from remote_worker import protocol
from remote_worker.coalesce import Coalescer
from remote_worker.compute import SEND_TIMEOUT_MS, StageCompute, one_line, rarely
from remote_worker.config import StageConfig
from remote_worker.engine import BATCH_TOKENS
from remote_worker.intake import (
    ControlRequestError,
    Inbox,
    Refusal,
    RunStep,
    RunStops,
    lease_seconds,
    parse_control,
)
from remote_worker.security import PLAINTEXT_WARNING, LinkSecurity
from remote_worker.telemetry import StageStats, encode_sample, rss_megabytes

logger = logging.getLogger(__name__)

MAX_QUEUE = 4096  # messages waiting, whatever their size; beyond this new ones are refused
# larger data messages make ZeroMQ drop the connection; smaller ones over
MAX_MESSAGE_BYTES = 512 << 20
# the inbox's byte budget are refused with an Error
# ZeroMQ drops the connection of a peer sending more (no reply possible)
CONTROL_MAX_MESSAGE = 16 << 20
# telemetry PUB and a bound result PUSH only ever receive subscriptions
SMALL_MAX_MESSAGE = 64 << 10
POLL_CEILING_MS = 200  # both loops wake at least this often to notice a stop
HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
CONTROL_OPS = ("ping", "stats", "lease", "batching", "shutdown")
# a session counts as generating while it stepped within this many rounds of all open sessions
ACTIVE_INFERENCES = 2


class StageServer(StageCompute):
    """Serves one engine over ZeroMQ per its StageConfig; `serve_forever()` returns after
    shutdown."""

    def __init__(self, config: StageConfig, engine: Any) -> None:
        self.config = config
        self.engine = engine
        self.context = zmq.Context()
        self.security = LinkSecurity(self.context, config.curve)
        self.stats = StageStats(config.name, config.stage_index, config.role)
        self.inbox = Inbox(config.max_queue_bytes, MAX_QUEUE)
        self.run_stops = RunStops()
        self.coalescer = Coalescer(
            config.result_batch_ms / 1e3 if config.result_port is not None else 0.0
        )
        self.running = False
        self._stop_requested = False
        self.state = "starting"
        self.stop_reason = ""
        self.lease_seconds = float(config.lease_seconds)
        self._last_control = time.monotonic()
        self._busy_since: float | None = None  # monotonic start of the message being served
        # set by the control thread, applied by the compute thread
        self._wanted_batch = engine.batch_max
        self._stepped: dict[
            int, int
        ] = {}  # session -> the inference it last stepped in (compute thread only)
        self._inferences = 0  # inferences this worker served (compute thread only)
        self._properties = engine.effective_properties()  # asked once: the plugin may be busy later
        self._sockets: list[zmq.Socket[bytes]] = []
        self._monitors: dict[zmq.Socket[bytes], str] = {}
        self._io: threading.Thread | None = None
        self.data: zmq.Socket[bytes] | None = None
        self.output: zmq.Socket[bytes] | None = None
        self.control: zmq.Socket[bytes] | None = None
        self.telemetry: zmq.Socket[bytes] | None = None
        self.loop: zmq.Socket[bytes] | None = None

    # ---------------------------------------------------------------------------------------
    # sockets
    def _socket(self, kind: int, name: str, max_message: int) -> zmq.Socket[bytes]:
        socket = self.context.socket(kind)
        socket.linger = 0
        socket.maxmsgsize = max_message
        self._sockets.append(socket)
        # a bound socket: watch for peers whose handshake fails (before ZAP, or not ZeroMQ at all)
        if name:
            self._monitors[socket.get_monitor_socket(HANDSHAKE_FAILURES)] = name
        return socket

    def _url(self, port: int) -> str:
        host = self.config.bind_address
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

    def bind(self) -> None:
        """Create and bind/connect every socket (call after the engine compiled)."""
        config = self.config
        self.data = self._socket(zmq.PULL, "data", MAX_MESSAGE_BYTES)
        self.data.rcvhwm = 64
        self.security.server(self.data)
        self.data.bind(self._url(config.data_port))
        self.control = self._socket(zmq.REP, "control", CONTROL_MAX_MESSAGE)
        self.control.rcvhwm = 8
        self.security.server(self.control)
        self.control.bind(self._url(config.control_port))
        self.telemetry = self._socket(zmq.PUB, "telemetry", SMALL_MAX_MESSAGE)
        self.security.server(self.telemetry)
        self.telemetry.bind(self._url(config.telemetry_port))
        if config.next is not None:
            self.output = self._socket(zmq.PUSH, "", SMALL_MAX_MESSAGE)
            self.security.client(self.output)
            self.output.connect(config.next.url())
        else:
            assert config.result_port is not None  # StageConfig guarantees it
            self.output = self._socket(zmq.PUSH, "result", SMALL_MAX_MESSAGE)
            self.security.server(self.output)
            self.output.bind(self._url(config.result_port))
        self.output.sndtimeo = SEND_TIMEOUT_MS
        if (
            config.loop is not None
        ):  # the last stage of several: a run's next step goes back to stage 0
            self.loop = self._socket(zmq.PUSH, "", SMALL_MAX_MESSAGE)
            self.security.client(self.loop, loop=True)
            self.loop.connect(config.loop.url())
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
            with contextlib.suppress(zmq.ZMQError):
                socket.disable_monitor()
        for socket in [*self._monitors, *self._sockets]:
            socket.close(linger=0)
        self._monitors.clear()
        self._sockets.clear()
        self.security.stop()
        self.context.term()

    def stop(self, reason: str = "") -> None:
        """Ask both loops to finish (safe from a signal handler, also before the loops started)."""
        self.stop_reason = self.stop_reason or reason
        self._stop_requested = True
        self.running = False

    # ------------------------------------------------------------------------------------- compute
    # loop
    def serve_forever(self) -> None:
        if self.data is None:
            self.bind()
        self.running = not self._stop_requested
        self._last_control = time.monotonic()
        self._io = threading.Thread(
            target=self._io_loop, name=f"{self.config.name}-io", daemon=True
        )
        self._io.start()
        try:
            while self.running:
                if self._wanted_batch != self.engine.batch_max:
                    self._wanted_batch = self.engine.set_batching(self._wanted_batch)
                wait = POLL_CEILING_MS / 1e3
                due = self.coalescer.seconds_to_due(time.monotonic())
                if due is not None and due <= 0:
                    self.flush()
                elif due is not None:
                    wait = min(wait, due)
                item = self.inbox.get(wait)
                if item is None:
                    continue
                received, message = item
                if isinstance(message, Refusal):
                    self._send(message.error, block=False)
                    continue
                run: RunStep | None = None
                if isinstance(message, RunStep):
                    step = message.step
                    run = message if self.run_stops.current(step.session, step.seq) else None
                    if run is None and not message.first:
                        continue  # a control message of its session ended the run (see protocol)
                    message = step  # a first step is answered, as one step if its run already ended
                self._busy_since = time.monotonic()
                try:
                    work = self._gather(message, run)
                    if work:
                        started = time.time()
                        self._serve_steps([(received, message, run), *work])  # type: ignore[list-item]
                        self.stats.busy_seconds += time.time() - started
                    else:
                        self._serve(received, message, run)
                finally:
                    self._busy_since = None
        finally:
            self.running = False
            with contextlib.suppress(
                Exception
            ):  # best effort, never waiting: tokens made are not kept back
                self.flush(block=False)
            self._io.join(10)

    def _gather(
        self, first: protocol.Message, run: RunStep | None
    ) -> list[tuple[float, protocol.Step, RunStep | None]]:
        """Other sessions' small steps waiting in the inbox, to serve in one inference with
        `first`."""
        if not isinstance(first, protocol.Step):
            return []
        self._inferences += 1
        now = self._inferences
        self._stepped[first.session] = now
        if self.engine.batch_max < 2 or first.n > BATCH_TOKENS:
            return []
        work: list[tuple[float, protocol.Step, RunStep | None]] = []
        # a formed group runs whole: no KV rows copied
        mates = self.engine.batch_mates(first.session)

        def fits(step: protocol.Step) -> bool:
            return step.n <= BATCH_TOKENS and (not mates or step.session in mates)

        taken = self.inbox.take_steps({first.session}, self._batch_size(now) - 1, fits)
        for received, item in taken:
            if isinstance(item, RunStep):
                step = item.step
                current = item if self.run_stops.current(step.session, step.seq) else None
                if current is None and not item.first:
                    continue  # a control message of its session ended the run
                work.append((received, step, current))
            else:
                work.append((received, item, None))
        for _, step, _ in work:
            self._stepped[step.session] = now
        return work

    def _batch_size(self, now: int) -> int:
        """Rows per inference: the generating sessions shared out over the pipeline's stages, so
        that while this stage serves one share the others serve theirs (one batch of all would leave
        them idle).

        Generating means stepped in the last few rounds, counted in inferences rather than seconds,
        so a slow or loaded machine (long rounds) sees the same sessions as generating as a fast
        one."""
        window = ACTIVE_INFERENCES * max(1, len(self.engine.sessions))
        for session, when in list(self._stepped.items()):
            if now - when > window:
                del self._stepped[session]
        active, stages = len(self._stepped), max(1, self.config.stages)
        # shares of 2 on a pipeline lose to pipelining alone: their groups split and re-form as the
        # steps' arrival order drifts
        # (docs/performance.md#batching-one-inference-for-several-sessions)
        share = active if stages == 1 else (active // stages if active > 2 * stages else 1)
        return max(1, min(int(self.engine.batch_max), share))

    # ----------------------------------------------------------------------------------------- I/O
    # loop
    def _io_loop(self) -> None:
        assert self.data is not None and self.control is not None
        poller = zmq.Poller()
        for socket in (self.data, self.control, *self._monitors):
            poller.register(socket, zmq.POLLIN)
        while self.running:
            try:
                events = dict(poller.poll(self._io_timeout()))
                if self.data in events:
                    self._drain()
                if self.control in events:
                    self._answer_control()
                for monitor, name in self._monitors.items():
                    if monitor in events:
                        self._watch(monitor, name)
                if self.stats.due():
                    self._publish()
                self._check_lease()
            except zmq.ZMQError as error:
                if error.errno != errno.EINTR:
                    logger.error("I/O loop: %s", one_line(error))
                    time.sleep(0.05)
            except Exception as error:  # noqa: BLE001 - the I/O thread must outlive any one message
                logger.error("I/O loop: %s", one_line(error))
        self.state = "stopping"
        self.inbox.wake()
        with contextlib.suppress(Exception):  # best effort: the last sample says we stop
            self._publish()

    def _io_timeout(self) -> int:
        timeout = min(POLL_CEILING_MS, int(self.stats.seconds_to_sample() * 1e3) + 1)
        left = self.lease_left()
        return timeout if left is None else max(1, min(timeout, int(left * 1e3) + 1))

    def _drain(self) -> None:
        data = self.data
        assert data is not None
        while (
            int(data.getsockopt(zmq.EVENTS)) & zmq.POLLIN
        ):  # (cheaper than ending on zmq.Again each time)
            frames = data.recv_multipart(zmq.NOBLOCK)
            self.stats.received += 1
            try:
                parts = protocol.split(frames)
            except protocol.ProtocolError as error:
                self._drop(f"malformed batch: {error}")
                continue
            received = time.time()
            with self.inbox.together():  # the compute thread sees a batch whole
                for part in parts:
                    self._admit(received, list(part))  # type: ignore[arg-type]

    def _admit(self, received: float, frames: list[bytes]) -> None:
        """Validate one received message and queue it, refuse it with an Error, or drop it (no
        header)."""
        try:
            message = protocol.decode(frames)
        except protocol.RequestError as error:
            self._refuse(error.session, error.seq, f"malformed {error.kind.name.lower()}: {error}")
            return
        except protocol.ProtocolError as error:
            self._drop(f"malformed message: {error}")
            return
        accepted = (protocol.Step, protocol.Control, protocol.Hello, protocol.Error)
        if not isinstance(message, accepted) and not (
            isinstance(message, protocol.Propose) and self.config.role == "draft"
        ):
            self._drop(f"unexpected {type(message).__name__} at stage {self.config.stage_index}")
            return
        session, seq = getattr(message, "session", 0), message.seq
        problem = self._shape_problem(message)
        if problem:
            self._refuse(session, seq, problem)
            return
        size = sum(len(frame) for frame in frames)
        queued: protocol.Message | RunStep = message
        if isinstance(message, protocol.Control):
            # before it is queued: the compute thread may serve it at once
            self.run_stops.stopped(session)
        elif (
            isinstance(message, protocol.Step)
            and (message.run > 1 or message.looped)
            and self.engine.is_first
        ):
            # (a run's last step is looped with run = 1: dropped all the same, or it would be
            # computed after the Cancel and its Result would follow the Ack, one slot the
            # coordinator never learns of)
            if message.looped and not self.run_stops.current(session, seq):
                self.stats.run_ends += (
                    1  # the next step of a run that was ended: expected, not counted
                )
                return
            if not message.looped:
                self.run_stops.started(session, seq)
                if self.engine.is_last:
                    queued = RunStep(message, first=True)
        if not self.inbox.put(received, queued, size):
            self.stats.overflow += 1
            if rarely(self.stats.overflow):
                logger.warning("overloaded #%d: refused %d bytes", self.stats.overflow, size)
            self._refuse(
                session,
                seq,
                f"stage {self.config.stage_index} is overloaded: {self.inbox.bytes} bytes in "
                f"{len(self.inbox)} messages queued (limit {self.inbox.max_bytes} bytes)",
                count=False,
            )

    def _shape_problem(self, message: protocol.Message) -> str:
        """Why a well-formed request does not fit this stage (its input kind, width, finite
        values), or ""."""
        if not isinstance(message, protocol.Step):
            return ""
        here = f"stage {self.config.stage_index}"
        if (
            message.run > 1
            and self.engine.is_last
            and not self.engine.is_first
            and self.config.loop is None
        ):
            return f"{here}: a run of {message.run} tokens needs the last stage's loop to stage 0"
        if self.engine.is_first:
            return (
                ""
                if message.tokens is not None
                else f"{here} takes token ids, the step carries hidden states"
            )
        hidden = message.hidden
        if hidden is None:
            return f"{here} takes hidden states, the step carries token ids"
        if hidden.shape[1] != self.engine.hidden_size:
            return (
                f"{here} takes hidden states of width {self.engine.hidden_size}, got "
                f"{hidden.shape[1]}"
            )
        if not bool(np.isfinite(hidden).all()):
            return (
                f"session {message.session}: non-finite hidden states (NaN/Inf) arrived at {here}"
            )
        return ""

    def _refuse(self, session: int, seq: int, reason: str, count: bool = True) -> None:
        if count:
            self.stats.rejected += 1
            if rarely(self.stats.rejected):
                logger.warning(
                    "rejected #%d (session %d seq %d): %s",
                    self.stats.rejected,
                    session,
                    seq,
                    reason,
                )
        if not self.inbox.refuse(protocol.Error(session, seq, self.config.stage_index, reason)):
            self.stats.unsent += 1

    def _drop(self, reason: str) -> None:
        self.stats.dropped += 1
        if rarely(self.stats.dropped):
            logger.warning("dropped #%d: %s", self.stats.dropped, reason)

    def _watch(self, monitor: zmq.Socket[bytes], name: str) -> None:
        """Count and log peers whose handshake failed (a wrong CURVE key, a refused ZAP, not
        ZeroMQ)."""
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.stats.refused += 1
            if rarely(self.stats.refused):
                kind = zmq.Event(event["event"]).name
                logger.warning(
                    "refused a peer on %s (%s): %s 0x%x (%d so far)",
                    name,
                    event.get("endpoint", b"").decode("ascii", "replace"),
                    kind,
                    event.get("value", 0),
                    self.stats.refused,
                )

    def _publish(self) -> None:
        if self.telemetry is None:
            return
        sample_dict = self.stats.sample(
            self.state, len(self.inbox), len(self.engine.sessions), self.engine.cache_slots()
        )
        sample_dict.update(queue_bytes=self.inbox.bytes, busy_since=self.busy_since())
        with contextlib.suppress(zmq.Again):  # no subscriber keeping up: this sample is simply lost
            self.telemetry.send(encode_sample(sample_dict), zmq.NOBLOCK)

    # ---------------------------------------------------------------------------------------
    # control
    def busy_since(self) -> float | None:
        """Seconds the message being served has been running, or None when idle."""
        started = self._busy_since
        return None if started is None else round(time.monotonic() - started, 3)

    def lease_left(self) -> float | None:
        if self.lease_seconds <= 0:
            return None
        return max(0.0, self.lease_seconds - (time.monotonic() - self._last_control))

    def _check_lease(self) -> None:
        left = self.lease_left()
        if left is not None and left <= 0 and self.running:
            logger.warning(
                "lease of %.1f s expired: no control request from the coordinator since; exiting",
                self.lease_seconds,
            )
            self.stop("lease expired")

    def describe(self) -> dict[str, Any]:
        """The ping answer: who this worker is, how it computes and whether it is alive and
        keeping up."""
        layers = self.engine.stage.layers
        left = self.lease_left()
        answer = {
            "state": self.state,
            "stage": self.config.stage_index,
            "name": self.config.name,
            "pid": os.getpid(),
            "role": self.config.role,
            "deployment": self.config.deployment,
            "properties": dict(self._properties),
            "compile_seconds": round(float(self.engine.compile_seconds), 3),
            "compiled_from_cache": bool(self.engine.loaded_from_cache),
            "warm_up_seconds": round(float(self.engine.warm_up_seconds), 3),
            "layers": [layers.start, layers.end],
            "is_first": self.engine.is_first,
            "is_last": self.engine.is_last,
            "dropped": self.stats.dropped,
            "rejected": self.stats.rejected,
            "overflow": self.stats.overflow,
            "refused": self.stats.refused,
            "busy_since": self.busy_since(),
            "queue_bytes": self.inbox.bytes,
            "lease_left": None if left is None else round(left, 3),
            "max_sessions": self.config.max_sessions,
            "open_sessions": len(self.engine.sessions),
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
                frames = self.control.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = self._control_reply(frames)
            try:
                self.control.send(json.dumps(reply).encode("utf-8"), zmq.NOBLOCK)
            except zmq.ZMQError as error:  # the requester went away: nothing to answer to
                logger.warning("control reply not sent: %s", one_line(error))

    def _control_reply(self, frames: list[bytes]) -> dict[str, Any]:
        try:
            operation, request = parse_control(frames)
            if operation not in CONTROL_OPS:
                raise ControlRequestError(
                    f"unknown op {operation[:40]!r}; known: {', '.join(CONTROL_OPS)}"
                )
            if operation == "lease":
                self.lease_seconds = lease_seconds(request)
            self._last_control = time.monotonic()  # any request of the coordinator renews the lease
            if operation == "ping":
                return self.describe()
            if operation == "stats":
                return self._statistics()
            if operation == "lease":
                return {"lease": self.lease_seconds, "lease_left": self.lease_left()}
            if operation == "batching":
                return {"max_batch": self._batching(request)}
            logger.info("shutdown requested")
            self.stop("shutdown requested")
            return {"state": "stopping", "pid": os.getpid()}
        except ControlRequestError as error:
            self.stats.control_errors += 1
            return {"error": str(error)}
        except Exception as error:  # noqa: BLE001 - every request gets an answer
            self.stats.control_errors += 1
            logger.error("control request failed: %s", one_line(error))
            return {"error": one_line(error)}

    def _batching(self, request: dict[str, Any]) -> int:
        """Turn batching on (up to max_sessions per inference) or off; served between two compute
        steps."""
        wanted = request.get("on")
        if not isinstance(wanted, bool):
            raise ControlRequestError("batching: 'on' must be true or false")
        size = self.config.max_sessions if wanted else 1
        self._wanted_batch = size
        self.inbox.wake()
        return size

    def _statistics(self) -> dict[str, Any]:
        sessions = {}
        for session in sorted(
            self.engine.sessions
        ):  # sessions may open/close meanwhile: skip those
            with contextlib.suppress(Exception):
                sessions[str(session)] = {
                    "cache_len": self.engine.cache_len(session),
                    "masked": self.engine.masked_slots(session),
                }
        return {
            **self.describe(),
            **self.stats.totals(),
            "queue": len(self.inbox),
            "sessions": sessions,
            "cache_slots": self.engine.cache_slots(),
            "kv_bytes": self.engine.session_bytes(),
            "regroups": self.engine.regroups,
            "refused_clients": self.security.refused,
            "rss_mb": round(rss_megabytes(), 1),
        }
