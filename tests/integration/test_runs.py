"""Integration test of runs with the real parts: fleets of the real model (exact settings) whose
pipeline generates on its own, the token the last stage scores fed back in as the next step (by the
only stage itself, or sent back to stage 0 over the last stage's loop), while the coordinator reads
the tokens as they come.

Every turn of a conversation (greedy to EOS, a stop string, seeded sampling with penalties) must
give the tokens of round-by-round decoding on the same stage, and the worker's cache must end
exactly where the coordinator's ledger says, including the tokens the worker made past the end of a
reply."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fleettui.control.controller import FleetController
from fleettui.runtime.coordinator import Coordinator
from fleettui.runtime.generation import GenerationParams
from fleettui.runtime.transport import control_request
from remote_worker import protocol
from tests.support.faults import make_fleet

pytestmark = pytest.mark.slow

TURNS = [
    ("What is the capital of France?", GenerationParams(max_tokens=48)),
    ("And of Italy? Answer in one sentence.", GenerationParams(max_tokens=48, stop=("Rome",))),
    (
        "Write a short poem about it.",
        GenerationParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=3, frequency_penalty=0.5),
    ),
    ("Thank you. Now count from one to twenty.", GenerationParams(max_tokens=10)),  # ends by length
]


async def _conversation(coordinator: Coordinator, max_run: int) -> tuple[list[Any], int, int]:
    """The turns in one session; returns each turn's (tokens, finish reason), the tokens the worker
    made past the first reply, and the session id."""
    coordinator.max_run = max_run
    session = await coordinator.open_session()
    # (seeded with the session id too: the same for both runs)
    session.rng = np.random.default_rng(11)
    assert coordinator.chat_format is not None
    eos = coordinator.chat_format.eos_token_ids
    replies: list[Any] = []

    async def linger_at_eos(tokens: list[int], _text: str) -> None:
        if any(token in eos for token in tokens):
            # the worker's run goes on meanwhile: it must be cancelled and masked
            await asyncio.sleep(0.3)

    past_the_reply = 0
    for index, (text, params) in enumerate(TURNS):
        generation = await coordinator.chat(
            session, text, params, linger_at_eos if index == 0 else None
        )
        replies.append((list(generation.token_ids), generation.stats.finish_reason))
        if index == 0:
            past_the_reply = session.ledger.cache_len - (len(session.history) - 1)
    return replies, past_the_reply, session.id


async def _scenario(fleet: Any) -> None:
    controller = FleetController(fleet)
    try:
        coordinator = await controller.start()
        assert coordinator.max_run == protocol.MAX_RUN  # a one-stage fleet runs
        link = coordinator.target
        runs: list[int] = []
        streaming = link.stream  # type: ignore[attr-defined]

        async def counted(step: protocol.Step) -> Any:
            runs.append(step.run)
            return await streaming(step)

        link.stream = counted  # type: ignore[attr-defined]
        with_runs, past, session_id = await _conversation(coordinator, protocol.MAX_RUN)
        plain, _, _ = await _conversation(coordinator, 0)
        assert len(runs) == len(TURNS)  # one run per reply, nothing else
        assert with_runs == plain
        assert [reason for _tokens, reason in with_runs] == ["eos", "stop", "length", "length"]
        # the worker went on past EOS while the reply lingered, and the next turns stayed exact
        assert past > 0
        deployment = controller.deployment
        assert deployment is not None
        session = coordinator.sessions[session_id]
        for stage in deployment.stages:  # every stage's cache ends where the ledger says
            reply = await control_request(
                stage.control_url, {"op": "stats"}, deployment.keys, stage.server_key
            )
            assert reply is not None
            assert reply["sessions"][str(session_id)]["cache_len"] == session.ledger.cache_len
            if stage.config.stage_index == 0 and len(deployment.stages) > 1:
                # what came back from the last stage after a Cancel was dropped
                assert reply["run_ends"] > 0
    finally:
        await controller.stop()


@pytest.mark.parametrize("stages", [1, 2])
def test_runs_give_the_tokens_of_round_by_round_decoding(shard_cache: Path, stages: int) -> None:
    asyncio.run(_scenario(make_fleet(shard_cache, stages)))


def test_a_cancelled_runs_last_step_is_dropped_at_stage_0(shard_cache: Path) -> None:
    """A run of 2 tokens on 2 stages, cancelled at once: the Cancel reaches stage 0 before the run's
    last step comes back over the loop (a looped step with run = 1). That step must be dropped like
    any other of the run, or stage 0 computes it after the Cancel, its Result follows the Ack, and
    stage 0 holds a slot the coordinator never learns of (seen as "step expects 70 cached slots,
    stage 0 has 71" when runs were cut short for prompt lookup)."""

    async def scenario() -> None:
        controller = FleetController(make_fleet(shard_cache, 2))
        try:
            coordinator = await controller.start()
            deployment = controller.deployment
            assert deployment is not None
            session = await coordinator.open_session()
            prompt = list(range(1, 33))
            greedy = protocol.Decode(0.0, 1.0, 0, uniforms=np.zeros(0))
            link: Any = coordinator.target
            stream = await link.stream(session.ledger.plan(prompt).step(session.id, greedy, run=2))
            ack = await link.request(protocol.Control(protocol.Kind.CANCEL, session.id, 0))
            assert isinstance(ack, protocol.Ack)
            made = stream.received  # the Ack follows the run's last Result
            await asyncio.sleep(0.5)  # a step computed after the Cancel would have shown by now
            stage = deployment.stages[0]
            reply = await control_request(
                stage.control_url, {"op": "stats"}, deployment.keys, stage.server_key
            )
            assert reply is not None
            assert reply["sessions"][str(session.id)]["cache_len"] == len(prompt) + made - 1
            assert made == 1 and reply["run_ends"] == 1  # the race this test is about did happen
        finally:
            await controller.stop()

    asyncio.run(scenario())
