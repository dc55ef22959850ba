"""Provides a user-space one-way link delay: TCP forwarding proxies that hold every chunk for D ms,
in order.

`tc netem` is not available on the machines this project is measured on, so a WAN hop is emulated by
putting a proxy between two ZeroMQ peers. The proxy is a plain byte pipe (transparent to ZMTP and
CurveZMQ): each chunk read from one side is written to the other side D ms after it arrived. Chunks
are queued, so a slow hop delays but never reorders, and a stream of chunks is pipelined (the delay
is latency, not a bandwidth cap). Both directions are delayed; ZeroMQ PUSH/PULL data flows one way,
so a message crossing one proxy pays D once.

The proxies run on their own event loop in a daemon thread, so the coordinator's loop cannot stall
them."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from remote_worker.config import Endpoint

log = logging.getLogger(__name__)
CHUNK = 1 << 16
LOOPBACK = "127.0.0.1"
T = TypeVar("T")


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy reader → writer, releasing each chunk `delay` seconds after it was read, in arrival
    order."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def release() -> None:
        while True:
            due, chunk = await queue.get()
            if not chunk:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(chunk)
            await writer.drain()

    releaser = asyncio.create_task(release())
    try:
        while True:
            chunk = await reader.read(CHUNK)
            await queue.put((time.monotonic() + delay, chunk))
            if not chunk:
                break
        await releaser
    except (ConnectionError, OSError):
        pass
    finally:
        releaser.cancel()
        writer.close()


class DelayProxy:
    """Listens on a loopback port and forwards each connection to `target`, delaying both
    directions."""

    def __init__(self, target: Endpoint, delay_ms: float, listen_port: int = 0) -> None:
        self.target = target
        self.delay_ms = float(delay_ms)
        self.listen_port = listen_port
        self.connections = 0
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(LOOPBACK, self.listen_port)

    async def start(self) -> Endpoint:
        self._server = await asyncio.start_server(self._serve, LOOPBACK, self.listen_port)
        self.listen_port = int(self._server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
        return self.endpoint

    async def _serve(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        self.connections += 1
        try:
            target_reader, target_writer = await asyncio.open_connection(
                self.target.address, self.target.port
            )
        except OSError:  # the peer is not listening (yet): ZeroMQ reconnects by itself
            client_writer.close()
            return
        delay = self.delay_ms / 1000.0
        pumps = [
            asyncio.create_task(_pump(client_reader, target_writer, delay)),
            asyncio.create_task(_pump(target_reader, client_writer, delay)),
        ]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
                self._tasks.discard(pump)
            target_writer.close()
            client_writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._tasks.clear()
            self._server = None


class HopDelay:
    """A set of delay proxies on a background event loop; `route(endpoint)` gives the delayed
    endpoint.

    Use as `endpoint_map` for `FleetController.start`: every link the map is asked about gets its
    own proxy."""

    def __init__(self, delay_ms: float) -> None:
        self.delay_ms = float(delay_ms)
        self.proxies: list[DelayProxy] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="hop-delay", daemon=True
        )
        self._thread.start()

    def _call(self, coroutine: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=30)  # type: ignore[arg-type]

    def route(self, target: Endpoint) -> Endpoint:
        """A loopback endpoint that reaches `target` after `delay_ms` (a new proxy per call)."""
        proxy = DelayProxy(target, self.delay_ms)
        endpoint = self._call(proxy.start())
        self.proxies.append(proxy)
        log.info("hop delay %.0f ms: %s -> %s", self.delay_ms, endpoint.url(), target.url())
        return endpoint

    __call__ = route

    def close(self) -> None:
        if not self._loop.is_closed():
            for proxy in self.proxies:
                self._call(proxy.stop())
            self.proxies.clear()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    def __enter__(self) -> HopDelay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
