"""Provides the `[resilience]` table of a fleet file: heartbeats, loss detection, grace,
rebalancing."""

from __future__ import annotations

from dataclasses import dataclass

from fleettui.config.toml_source import Section

REBALANCE_MODES = ("off", "propose", "auto")
CALIBRATE_MODES = ("auto", "off")


@dataclass(frozen=True)
class ResilienceSettings:
    """Fault handling: how fast a lost stage is declared, how long a host may stay away,
    rebalancing."""

    heartbeat_seconds: float = 0.5  # ping every stage's control socket this often
    # a stage silent this long is lost (workers answer pings while computing)
    detect_seconds: float = 2.0
    grace_seconds: float = 30.0  # relaunch attempts on the same host before re-planning without it
    rebalance: str = "propose"  # off | propose | auto (apply a better split between rounds)
    throttle_ratio: float = 1.5  # step time over the stage's own baseline that counts as throttled
    # auto: a deploy times hosts with no cost profile for its settings first | off
    calibrate: str = "auto"
    # a host planned around is tried this often; back, the model moves onto it (0: never)
    rejoin_seconds: float = 10.0
    # answers of a degraded fleet wait this long for it to be whole again (0: end)
    hold_seconds: float = 60.0


def parse_resilience(section: Section) -> ResilienceSettings:
    section.reject_unknown(
        (
            "heartbeat_seconds",
            "detect_seconds",
            "grace_seconds",
            "rebalance",
            "throttle_ratio",
            "calibrate",
            "rejoin_seconds",
            "hold_seconds",
        )
    )
    heartbeat = section.number(
        "heartbeat_seconds", float, 0.5, lambda v: 0.05 <= v <= 10.0, "0.05..10"
    )
    detect = section.number("detect_seconds", float, 2.0, lambda v: 0.1 <= v <= 600.0, "0.1..600")
    if detect < 2 * heartbeat:
        raise section.error(
            "detect_seconds", f"{detect} must be at least twice heartbeat_seconds ({heartbeat})"
        )
    return ResilienceSettings(
        heartbeat_seconds=heartbeat,
        detect_seconds=detect,
        grace_seconds=section.number(
            "grace_seconds", float, 30.0, lambda v: 0.0 <= v <= 86400.0, "0..86400"
        ),
        rebalance=section.choice("rebalance", REBALANCE_MODES, "propose"),
        throttle_ratio=section.number(
            "throttle_ratio", float, 1.5, lambda v: 1.0 < v <= 100.0, "over 1, at most 100"
        ),
        calibrate=section.choice("calibrate", CALIBRATE_MODES, "auto"),
        rejoin_seconds=section.number(
            "rejoin_seconds", float, 10.0, lambda v: v == 0 or 1.0 <= v <= 3600.0, "0 or 1..3600"
        ),
        hold_seconds=section.number(
            "hold_seconds", float, 60.0, lambda v: 0.0 <= v <= 3600.0, "0..3600"
        ),
    )
