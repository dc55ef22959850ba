"""Provides the coordinator's rounds of runs: tokens the pipeline generates on its own.

Without speculation, a round of one token costs a round trip through the coordinator (send, the
stages' queues, the reply, the coordinator's Python) for a few milliseconds of compute. A run
removes it: the token the last stage scores goes straight back in as the next step
(`remote_worker.protocol`, runs: the only stage queues it itself, the last of several sends it to
stage 0) and every token streams out, while the coordinator reads them as rounds of their own. The
cache ledger stays exact because the steps a run makes are the ones the coordinator would have sent
(one token, right after the previous, no masks): each Result read commits that step. Tokens the
stage made past the end of the reply (EOS, a stop string) are committed too, once the Cancel's Ack
says nothing more comes, and the next turn masks them like rejected drafts."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fleettui.runtime.generation import NO_UNIFORMS, GenerationParams, Round, penalties
from fleettui.runtime.ledger import CacheLedger, Feed
from fleettui.runtime.lookup_watch import Cut, Shadow, cut_k, take_cut
from fleettui.runtime.policy import KPolicy
from fleettui.runtime.speculation import Draft, Drafter, PromptLookupDrafter
from fleettui.runtime.transport import Link, ReplyStream, RunLink, RunStalled
from fleettui.runtime.tuning import TUNING
from remote_worker import protocol

log = logging.getLogger(__name__)


def costly_run_tokens(policy: KPolicy, loaded: bool) -> int:
    """Tokens a run may make before a costly drafter's `policy` chooses again: a few while its costs
    are measured, until its next probe is due, at most `Tuning.run_tokens_adaptive`;
    `Tuning.run_tokens_unpaying` while it could not pay at any acceptance."""
    if not policy.could_pay(
        loaded
    ):  # (True while a cost is unknown: an exploring draft is measured soon)
        return TUNING.run_tokens_unpaying
    probe = policy.rounds_until_probe(loaded)
    if policy.measuring_soon(loaded):  # measure the draft soon, not after 16 tokens
        probe = min(probe, TUNING.run_tokens_exploring)
    return min(TUNING.run_tokens_adaptive, probe)


@dataclass
class Run:
    """One run of a session: its Results' stream and what the next Result read commits."""

    stream: ReplyStream
    feed: Feed  # the step that started the run (committed with its first Result)
    policy: KPolicy  # whose costs the run's rounds update
    loaded: bool
    sampled: bool  # each token drew 2 uniforms from the session's RNG
    last: float  # when the previous Result arrived (the first: when the run was sent), time.time()
    made: float | None = None  # when the last stage finished the previous token (its clock)
    consumed: int = 0
    token: int = -1  # the last token read: the run's next step fed it
    counted: tuple[KPolicy, ...] = ()  # policies whose probe schedule counts the run's later tokens
    # a free drafter's drafts its next tokens are compared with (lookup_watch)
    shadow: Shadow | None = None

    @property
    def finished(self) -> bool:
        """Every Result of the run was read."""
        return self.consumed >= self.stream.count

    def next_feed(self, ledger: CacheLedger) -> Feed:
        """The step behind the next Result: the starting one, then one token right after the
        previous."""
        if self.consumed == 0:
            return self.feed
        return Feed(ledger.cache_len, ledger.logical_len, (self.token,), ())

    def read(self, ledger: CacheLedger, token: int) -> Feed:
        """Commit the step behind the Result just read (its token `token`) to `ledger`; returns
        that step."""
        feed = self.next_feed(ledger)
        ledger.commit(feed)
        self.consumed += 1
        self.token = token
        return feed


class RunSession(Protocol):
    """What the run rounds use of a coordinator's session."""

    id: int
    history: list[int]
    ledger: CacheLedger
    rng: np.random.Generator
    run: Run | None
    cut: Cut | None
    target_epoch: int
    lock: asyncio.Lock


