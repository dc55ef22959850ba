"""Provides pruning a host's old shard folders on its own (`deploy --prune` does it as part of a
deploy)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from fleettui.config.fleet import Host
from fleettui.provision.deploy import EventHandler, HostSession


async def prune_host(
    host: Host, keep: Sequence[str], on_event: EventHandler | None = None, timeout: float = 10.0
) -> dict[str, Any]:
    """Remove the shard folders on `host` other than `keep` (the current deployment's); what was
    removed."""
    async with HostSession(replace(host, memory_gb=0.001), on_event) as session:
        await session.run_preflight()
        return await session.prune_shards(keep)
