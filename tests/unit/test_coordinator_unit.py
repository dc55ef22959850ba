"""Unit tests of the coordinator's speculation and rollback bookkeeping against an in-process fake
pipeline.

The fake stage mirrors what a real stage does with its KV cache (append-only slots, mask deltas,
logical positions) and its "model" is a deterministic function of exactly the tokens it attends to,
at exactly their logical positions. Any rollback mistake (a rejected draft left visible, a wrong
position, a slot masked twice or never) changes the next token, so speculative output must equal
plain greedy output."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest

from fleettui.runtime import ahead as ahead_drafts
from fleettui.runtime import cost_model as cost_model_module
from fleettui.runtime import policy as policy_module
from fleettui.runtime.coordinator import Coordinator
from fleettui.runtime.generation import GenerationParams
from fleettui.runtime.ledger import CacheLedger
from fleettui.runtime.policy import RoundFacts
from fleettui.runtime.speculation import Draft, KPolicy, NgramIndex, PromptLookupDrafter, Sampling
from fleettui.runtime.transport import StageLost
from fleettui.runtime.tuning import TUNING
from remote_worker import decoding, protocol

VOCAB = 17


def _model(visible: list[tuple[int, int]]) -> np.ndarray:
    """Logits of the next token given (logical position, token) pairs the query attends to."""
    positions = [p for p, _ in visible]
    assert positions == list(range(len(visible))), f"positions not contiguous: {positions}"
    tokens = [t for _, t in visible]
    seed = (sum((i + 3) * (t + 1) for i, t in enumerate(tokens[-4:])) + 7 * len(tokens)) % 9973
    logits = np.random.default_rng(seed).normal(size=VOCAB).astype(np.float32)
    return logits


class FakePipeline:
    """A one-process stand-in for the chain: validates what a stage validates, scores like the
    last stage."""

    def __init__(self, delay: float = 0.0) -> None:
        self.slots: dict[int, list[list[int]]] = {}  # session -> [token, position, valid]
        self.delay = delay
        self.steps = 0
        self.in_flight = 0
        self.max_in_flight = 0

    async def request(
        self, message: protocol.Message, timeout: float | None = None
    ) -> protocol.Message:
        message = protocol.decode(protocol.encode(message))  # the wire format round-trips
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            return self._serve(message)
        finally:
            self.in_flight -= 1

    def _serve(self, message: protocol.Message) -> protocol.Message:
        if isinstance(message, protocol.Hello):
            return protocol.Ack(protocol.Kind.HELLO, 0, message.seq, 1)
        if isinstance(message, protocol.Control):
            if message.kind == protocol.Kind.OPEN:
                self.slots[message.session] = []
            elif message.kind == protocol.Kind.CLOSE:
                self.slots.pop(message.session, None)  # a no-op where unknown, as on a stage
            elif message.kind == protocol.Kind.COMPACT:
                slots = self.slots[message.session]
                assert len(slots) == message.cache_len
                self.slots[message.session] = [s for s in slots if s[2]]
            length = len(self.slots.get(message.session, ()))
            return protocol.Ack(message.kind, message.session, message.seq, length)
        assert isinstance(message, protocol.Step)
        self.steps += 1
        slots = self.slots[message.session]
        assert message.cache_len == len(slots), "coordinator and stage disagree on the cache length"
        for start, end in message.mask_ranges:
            assert end <= len(slots)
            for slot in range(start, end):
                assert slots[slot][2], "slot masked twice"
                slots[slot][2] = 0
        assert message.tokens is not None
        logits = []
        for offset, token in enumerate(message.tokens):
            slots.append([int(token), message.pos0 + offset, 1])
            visible = sorted((p, t) for t, p, valid in slots if valid)
            logits.append(_model(visible))
        decode = message.decode or protocol.Decode()
        scored = np.stack(logits[-decode.n_score :])
        tokens, accepted, _, _ = decoding.score(scored, decode)
        return protocol.Result(message.session, message.seq, tokens, accepted)

    async def close(self) -> None:
        return None


class NoisyDrafter:
    """Proposes the true greedy continuation with some tokens corrupted, to exercise partial
    acceptance."""

    name = "noisy"
    costs_time = True

    def __init__(self, wrong_every: int) -> None:
        self.wrong_every = wrong_every
        self.calls = 0

    async def open(self, session: int) -> None:
        return None

    async def close(self, session: int) -> None:
        return None

    async def propose(self, session, history, k, sampling, rng) -> Draft:  # type: ignore[no-untyped-def]
        tokens, sequence = [], list(history)
        for _index in range(k):
            self.calls += 1
            best = int(np.argmax(_model(list(enumerate(sequence)))))
            if self.calls % self.wrong_every == 0:
                best = (best + 1) % VOCAB
            tokens.append(best)
            sequence.append(best)
        return Draft.deterministic(tokens)


def _plain_greedy(prompt: list[int], count: int) -> list[int]:
    sequence = list(prompt)
    for _ in range(count):
        sequence.append(int(np.argmax(_model(list(enumerate(sequence))))))
    return sequence[len(prompt) :]


PROMPTS = [[1, 2, 3, 4, 5], [9, 9, 9, 1], list(range(1, 16)) * 20]


@pytest.mark.parametrize("wrong_every", [2, 3, 7, 1000])
@pytest.mark.parametrize("k", [1, 3, 5])
async def test_speculation_with_mask_rollback_equals_plain_greedy(wrong_every: int, k: int) -> None:
    pipeline = FakePipeline()
    coordinator = Coordinator(
        pipeline, None, NoisyDrafter(wrong_every), max_k=k, compaction_minimum=8
    )
    coordinator.policy.fixed_k = k
    for prompt in PROMPTS:
        session = await coordinator.open_session()
        generation = await coordinator.generate(session, prompt, GenerationParams(max_tokens=40))
        assert list(generation.token_ids) == _plain_greedy(prompt, 40)
        assert generation.stats.drafted > 0
        if wrong_every < 1000:
            assert 0 < generation.stats.accepted < generation.stats.drafted
        await coordinator.close_session(session)


async def test_prefill_is_chunked_and_long_prompts_stay_exact() -> None:
    pipeline = FakePipeline()
    coordinator = Coordinator(pipeline, None, None)
    session = await coordinator.open_session()
    prompt = PROMPTS[2]
    generation = await coordinator.generate(session, prompt, GenerationParams(max_tokens=10))
    assert list(generation.token_ids) == _plain_greedy(prompt, 10)
    assert pipeline.steps == 10 + (len(prompt) - 1) // 128


async def test_multi_turn_reuses_the_shared_prefix_and_masks_the_rest() -> None:
    pipeline = FakePipeline()
    coordinator = Coordinator(pipeline, None, NoisyDrafter(3), max_k=3)
    coordinator.policy.fixed_k = 3
    session = await coordinator.open_session()
    first = await coordinator.generate(session, [1, 2, 3], GenerationParams(max_tokens=12))
    # The next turn shares the first prompt but diverges afterwards: the cache must keep [1, 2, 3]
    # only.
    second_prompt = [1, 2, 3, 4, 4, 4]
    second = await coordinator.generate(session, second_prompt, GenerationParams(max_tokens=12))
    assert list(first.token_ids) == _plain_greedy([1, 2, 3], 12)
    assert list(second.token_ids) == _plain_greedy(second_prompt, 12)


async def test_interleaved_sessions_are_isolated_and_overlap() -> None:
    pipeline = FakePipeline(delay=0.001)
    coordinator = Coordinator(pipeline, None, NoisyDrafter(4), max_k=3)
    coordinator.policy.fixed_k = 3
    sessions = [await coordinator.open_session() for _ in PROMPTS]
    results = await asyncio.gather(
        *(
            coordinator.generate(s, p, GenerationParams(max_tokens=30))
            for s, p in zip(sessions, PROMPTS, strict=False)
        )
    )
    for prompt, generation in zip(PROMPTS, results, strict=False):
        assert list(generation.token_ids) == _plain_greedy(prompt, 30)
    # every session had its step in flight at once (and at times the next one, started ahead)
    assert len(PROMPTS) <= pipeline.max_in_flight <= 2 * len(PROMPTS)


async def test_compaction_keeps_output_exact() -> None:
    pipeline = FakePipeline()
    coordinator = Coordinator(
        pipeline, None, NoisyDrafter(2), max_k=6, compaction_ratio=0.1, compaction_minimum=4
    )
    coordinator.policy.fixed_k = 6
    session = await coordinator.open_session()
    generation = await coordinator.generate(session, [5, 4, 3], GenerationParams(max_tokens=60))
    assert list(generation.token_ids) == _plain_greedy([5, 4, 3], 60)
    # compaction ran and bounded the waste
    assert session.ledger.garbage < session.ledger.logical_len


def test_ledger_plans_rollback_as_mask_ranges() -> None:
    ledger = CacheLedger()
    feed = ledger.plan([1, 2, 3, 4])
    assert (feed.pos0, feed.tokens, feed.mask_ranges) == (0, (1, 2, 3, 4), ())
    ledger.commit(feed)
    feed = ledger.plan([1, 2, 3, 4, 5, 6, 7])  # verify [4?] no: 4 is cached, feed 5, 6, 7
    assert (feed.pos0, feed.tokens) == (4, (5, 6, 7))
    ledger.commit(feed)
    feed = ledger.plan([1, 2, 3, 4, 5, 9])  # 6 and 7 rejected: masked, 9 fed at position 5
    assert feed.mask_ranges == ((5, 7),) and feed.pos0 == 5 and feed.tokens == (9,)
    ledger.commit(feed)
    assert ledger.sequence() == [1, 2, 3, 4, 5, 9] and ledger.cache_len == 8 and ledger.garbage == 2
    feed = ledger.plan([1, 2, 3, 4, 5, 9])  # nothing new: the last token is re-fed for its logits
    assert feed.tokens == (9,) and feed.mask_ranges == ((7, 8),)
    ledger.commit(feed)
    ledger.compact()
    assert ledger.cache_len == 6 and ledger.sequence() == [1, 2, 3, 4, 5, 9]


async def test_the_same_prompt_again_with_speculation_re_feeds_its_cached_reply() -> None:
    """A repeated request (a retry, "regenerate") finds its whole reply cached: the verify step
    still feeds the last prompt token and every draft (the cached copies are masked), not just what
    the cache lacks."""
    coordinator = Coordinator(FakePipeline(), None, NoisyDrafter(1000), max_k=4)
    coordinator.policy.fixed_k = 4
    session = await coordinator.open_session()
    for _turn in range(3):
        generation = await coordinator.generate(
            session, PROMPTS[0], GenerationParams(max_tokens=30)
        )
        assert list(generation.token_ids) == _plain_greedy(PROMPTS[0], 30)
    ledger = CacheLedger()
    ledger.commit(ledger.plan([1, 2, 3, 4, 5]))
    feed = ledger.plan([1, 2, 3, 4, 5], scored=3)
    assert feed.pos0 == 2 and feed.tokens == (3, 4, 5) and feed.mask_ranges == ((2, 5),)
    with pytest.raises(ValueError, match="scored"):
        ledger.plan([1, 2], scored=3)


def test_ledger_plan_after_pending_steps_leaves_the_ledger_as_it_was() -> None:
    """A round planned ahead sees the pending steps as committed, on a copy: the ledger itself is
    unchanged."""
    ledger = CacheLedger()
    ledger.commit(ledger.plan([1, 2, 3, 4, 5, 6]))
    pending = ledger.plan([1, 2, 3, 4, 9, 8])  # 5 and 6 rejected, 9 and 8 fed (not yet committed)
    ahead = ledger.plan_after([pending], [1, 2, 3, 4, 9, 8, 7])
    assert (ahead.cache_len, ahead.pos0, ahead.tokens, ahead.mask_ranges) == (8, 6, (7,), ())
    assert ledger.sequence() == [1, 2, 3, 4, 5, 6] and ledger.cache_len == 6 and ledger.garbage == 0
    ledger.commit(pending)
    assert ledger.sequence() == [1, 2, 3, 4, 9, 8] and ledger.garbage == 2
    twin = ledger.copy()
    twin.commit(twin.plan([1, 2, 3, 4, 9, 8, 7]))
    assert ledger.sequence() == [1, 2, 3, 4, 9, 8] and twin.sequence() == [1, 2, 3, 4, 9, 8, 7]


def test_ledger_refuses_a_stale_feed() -> None:
    ledger = CacheLedger()
    feed = ledger.plan([1, 2])
    ledger.commit(feed)
    with pytest.raises(ValueError):
        ledger.commit(feed)


def test_prompt_lookup_finds_the_latest_match() -> None:
    assert NgramIndex().find([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]
    assert NgramIndex().find([1, 2, 3], 2) == []
    assert NgramIndex().find([5, 6, 5], 2) == [6, 5]


def _scanned_lookup(history: list[int], k: int, max_ngram: int) -> list[int]:
    """The lookup by a scan of the whole history (what the incremental index replaces)."""
    for n in range(min(max_ngram, len(history) - 1), 0, -1):
        starts = [i for i in range(len(history) - n) if history[i : i + n] == history[-n:]]
        if starts and k > 0:
            return history[starts[-1] + n : starts[-1] + n + k]
    return []


def test_the_incremental_ngram_index_finds_what_a_scan_of_the_whole_history_finds() -> None:
    """A run asks the lookup at every token, so each session's history is indexed as it grows: per
    token O(max_ngram) instead of a scan (51 us at 300 tokens). Replies appended one token or
    several at a time, a new reply's list, all give what a scan gives."""
    rng = np.random.default_rng(7)
    drafter = PromptLookupDrafter(max_ngram=3)
    for reply in range(40):
        history = [int(t) for t in rng.integers(0, 5, size=int(rng.integers(1, 6)))]
        for _step in range(int(rng.integers(1, 40))):
            history.extend(int(t) for t in rng.integers(0, 5, size=int(rng.integers(1, 4))))
            k = int(rng.integers(0, 9))
            assert drafter.find(history, k, session=reply % 3) == _scanned_lookup(history, k, 3)


