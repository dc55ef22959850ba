"""Provides the connection to a running deployment: data links, drafter, coordinator, hop times
and telemetry feed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from fleettui.config.fleet import Fleet
from fleettui.control.compile import CompiledModel
from fleettui.control.deployment import Deployment, Placement
from fleettui.model.shape import SYNTHETIC_REFUSAL
from fleettui.runtime.coordinator import Coordinator
from fleettui.runtime.speculation import Drafter, ModelDrafter, PromptLookupDrafter
from fleettui.runtime.transport import StageLost, TelemetryFeed, ZmqLink, control_request
from remote_worker import protocol
from remote_worker.config import Endpoint
from remote_worker.replies import TelemetrySample


@dataclass
class Connection:
    """What this process holds open to a deployment; closing it leaves the workers running."""

    coordinator: Coordinator
    links: list[ZmqLink]
    feed: TelemetryFeed
    deployment: Deployment
    hops_ms: dict[str, float] = field(default_factory=dict)

    def draft_link(self) -> ZmqLink | None:
        drafter = self.coordinator.drafter
        link = drafter.link if isinstance(drafter, ModelDrafter) else None
        return link if isinstance(link, ZmqLink) else None

    def block(self, error: StageLost, draft: bool) -> None:
        """A stage was lost: its chain's pending requests fail now, new ones until `unblock()`;
        sessions replay."""
        if draft:
            self.coordinator.draft_epoch += 1
        else:
            self.coordinator.target_epoch += 1
        link = self.draft_link() if draft else self.coordinator.target
        if isinstance(link, ZmqLink):
            link.block(error)

    def unblock(self) -> None:
        for link in (self.coordinator.target, self.draft_link()):
            if isinstance(link, ZmqLink):
                link.unblock()

    async def retarget(self, deployment: Deployment) -> None:
        """Link the coordinator to a new chain (a new split) and check it with Hello; the old
        link closes."""
        head, tail = deployment.stages[0], deployment.stages[-1]
        head_url = Endpoint(head.connect_address, head.config.data_port).url()
        link = ZmqLink(head_url, tail.result_url, deployment.keys, head.server_key, tail.server_key)
        previous, self.coordinator.target = self.coordinator.target, link
        self.links = [link, *(each for each in self.links if each is not previous)]
        if isinstance(previous, ZmqLink):
            await previous.close()
        self.coordinator.target_epoch += 1
        self.coordinator.max_run = run_limit(deployment)
        self.deployment = deployment  # hop times and telemetry follow the new stage list
        self.hops_ms.clear()
        await self.feed.retarget(_telemetry_urls(deployment))
        stages = await self.coordinator.hello()
        if stages != len(deployment.stages):
            raise RuntimeError(
                f"handshake crossed {stages} stages, expected {len(deployment.stages)}"
            )

    async def close(self) -> None:
        await self.feed.stop()
        for link in self.links:
            await link.close()
        self.links.clear()


async def connect(
    fleet: Fleet,
    deployment: Deployment,
    target: CompiledModel,
    endpoint_map: Callable[[Endpoint], Endpoint] | None,
    on_sample: Callable[[TelemetrySample], None],
) -> Connection:
    """Link to the chain's head and tail (and the draft) and follow telemetry; `handshake` then
    checks the chain."""
    from fleettui.runtime.chat_format import ChatFormat

    head, tail = deployment.stages[0], deployment.stages[-1]
    route = endpoint_map or (lambda endpoint: endpoint)
    assert tail.config.result_port is not None
    head_url = route(Endpoint(head.connect_address, head.config.data_port)).url()
    tail_url = route(Endpoint(tail.connect_address, tail.config.result_port)).url()
    links = [ZmqLink(head_url, tail_url, deployment.keys, head.server_key, tail.server_key)]
    drafter = _drafter(fleet, deployment, links)
    manifest = target.manifest
    coordinator = Coordinator(
        links[0],
        None if manifest.synthetic else ChatFormat(target.directory, manifest),
        drafter,
        max_k=fleet.speculation.max_k,
        context_length=manifest.max_position_embeddings,
    )
    if (
        manifest.synthetic
    ):  # seeded random weights, no tokenizer: generate() works, chat() refuses in one line
        coordinator.no_chat_reason = SYNTHETIC_REFUSAL.format(model=manifest.model_name)
    coordinator.max_run = run_limit(deployment)
    k = fleet.speculation.k
    if isinstance(k, int):
        coordinator.policy.fixed_k = k if drafter is not None else 0
    hops: dict[str, float] = {}

    def sample_with_hop(sample: TelemetrySample) -> None:
        on_sample(
            replace(sample, hop_ms=round(hops[sample.name], 2)) if sample.name in hops else sample
        )

    feed = TelemetryFeed(_telemetry_urls(deployment), deployment.keys, sample_with_hop)
    connection = Connection(coordinator, links, feed, deployment, hops)
    coordinator.result_observers.append(
        lambda result, received: _observe_hops(connection.deployment, hops, result, received)
    )
    feed.start()
    return connection


async def handshake(
    connection: Connection, recovered: Callable[[], Awaitable[object]], attempts: int = 3
) -> None:
    """Check the chain end to end with Hello. A stage lost meanwhile (declared by the recovery,
    which fails the Hello at once) is awaited with `recovered()` and the Hello sent again: a stage
    that dies while a command connects is relaunched like one that dies mid-answer."""
    coordinator = connection.coordinator
    for attempt in range(1, attempts + 1):
        try:
            stages = await coordinator.hello()
        except StageLost:
            await recovered()
            if coordinator.fatal is not None:
                raise RuntimeError(coordinator.fatal) from None
            if attempt == attempts:
                raise
            continue
        expected = len(connection.deployment.stages)  # a re-plan around a lost host changes it
        if stages != expected:
            raise RuntimeError(f"handshake crossed {stages} stages, expected {expected}")
        return


def run_limit(deployment: Deployment) -> int:
    """Tokens the chain may generate on its own per run: a one-stage chain feeds its tokens back
    itself, the last stage of a longer one over its loop to stage 0."""
    return (
        protocol.MAX_RUN if len(deployment.stages) == 1 or deployment.stages[-1].config.loop else 0
    )


def _telemetry_urls(deployment: Deployment) -> list[tuple[str, str | None]]:
    return [(p.telemetry_url, p.server_key) for p in deployment.placements]


def _drafter(fleet: Fleet, deployment: Deployment, links: list[ZmqLink]) -> Drafter | None:
    draft = fleet.speculation.draft
    if draft == "none":
        return None
    if draft == "prompt-lookup":
        return PromptLookupDrafter()
    if deployment.draft is None:
        raise RuntimeError(f"draft {draft!r} has no draft worker in deployment {deployment.id}")
    placement = deployment.draft
    link = ZmqLink(
        placement.data_url,
        placement.result_url,
        deployment.keys,
        placement.server_key,
        placement.server_key,
    )
    links.append(link)
    return ModelDrafter(link, name=draft)


def _observe_hops(
    deployment: Deployment, hops: dict[str, float], result: protocol.Result, received: float
) -> None:
    """Wire time from each stage to the next (the last stage: to the coordinator), smoothed, in
    ms."""
    records = protocol.trace_records(result.trace)
    if len(records) != len(deployment.stages):
        return
    arrivals = [record[1] for record in records[1:]] + [received]
    for (stage, _received, _started, _finished, sent), arrival in zip(
        records, arrivals, strict=True
    ):
        name = deployment.stages[int(stage)].config.name
        sample = (arrival - sent) * 1000.0
        previous = hops.get(name)
        hops[name] = sample if previous is None else 0.8 * previous + 0.2 * sample


class Lease:
    """Workers started for one command live on a lease this process renews; they exit when it
    lapses.

    They are launched on it (their config names it, counted from when each is ready), and the
    renewals start before the launch, so a controller killed at any point — even mid-launch or
    mid-relaunch — leaves no worker behind for longer than the lease. Any control request renews it,
    so the watcher pings every few seconds; `end()` sets 0 (no lease) when the workers are handed to
    a deployment record, and has each worker confirm it. Workers that predate the op answer an
    error: ignored. `current()` gives the deployment as it is now, so workers of a new split (a
    re-plan) are leased too."""

    RENEW_SECONDS = 5.0

    def __init__(self, current: Callable[[], Deployment | None], seconds: float) -> None:
        self.current = current
        self.seconds = seconds
        self._task: asyncio.Task[None] | None = None

    async def _send(self, seconds: float, attempts: int = 1) -> list[str]:
        """Set the lease of every worker; the names of those that did not confirm it in
        `attempts` tries."""
        deployment = self.current()
        if deployment is None:
            return []
        request = {"op": "lease", "seconds": seconds}

        async def confirmed(placement: Placement) -> bool:
            for _ in range(attempts):
                reply = await control_request(
                    placement.control_url, request, deployment.keys, placement.server_key, 1.0
                )
                if reply is not None and reply.get("lease") == seconds:
                    return True
            return False

        outcomes = await asyncio.gather(
            *(confirmed(p) for p in deployment.placements), return_exceptions=True
        )
        return [
            p.config.name
            for p, ok in zip(deployment.placements, outcomes, strict=True)
            if ok is not True
        ]

    async def _renew(self) -> None:
        while True:
            await self._send(self.seconds)
            await asyncio.sleep(self.RENEW_SECONDS)

    def start(self) -> None:
        """Renew from now on, every few seconds (workers launched on a lease are pinged while
        others start)."""
        self._task = asyncio.get_running_loop().create_task(self._renew(), name="lease-watcher")

    async def cancel(self) -> None:
        """Stop renewing (the lease then lapses unless the workers are stopped or handed over
        first)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def end(self) -> list[str]:
        """No lease any more: the workers stay until stopped. Returns a warning per worker that did
        not confirm it (retried for a few seconds: a lost request would let a deployed worker exit
        once the lease ran out)."""
        await self.cancel()
        then = (
            f": it exits within {self.seconds:g} s unless a fleettui command attaches to the fleet "
            "first"
        )
        return [
            f"warning: {name} did not confirm that it runs on no "
            f"lease{then if self.seconds else ''}"
            for name in await self._send(0, attempts=5)
        ]


async def answers_ping(placement: Placement, deployment: Deployment) -> bool:
    """Whether the worker of `placement` answers as a ready member of `deployment` (within 3 s)."""
    reply = await control_request(
        placement.control_url, {"op": "ping"}, deployment.keys, placement.server_key, timeout=3.0
    )
    return (
        reply is not None
        and reply.get("deployment") == deployment.id
        and reply.get("state") == "ready"
    )


async def set_batching(deployment: Deployment, on: bool) -> list[str]:
    """Turn batched inference on or off on every worker; the names of those that did not confirm
    it."""

    async def confirmed(placement: Placement) -> bool:
        reply = await control_request(
            placement.control_url,
            {"op": "batching", "on": on},
            deployment.keys,
            placement.server_key,
            3.0,
        )
        return reply is not None and isinstance(reply.get("max_batch"), int)

    outcomes = await asyncio.gather(*(confirmed(p) for p in deployment.placements))
    return [p.config.name for p, ok in zip(deployment.placements, outcomes, strict=True) if not ok]
