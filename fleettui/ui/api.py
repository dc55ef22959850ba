"""Provides the HTTP API run inside the TUI: the same server as `fleettui serve`, on the app's
own loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleettui.serve.live import LiveRequest


@dataclass(frozen=True)
class ApiOptions:
    """Where and how the TUI serves the OpenAI-compatible API (`fleettui tui --serve`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key_file: Path | None = None
    max_sessions: int = 4
    max_queued: int = 16

    def check(self) -> tuple[str, ...]:
        """The API keys, after the same checks as `fleettui serve` (raises FleetError with one
        line)."""
        from fleettui.serve.security import check_bind, load_api_keys

        keys = load_api_keys(self.api_key_file) if self.api_key_file is not None else ()
        check_bind(self.host, keys)
        return keys


class ApiService:
    """Runs one FleetServer over the app's controller until `stop()`; `requests()` feeds the API
    panel."""

    def __init__(self, options: ApiOptions) -> None:
        self.options = options
        self.keys = options.check()  # refused before the fleet starts, like `fleettui serve`
        self.server: Any = None
        self.url = ""
        self._stop = asyncio.Event()

    async def run(self, controller: Any, on_ready: Callable[[str], None]) -> None:
        from fleettui.serve.app import FleetServer
        from fleettui.serve.command import serve_http
        from fleettui.serve.fleet import ControllerFleet

        options = self.options
        self.server = FleetServer(
            ControllerFleet(controller),
            self.keys,
            max_sessions=options.max_sessions,
            max_queued=options.max_queued,
            max_idle=options.max_sessions,
        )

        def ready(url: str) -> None:
            self.url = url + "/v1"
            on_ready(self.url)

        try:
            await serve_http(
                self.server, options.host, options.port, ready_callback=ready, stop=self._stop
            )
        finally:
            await self.server.close()

    async def stop(self) -> None:
        """Stop answering and close the API's sessions (before the fleet is stopped or detached)."""
        self._stop.set()
        if self.server is not None:
            await self.server.close()

    def requests(self) -> tuple[list[LiveRequest], int]:
        if self.server is None:
            return [], 0
        return self.server.live.snapshot(), self.server.live.finished
