"""Provides `fleettui serve`: start (or reuse) a fleet and serve it over HTTP on the
coordinator's own loop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fleettui.errors import FleetError
from fleettui.serve.app import FleetServer
from fleettui.serve.security import check_bind, load_api_keys

ReadyCallback = Callable[[str], None]


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound listening socket (port 0 = any free port), or a one-line `FleetError`."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as error:
        raise FleetError(f"cannot listen on {host}:{port}: {error}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as error:
        sock.close()
        raise FleetError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    sock.setblocking(False)
    return sock


def _uvicorn_server(config: Any) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # `serve_fleet` handles SIGINT/SIGTERM itself so that the fleet is always stopped

    return Server(config)


async def serve_http(
    server: FleetServer,
    host: str,
    port: int,
    certfile: Path | None = None,
    keyfile: Path | None = None,
    ready_callback: ReadyCallback | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run uvicorn for `server` in the running loop until `stop` is set (or uvicorn exits)."""
    import uvicorn

    if (certfile is None) != (keyfile is None):
        raise FleetError("TLS needs both --tls-cert and --tls-key")
    for path in (certfile, keyfile):
        if path is not None and not path.is_file():
            raise FleetError(f"TLS file {path} does not exist")
    sock = listen_socket(host, port)
    config = uvicorn.Config(
        server.app,
        lifespan="off",
        log_level="warning",
        access_log=False,
        ssl_certfile=str(certfile) if certfile else None,
        ssl_keyfile=str(keyfile) if keyfile else None,
        timeout_graceful_shutdown=5,
    )
    try:
        # TLS files are read here: a bad certificate is a one-line error, not a traceback
        config.load()
    except Exception as error:
        sock.close()
        raise FleetError(f"TLS: {error}") from None
    http = _uvicorn_server(config)
    task = asyncio.get_running_loop().create_task(http.serve(sockets=[sock]))
    try:
        while not http.started:
            if task.done():
                await task
                raise FleetError(f"the HTTP server on {host}:{port} did not start")
            await asyncio.sleep(0.02)
        if ready_callback is not None:
            bound_host, bound_port = sock.getsockname()[:2]
            scheme = "https" if certfile else "http"
            shown = f"[{bound_host}]" if ":" in bound_host else bound_host
            ready_callback(f"{scheme}://{shown}:{bound_port}")
        waits: set[asyncio.Future[Any]] = {task}
        if stop is not None:
            waits.add(asyncio.ensure_future(stop.wait()))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        http.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 10)
        if not task.done():
            task.cancel()
        sock.close()


async def serve_fleet(
    fleet: Any,
    settings: Any = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key_file: Path | None = None,
    tls_certfile: Path | None = None,
    tls_keyfile: Path | None = None,
    ready_callback: ReadyCallback | None = None,
    max_queued: int = 16,
    max_idle: int | None = None,
    stop: asyncio.Event | None = None,
    on_event: Callable[[Any], None] | None = None,
) -> None:
    """Attach to the deployed fleet (or start one), serve it until SIGINT/SIGTERM (or `stop`), then
    stop the server and either detach (a deployed fleet stays) or stop the fleet this command
    started.

    `on_event` hears the controller's events (compile, provisioning and worker start progress)."""
    from fleettui.control.controller import FleetController
    from fleettui.serve.fleet import ControllerFleet

    keys = load_api_keys(api_key_file) if api_key_file is not None else ()
    check_bind(host, keys)  # refused before any worker starts
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    for number in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(
            NotImplementedError, RuntimeError, ValueError
        ):  # not the main thread
            loop.add_signal_handler(number, stop.set)
            handled.append(number)
    controller = FleetController(fleet, on_event=on_event, settings=settings)
    server: FleetServer | None = None
    try:
        await controller.start()
        sessions = fleet.sessions.max_sessions
        server = FleetServer(
            ControllerFleet(controller),
            keys,
            max_sessions=sessions,
            max_queued=max_queued,
            max_idle=sessions if max_idle is None else max_idle,
        )
        if not stop.is_set():
            await serve_http(server, host, port, tls_certfile, tls_keyfile, ready_callback, stop)
    finally:
        for number in handled:
            loop.remove_signal_handler(number)
        if server is not None:
            await server.close()
        if controller.attached:
            await controller.detach()  # a deployed fleet outlives the server
        else:
            await controller.stop()
