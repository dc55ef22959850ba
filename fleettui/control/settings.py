"""Provides the command line's overrides of a fleet file: exactness, draft, K and the sampling settings."""

from __future__ import annotations

from dataclasses import replace

from fleettui.config.fleet import Fleet
from fleettui.control.store import Settings
from fleettui.runtime.coordinator import GenerationParams


def with_overrides(
    fleet: Fleet, exact: bool | None = None, draft: str | None = None, k: int | None = None
) -> Fleet:
    """The fleet with command-line overrides applied (`--exact`, `--no-spec`, `--spec-k`)."""
    if exact:
        runtime = replace(
            fleet.runtime, inference_precision="f32", kv_cache_precision="f32", wire_dtype="f32", exact=True
        )
        fleet = replace(fleet, runtime=runtime, model=replace(fleet.model, precision="fp32"))
    if draft is not None or k is not None:
        speculation = fleet.speculation
        if draft is not None:
            speculation = replace(speculation, draft=draft)
        if k is not None:
            speculation = replace(speculation, k=k, max_k=max(speculation.max_k, k))
        fleet = replace(fleet, speculation=speculation)
    return fleet


def apply(fleet: Fleet, settings: Settings) -> Fleet:
    """The fleet with recorded or command-line settings applied."""
    return with_overrides(fleet, settings.exact, settings.draft, settings.k)


def generation_params(
    fleet: Fleet,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    no_spec: bool = False,
    spec_k: int | None = None,
) -> GenerationParams:
    """Sampling settings from the fleet file, overridden by the command line."""
    sessions = fleet.sessions
    return GenerationParams(
        max_tokens=max_tokens or sessions.max_tokens,
        temperature=sessions.temperature if temperature is None else temperature,
        top_p=sessions.top_p if top_p is None else top_p,
        seed=sessions.seed if seed is None else seed,
        spec_k=0 if no_spec else spec_k,
    )