class RunRounds:
    """The coordinator's rounds of runs (a mixin of `Coordinator`, which provides these
    attributes)."""

    target: Link
    max_run: int
    drafter: Drafter | None
    lookup: PromptLookupDrafter | None
    result_observers: list[Callable[[protocol.Result, float], None]]
    cancels: set[asyncio.Task[None]]  # Cancels of dropped runs on their way (kept from the GC)
    runs_cut: int  # runs cut short for a free drafter (lookup_watch)

    async def _run_start(
        self,
        session: RunSession,
        params: GenerationParams,
        length: int,
        generated: list[int],
        policy: KPolicy,
        loaded: bool,
        counted: tuple[KPolicy, ...] = (),
    ) -> Round:
        """Ask the pipeline for `length` tokens of its own and read the first (the rest are later
        rounds)."""
        sampling = params.sampling
        feed = session.ledger.plan(session.history)
        uniforms = NO_UNIFORMS
        if (
            not sampling.greedy
        ):  # the numbers plain rounds would draw; each read advances the RNG by its two
            state = session.rng.bit_generator.state
            uniforms = session.rng.random(2 * length)
            session.rng.bit_generator.state = state
        decode = protocol.Decode(
            sampling.temperature,
            sampling.top_p,
            sampling.top_k,
            uniforms=uniforms,
            top_logprobs=params.top_columns,
            **penalties(params, session.history, generated),
        )
        step = feed.step(session.id, decode, run=length)
        target: RunLink = self.target  # type: ignore[assignment]  # max_run > 0: a link that streams
        stream = await target.stream(step)
        session.run = Run(
            stream, feed, policy, loaded, not sampling.greedy, stream.sent_at, counted=counted
        )
        return await self._run_next(session)

    async def _run_round(self, session: RunSession, remaining: int) -> Round | None:
        """The run's next token, watched for a free drafter (`fleettui.runtime.lookup_watch`): where
        it would propose, the run is cut short if verifying pays (its tokens made until the Cancel's
        Ack are still read as rounds, since a run makes what plain rounds would; None once none is
        left, and the caller verifies), else the run's next tokens measure the drafts in its
        shadow."""
        run = session.run
        assert run is not None
        watch = self._watch(run)
        if watch is not None and run.shadow is None and not run.stream.done and remaining > 1:
            policy, drafter = watch
            proposal = drafter.find(session.history, policy.max_k, session.id)
            # each run token is a round that would have asked it: its hit rate is per token, as a
            # round's is
            policy.asked(proposed=bool(proposal))
            if proposal:
                # followed by the run's next tokens (after a cut: those made until the Cancel's Ack)
                run.shadow = Shadow(tuple(proposal))
                k, probe = cut_k(policy, run.loaded)
                if k:
                    take_cut(policy, k, probe, run.loaded)
                    await self._end_run_early(session, Cut(policy, k, session=session.id))
                    if session.run is None:
                        return None
        round_ = await self._run_next(session)
        if watch is not None and run.shadow is not None:  # (a run ended midway teaches nothing)
            shadow = run.shadow
            run.shadow = shadow.follow(int(round_.result.tokens[-1]), watch[0])
            if (
                session.cut is not None and shadow.differed
            ):  # the text went another way during the Cancel
                session.cut.k = 0  # the repeat ended: nothing to verify, a new run starts
        return round_

    def _watch(self, run: Run) -> tuple[KPolicy, PromptLookupDrafter] | None:
        """The free drafter a run is watched for and its policy (adaptive sessions with prompt
        lookup)."""
        policy = next((p for p in run.counted if p.free), None)
        drafter = self.lookup if self.lookup is not None else self.drafter
        if policy is None or not isinstance(drafter, PromptLookupDrafter):
            return None
        return policy, drafter

    async def _end_run_early(self, session: RunSession, cut: Cut) -> None:
        """Cancel the session's run mid-reply for `cut`'s drafter; what it made until the Cancel's
        Ack stays readable, and the time the Cancel took is that drafter's (`_charge_cut`)."""
        run = session.run
        assert run is not None
        cancelling, received = time.perf_counter(), run.stream.received
        try:
            await self.target.request(protocol.Control(protocol.Kind.CANCEL, session.id, 0))
            if (
                run.stream.failure is not None
            ):  # an Error of the run: the last step's effect is unknown
                raise run.stream.failure
        except BaseException:
            self._drop_run(session)
            raise
        # what the Cancel cost: its round trip, less the tokens the run made meanwhile (read as
        # rounds)
        costs = cut.policy.costs
        plain = costs.achieved("plain", run.loaded).rate
        made = (run.stream.received - received) / plain if plain > 0 else 0.0
        cut.seconds = max(time.perf_counter() - cancelling - made, 0.0)
        self.runs_cut += 1
        costs.cut.add(1, cut.seconds)
        session.cut = cut
        run.stream.end()
        if run.finished:
            session.run = None

    def _charge_cut(
        self,
        session: RunSession,
        policy: KPolicy,
        drafted: bool,
        loaded: bool,
        draft_seconds: float,
    ) -> float:
        """The drafting time of a round after a run was cut short for a drafter: with the Cancel's
        time if that drafter drafts this round, else that time goes to the drafter's realized rate
        on its own."""
        if session.cut is None:
            return draft_seconds
        cut, session.cut = session.cut, None
        return draft_seconds + cut.charge(drafted, policy, loaded)

    async def _run_next(self, session: RunSession) -> Round:
        """The run's next token as a round of K = 0 (its cost: the time since the previous token
        arrived)."""
        run = session.run
        assert run is not None
        try:
            result, arrived = await run.stream.next()
        except BaseException as error:
            self._drop_run(session)
            if isinstance(error, RunStalled) and self.max_run:
                log.warning("%s; this pipeline generates without runs from now on", error)
                self.max_run = 0
            raise
        if (
            run.consumed
        ):  # a token the policy was not asked about: it still brings its next probe closer
            for policy in run.counted:
                policy.plain_round(run.loaded)
        feed = run.read(session.ledger, int(result.tokens[-1]))
        if run.sampled:
            session.rng.random(2)
        if run.finished:
            session.run = None
        for observe in self.result_observers:
            observe(result, arrived)
        # a token's cost: since the previous one was made (the last stage's clock; its Results may
        # leave in bursts, remote_worker.coalesce), the first since the run was sent
        records = protocol.trace_records(result.trace)
        finished = records[-1][3] if records else None
        if finished is not None and run.made is not None:
            verify_seconds = max(finished - run.made, 0.0)
        else:
            verify_seconds = max(arrived - run.last, 0.0)
        run.last, run.made = arrived, finished
        return Round(0, Draft.empty(), feed, result, 0.0, verify_seconds, 0, run.policy, run.loaded)

    async def _finish_run(self, session: RunSession) -> None:
        """End a run the reply no longer needs: Cancel it, then commit the steps it made past the
        reply."""
        async with session.lock:
            run, session.run = session.run, None
            session.cut = None  # (a cut for the reply's last tokens: nothing is left to verify)
            if run is None:
                return
            try:
                if not run.stream.done:
                    await self.target.request(protocol.Control(protocol.Kind.CANCEL, session.id, 0))
                if (
                    run.stream.failure is not None
                ):  # an Error of the run: the last step's effect is unknown
                    raise run.stream.failure
                for result, _arrived in run.stream.buffered():
                    run.read(session.ledger, int(result.tokens[-1]))
                if (
                    not run.stream.done
                ):  # what ran is known only from Results: fewer than asked is fine
                    run.stream.close()
            except BaseException as error:
                run.stream.close()
                # what the pipeline holds is unknown: replay before the next round
                session.target_epoch = -1
                if not isinstance(error, Exception):
                    raise
                log.info(
                    "session %d: a run did not end cleanly (%s); it is rebuilt", session.id, error
                )

    def _drop_run(self, session: RunSession) -> None:
        """Forget a run whose end is unknown (a failure, a cancelled reply): the session is
        replayed, and a Cancel goes out at once so the pipeline stops generating for nobody (a
        client gone mid-reply)."""
        run, session.run = session.run, None
        if run is None:
            return
        run.stream.close()
        session.target_epoch = -1
        if not run.stream.done:
            task = asyncio.get_running_loop().create_task(self._cancel_quietly(session.id))
            self.cancels.add(task)
            task.add_done_callback(self.cancels.discard)

    async def _cancel_quietly(self, session_id: int) -> None:
        try:
            await self.target.request(protocol.Control(protocol.Kind.CANCEL, session_id, 0))
        except Exception as error:  # noqa: BLE001 - best effort: the session's next round re-opens it anyway
            log.debug("session %d: the Cancel of a dropped run failed: %s", session_id, error)
