"""Provides the CPU share of each local stage: several stages on this machine get disjoint cores by
default.

Unpinned, two stages of one machine each start as many inference threads as it has cores; with two
or more sessions both compute at once and their threads fight over every core
(docs/performance.md#tuning-constants). So when no local host says `cores` or `threads`, the local
stages split this machine's usable CPUs into contiguous, disjoint slices (the first stages get the
remainder), each with as many threads as cores: the stages then behave like the separate PCs they
stand for. A host that sets either keeps the whole fleet's local hosts as written (set `cores` to
every CPU on each host to share them as before)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from fleettui.config.fleet import Fleet


def share_local_cores(fleet: Fleet, cpus: Sequence[int] | None = None) -> Fleet:
    """The fleet with its local stages pinned to disjoint slices of CPUS (default: the CPUs this
    process may use); see the module docstring."""
    ordered = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    local = [index for index, host in enumerate(fleet.hosts) if host.is_local]
    if len(local) < 2 or len(ordered) < len(local):
        return fleet
    if any(fleet.hosts[index].cores or fleet.hosts[index].threads for index in local):
        return fleet
    base, extra = divmod(len(ordered), len(local))
    hosts, start = list(fleet.hosts), 0
    for rank, index in enumerate(local):
        size = base + (1 if rank < extra else 0)
        hosts[index] = replace(
            hosts[index], cores=tuple(ordered[start : start + size]), threads=size
        )
        start += size
    return replace(fleet, hosts=tuple(hosts))


def core_kind(cpu: int, root: Path = Path("/sys/devices")) -> tuple[str, ...]:
    """What sets CPU apart from this machine's other cores, as Linux tells it: its capacity, its
    highest clock, and on hybrid Intel CPUs whether it is a performance or an efficient core (''
    when not told)."""
    found: list[str] = []
    for name in ("cpu_capacity", "cpufreq/cpuinfo_max_freq"):
        try:
            found.append(
                (root / "system" / "cpu" / f"cpu{cpu}" / name).read_text(encoding="ascii").strip()
            )
        except OSError:
            found.append("")
    for kind in ("cpu_core", "cpu_atom"):
        try:
            listed = (root / kind / "cpus").read_text(encoding="ascii")
        except OSError:
            continue
        if cpu in _cpu_list(listed):
            found.append(kind)
    return tuple(found)


def _cpu_list(text: str) -> set[int]:
    """The CPUs of a sysfs list such as '0-7,16-23' (malformed parts are skipped)."""
    found: set[int] = set()
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        try:
            found.update(range(int(first), int(last or first) + 1))
        except ValueError:
            continue
    return found
