"""The CI soak: 8 sessions for 60 s on an exact fleet, a random worker killed every 15 s; nothing
is lost."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fleettui.bench.soak import soak
from tests.support.faults import make_fleet

pytestmark = pytest.mark.slow


def test_soak_loses_nothing_and_memory_stays_bounded(shard_cache: Path) -> None:
    fleet = make_fleet(shard_cache, 2, "self-int4", 3)
    report = asyncio.run(soak(fleet, seconds=60.0, sessions=8, kill_every=15.0, max_tokens=32))
    print(report.summary())
    assert report.errors == [] and report.mismatches == []
    assert len(report.kills) >= 3 and report.answers >= 8
    recovered = sorted(name for r in report.recoveries for name in r.stages)
    assert recovered == sorted(report.kills) and {r.action for r in report.recoveries} == {
        "relaunch"
    }
    coordinator_start, coordinator_end = report.rss_mb[0][1], report.rss_mb[-1][1]
    assert coordinator_end < coordinator_start * 1.5 + 200  # MB: no growth with kills and replays
    assert max(r[2] for r in report.rss_mb) < report.rss_mb[0][2] * 2 + 500
