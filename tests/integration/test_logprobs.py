"""Integration test of log-probs on the real model through real pipelines (exact settings).

The last stage reports, per emitted token, that token's log-probability under the model and the
likeliest alternatives. They must not depend on how the tokens were made: one stage or two, plain
rounds or runs, speculation with the INT4 self-draft (several tokens scored in one verify, drafts
rejected by the mask) or none. Sampled tokens get their own log-prob, not the likeliest one's."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from fleettui.control.controller import FleetController
from fleettui.runtime.generation import Generation, GenerationParams
from tests.integration.test_pipeline import make_fleet

pytestmark = pytest.mark.slow
PROMPT = "Explain in two sentences why the sky is blue."
TOKENS = 40
TOP = 4


async def _generate(fleet, runs: list[GenerationParams]) -> list[Generation]:  # type: ignore[no-untyped-def]
    controller = FleetController(fleet)
    try:
        coordinator = await controller.start()
        generations = []
        for params in runs:
            session = await coordinator.open_session(seed=7)
            generations.append(await coordinator.chat(session, PROMPT, params))
            await coordinator.close_session(session)
        return generations
    finally:
        await controller.stop()


def _values(generation: Generation) -> list[float]:
    return [entry.logprob for entry in generation.logprobs]


def test_logprobs_do_not_depend_on_stages_speculation_or_sampling(shard_cache: Path) -> None:
    greedy = GenerationParams(max_tokens=TOKENS, spec_k=0, ignore_eos=True, logprobs=TOP)
    one_stage = asyncio.run(_generate(make_fleet(shard_cache, 1, "none"), [greedy]))[0]
    fleet = make_fleet(shard_cache, 2, "self-int4", k=3, encryption="plaintext")
    sampled = GenerationParams(
        max_tokens=TOKENS, spec_k=3, ignore_eos=True, logprobs=TOP, temperature=1.0, seed=7
    )
    plain, speculative, sampling, without = asyncio.run(
        _generate(
            fleet,
            [
                greedy,
                GenerationParams(max_tokens=TOKENS, spec_k=3, ignore_eos=True, logprobs=TOP),
                sampled,
                GenerationParams(max_tokens=TOKENS, spec_k=0, ignore_eos=True),
            ],
        )
    )
    assert without.logprobs == () and without.token_ids == plain.token_ids  # asking changes nothing
    # several tokens per verify
    assert speculative.stats.accepted > 0 and speculative.stats.rounds < TOKENS
    for name, generation in (("1 stage", one_stage), ("speculative", speculative)):
        gap = max(abs(a - b) for a, b in zip(_values(generation), _values(plain), strict=True))
        print(f"{name}: largest log-prob difference from 2 stages plain {gap:.2e}")
    for generation in (one_stage, plain, speculative):
        assert generation.token_ids == plain.token_ids
        assert [e.token for e in generation.logprobs] == list(plain.token_ids)
        assert _values(generation) == pytest.approx(_values(plain), abs=1e-4)  # measured: 1.2e-05
        for entry in generation.logprobs:  # greedy: the emitted token is the likeliest
            assert len(entry.top) == TOP and entry.top[0][0] == entry.token
            assert (
                entry.top[0][1] == pytest.approx(entry.logprob, abs=1e-6) and entry.logprob <= 0.0
            )
            assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
            assert sum(math.exp(v) for _, v in entry.top) <= 1.0 + 1e-5
    assert [e.token for e in sampling.logprobs] == list(sampling.token_ids) and len(
        sampling.logprobs
    ) == TOKENS
    # sampled: not always the likeliest
    assert any(e.token != e.top[0][0] for e in sampling.logprobs)
    for (
        entry
    ) in sampling.logprobs:  # the sampled token's own log-prob, of the untempered distribution
        ranked = dict(entry.top)
        if entry.token in ranked:
            assert ranked[entry.token] == pytest.approx(entry.logprob, abs=1e-6)
        else:
            assert entry.logprob <= min(ranked.values()) + 1e-6