async def test_prompt_lookup_drafter_is_exact_under_greedy() -> None:
    pipeline = FakePipeline()
    coordinator = Coordinator(pipeline, None, PromptLookupDrafter(), max_k=4)
    coordinator.policy.fixed_k = 4
    session = await coordinator.open_session()
    prompt = PROMPTS[2][:60]
    generation = await coordinator.generate(session, prompt, GenerationParams(max_tokens=30))
    assert list(generation.token_ids) == _plain_greedy(prompt, 30)
    # a fleet whose draft is prompt lookup, adaptive K: the lookup drafts (it is the fleet's
    # drafter)
    adaptive = Coordinator(FakePipeline(), None, PromptLookupDrafter(), max_k=4)
    session = await adaptive.open_session()
    generation = await adaptive.generate(session, prompt, GenerationParams(max_tokens=30))
    assert list(generation.token_ids) == _plain_greedy(prompt, 30) and generation.stats.drafted > 0


async def test_a_lookup_that_finds_nothing_hands_its_round_to_the_model_draft(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Beside a model draft, prompt lookup is a free candidate; when it is chosen and finds nothing,
    the round is the model draft's (if it pays now), not a plain step or run, and the lookup's miss
    is counted once. The first round of a reply stays plain on a miss (the first token never waits
    for the draft)."""
    monkeypatch.setattr(
        "fleettui.runtime.coordinator.choose_drafter",
        lambda _policies, _loaded, _shared, _watched: ("lookup", 3),
    )
    drafter = PartDrafter()  # records each proposal
    coordinator = Coordinator(FakePipeline(), None, drafter, max_k=4)
    session = await coordinator.open_session()
    policies = {name: policy for name, policy, _free in coordinator._candidates(session)}
    policies["model"].fixed_k = 2  # the model draft pays (its best K)
    misses: list[bool] = []
    record = policies["lookup"].asked

    def counted(proposed: bool, decay: float = 0.97) -> None:
        misses.append(not proposed)
        record(proposed, decay)

    policies["lookup"].asked = counted  # type: ignore[method-assign]
    prompt = [1, 2, 3, 4, 5]  # no repeats: the lookup misses at first
    generation = await coordinator.generate(session, prompt, GenerationParams(max_tokens=30))
    assert list(generation.token_ids) == _plain_greedy(prompt, 30)
    # one count per round the lookup was asked for (all but the last, which had one token left); the
    # first missed
    assert len(misses) == generation.stats.rounds - 1 and misses[0]
    # the model drafted in every later round the lookup missed
    assert len(drafter.asked) == sum(misses[1:]) > 0
    assert all(k == 2 for _length, k in drafter.asked[:-1])
    await coordinator.close_session(session)


def test_policy_picks_zero_when_drafting_does_not_pay_and_large_k_when_hops_are_slow() -> None:
    slow_draft = KPolicy(None, max_k=8)
    for _ in range(40):
        for k in (0, 3):
            slow_draft.record_round(
                RoundFacts(
                    k, 1 if k else 0, draft_seconds=0.020 * k, verify_seconds=0.025 + 0.002 * k
                )
            )
    assert slow_draft.choose() == 0
    slow_hops = KPolicy(None, max_k=8)
    for _ in range(40):
        for k in (0, 3, 6):
            slow_hops.record_round(
                RoundFacts(k, k, draft_seconds=0.004 * k, verify_seconds=0.200 + 0.003 * k)
            )
    assert slow_hops.choose() >= 6


def test_sampling_property() -> None:
    assert Sampling().greedy and not Sampling(temperature=0.7).greedy


def test_policy_does_not_extrapolate_a_single_draft_measurement_as_free() -> None:
    """Measurements at K=3 only of a draft almost as slow as the target must not make K=8 look
    cheap."""
    policy = KPolicy(None, max_k=8)
    policy.record_round(RoundFacts(0, 0, draft_seconds=0.0, verify_seconds=0.015))
    for _ in range(8):
        policy.record_round(RoundFacts(3, 3, draft_seconds=0.042, verify_seconds=0.015))
    assert policy.alpha > 0.85
    # draft(K) ~ 14 ms x K against a 15 ms verify: at most K = 1 breaks even (a flat draft cost
    # would say K = 8)
    assert policy.choose() <= 1


async def test_prefill_rounds_do_not_teach_the_policy_decode_costs() -> None:
    pipeline = FakePipeline()
    coordinator = Coordinator(pipeline, None, NoisyDrafter(1000), max_k=4)
    session = await coordinator.open_session()
    await coordinator.generate(session, PROMPTS[2][:100], GenerationParams(max_tokens=1))
    assert coordinator.policy.expected_rate(0) is None  # the only round fed the whole prompt
    await coordinator.generate(session, PROMPTS[2][:100], GenerationParams(max_tokens=3))
    assert coordinator.policy.expected_rate(0) is not None


def test_policy_probes_k_zero_decisions_less_and_less_often() -> None:
    policy = KPolicy(None, max_k=8, probe_every=4)
    for _ in range(10):
        policy.record_round(RoundFacts(0, 0, draft_seconds=0.0, verify_seconds=0.015))
        # a cheap draft that is seldom right: K = 0 wins, full acceptance would pay (so it is
        # probed)
        policy.record_round(RoundFacts(3, 0, draft_seconds=0.006, verify_seconds=0.018))
    policy.costs.generating[False] += 1e6  # the probes' time budget is no limit here
    probes = [index for index in range(60) if policy.choose() > 0]
    gaps = [later - earlier for earlier, later in zip(probes, probes[1:], strict=False)]
    assert probes and gaps == sorted(gaps) and gaps[-1] > gaps[0]


async def test_a_draft_far_behind_restarts_from_a_short_window() -> None:
    """A model draft never catches up on more than `window` tokens: a long prompt, or a long stretch
    without speculation, restarts its cache from the recent tokens (the target verifies every draft
    regardless)."""
    from fleettui.runtime.speculation import ModelDrafter, Sampling

    sent: list[object] = []

    class Recorder:
        async def request(self, message: object, timeout: float | None = None) -> object:
            sent.append(message)
            if isinstance(message, protocol.Propose):
                tokens = np.arange(message.k, dtype=np.int64)
                return protocol.Proposal(
                    message.session,
                    0,
                    tokens,
                    np.zeros((0, 0), np.int64),
                    np.zeros((0, 0), np.float32),
                )
            return protocol.Ack(protocol.Kind.OPEN, 0, 0)

    drafter = ModelDrafter(Recorder(), window=8)  # type: ignore[arg-type]
    await drafter.open(1)
    history = list(range(100, 130))  # a 30-token prompt
    rng = np.random.default_rng(0)
    first = await drafter.propose(1, history, 2, Sampling(), rng)
    proposals = [m for m in sent if isinstance(m, protocol.Propose)]
    assert first.fed == 8 and list(proposals[-1].tokens) == history[-8:] and proposals[-1].pos0 == 0
    # one round later: only the new tokens are fed, the rejected draft token masked
    history += [
        7,
        8,
    ]
    await drafter.propose(1, history, 2, Sampling(), rng)
    second = [m for m in sent if isinstance(m, protocol.Propose)][-1]
    assert (
        list(second.tokens) == [7, 8]
        and second.pos0 == 8
        and second.mask_ranges.tolist() == [[8, 9]]
    )
    history += list(range(200, 220))  # 20 tokens without speculation: restart from the last 8
    third = await drafter.propose(1, history, 2, Sampling(), rng)
    last = [m for m in sent if isinstance(m, protocol.Propose)][-1]
    assert third.fed == 8 and list(last.tokens) == history[-8:] and last.cache_len == 0


# ------------------------------------------------------------------------------------ drafting
# ahead
class WiredPipeline(FakePipeline):
    """The fake chain behind slow links: each step spends `wire` seconds between stages, `stage`
    at one."""

    def __init__(self, wire: float, stage: float = 0.001) -> None:
        super().__init__(delay=wire + stage)
        self.stage = stage

    def _serve(self, message: protocol.Message) -> protocol.Message:
        reply = super()._serve(message)
        if isinstance(reply, protocol.Result):
            finished = time.time()
            started = finished - self.stage
            trace = np.array([0, started, started, finished, finished], np.float64)
            reply = dataclasses.replace(reply, trace=trace)
        return reply


class LanPipeline(WiredPipeline):
    """The fake chain on a LAN: a step's whole time (the fake's compute included) counts as stage
    time."""

    def __init__(self, stage: float) -> None:
        super().__init__(wire=0.0, stage=stage)
        self.arrived = 0.0

    async def request(
        self, message: protocol.Message, timeout: float | None = None
    ) -> protocol.Message:
        self.arrived = time.time()
        return await super().request(message, timeout)

    def _serve(self, message: protocol.Message) -> protocol.Message:
        reply = FakePipeline._serve(self, message)
        if isinstance(reply, protocol.Result):
            finished = time.time()
            trace = np.array([0, self.arrived, self.arrived, finished, finished], np.float64)
            reply = dataclasses.replace(reply, trace=trace)
        return reply


class TimedDrafter(NoisyDrafter):
    """A noisy drafter that takes `per_token` seconds per proposed token and records what it was
    asked."""

    def __init__(self, wrong_every: int, per_token: float) -> None:
        super().__init__(wrong_every)
        self.per_token = per_token
        self.busy: set[int] = set()
        self.overlapped = False
        # seconds of a 1-token proposal (a keep-up: mostly reading)
        self.read_cost: float | None = None

    async def propose(self, session, history, k, sampling, rng) -> Draft:  # type: ignore[no-untyped-def]
        # one proposal per session at a time, as a draft worker needs
        self.overlapped |= session in self.busy
        self.busy.add(session)
        try:
            await asyncio.sleep(
                self.per_token * k if k > 1 or self.read_cost is None else self.read_cost
            )
            return await super().propose(session, history, k, sampling, rng)
        finally:
            self.busy.discard(session)


@pytest.mark.parametrize("wrong_every", [7, 25, 1000])
async def test_drafting_ahead_on_slow_links_is_used_and_stays_exact(wrong_every: int) -> None:
    """Slow wires (20 ms a step, 1 ms at the stage) hide a 9-token draft (0.5 ms a token): the next
    round's draft is proposed during this round and used when the round accepted everything; output
    = plain greedy. A draft that is rarely wrong chains rounds ahead (verifies sent behind verifies
    sent ahead), and a rejection inside a chain drops every round after it."""
    drafter = TimedDrafter(wrong_every, per_token=0.0005)
    coordinator = Coordinator(WiredPipeline(wire=0.02), None, drafter, max_k=4)
    coordinator.policy.fixed_k = 4
    sessions = [await coordinator.open_session() for _ in PROMPTS[:2]]
    for _turn in range(
        2
    ):  # the second turn starts while nothing is pending: the first turn settled it
        results = await asyncio.gather(
            *(
                coordinator.generate(s, p, GenerationParams(max_tokens=30))
                for s, p in zip(sessions, PROMPTS, strict=False)
            )
        )
        for prompt, generation in zip(PROMPTS, results, strict=False):
            assert list(generation.token_ids) == _plain_greedy(prompt, 30)
        assert all(not session.ahead for session in sessions)
    counts = coordinator.ahead_counts
    assert 0 < counts.pipelined <= counts.sent <= counts.started  # verifies sent ahead were rounds
    if wrong_every < 1000:
        assert counts.used + counts.pipelined < counts.started  # a rejection throws the round away
    if wrong_every >= 25:
        assert counts.chained > 0
    # the second turn's opening rounds (the links' idle time and the draft's cost known by then) had
    # the round after them drafted while the stages scored the prompt
    assert counts.opened > 0
    assert not drafter.overlapped
    for session in sessions:
        await coordinator.close_session(session)


class PartDrafter(NoisyDrafter):
    """A noisy drafter that records each request (history length, tokens asked); when `gated`, each
    request is announced on `requests` and waits until the test releases it on `gate`."""

    def __init__(self, gated: bool = False) -> None:
        super().__init__(wrong_every=1000)
        self.asked: list[tuple[int, int]] = []
        self.gated = gated
        self.requests: asyncio.Queue[int] = asyncio.Queue()
        self.gate: asyncio.Queue[None] = asyncio.Queue()

    async def propose(self, session, history, k, sampling, rng) -> Draft:  # type: ignore[no-untyped-def]
        self.asked.append((len(history), k))
        if self.gated:
            self.requests.put_nowait(len(self.asked))
            await self.gate.get()
        return await super().propose(session, history, k, sampling, rng)


async def test_a_proposal_ahead_is_drafted_in_parts_and_stops_when_the_round_before_failed() -> (
    None
):
    """A proposal ahead of 9 tokens asks the draft for `Tuning.ahead_chunk` at a time, each part
    after the tokens before it, and joins them into what one request gives; once the round it
    assumed is known to have failed (it gave fewer tokens than assumed, or a bonus other than the
    guess) it ends after its current part and sends no verify, so the draft is free for the fresh
    round sooner. A round that went as assumed stops nothing."""
    assumed = [1, 2, 3, 4, 5]
    whole = await PartDrafter().propose(1, assumed, 9, Sampling(), np.random.default_rng(0))
    sends: list[Draft] = []
    drafter = PartDrafter()
    pending = ahead_drafts.Ahead(list(assumed), 8, ahead_drafts._NOTHING, 20)
    ahead_drafts.start(drafter, 1, pending, 8, lambda _ahead, proposal: sends.append(proposal))
    proposal = (await ahead_drafts.settle(pending)).task.result()  # type: ignore[union-attr]
    assert proposal.tokens == whole.tokens and sends == [proposal]
    part = TUNING.ahead_chunk
    assert drafter.asked == [(5 + start, min(part, 9 - start)) for start in range(0, 9, part)]
    held = [*assumed, whole.tokens[0]]
    assert pending.holds(held) and not pending.failed(held)

    rejected, wrong_bonus = [*assumed, 0, 0], [*assumed, (whole.tokens[0] + 1) % VOCAB]
    for history in (rejected, wrong_bonus, held):
        drafter = PartDrafter(gated=True)
        sends.clear()
        chain = [ahead_drafts.Ahead(list(assumed), 8, ahead_drafts._NOTHING, 20) for _ in range(2)]
        ahead_drafts.start(drafter, 1, chain[0], 8, lambda _ahead, proposal: sends.append(proposal))
        assert await drafter.requests.get() == 1
        # the first part (the guess is back when the second is asked for)
        drafter.gate.put_nowait(None)
        assert await drafter.requests.get() == 2 and chain[0].guess == whole.tokens[0]
        ahead_drafts.stop_failed(chain, history)  # while the second part is drafted
        for _part in range(9):  # whatever parts are still asked for
            drafter.gate.put_nowait(None)
        done = (await ahead_drafts.settle(chain[0])).task.result()  # type: ignore[union-attr]
        if history is held:
            assert not any(link.stopped for link in chain)
            assert done.tokens == whole.tokens and sends == [done] and chain[0].holds(history)
        else:
            assert all(link.stopped for link in chain)
            assert (
                done.tokens == whole.tokens[: 2 * part]
                and sends == []
                and not chain[0].holds(history)
            )
            assert drafter.asked == [(5, part), (5 + part, part)]


async def test_a_stage_lost_while_a_verify_was_sent_ahead_is_recovered_exactly() -> None:
    """The pipeline loses every session's cache (a stage relaunched) while a round and the verify
    sent behind it are in flight: both fail, the verify sent ahead is dropped uncommitted, the
    session is replayed."""
    pipeline = WiredPipeline(wire=0.02)
    coordinator = Coordinator(pipeline, None, TimedDrafter(1000, per_token=0.0005), max_k=4)
    coordinator.policy.fixed_k = 4
    session = await coordinator.open_session()
    serve = pipeline._serve

    def losing(message: protocol.Message) -> protocol.Message:
        if (
            isinstance(message, protocol.Step)
            and coordinator.ahead_counts.pipelined == 2
            and not pipeline.lost
        ):
            pipeline.lost = True
            pipeline.slots.clear()
            coordinator.target_epoch += 1  # what the recovery does once the stage is back
        if isinstance(message, protocol.Step) and message.session not in pipeline.slots:
            raise StageLost("stage-0 lost")
        return serve(message)

    pipeline.lost = False  # type: ignore[attr-defined]
    pipeline._serve = losing  # type: ignore[method-assign]
    generation = await coordinator.generate(session, PROMPTS[0], GenerationParams(max_tokens=60))
    assert list(generation.token_ids) == _plain_greedy(PROMPTS[0], 60)
    assert (
        pipeline.lost and coordinator.replayed_tokens > 0 and coordinator.ahead_counts.pipelined > 0
    )


async def test_no_drafting_ahead_when_the_round_leaves_no_time_or_samples() -> None:
    """On fast links (the wires hide less than the draft would take) and for sampled requests the
    draft is proposed in its round only; with penalties it is proposed ahead, but its verify is not
    sent ahead."""
    # a draft of 20 ms a token: a stall of the event loop on a loaded machine (tens of ms in one
    # round, read as idle wire time) must not make a 5-token draft look hidden
    fast = Coordinator(
        WiredPipeline(wire=0.0005), None, TimedDrafter(1000, per_token=0.02), max_k=4
    )
    fast.policy.fixed_k = 4
    session = await fast.open_session()
    generation = await fast.generate(session, PROMPTS[0], GenerationParams(max_tokens=20))
    assert list(generation.token_ids) == _plain_greedy(PROMPTS[0], 20)
    assert fast.ahead_counts.started == 0

    # with penalties (they depend on the reply so far) drafts are made ahead, their verify is not
    # sent ahead
    replies = []
    for ahead in (True, False):
        penalized = Coordinator(
            WiredPipeline(wire=0.02), None, TimedDrafter(1000, per_token=0.0005), max_k=4
        )
        penalized.policy.fixed_k = 4
        penalized.draft_ahead = ahead
        session = await penalized.open_session()
        params = GenerationParams(max_tokens=30, frequency_penalty=0.5, repetition_penalty=1.2)
        replies.append((await penalized.generate(session, PROMPTS[0], params)).token_ids)
        if ahead:
            assert penalized.ahead_counts.used > 0 and penalized.ahead_counts.sent == 0
    assert replies[0] == replies[1]

    sampled = Coordinator(
        WiredPipeline(wire=0.02), None, TimedDrafter(1000, per_token=0.0005), max_k=4
    )
    sampled.policy.fixed_k = 4
    session = await sampled.open_session()
    await sampled.generate(
        session, PROMPTS[0], GenerationParams(max_tokens=20, temperature=0.7, seed=3)
    )
    assert sampled.ahead_counts.started == 0


async def test_a_cancelled_reply_leaves_the_draft_made_ahead_to_the_next_turn() -> None:
    """A client gone mid-reply cancels its generation; the proposal still running ahead is not cut
    off (the draft's cache would leave its ledger) and the next turn waits for it, then stays
    exact."""
    drafter = TimedDrafter(1000, per_token=0.002)
    coordinator = Coordinator(WiredPipeline(wire=0.03), None, drafter, max_k=4)
    coordinator.policy.fixed_k = 4
    session = await coordinator.open_session()
    task = asyncio.create_task(
        coordinator.generate(session, PROMPTS[0], GenerationParams(max_tokens=200))
    )
    while not session.ahead or session.ahead[0].keep_up:  # noqa: ASYNC110 - until a round is drafted ahead
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    generation = await coordinator.generate(session, PROMPTS[1], GenerationParams(max_tokens=20))
    assert list(generation.token_ids) == _plain_greedy(PROMPTS[1], 20)
    assert not drafter.overlapped
    await coordinator.close_session(session)


class LagDrafter(TimedDrafter):
    """A timed drafter that records, per proposal, how many history tokens it had not seen
    before."""

    def __init__(self, per_token: float) -> None:
        super().__init__(1000, per_token)
        # reading what it missed is a batched prefill, drafting is token by token
        self.read_cost = 0.002
        self.seen: dict[int, int] = {}
        self.lags: list[tuple[int, int]] = []  # (K asked, tokens it had to catch up on)

    async def propose(self, session, history, k, sampling, rng) -> Draft:  # type: ignore[no-untyped-def]
        self.lags.append((k, len(history) - self.seen.get(session, 0)))
        self.seen[session] = len(history) + k - 1
        return await super().propose(session, history, k, sampling, rng)


@pytest.mark.parametrize(("wire", "keep_up"), [(0.01, True), (0.01, False), (0.0, True)])
async def test_a_draft_left_behind_by_plain_rounds_is_fed_in_the_background(
    wire: float, keep_up: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A costly draft loses, so the policy decodes plainly (or with prompt lookup) and probes now
    and then; behind links that leave the cores idle (10 ms a step) the draft reads what it missed
    in the background (every TUNING.keep_up tokens, and the prompt while the stages prefill it), so
    a probe never catches up on more than that and the rounds since. On a LAN (all of a step's time
    at the stage) it does not (it would take its compute from the stages). The output is plain
    greedy in every case."""
    # what a probe catches up on, not how often probes come: no time budget for them here, and
    # probes even of a draft that perfect acceptance could not make pay (`KPolicy.could_pay`)
    tuning = dataclasses.replace(TUNING, probe_share=1e9, probe_ceiling=0.0)
    monkeypatch.setattr(cost_model_module, "TUNING", tuning)
    monkeypatch.setattr(policy_module, "TUNING", tuning)
    drafter = LagDrafter(per_token=0.05)
    pipeline = WiredPipeline(wire=wire) if wire else LanPipeline(stage=0.005)
    coordinator = Coordinator(pipeline, None, drafter, max_k=4)
    coordinator.draft_ahead = keep_up
    session = await coordinator.open_session()
    generation = await coordinator.generate(session, PROMPTS[0], GenerationParams(max_tokens=120))
    assert list(generation.token_ids) == _plain_greedy(PROMPTS[0], 120)
    assert not drafter.overlapped
    probes = [lag for k, lag in drafter.lags if k >= 2]
    assert probes  # the policy probed the draft while decoding plainly
    if not wire:
        assert coordinator.ahead_counts.kept_up == 0
        return
    # a probe catches up on at most TUNING.keep_up tokens and the rounds since (up to 4 drafts and a
    # bonus each)
    if keep_up:
        assert coordinator.ahead_counts.kept_up >= 3
        assert max(probes) <= TUNING.keep_up + 5
    else:
        assert max(probes) > TUNING.keep_up + 5
    # a request that switches speculation off leaves the draft alone
    before = len(drafter.lags)
    await coordinator.generate(session, PROMPTS[1], GenerationParams(max_tokens=40, spec_k=0))
    assert len(drafter.lags) == before
    await coordinator.close_session(session)


def test_one_slow_proposal_does_not_hold_drafting_ahead_off() -> None:
    """The draft's first inference (or a proposal queued behind another session's) can take 50x a
    usual one; after two usual proposals drafting ahead is judged on them, and a steady slowdown
    still counts."""
    cost = ahead_drafts.AheadCost()
    assert not cost.fits(4, 1.0)  # nothing measured yet: no drafting ahead
    cost.add(3, 3 * 0.5)  # a cold first proposal: 0.5 s a token
    assert not cost.fits(4, 0.1)
    cost.add(3, 3 * 0.01)
    cost.add(3, 3 * 0.01)
    assert cost.fits(4, 0.1) and cost.per_token == pytest.approx(0.01)
    for _ in range(4):
        cost.add(3, 3 * 0.05)  # the draft's host got slower for good
    assert not cost.fits(4, 0.1)
    cost.add(0, 1.0)  # nothing proposed: no sample
    assert cost.per_token == pytest.approx(0.05)


@pytest.mark.parametrize("close_after", [0.0, 0.005, 0.015])
async def test_a_session_closed_while_the_rebuild_replays_it_is_closed_after_it(
    close_after: float,
) -> None:
    """A rebalance rebuilds every session; one whose answer ends meanwhile closes after its rebuild
    (or is not rebuilt at all), never between its OPEN and its replay (the stage then refused the
    replay as not open)."""
    pipeline = FakePipeline(delay=0.01)
    coordinator = Coordinator(pipeline, None, None)
    sessions = [await coordinator.open_session() for _ in range(2)]
    for session, prompt in zip(sessions, PROMPTS, strict=False):
        await coordinator.generate(session, prompt, GenerationParams(max_tokens=6))
    pipeline.slots.clear()  # the switch: new stages, nothing cached
    coordinator.target_epoch += 1
    rebuild = asyncio.create_task(coordinator.rebuild_all())
    await asyncio.sleep(close_after)
    await coordinator.close_session(sessions[1])
    assert await rebuild > 0
    assert set(pipeline.slots) == {sessions[0].id}
    generation = await coordinator.generate(sessions[0], [7], GenerationParams(max_tokens=4))
    assert len(generation.token_ids) == 4


async def test_on_loaded_stages_a_session_speculates_only_while_every_other_one_would() -> None:
    """Measured on 2 emulated PCs with 2 users: the user whose prompt lookup confirmed every draft
    ran at 73-89 tok/s, the other, queued behind its longer verifies, at 41-46 against 52 each
    plain. On loaded stages a session speculates only while every other generating session's last
    choice found speculation paying."""
    coordinator = Coordinator(FakePipeline(), None, PartDrafter(), max_k=4)
    first, second = await coordinator.open_session(), await coordinator.open_session()
    first.busy = second.busy = True
    assert not coordinator._others_speculate(first)  # the other's last choice: plain
    second.wants_speculation = True
    assert coordinator._others_speculate(first)
    second.busy = False  # a session that is not generating has no say
    second.wants_speculation = False
    assert coordinator._others_speculate(first)
    # a request with a fixed K speculates whatever the others do: it says so to them
    await coordinator.generate(second, [5, 6, 7, 8], GenerationParams(4, ignore_eos=True, spec_k=2))
    assert second.wants_speculation
    await coordinator.generate(second, [5, 6, 7, 9], GenerationParams(4, ignore_eos=True, spec_k=0))
    assert not second.wants_speculation


async def test_a_close_cut_by_a_split_switch_is_not_an_error() -> None:
    """A switch waits for the rounds of open sessions, not for a CLOSE in flight: when it closes the
    old chain under that CLOSE, the session is gone all the same (the new workers never knew it). A
    closed link that is still the target is an error."""
    from fleettui.runtime.transport import LinkError

    class ClosedUnderCloses(FakePipeline):
        def __init__(self, coordinator_of: list[Coordinator]) -> None:
            super().__init__()
            self.coordinator_of = coordinator_of

        async def request(
            self, message: protocol.Message, timeout: float | None = None
        ) -> protocol.Message:
            if isinstance(message, protocol.Control) and message.kind == protocol.Kind.CLOSE:
                self.coordinator_of[
                    0
                ].target = FakePipeline()  # the switch's retarget, then its close
                raise LinkError("link closed")
            return await super().request(message, timeout)

    holder: list[Coordinator] = []
    old = ClosedUnderCloses(holder)
    coordinator = Coordinator(old, None, None)
    holder.append(coordinator)
    session = await coordinator.open_session()
    await coordinator.close_session(session)  # no error
    assert session.id not in coordinator.sessions and session.id not in coordinator.unclosed
    # the link closes, but this one's target stays
    elsewhere = [Coordinator(FakePipeline(), None, None)]
    stuck = Coordinator(ClosedUnderCloses(elsewhere), None, None)
    lone = await stuck.open_session()
    with pytest.raises(LinkError, match="link closed"):
        await stuck.close_session(lone)


async def test_a_long_prompt_is_prefilled_with_one_chunk_in_flight_per_stage() -> None:
    """Pipelined prefill: up to one unscored chunk per stage in flight, committed in order; the
    steps and the tokens are those of the serial prefill, and the next turn (its shared prefix
    cached) is exact too."""
    # 600 tokens: four 128-token chunks unscored, the rest scored by round 1
    prompt = list(range(1, 16)) * 40
    results = {}
    for stages in (1, 3):
        pipeline = FakePipeline(delay=0.005)
        coordinator = Coordinator(pipeline, None, None)  # type: ignore[arg-type]
        session = await coordinator.open_session()
        coordinator.stages = stages
        first = await coordinator.generate(session, prompt, GenerationParams(max_tokens=6))
        peak = pipeline.max_in_flight
        second = await coordinator.generate(
            session, [*prompt, *first.token_ids, *prompt[:300]], GenerationParams(max_tokens=6)
        )
        results[stages] = (list(first.token_ids), list(second.token_ids), pipeline.steps, peak)
    assert results[1][:3] == results[3][:3]  # the same tokens from the same steps
    assert results[1][3] == 1 and results[3][3] == 3
    assert results[1][0] == _plain_greedy(prompt, 6)


async def test_a_long_prompt_is_prefilled_in_small_chunks_while_another_session_generates() -> None:
    """Each step of a generating session waits behind the chunk a stage computes: while one
    generates, the prompt of another goes in chunks of SHARED_CHUNK tokens, and both answers stay
    exact."""
    from fleettui.runtime.prefill import PREFILL_CHUNK, SHARED_CHUNK

    class Recording(FakePipeline):
        def __init__(self) -> None:
            super().__init__(delay=0.002)
            self.sizes: dict[int, list[int]] = {}

        def _serve(self, message: protocol.Message) -> protocol.Message:
            if isinstance(message, protocol.Step) and message.decode is None:
                self.sizes.setdefault(message.session, []).append(message.n)
            return super()._serve(message)

    prompt, other = list(range(1, 16)) * 40, [3, 1, 4, 1, 5]
    pipeline = Recording()
    coordinator = Coordinator(pipeline, None, None)  # type: ignore[arg-type]
    coordinator.stages = 2
    alone, busy, talker = [await coordinator.open_session() for _ in range(3)]
    await coordinator.generate(alone, prompt, GenerationParams(max_tokens=4))
    talking = asyncio.ensure_future(
        coordinator.generate(talker, other, GenerationParams(max_tokens=400))
    )
    await asyncio.sleep(0.05)
    answer = await coordinator.generate(busy, prompt, GenerationParams(max_tokens=6))
    talked = await talking
    # 600 tokens: 4 unscored, the last 88 scored
    assert pipeline.sizes[alone.id] == [PREFILL_CHUNK] * 4
    assert set(pipeline.sizes[busy.id]) == {SHARED_CHUNK} and len(pipeline.sizes[busy.id]) >= 15
    assert list(answer.token_ids) == _plain_greedy(prompt, 6)
    assert list(talked.token_ids) == _plain_greedy(other, 400)
