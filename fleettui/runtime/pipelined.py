"""Provides the coordinator's rounds ahead: drafts proposed and verifies sent while a round is on the wires.

See `fleettui.runtime.ahead` for the idea and its exactness. This mixin decides when to start the next
round early (greedy, a costly model draft, and the last round left the proposal's time idle on the wires),
sends that round's verify right behind the outstanding one, and turns it into the next round when the
outstanding one went as assumed.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Protocol

from fleettui.runtime import ahead as ahead_drafts
from fleettui.runtime.generation import NO_UNIFORMS, GenerationParams, Round, verify_decode
from fleettui.runtime.ledger import CacheLedger, Feed
from fleettui.runtime.policy import KPolicy
from fleettui.runtime.speculation import Draft, Drafter
from fleettui.runtime.transport import Link
from remote_worker import protocol


class AheadSession(Protocol):
    """What the rounds ahead use of a coordinator's session."""

    id: int
    history: list[int]
    ledger: CacheLedger
    busy: bool
    policies: dict[str, KPolicy]
    ahead: ahead_drafts.Ahead | None
    outstanding: Feed | None  # the verify step whose result the session's round is waiting for
    idle: float  # seconds its last verify round spent on no stage (what drafting ahead can hide)


class AheadRounds:
    """The coordinator's rounds ahead (a mixin of `Coordinator`, which provides these attributes)."""

    target: Link
    drafter: Drafter | None
    max_k: int
    policy: KPolicy
    result_observers: list[Callable[[protocol.Result, float], None]]
    draft_ahead: bool  # drafts may be proposed ahead (a costly model draft); set by the coordinator
    ahead_cost: ahead_drafts.AheadCost
    ahead_counts: dict[str, int]
    _loaded: Callable[[], bool]  # whether sessions compete for the stages (the coordinator's)

    def _ahead_fields(self, drafter: Drafter | None) -> None:
        self.draft_ahead = drafter is not None and getattr(drafter, "costs_time", True)
        self.ahead_cost = ahead_drafts.AheadCost()
        self.ahead_counts = {"started": 0, "used": 0, "sent": 0, "pipelined": 0}

    def _maybe_draft_ahead(
        self,
        session: AheadSession,
        params: GenerationParams,
        draft: Draft,
        feed: Feed,
        remaining: int,
        policy: KPolicy,
    ) -> None:
        """Start the next round (its draft, then its verify) while `feed` is verified, when the last round
        left the wires idle long enough to hide the proposal and the reply goes on after this round.

        The next round's K is this round's when K is fixed, else the best K of the session's `policy` now
        (the policy sees each round, those started ahead included, so K follows acceptance along a chain).
        """
        k = len(draft.tokens)
        fixed = params.spec_k is not None or policy.fixed_k is not None
        tokens = k if fixed else min(self.max_k, policy.best_k(loaded=self._loaded()))
        if (
            not self.draft_ahead
            or self.drafter is None
            or k == 0
            or tokens == 0
            or not params.sampling.greedy
            or remaining <= k + 2
            or not self.ahead_cost.fits(tokens + 1, session.idle)  # + 1: the guess of the bonus token
        ):
            return
        send = None if params.penalized else functools.partial(self._send_ahead, session, params)
        pending = ahead_drafts.Ahead(session.history + list(draft.tokens), tokens, feed)
        ahead_drafts.start(self.drafter, session.id, pending, tokens, send)
        session.ahead = pending
        self.ahead_counts["started"] += 1

    def _send_ahead(
        self, session: AheadSession, params: GenerationParams, ahead: ahead_drafts.Ahead, proposal: Draft
    ) -> ahead_drafts.Sent | None:
        """Send the verify of the round after `ahead.after` now, if that round's result is still outstanding."""
        if session.outstanding is not ahead.after or len(proposal.tokens) < 2 or session.ahead is not ahead:
            return None
        end = 1 + ahead.k
        draft = Draft(proposal.tokens[1:end], proposal.ids[1:end], proposal.probs[1:end])
        sequence = [*ahead.assumed, proposal.tokens[0], *draft.tokens]
        scored = len(draft.tokens) + 1
        ledger = session.ledger
        # the outstanding step is committed when its result comes, or was when it was sent (sent ahead itself)
        committed = ledger.cache_len != ahead.after.cache_len
        feed = (
            ledger.plan(sequence, scored) if committed else ledger.plan_after(ahead.after, sequence, scored)
        )
        decode = verify_decode(
            params, draft, NO_UNIFORMS, sequence, []
        )  # greedy, no penalties: nothing drawn
        reply = asyncio.ensure_future(self.target.request(feed.step(session.id, decode)))
        self.ahead_counts["sent"] += 1
        return ahead_drafts.Sent(draft, feed, reply)

    async def _settle_ahead(self, session: AheadSession) -> ahead_drafts.Ahead | None:
        """Wait for the round started ahead (if any), learn its draft's cost; returns it unless it failed."""
        pending, session.ahead = session.ahead, None
        if pending is None:
            return None
        try:
            settled = await ahead_drafts.settle(pending)
        except BaseException:
            session.ahead = pending  # cancelled while waiting: the next use of the draft waits again
            raise
        if settled is not None:
            self.ahead_cost.add(len(settled.task.result().tokens), settled.seconds)
        return settled

    async def _drop_ahead(self, session: AheadSession, commit: bool) -> None:
        """Settle the round started ahead and drop it; a verify it sent is committed to the ledger (`commit`,
        the stages apply it all the same) or not (the ledger is being reset)."""
        settled = await self._settle_ahead(session)
        if settled is not None and settled.sent is not None:
            sent, settled.sent = settled.sent, None
            if commit:
                session.ledger.commit(sent.feed)
            sent.drop()

    async def _pipelined_round(
        self,
        session: AheadSession,
        params: GenerationParams,
        ahead: ahead_drafts.Ahead,
        remaining: int,
        draft_started: float,
    ) -> Round | None:
        """The round whose verify was sent ahead, if the round before went as assumed (else it is dropped)."""
        sent, ahead.sent = ahead.sent, None
        assert sent is not None
        session.ledger.commit(sent.feed)  # applied by the stages whatever its fate; the next step masks it
        if not ahead.holds(session.history):
            sent.drop()
            return None
        self.ahead_counts["pipelined"] += 1
        draft_seconds = time.perf_counter() - draft_started
        waiting = time.perf_counter()
        session.outstanding = sent.feed
        policy = session.policies.get("model") or self.policy
        self._maybe_draft_ahead(session, params, sent.draft, sent.feed, remaining, policy)
        try:
            reply = await sent.reply
        finally:
            session.outstanding = None
        if not isinstance(reply, protocol.Result):
            raise TypeError(f"pipeline answered a step with {type(reply).__name__}")
        received = time.time()
        for observe in self.result_observers:
            observe(reply, received)
        now = time.perf_counter()
        session.idle = ahead_drafts.wire_seconds(reply.trace, now - sent.sent_at)
        k = len(sent.draft.tokens)
        loaded = self._loaded()
        return Round(k, sent.draft, sent.feed, reply, draft_seconds, now - waiting, k, policy, loaded, True)
