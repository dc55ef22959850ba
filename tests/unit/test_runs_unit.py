"""Unit tests of runs (a one-stage pipeline generating on its own) against an in-process fake stage.

The fake serves a run the way `remote_worker` does: each token it scores is fed back as the next
step, every Result is streamed on the run's stream, and any control message of the session ends the
run before it is answered. Its "model" depends on exactly the tokens attended at exactly their
positions (see test_coordinator_unit), so a run that left the coordinator's ledger out of step would
change the output."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest

from fleettui.runtime.coordinator import Coordinator
from fleettui.runtime.generation import GenerationParams
from fleettui.runtime.speculation import PromptLookupDrafter
from fleettui.runtime.transport import ReplyStream, StageLost
from fleettui.runtime.tuning import TUNING
from remote_worker import protocol
from remote_worker.decoding import next_run_step, run_step
from tests.unit.test_coordinator_unit import (
    PROMPTS,
    FakePipeline,
    NoisyDrafter,
    _model,
    _plain_greedy,
)


class FakeRunStage(FakePipeline):
    """A one-stage worker's runs: tokens fed back, streamed; a control message of the session
    stops them."""

    def __init__(self, delay: float = 0.0002) -> None:
        super().__init__(delay)
        self.runs: list[int] = []  # the length of every run asked for
        self.extra = 0  # steps a run made that the coordinator did not read before it ended the run
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._streams: dict[int, ReplyStream] = {}
        self._stopping: set[int] = set()
        self.lose_after: int | None = None  # fail every run with StageLost after this many Results
        self.on_loss = lambda: None
        self.results = 0

    async def stream(self, step: protocol.Step) -> ReplyStream:
        decoded = protocol.decode(protocol.encode(step))
        assert isinstance(decoded, protocol.Step) and decoded.run > 1
        self.runs.append(decoded.run)
        stream = ReplyStream(decoded.run, 10.0, lambda: None)
        self._streams[decoded.session] = stream
        self._tasks[decoded.session] = asyncio.ensure_future(self._run(decoded, stream))
        return stream

    async def _run(self, step: protocol.Step, stream: ReplyStream) -> None:
        for _ in range(step.run):
            await asyncio.sleep(self.delay)
            if step.session in self._stopping:
                return
            assert step.decode is not None
            result = self._serve(replace(step, decode=run_step(step.decode)))
            self.results += 1
            if self.lose_after is not None and self.results > self.lose_after:
                self.lose_after = None
                self.slots.clear()  # the relaunched worker holds nothing
                self.on_loss()
                stream.fail(StageLost("stage-0 lost"))
                return
            stream.deliver(result)
            step = next_run_step(step, int(result.tokens[-1]))  # what the worker queues

    async def request(
        self, message: protocol.Message, timeout: float | None = None
    ) -> protocol.Message:
        if isinstance(message, protocol.Control):
            task = self._tasks.pop(message.session, None)
            if (
                task is not None
            ):  # the control ends the run; its answer follows the run's last Result
                self._stopping.add(message.session)
                await task
                self._stopping.discard(message.session)
                stream = self._streams.pop(message.session)  # (its unread Results stay readable)
                self.extra += max(0, stream.received - stream.count) + stream.unread
            if message.kind == protocol.Kind.CANCEL:
                return protocol.Ack(message.kind, message.session, message.seq, 0)
        return await super().request(message, timeout)


def _coordinator(
    stage: FakePipeline, max_run: int, drafter: NoisyDrafter | None = None
) -> Coordinator:
    coordinator = Coordinator(stage, None, drafter, max_k=4)
    coordinator.max_run = max_run
    return coordinator


async def _answers(stage: FakePipeline, max_run: int, params: GenerationParams) -> list[list[int]]:
    coordinator = _coordinator(stage, max_run)
    session = await coordinator.open_session(seed=7)
    replies = []
    for prompt in ([1, 2, 3], [1, 2, 3, 4, 4]):  # the second turn keeps only the shared prefix
        generation = await coordinator.generate(session, prompt, params)
        replies.append(list(generation.token_ids))
    return replies


@pytest.mark.parametrize(
    "params",
    [
        GenerationParams(max_tokens=30),
        GenerationParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=7),
        GenerationParams(
            max_tokens=30, temperature=0.7, frequency_penalty=0.8, presence_penalty=0.4
        ),
        GenerationParams(max_tokens=30, repetition_penalty=1.5),
    ],
    ids=["greedy", "sampled", "sampled-penalized", "repetition"],
)
async def test_runs_give_the_tokens_of_round_by_round_decoding(params: GenerationParams) -> None:
    """Greedy, seeded sampling and penalties: runs draw the same uniforms and count the same
    tokens."""
    stage = FakeRunStage()
    with_runs = await _answers(stage, protocol.MAX_RUN, params)
    without = await _answers(FakeRunStage(), 0, params)
    assert with_runs == without
    assert stage.runs == [30, 30]  # one run per reply: the coordinator sent two steps for 60 tokens
    if params.temperature == 0 and not params.penalized:
        assert with_runs == [_plain_greedy([1, 2, 3], 30), _plain_greedy([1, 2, 3, 4, 4], 30)]


async def test_interleaved_runs_and_adaptive_speculation_stay_exact() -> None:
    """Three users at once; with a drafter the policy alternates runs of 16 and speculative
    rounds."""
    for drafter in (None, NoisyDrafter(1000)):
        # a step far costlier than a draft, even on a loaded machine
        stage = FakeRunStage(delay=0.005)
        coordinator = _coordinator(stage, protocol.MAX_RUN, drafter)
        sessions = [await coordinator.open_session() for _ in PROMPTS]
        params = GenerationParams(max_tokens=40)
        results = await asyncio.gather(
            *(coordinator.generate(s, p, params) for s, p in zip(sessions, PROMPTS, strict=True))
        )
        for prompt, generation in zip(PROMPTS, results, strict=True):
            assert list(generation.token_ids) == _plain_greedy(prompt, 40)
        assert stage.runs
        if drafter is not None:
            assert max(stage.runs) <= 16


async def test_a_new_pipeline_measures_its_draft_after_two_run_tokens_not_sixteen() -> None:
    """While the draft's cost is unknown a run lasts 2 tokens, so the first probe comes early; once
    the policy knows its costs, runs go back to 16 (or to its next probe)."""
    stage = FakeRunStage(delay=0.0005)
    coordinator = _coordinator(stage, protocol.MAX_RUN, NoisyDrafter(1000))
    session = await coordinator.open_session()
    generation = await coordinator.generate(session, [2, 7, 1, 8], GenerationParams(max_tokens=60))
    assert list(generation.token_ids) == _plain_greedy([2, 7, 1, 8], 60)
    assert stage.runs[0] == 2 and generation.stats.drafted > 0
    assert not all(policy.exploring() for policy in session.policies.values())


async def test_runs_are_not_cut_for_a_draft_that_could_not_pay() -> None:
    """A draft costlier per token than the stage's whole step (10 ms against ~1 ms) pays at no
    acceptance (`KPolicy.could_pay`): once its costs are measured, a run goes on for
    `Tuning.run_tokens_unpaying` tokens instead of ending every 16 for a choice that cannot change
    (each restart is a round trip through the coordinator with the stages idle: 2-4 % of a 2-stage
    reply here). A draft that could pay still ends runs at 16
    (`test_interleaved_runs_and_adaptive_speculation_stay_exact`). Output unchanged."""
    from fleettui.runtime.tuning import TUNING
    from tests.unit.test_coordinator_unit import TimedDrafter

    stage = FakeRunStage(delay=0.0005)
    coordinator = _coordinator(stage, protocol.MAX_RUN, TimedDrafter(1000, per_token=0.01))
    session = await coordinator.open_session()
    generation = await coordinator.generate(session, [2, 7, 1, 8], GenerationParams(max_tokens=300))
    assert list(generation.token_ids) == _plain_greedy([2, 7, 1, 8], 300)
    policy = session.policies["model"]
    assert not policy.exploring() and not policy.could_pay(False)
    assert stage.runs[0] < TUNING.run_tokens_adaptive  # measured first (exploring runs of 2 tokens)
    assert TUNING.run_tokens_unpaying in stage.runs  # then runs of 128 tokens, not of 16
    assert sum(1 for run in stage.runs if run >= TUNING.run_tokens_adaptive) <= 3


async def test_a_reply_that_fails_mid_run_leaves_the_session_exact_for_its_next_turn() -> None:
    """The reply's consumer fails after 5 tokens of a run of 200: a Cancel stops the stage at once
    (no generating for nobody), and the next turn replays the session, exactly."""
    stage = FakeRunStage(delay=0.001)
    coordinator = _coordinator(stage, protocol.MAX_RUN)
    session = await coordinator.open_session()
    seen: list[int] = []

    def fail_after_five(tokens: list[int], _text: str) -> None:
        seen.extend(tokens)
        if len(seen) >= 5:
            raise RuntimeError("the client went away")

    with pytest.raises(RuntimeError, match="went away"):
        await coordinator.generate(
            session, [4, 5, 6], GenerationParams(max_tokens=200), fail_after_five
        )
    assert session.run is None and session.target_epoch == -1
    await asyncio.sleep(0.1)  # a run left alone would make 100 more tokens meanwhile
    assert stage.results < 20 and not coordinator.cancels
    generation = await coordinator.generate(session, [4, 5, 6, 7], GenerationParams(max_tokens=20))
    assert list(generation.token_ids) == _plain_greedy([4, 5, 6, 7], 20)
    assert coordinator.replayed_tokens > 0


async def test_a_stage_lost_mid_run_is_recovered_exactly() -> None:
    stage = FakeRunStage()
    coordinator = _coordinator(stage, protocol.MAX_RUN)
    session = await coordinator.open_session()
    stage.lose_after = 12

    def lost() -> None:
        coordinator.target_epoch += 1  # what the recovery does once the stage is back

    stage.on_loss = lost
    generation = await coordinator.generate(
        session, [3, 1, 4, 1, 5], GenerationParams(max_tokens=30)
    )
    assert list(generation.token_ids) == _plain_greedy([3, 1, 4, 1, 5], 30)
    # the second run picks up where the first was lost
    assert len(stage.runs) == 2 and stage.runs[1] < 30


class _LookupFindingNothing(PromptLookupDrafter):
    """A prompt lookup on a reply that never repeats its history: asked, it finds nothing."""

    def find(self, history: list[int], k: int, session: int = 0) -> list[int]:
        self.asked = getattr(self, "asked", 0) + 1
        return []


async def test_a_lookup_that_finds_nothing_never_cuts_a_run() -> None:
    """A free lookup is asked at each token of a run, not where runs were cut at fixed lengths for
    it: one that finds nothing leaves the reply one run (the bench's 2-stage lookup row, 2 drafts in
    128 tokens, lost 6 % to runs cut every 16 tokens). Output unchanged."""
    stage = FakeRunStage(delay=0.0002)
    drafter = _LookupFindingNothing()
    coordinator = _coordinator(stage, protocol.MAX_RUN, drafter)  # type: ignore[arg-type]
    session = await coordinator.open_session()
    generation = await coordinator.generate(session, [2, 7, 1, 8], GenerationParams(max_tokens=80))
    assert list(generation.token_ids) == _plain_greedy([2, 7, 1, 8], 80)
    assert generation.stats.drafted == 0 and drafter.asked >= 2
    assert stage.runs == [80] and stage.extra == 0
    # each run token counts as an ask: for the all-or-none rule on loaded stages the session does
    # not draft
    assert session.policies["lookup"].hit_rate < TUNING.measurable_hit_rate


class _LookupFindingSometimes(PromptLookupDrafter):
    """A prompt lookup that is right whenever it proposes, and proposes only in some stretches of
    the reply (where the text repeats): `window` positions out of every `period`."""

    def __init__(self, period: int = 12, window: int = 5) -> None:
        super().__init__()
        self.period, self.window = period, window

    def find(self, history: list[int], k: int, session: int = 0) -> list[int]:
        if len(history) % self.period >= self.window:
            return []
        sequence = list(history)
        for _ in range(k):
            sequence.append(int(np.argmax(_model(list(enumerate(sequence))))))
        return sequence[len(history) :]


async def test_a_run_ends_early_where_a_paying_lookup_finds_a_repeat() -> None:
    """A free lookup is asked at each token a run makes: where it would propose and pays, the run is
    cancelled and the tokens it made until the Cancel's Ack are still read (a run makes what plain
    rounds would), then the lookup's drafts are verified. Output identical to plain greedy
    decoding."""
    stage = FakeRunStage(delay=0.005)  # a step far costlier than a lookup, even on a loaded machine
    drafter = _LookupFindingSometimes()
    coordinator = _coordinator(stage, protocol.MAX_RUN, drafter)  # type: ignore[arg-type]
    for prompt in ([2, 7, 1, 8], [3, 3, 3]):
        session = await coordinator.open_session()
        generation = await coordinator.generate(session, prompt, GenerationParams(max_tokens=90))
        assert list(generation.token_ids) == _plain_greedy(prompt, 90)
        # how many stretches pay depends on the step costs the policy measures
        assert (
            generation.stats.accepted >= 10
            and generation.stats.accepted == generation.stats.drafted
        )
        await coordinator.close_session(session)
    # runs asked for the rest were cut short
    assert len(stage.runs) >= 4 and sum(stage.runs) > 2 * 90


class _LookupAlwaysWrong(_LookupFindingSometimes):
    """A prompt lookup that proposes in the same stretches, always a wrong first token."""

    def find(self, history: list[int], k: int, session: int = 0) -> list[int]:
        right = super().find(history, k, session)
        return [(right[0] + 1) % 16, *right[1:]] if right else []


async def test_a_lookup_that_is_seldom_right_is_measured_in_the_runs_shadow() -> None:
    """Where the lookup proposes but a verify is not expected to pay, the run goes on and its next
    tokens say how many drafts a verify would have accepted: a lookup that is always wrong never
    costs a verify or a cut run, and its acceptance falls all the same."""
    stage = FakeRunStage(delay=0.0005)
    coordinator = _coordinator(stage, protocol.MAX_RUN, _LookupAlwaysWrong())  # type: ignore[arg-type]
    session = await coordinator.open_session()
    generation = await coordinator.generate(session, [2, 7, 1, 8], GenerationParams(max_tokens=90))
    assert list(generation.token_ids) == _plain_greedy([2, 7, 1, 8], 90)
    policy = session.policies["lookup"]
    assert generation.stats.drafted <= 3  # the first round's exploration only
    assert len(stage.runs) == 1 and policy.alpha < 0.1


class _FakeRunStageInFlight(FakeRunStage):
    """A Cancel reaches the stage once one more token of the run is on its way, as over real links:
    the run's tokens made until the Cancel's Ack are then never none."""

    def __init__(self, delay: float = 0.0002) -> None:
        super().__init__(delay)
        self._delivered: dict[int, asyncio.Event] = {}

    async def stream(self, step: protocol.Step) -> ReplyStream:
        stream = await super().stream(step)
        event = self._delivered[step.session] = asyncio.Event()
        deliver = stream.deliver

        def delivered(result: protocol.Result) -> None:
            deliver(result)
            event.set()

        stream.deliver = delivered  # type: ignore[method-assign]
        return stream

    async def request(
        self, message: protocol.Message, timeout: float | None = None
    ) -> protocol.Message:
        task = self._tasks.get(message.session) if isinstance(message, protocol.Control) else None
        if task is not None:  # until the run delivered one more token (or ended)
            event = self._delivered[message.session]
            event.clear()
            waiter = asyncio.ensure_future(event.wait())
            await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        return await super().request(message, timeout)


async def test_a_cut_whose_run_went_another_way_meanwhile_verifies_nothing() -> None:
    """A run is cut where the lookup proposes; the token the run made until the Cancel's Ack differs
    from the lookup's first draft: the repeat ended there, so the round after the cut verifies
    nothing (on 2 emulated PCs x 1 user 4-8 such cuts a reply were followed by a verify of fresh
    drafts that failed, 0 of 19 accepted) and a new run starts. The restart is charged to the
    lookup, not to plain decoding, whose realized rate the policy compares every drafter with.
    Output identical to plain greedy decoding."""
    stage = _FakeRunStageInFlight(delay=0.0005)
    coordinator = _coordinator(stage, protocol.MAX_RUN, _LookupAlwaysWrong())  # type: ignore[arg-type]
    # the pipeline's lookup was right elsewhere
    coordinator.policy.costs.acceptance["lookup"] = [
        50.0,
        1.0,
    ]
    session = await coordinator.open_session()
    generation = await coordinator.generate(session, [2, 7, 1, 8], GenerationParams(max_tokens=90))
    assert list(generation.token_ids) == _plain_greedy([2, 7, 1, 8], 90)
    assert coordinator.runs_cut >= 1
    # a reply's first round may verify the lookup's guess, no cut did
    assert generation.stats.drafted <= 4
