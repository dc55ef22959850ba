"""Provides a real fleet for the server tests: started on its own asyncio loop in a thread (the
coordinator and the HTTP server share one loop in production), with real uvicorn servers put in
front of it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from fleettui.config.fleet import DEFAULT_FLEET, Fleet, Host, load_fleet
from fleettui.control.controller import FleetController, with_overrides
from fleettui.control.deployment import free_port_block
from fleettui.runtime.chat_format import ChatMessage
from fleettui.runtime.generation import GenerationParams
from fleettui.runtime.transport import control_request
from fleettui.serve.app import FleetServer
from fleettui.serve.command import serve_http
from fleettui.serve.fleet import ControllerFleet
from tests.support.processes import worker_children

KEY = "sk-fleettui-test-0123456789abcdef"
MODEL = "smollm2-135m-instruct"


def make_fleet(cache: Path) -> Fleet:
    base = load_fleet(DEFAULT_FLEET)
    hosts = tuple(Host(name=f"stage-{i}", base_port=free_port_block()) for i in range(2))
    # Two servers and the tests' direct sessions share this fleet: the workers admit more sessions
    # than one server keeps open (a server alone never exceeds its own max_sessions, see the pool
    # test).
    sessions = replace(base.sessions, max_sessions=8)
    fleet = replace(base, hosts=hosts, model=replace(base.model, shards=cache), sessions=sessions)
    return with_overrides(fleet, exact=True, draft="none")


class Served:
    """A started fleet on a private loop thread, and HTTP servers in front of it."""

    def __init__(self, fleet: Fleet) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="served-fleet", daemon=True
        )
        self.thread.start()
        self.controller = FleetController(fleet)
        self.servers: list[tuple[FleetServer, asyncio.Event, Any]] = []
        self.run(self.controller.start())
        self.fleet = ControllerFleet(self.controller)

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout: float = 900) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def add_server(self, **limits: Any) -> tuple[FleetServer, str]:
        ready = threading.Event()
        urls: list[str] = []

        def on_ready(url: str) -> None:
            urls.append(url)
            ready.set()

        async def make() -> tuple[FleetServer, asyncio.Event, Any]:
            server = FleetServer(self.fleet, **limits)
            stop = asyncio.Event()
            task = self.loop.create_task(
                serve_http(server, "127.0.0.1", 0, ready_callback=on_ready, stop=stop)
            )
            return server, stop, task

        entry = self.run(make())
        self.servers.append(entry)
        assert ready.wait(30), "the HTTP server did not start"
        return entry[0], urls[0]

    def stage_stats(self) -> dict[str, dict[str, Any]]:
        """Each stage worker's answer to the `stats` control request."""
        deployment = self.controller.deployment

        async def ask() -> dict[str, dict[str, Any]]:
            replies = {}
            for placement in deployment.stages:
                reply = await control_request(
                    placement.control_url,
                    {"op": "stats"},
                    deployment.keys,
                    placement.server_key,
                    timeout=5,
                )
                assert reply is not None
                replies[placement.config.name] = reply
            return replies

        return self.run(ask())

    def stage_sessions(self) -> dict[str, int]:
        """Open sessions per stage, as each worker reports them on its control socket."""
        return {name: len(reply["sessions"]) for name, reply in self.stage_stats().items()}

    def direct(self, messages: list[ChatMessage], max_tokens: int) -> str:
        """The same prompt through the coordinator in a fresh session (what `fleettui ask` does)."""

        async def ask() -> str:
            coordinator = self.controller.coordinator
            session = await coordinator.open_session()
            try:
                prompt = coordinator.chat_format.encode_chat(messages)
                generation = await coordinator.generate(
                    session, prompt, GenerationParams(max_tokens=max_tokens)
                )
                return generation.text
            finally:
                await coordinator.close_session(session)

        return self.run(ask())

    def close(self) -> None:
        async def shutdown() -> None:
            for server, stop, task in self.servers:
                stop.set()
                await task
                await server.close()
            await self.controller.stop()

        try:
            self.run(shutdown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


def module_fleet(shard_cache: Path) -> Iterator[Served]:
    """A module fixture's fleet: started, yielded, stopped; asserts the stop left no worker
    running."""
    served = Served(make_fleet(shard_cache))
    try:
        yield served
    finally:
        served.close()
        leftovers = worker_children()  # a clean stop leaves none; kill what a failure left behind
        for process in leftovers:
            process.kill()
        psutil.wait_procs(leftovers, timeout=5)
        assert not leftovers, "the fleet's stop left workers running"
