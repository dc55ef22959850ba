"""Provides the command line's overrides of a fleet file: exactness, draft, K and the sampling
settings."""

from __future__ import annotations

from dataclasses import replace

from fleettui.config.fleet import Fleet
from fleettui.config.local_cores import share_local_cores
from fleettui.control.store import Settings
from fleettui.runtime.generation import GenerationParams


def with_overrides(
    fleet: Fleet, exact: bool | None = None, draft: str | None = None, k: int | None = None
) -> Fleet:
    """The fleet with command-line overrides applied (`--exact`, `--no-spec`, `--spec-k`)."""
    if exact:
        runtime = replace(
            fleet.runtime,
            inference_precision="f32",
            kv_cache_precision="f32",
            wire_dtype="f32",
            exact=True,
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
    """The fleet as it runs: recorded or command-line settings applied, local stages on their own
    cores."""
    fleet = share_local_cores(fleet)
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
    """Sampling settings: the command line, else the fleet file's [sessions], else the model's
    recommended.

    The model's recommendation (fleettui.config.recommended) applies only to what neither the
    command line nor the fleet file sets, and never under exact settings: `--exact` stays greedy,
    without penalties. Its top_k and repetition penalty follow its temperature: a temperature given
    here means plain sampling (`--temperature 0` is plain greedy)."""
    from fleettui.config.recommended import GREEDY, recommended_sampling

    sessions = fleet.sessions
    temperature = sessions.temperature if temperature is None else temperature
    top_p = sessions.top_p if top_p is None else top_p
    if top_p == 0.0:  # the smallest nucleus is the single most likely token: `--top-p 0` is greedy
        temperature, top_p = 0.0, 1.0
    model = GREEDY if fleet.runtime.exact else recommended_sampling(fleet.model.name)
    if temperature is None:
        temperature, top_k, repetition_penalty = (
            model.temperature,
            model.top_k,
            model.repetition_penalty,
        )
    else:
        top_k, repetition_penalty = 0, 1.0
    return GenerationParams(
        max_tokens=max_tokens or sessions.max_tokens,
        temperature=temperature,
        top_p=(model.top_p if temperature > 0 else 1.0) if top_p is None else top_p,
        top_k=top_k if temperature > 0 else 0,
        seed=sessions.seed if seed is None else seed,
        spec_k=0 if no_spec else spec_k,
        repetition_penalty=repetition_penalty,
    )
