"""Provides the argument groups the subcommands share and the one way they load a fleet with its
overrides."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, overload

from fleettui.errors import FleetError

if TYPE_CHECKING:
    from fleettui.config.fleet import Fleet
    from fleettui.control.store import Settings
    from fleettui.runtime.generation import GenerationParams


def add_fleet(parser: argparse.ArgumentParser, required: bool = False) -> None:
    help_text = "fleet TOML file" + ("" if required else " (default: the embedded local fleet)")
    parser.add_argument("fleet", nargs=None if required else "?", metavar="FLEET", help=help_text)


def add_settings(parser: argparse.ArgumentParser) -> None:
    """How the fleet computes (recorded with a deployment; an attach must match them)."""
    parser.add_argument(
        "--exact",
        action="store_true",
        help="exact arithmetic: fp32 weights, f32 inference and f32 KV cache on every stage and "
        "the draft",
    )
    spec = parser.add_mutually_exclusive_group()
    spec.add_argument(
        "--spec-k", type=int, metavar="K", help="speculate K tokens per verify (0..16)"
    )
    spec.add_argument("--no-spec", action="store_true", help="no speculative decoding")
    parser.add_argument("--draft", help="draft override: self-int4 | prompt-lookup | none | PATH")


def add_sampling(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, help="stop after this many new tokens")
    parser.add_argument(
        "--temperature", type=float, help="0 = greedy (default from the fleet file)"
    )
    parser.add_argument("--top-p", type=float, help="nucleus sampling threshold")
    parser.add_argument("--seed", type=int, help="sampling seed")


def load(args: argparse.Namespace) -> Fleet:
    from fleettui.config.fleet import load_fleet, resolve_fleet

    return load_fleet(resolve_fleet(getattr(args, "fleet", None)))


def load_for_chat(args: argparse.Namespace) -> Fleet:
    """The fleet of a command that chats (ask, serve, tui): a synthetic model is refused before
    any compile."""
    from fleettui.model.shape import SYNTHETIC_PREFIX, SYNTHETIC_REFUSAL

    fleet = load(args)
    if fleet.model.name.startswith(SYNTHETIC_PREFIX):
        raise FleetError(SYNTHETIC_REFUSAL.format(model=fleet.model.name))
    return fleet


def settings(args: argparse.Namespace) -> Settings:
    from fleettui.control.store import Settings

    spec_k = getattr(args, "spec_k", None)
    if spec_k is not None and not 0 <= spec_k <= 16:
        raise FleetError(f"--spec-k: {spec_k} is out of range 0..16")
    draft = "none" if getattr(args, "no_spec", False) else getattr(args, "draft", None)
    return Settings(exact=bool(getattr(args, "exact", False)), draft=draft, k=spec_k)


@overload
def tokens(args: argparse.Namespace, default: int) -> int: ...
@overload
def tokens(args: argparse.Namespace, default: None) -> int | None: ...
def tokens(args: argparse.Namespace, default: int | None) -> int | None:
    """--max-tokens, or DEFAULT when it is not given (0 is refused, never read as "not given")."""
    max_tokens = getattr(args, "max_tokens", None)
    if max_tokens is None:
        return default
    if max_tokens < 1:
        raise FleetError(f"--max-tokens: {max_tokens} must be at least 1")
    return int(max_tokens)


def sampling(fleet: Fleet, args: argparse.Namespace) -> GenerationParams:
    from fleettui.control.settings import generation_params
    from fleettui.runtime.limits import RequestError, validate_params

    max_tokens = tokens(args, None)
    params = generation_params(
        fleet,
        max_tokens,
        getattr(args, "temperature", None),
        getattr(args, "top_p", None),
        getattr(args, "seed", None),
        getattr(args, "no_spec", False),
        getattr(args, "spec_k", None),
    )
    try:
        validate_params(params)  # the request's own range checks, before anything starts
    except RequestError as error:
        raise FleetError(str(error)) from None
    return params
