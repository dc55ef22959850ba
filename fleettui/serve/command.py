"""Provides `fleettui serve`: start (or reuse) a fleet and serve it over HTTP on the coordinator's own loop."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import sys
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
        config.load()  # TLS files are read here: a bad certificate is a one-line error, not a traceback
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
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key_file: Path | None = None,
    tls_certfile: Path | None = None,
    tls_keyfile: Path | None = None,
    ready_callback: ReadyCallback | None = None,
    max_queued: int = 16,
    max_idle: int | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Start the fleet, serve it until SIGINT/SIGTERM (or `stop`), then stop the server and the fleet."""
    from fleettui.control.controller import FleetController
    from fleettui.serve.fleet import ControllerFleet

    keys = load_api_keys(api_key_file) if api_key_file is not None else ()
    check_bind(host, keys)  # refused before any worker starts
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    for number in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(number, stop.set)
            handled.append(number)
    controller = FleetController(fleet)
    server: FleetServer | None = None
    try:
        await controller.start()
        sessions = fleet.sessions.max_sessions
        server = FleetServer(
            ControllerFleet(controller),
            keys,
            max_sessions=sessions,
            max_queued=max_queued,
            max_idle=2 * sessions if max_idle is None else max_idle,
        )
        if not stop.is_set():
            await serve_http(server, host, port, tls_certfile, tls_keyfile, ready_callback, stop)
    finally:
        for number in handled:
            loop.remove_signal_handler(number)
        if server is not None:
            await server.close()
        await controller.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags (the fleet file and the --exact/--draft overrides come from the main parser)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    parser.add_argument("--api-key-file", type=Path, help="file of bearer API keys, one per line, mode 0600")
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate: serve HTTPS")
    parser.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    parser.add_argument("--max-queued", type=int, default=16, help="requests that may wait for a slot")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleettui serve", description="Serve the fleet as an OpenAI-compatible HTTP API."
    )
    parser.add_argument("fleet", nargs="?", help="fleet TOML file (default: the embedded fleets/local.toml)")
    parser.add_argument("--exact", action="store_true", help="fp32 weights, f32 inference and KV cache")
    parser.add_argument("--draft", help="draft override: self-int4 | prompt-lookup | none | PATH")
    spec = parser.add_mutually_exclusive_group()
    spec.add_argument("--spec-k", type=int, metavar="K", help="speculate K tokens per verify (0..16)")
    spec.add_argument("--no-spec", action="store_true", help="no speculative decoding")
    parser.add_argument("--verbose", "-v", action="store_true", help="log to stderr")
    add_arguments(parser)
    return parser


def run_serve(fleet: Any, args: argparse.Namespace) -> int:
    """`fleettui serve`: returns the exit code (2 for a refused setting, 1 when the fleet fails)."""
    from fleettui.control.controller import ControllerError, with_overrides

    if not 0 <= args.port <= 65535:
        raise FleetError(f"--port: {args.port} is out of range 0..65535")
    if args.max_queued < 0:
        raise FleetError("--max-queued must be >= 0")
    draft = "none" if getattr(args, "no_spec", False) else getattr(args, "draft", None)
    fleet = with_overrides(
        fleet, exact=getattr(args, "exact", False), draft=draft, k=getattr(args, "spec_k", None)
    )

    def ready(url: str) -> None:
        print(
            f"fleettui serve: {url}/v1 (model {fleet.model.name}); ctrl+c stops", file=sys.stderr, flush=True
        )

    try:
        asyncio.run(
            serve_fleet(
                fleet,
                args.host,
                args.port,
                args.api_key_file,
                args.tls_cert,
                args.tls_key,
                ready,
                max_queued=args.max_queued,
            )
        )
    except ControllerError as error:
        print(f"fleettui: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    """Entry from `fleettui serve ...` (cli.py hands over the arguments after `serve`)."""
    import logging

    from fleettui.config.fleet import load_fleet, resolve_fleet

    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.spec_k is not None and not 0 <= args.spec_k <= 16:
            raise FleetError(f"--spec-k: {args.spec_k} is out of range 0..16")
        return run_serve(load_fleet(resolve_fleet(args.fleet)), args)
    except FleetError as error:
        print(f"fleettui: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fleettui: interrupted", file=sys.stderr)
        return 130
