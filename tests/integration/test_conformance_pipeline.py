"""The conformance harness through the real runtime: tiny models of the registry's `pipeline`
architectures (Gemma 3 with its sliding window, Qwen3-MoE) deployed on 2 real ZeroMQ stage processes
give transformers' greedy tokens with prompt-lookup speculation on (its rejected drafts roll back by
mask), for two interleaved sessions."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from fleettui.config.fleet import DEFAULT_FLEET, Host, load_fleet
from fleettui.control.controller import FleetController, with_overrides
from fleettui.control.deployment import free_port_block
from fleettui.runtime.generation import GenerationParams
from shard_compiler.conformance import REGISTRY, Entry
from tests.support import tiny_models

pytestmark = pytest.mark.slow
TOKENS = 32
# repeated phrases give prompt lookup drafts to propose, which the random model mostly rejects
PROMPTS = [[40, 41, 42, 43, 40, 41, 42, 43, 40, 41], [50, 51, 52, 50, 51, 52, 50, 51, 52, 50, 51]]


def greedy_reference(entry: Entry, prompt: list[int]) -> list[int]:
    import torch

    model = tiny_models.model(entry)
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(TOKENS):
            sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
            if sequence[-1] == model.config.eos_token_id:  # the runtime stops at end of sequence
                break
    return sequence[len(prompt) :]


async def run(folder: Path, cache: Path) -> tuple[list[list[int]], int, int]:
    base = load_fleet(DEFAULT_FLEET)
    hosts = tuple(Host(name=f"stage-{index}", base_port=free_port_block()) for index in range(2))
    fleet = replace(base, hosts=hosts, model=replace(base.model, name=str(folder), shards=cache))
    fleet = with_overrides(fleet, exact=True, draft="prompt-lookup")
    fleet = replace(fleet, speculation=replace(fleet.speculation, k=3))
    controller = FleetController(fleet)
    try:
        coordinator = await controller.start()
        sessions = [await coordinator.open_session() for _ in PROMPTS]
        params = GenerationParams(max_tokens=TOKENS)
        calls = [coordinator.generate(s, p, params) for s, p in zip(sessions, PROMPTS, strict=True)]
        generations = await asyncio.gather(*calls)
        drafted = sum(g.stats.drafted for g in generations)
        accepted = sum(g.stats.accepted for g in generations)
        return [list(g.token_ids) for g in generations], drafted, accepted
    finally:
        await controller.stop()


@pytest.mark.parametrize("entry", [e for e in REGISTRY if e.pipeline], ids=lambda e: e.key)
def test_two_stage_pipeline_with_speculation_matches_transformers(
    entry: Entry, tmp_path: Path
) -> None:
    folder = tiny_models.write_hf(entry, tmp_path / "model")
    tokens, drafted, accepted = asyncio.run(run(folder, tmp_path / "cache"))
    assert tokens == [greedy_reference(entry, prompt) for prompt in PROMPTS]
    assert drafted > accepted  # drafts were rejected: the answers went through mask rollbacks
