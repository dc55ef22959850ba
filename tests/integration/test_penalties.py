"""Integration test of the penalties on the real model through a real 2-stage pipeline (exact
settings).

Frequency/presence/repetition penalties are applied on the last stage before greedy choice and
speculative acceptance, with the verify window's draft tokens counted position by position: greedy
output with penalties must be token-identical with speculation (the INT4 self-draft, fixed K) and
without it, and the penalties must visibly change an output that loops."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fleettui.control.controller import FleetController
from fleettui.runtime.generation import GenerationParams
from tests.integration.test_pipeline import make_fleet

pytestmark = pytest.mark.slow
PROMPT = "Write a poem about light and sound."
TOKENS = 64


def _repeats(tokens: list[int], n: int = 3) -> int:
    """How many n-grams occur more than once (a loop repeats many)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) - len(set(grams))


async def _generate(fleet, runs: list[GenerationParams]) -> list:  # type: ignore[no-untyped-def]
    controller = FleetController(fleet)
    try:
        coordinator = await controller.start()
        generations = []
        for params in runs:
            session = await coordinator.open_session()
            generations.append(await coordinator.chat(session, PROMPT, params))
            await coordinator.close_session(session)
        return generations
    finally:
        await controller.stop()


def test_penalties_are_exact_under_speculation_and_break_a_loop(shard_cache: Path) -> None:
    fleet = make_fleet(shard_cache, 2, "self-int4", k=3, encryption="plaintext")
    penalties = {"frequency_penalty": 0.3, "presence_penalty": 0.2, "repetition_penalty": 1.2}
    plain, penalized, speculative = asyncio.run(
        _generate(
            fleet,
            [
                GenerationParams(max_tokens=TOKENS, spec_k=0, ignore_eos=True),
                GenerationParams(max_tokens=TOKENS, spec_k=0, ignore_eos=True, **penalties),
                GenerationParams(max_tokens=TOKENS, spec_k=3, ignore_eos=True, **penalties),
            ],
        )
    )
    assert speculative.token_ids == penalized.token_ids  # exact under speculation
    # drafts were accepted, so positions after the first counted the drafts before them
    assert speculative.stats.accepted > 0 and speculative.stats.rounds < TOKENS
    # greedy alone repeats itself on this prompt
    assert _repeats(list(plain.token_ids)) >= 3, plain.text
    assert penalized.token_ids != plain.token_ids
    assert _repeats(list(penalized.token_ids)) < _repeats(list(plain.token_ids)), penalized.text
