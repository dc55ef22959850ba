"""Provides the coordinator's links to a chain of stages over ZeroMQ: requests, control pings,
telemetry."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from remote_worker import protocol
from remote_worker.replies import PingReply, TelemetrySample

log = logging.getLogger(__name__)


class LinkError(RuntimeError):
    """A request that the chain could not answer (stage error, timeout, closed link)."""


class StageFailure(LinkError):
    def __init__(self, stage: int, message: str) -> None:
        super().__init__(f"stage {stage}: {message}")
        self.stage = stage


class StageLost(LinkError):
    """A stage of this link was declared lost: the request may be retried once recovery is done."""


class RunStalled(StageLost):
    """A run's tokens stopped coming with every stage up (its way back to stage 0 is broken): the
    round is retried after a replay, without runs."""


RUN_GAP_SECONDS = 30.0  # a run whose next token takes longer than this has stalled


@dataclass(frozen=True)
class ClientKeys:
    """The coordinator's CurveZMQ key pair (Z85 text)."""

    public_key: str
    secret_key: str


class Link(Protocol):
    """Request/reply over a chain: the transport interface the coordinator is written against."""

    async def request(
        self, message: protocol.Message, timeout: float | None = None
    ) -> protocol.Message: ...

    async def close(self) -> None: ...


@runtime_checkable
class RunLink(Link, Protocol):
    """A link that can also start a run (a Step with `run` > 1) and read its Results as they
    come."""

    async def stream(self, step: protocol.Step) -> ReplyStream: ...


class ReplyStream:
    """The Results of one run, in order, as they arrive (each with its arrival time, `time.time()`).

    `next()` waits for the next one (at most `timeout` seconds after asking); an Error of the run, a
    blocked or closed link fail it. `received` counts what arrived, `done` is True once all `count`
    did."""

    def __init__(
        self, count: int, timeout: float, retire: Callable[[], None], gap: float = RUN_GAP_SECONDS
    ) -> None:
        self.count = count
        # for the first Result (a prefill may come first); then `gap` for each next
        self.timeout = timeout
        self.gap = gap
        self.received = 0
        self.sent_at = time.time()
        self._ready: deque[tuple[protocol.Result, float]] = deque()
        self._failure: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._retire = retire

    @property
    def done(self) -> bool:
        return self.received >= self.count

    @property
    def failure(self) -> BaseException | None:
        """Why the run's stream ended before all its Results (an Error, a lost stage, `close()`),
        or None."""
        return self._failure

    @property
    def unread(self) -> int:
        """How many Results arrived and were not read yet."""
        return len(self._ready)

    def buffered(self) -> list[tuple[protocol.Result, float]]:
        """What arrived and was not read yet (taken out)."""
        items = list(self._ready)
        self._ready.clear()
        return items

    def deliver(self, message: protocol.Message) -> None:
        if isinstance(message, protocol.Result):
            self.received += 1
            self._ready.append((message, time.time()))
            if self.done:
                self._retire()
        elif isinstance(message, protocol.Error):
            self.fail(StageFailure(message.stage, message.message))
        else:
            self.fail(LinkError(f"a run answered {type(message).__name__}"))
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def fail(self, error: BaseException) -> None:
        if self._failure is None:
            self._failure = error
            self._retire()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self) -> tuple[protocol.Result, float]:
        """The next Result and when it arrived."""
        if not self._ready and self._failure is None:
            loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            limit = min(self.timeout, self.gap) if self.received else self.timeout
            # a timer, not wait_for: once per token
            expiry = loop.call_later(limit, self._expire, limit)
            try:
                await self._waiter
            finally:
                expiry.cancel()
                self._waiter = None
        if self._ready:
            return self._ready.popleft()
        assert self._failure is not None
        raise self._failure

    def _expire(self, limit: float) -> None:
        if self.received:
            self.fail(RunStalled(f"a run stalled: no token for {limit:g} s"))
        else:
            self.fail(LinkError(f"no answer from the pipeline within {limit:g} s (a run)"))

    def end(self) -> None:
        """The run was cancelled and the Cancel's Ack came: what arrived is all of it (the Ack
        follows the run's last Result)."""
        self.count = self.received
        self._retire()

    def close(self) -> None:
        """Stop listening: whatever of the run still arrives is dropped quietly."""
        self.fail(LinkError("run closed"))


def secure(socket: Any, keys: ClientKeys | None, server_key: str | None) -> None:
    if keys is None:
        return
    if server_key is None:
        raise LinkError("encrypted link without the server's public key")
    socket.curve_publickey = keys.public_key.encode()
    socket.curve_secretkey = keys.secret_key.encode()
    socket.curve_serverkey = server_key.encode()


class ZmqLink:
    """Pushes messages into the head of a chain and matches what comes out of its tail by sequence
    number.

    Many requests may be in flight at once (one per session): this is what keeps every stage busy.
    """

    def __init__(
        self,
        head: str,
        tail: str,
        keys: ClientKeys | None = None,
        head_key: str | None = None,
        tail_key: str | None = None,
        timeout: float = 300.0,
    ) -> None:
        import zmq
        import zmq.asyncio

        self._context = zmq.asyncio.Context.instance()
        self._push = self._context.socket(zmq.PUSH)
        self._pull = self._context.socket(zmq.PULL)
        for socket in (self._push, self._pull):
            socket.linger = 0
        secure(self._push, keys, head_key)
        secure(self._pull, keys, tail_key)
        self._push.connect(head)
        self._pull.connect(tail)
        # The hot path uses plain sockets over the same ZeroMQ sockets: a send that can go at once
        # is made at once, and replies are read from the event loop's readiness callback (no future
        # per message).
        self._push_now: zmq.Socket[bytes] = zmq.Socket.shadow(self._push.underlying)
        self._pull_now: zmq.Socket[bytes] = zmq.Socket.shadow(self._pull.underlying)
        self._reply_fd = int(self._pull_now.getsockopt(zmq.FD))
        self._again = zmq.Again
        self._noblock = zmq.NOBLOCK
        self._events, self._pollin = zmq.EVENTS, zmq.POLLIN
        self._timeout = timeout
        self._sequence = itertools.count(1)
        self._pending: dict[int, asyncio.Future[protocol.Message]] = {}
        self._streams: dict[int, ReplyStream] = {}
        # runs closed early and requests their callers stopped waiting for: their late replies are
        # expected
        self._retired: deque[int] = deque(maxlen=256)
        self._reading: asyncio.AbstractEventLoop | None = None
        self._blocked: StageLost | None = None
        self.dropped = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        # steps asked for in one turn of the event loop leave together as one Batch (one inference
        # per stage)
        self._outbox: list[tuple[list[Any], protocol.Message]] = []
        self._backlog: deque[tuple[list[Any], list[protocol.Message]]] | None = None
        self.batches_sent = 0

    def _ensure_reader(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read replies from the event loop's readiness callback of the PULL socket's descriptor."""
        if self._reading is loop:
            return
        if (
            self._reading is not None
        ):  # an earlier loop (asyncio.run once more): watch from this one now
            with contextlib.suppress(Exception):
                self._reading.remove_reader(self._reply_fd)
        loop.add_reader(self._reply_fd, self._drain)
        self._reading = loop
        loop.call_soon(self._drain)  # what arrived before the descriptor was watched

    def _drain(self) -> None:
        """Dispatch every reply waiting (the descriptor is edge-triggered: read until there is
        none)."""
        pull = self._pull_now
        try:
            while (
                int(pull.getsockopt(self._events)) & self._pollin
            ):  # (cheaper than ending on zmq.Again)
                frames = pull.recv_multipart(self._noblock, copy=False)
                self._dispatch([frame.buffer for frame in frames])
        except Exception as error:  # noqa: BLE001 - a closed socket: the link is being closed
            log.debug("reply reader stopped: %s", error)

    def _dispatch(self, buffers: list[memoryview]) -> None:
        self.bytes_received += sum(len(b) for b in buffers)
        try:
            parts = protocol.split(buffers)
        except protocol.ProtocolError as error:
            self.dropped += 1
            log.warning("dropped a malformed batch of replies: %s", error)
            return
        for part in parts:
            self._deliver(part)

    def _deliver(self, buffers: Sequence[bytes | memoryview]) -> None:
        try:
            message = protocol.decode(buffers)
        except protocol.ProtocolError as error:
            self.dropped += 1
            log.warning("dropped a malformed reply: %s", error)
            return
        seq = getattr(message, "seq", -1)
        stream = self._streams.get(seq)
        if stream is not None:
            stream.deliver(message)
            return
        future = self._pending.pop(seq, None)
        if future is None and seq in self._retired:
            # the rest of a run the coordinator ended (it learns what ran from the Cancel's Ack), or
            # the reply to a request its caller gave up on
            return
        if future is None or future.done():
            self.dropped += 1
            log.warning(
                "dropped an unexpected %s (seq %s)",
                type(message).__name__,
                getattr(message, "seq", "?"),
            )
            return
        if isinstance(message, protocol.Error):
            future.set_exception(StageFailure(message.stage, message.message))
        else:
            future.set_result(message)

    def block(self, error: StageLost) -> None:
        """Fail every pending request with `error` now, and every new one until `unblock()` (fail
        fast)."""
        self._blocked = error
        for future in self._pending.values():
            if not future.done():
                future.set_exception(StageLost(str(error)))
        for stream in list(self._streams.values()):
            stream.fail(StageLost(str(error)))

    def unblock(self) -> None:
        self._blocked = None

    async def request(
        self, message: protocol.Message, timeout: float | None = None
    ) -> protocol.Message:
        if self._blocked is not None:
            raise StageLost(str(self._blocked))
        loop = asyncio.get_running_loop()
        self._ensure_reader(loop)
        seq = next(self._sequence) & 0xFFFFFFFF
        message = replace(message, seq=seq)  # type: ignore[type-var]
        future: asyncio.Future[protocol.Message] = loop.create_future()
        self._pending[seq] = future
        limit = timeout or self._timeout
        expiry = loop.call_later(limit, self._expire, future, limit, message)
        try:
            await self._send(message, limit, future)
            return await future
        finally:
            expiry.cancel()
            if (
                self._pending.pop(seq, None) is not None
            ):  # no reply came, and none is awaited any more
                self._retired.append(seq)  # (cancelled, timed out): a late one is expected

    async def stream(self, step: protocol.Step, timeout: float | None = None) -> ReplyStream:
        """Start a run (`step.run` tokens) and return the stream its Results arrive on."""
        if self._blocked is not None:
            raise StageLost(str(self._blocked))
        self._ensure_reader(asyncio.get_running_loop())
        seq = next(self._sequence) & 0xFFFFFFFF
        step = replace(step, seq=seq)

        def retire() -> None:
            if self._streams.pop(seq, None) is not None:
                self._retired.append(seq)

        stream = ReplyStream(max(step.run, 1), timeout or self._timeout, retire)
        self._streams[seq] = stream
        try:
            await self._send(step, timeout or self._timeout, None)
        except BaseException:
            stream.close()
            raise
        return stream

    async def _send(
        self,
        message: protocol.Message,
        limit: float,
        future: asyncio.Future[protocol.Message] | None,
    ) -> None:
        """Send at once when ZeroMQ can; else wait for it, bounded (a PUSH whose peer refused our
        CURVE key has no pipe and would block forever), and stop waiting when the answer (`future`)
        is settled."""
        frames = protocol.encode(message)
        self.bytes_sent += sum(len(f) for f in frames)
        if isinstance(message, protocol.Step):
            if not self._outbox:
                asyncio.get_running_loop().call_soon(self._flush)
            self._outbox.append((frames, message))
            return
        self._flush()  # what was asked for before this message leaves before it
        while self._backlog is not None and limit > 0:
            await asyncio.sleep(0.005)
            limit -= 0.005
        try:
            self._push_now.send_multipart(frames, self._noblock, copy=False)
            return
        except self._again:
            pass
        sending = asyncio.ensure_future(self._push.send_multipart(frames, copy=False))
        waiting = (sending,) if future is None else (sending, future)
        done, _ = await asyncio.wait(waiting, timeout=limit, return_when="FIRST_COMPLETED")
        if sending not in done:
            sending.cancel()
            if future is None:
                raise LinkError(f"could not send to the pipeline within {limit:g} s")
            if not future.done():
                self._expire(future, limit, message)
        elif sending.exception() is not None:
            raise LinkError(f"could not send to the pipeline: {sending.exception()}") from None

    def _flush(self) -> None:
        """Send the steps asked for since the last flush as one message (a Batch when several)."""
        if not self._outbox:
            return
        parts, self._outbox = self._outbox, []
        frames = protocol.batch_frames([part for part, _ in parts])
        messages = [message for _, message in parts]
        self.batches_sent += len(parts) > 1
        if self._backlog is None:
            try:
                self._push_now.send_multipart(frames, self._noblock, copy=False)
                return
            except self._again:
                self._backlog = deque()
                asyncio.ensure_future(self._send_backlog())
            except Exception as error:  # noqa: BLE001 - a closed socket: those requests fail
                self._fail_sent(messages, LinkError(f"could not send to the pipeline: {error}"))
                return
        self._backlog.append((frames, messages))

    async def _send_backlog(self) -> None:
        """Send what ZeroMQ could not take at once, in order, each bounded by the link's timeout."""
        backlog = self._backlog
        assert backlog is not None
        while backlog:
            frames, messages = backlog[0]
            try:
                await asyncio.wait_for(self._push.send_multipart(frames, copy=False), self._timeout)
            except (TimeoutError, asyncio.TimeoutError):
                self._fail_sent(
                    messages,
                    LinkError(f"could not send to the pipeline within {self._timeout:g} s"),
                )
            except Exception as error:  # noqa: BLE001 - a closed socket: those requests fail
                self._fail_sent(messages, LinkError(f"could not send to the pipeline: {error}"))
            backlog.popleft()
        self._backlog = None

    def _fail_sent(self, messages: list[protocol.Message], error: LinkError) -> None:
        for message in messages:
            seq = getattr(message, "seq", -1)
            future = self._pending.get(seq)
            if future is not None and not future.done():
                future.set_exception(error)
            stream = self._streams.get(seq)
            if stream is not None:
                stream.fail(error)

    @staticmethod
    def _expire(
        future: asyncio.Future[protocol.Message], limit: float, message: protocol.Message
    ) -> None:
        if not future.done():
            future.set_exception(
                LinkError(
                    f"no answer from the pipeline within {limit:g} s "
                    f"({type(message).__name__} seq {getattr(message, 'seq', '?')})"
                )
            )

    async def close(self) -> None:
        if self._reading is not None:
            with contextlib.suppress(Exception):  # the loop may be closing already
                self._reading.remove_reader(self._reply_fd)
            self._reading = None
        for future in self._pending.values():
            if not future.done():
                future.set_exception(LinkError("link closed"))
        for stream in list(self._streams.values()):
            stream.fail(LinkError("link closed"))
        self._push.close(0)
        self._pull.close(0)


async def control_request(
    url: str,
    request: dict[str, Any],
    keys: ClientKeys | None = None,
    server_key: str | None = None,
    timeout: float = 2.0,
) -> dict[str, Any] | None:
    """One JSON request to a worker's control socket; None when it does not answer within
    `timeout`."""
    import zmq
    import zmq.asyncio

    socket = zmq.asyncio.Context.instance().socket(zmq.REQ)
    socket.linger = 0
    try:
        secure(socket, keys, server_key)
        socket.connect(url)
        # bounded too: a REQ blocks on send until its peer's handshake completed, which may never
        # happen
        try:
            async with asyncio.timeout(
                timeout
            ):  # not wait_for: on 3.11 it can drop a cancel (watch.py)
                await socket.send(json.dumps(request).encode())
        except TimeoutError:
            return None
        if not await socket.poll(int(timeout * 1000)):
            return None
        reply = json.loads(await socket.recv())
        return reply if isinstance(reply, dict) else None
    finally:
        socket.close(0)


async def wait_until_ready(
    url: str,
    keys: ClientKeys | None,
    server_key: str | None,
    timeout: float,
    failure: Callable[[], str | None] = lambda: None,
) -> PingReply:
    """Ping a worker's control socket until it reports "ready" (its handshake); `failure()`
    aborts early."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        reason = failure()
        if reason is not None:
            raise LinkError(reason)
        reply = await control_request(url, {"op": "ping"}, keys, server_key, timeout=1.0)
        if reply is not None and reply.get("state") == "ready":
            try:
                return PingReply.parse(reply)
            except ValueError as error:
                raise LinkError(f"{url}: a malformed ping reply: {error}") from None
        if reply is None:
            continue  # the poll itself waited; a worker still compiling does not answer yet
        await asyncio.sleep(0.2)  # answered "loading": ask again shortly
    raise LinkError(f"{url}: not ready after {timeout:.0f} s")


class TelemetryFeed:
    """Subscribes to every stage's telemetry socket and calls `on_sample(sample)` for each valid
    report."""

    def __init__(
        self,
        urls: list[tuple[str, str | None]],
        keys: ClientKeys | None,
        on_sample: Callable[[TelemetrySample], None],
    ) -> None:
        self._urls = urls
        self._keys = keys
        self._on_sample = on_sample
        self.dropped = 0  # reports that were not valid samples
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="telemetry-feed")

    async def _run(self) -> None:
        import zmq
        import zmq.asyncio

        context = zmq.asyncio.Context.instance()
        sockets = []
        for url, server_key in self._urls:
            socket = context.socket(zmq.SUB)
            socket.linger = 0
            secure(socket, self._keys, server_key)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(url)
            sockets.append(socket)
        poller = zmq.asyncio.Poller()
        for each in sockets:
            poller.register(each, zmq.POLLIN)
        try:
            while True:
                for ready, _ in await poller.poll():
                    try:
                        sample = TelemetrySample.parse(json.loads(await ready.recv()))
                    except ValueError as error:  # ReplyError too: validated like a data frame
                        self.dropped += 1
                        log.debug("dropped a telemetry report: %s", error)
                        continue
                    self._on_sample(sample)
        finally:
            for each in sockets:
                each.close(0)

    async def retarget(self, urls: list[tuple[str, str | None]]) -> None:
        """Follow these telemetry sockets instead (a new split); a feed not started stays
        stopped."""
        running = self._task is not None
        await self.stop()
        self._urls = urls
        if running:
            self.start()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # stopping
                await self._task
            self._task = None
