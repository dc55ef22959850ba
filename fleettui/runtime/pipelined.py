"""Provides the coordinator's rounds ahead: drafts proposed and verifies sent while a round is on
the wires.

See `fleettui.runtime.ahead` for the idea and its exactness. This mixin decides when to start the
next round early (greedy, a costly model draft, and the last round left the proposal's time idle on
the wires), sends that round's verify right behind the outstanding one (and goes on to the round
after it, up to `Tuning.ahead_depth` verifies ahead), and turns it into the next round when the
outstanding one went as assumed."""

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
from fleettui.runtime.tuning import TUNING
from remote_worker import protocol


class AheadSession(Protocol):
    """What the rounds ahead use of a coordinator's session."""

    id: int
    history: list[int]
    ledger: CacheLedger
    busy: bool
    policies: dict[str, KPolicy]
    # the rounds started ahead, in order; the first follows `outstanding`
    ahead: list[ahead_drafts.Ahead]
    outstanding: Feed | None  # the verify step whose result the session's round is waiting for
    drafted_at: int  # how much of the history the model draft has read (its drafts taken as read)
    idle: float  # seconds its last verify round spent on no stage (what drafting ahead can hide)


class AheadRounds:
    """The coordinator's rounds ahead (a mixin of `Coordinator`, which provides these
    attributes)."""

    target: Link
    drafter: Drafter | None
    max_k: int
    policy: KPolicy
    draft_ahead: bool  # drafts may be proposed ahead (a costly model draft); set by the coordinator
    ahead_cost: ahead_drafts.AheadCost
    ahead_counts: ahead_drafts.AheadCounts
    wire_idle: float  # seconds the pipeline's last verify round (any session's) spent on no stage
    _loaded: Callable[[], bool]  # whether sessions compete for the stages (the coordinator's)
    _result: Callable[[protocol.Message], protocol.Result]  # a step's reply, checked and observed

    def _ahead_fields(self, drafter: Drafter | None) -> None:
        self.draft_ahead = drafter is not None and drafter.costs_time
        self.ahead_cost = ahead_drafts.AheadCost()
        self.wire_idle = 0.0
        self.ahead_counts = ahead_drafts.AheadCounts()

    def _maybe_draft_ahead(
        self,
        session: AheadSession,
        params: GenerationParams,
        history: list[int],
        draft: Draft,
        feed: Feed,
        remaining: int,
        policy: KPolicy,
        opening: int = 0,
    ) -> bool:
        """Start the round after the one whose verify is `feed` (`draft` after `history`,
        `remaining` tokens left at it): its draft, then its verify. Only when the last round left
        the wires idle long enough to hide the proposal's first part, the reply goes on after that
        round, and the chain may grow (`ahead.deep_enough`). Whether it started.

        The next round's K is this round's when K is fixed, else the best K of the session's
        `policy` now (the policy sees each round, those started ahead included, so K follows
        acceptance along a chain). `opening` is the K chosen for a reply's opening round, which
        scores the prompt without drafts: the draft then reads the prompt, guesses the first token
        and drafts the next round behind it meanwhile (the links' last idle time, the pipeline's,
        stands for the new session's)."""
        k = len(draft.tokens)
        fixed = params.spec_k is not None or policy.fixed_k is not None
        loaded = self._loaded()
        tokens = (k or opening) if fixed else min(self.max_k, policy.best_k(loaded=loaded))
        idle = self.wire_idle if opening else session.idle
        if (
            not self.draft_ahead
            or self.drafter is None
            or params.constraint
            is not None  # its masks follow from the round before: no round ahead
            or (k == 0 and opening <= 0)
            or tokens == 0
            or not params.sampling.greedy
            or remaining <= k + 2
            or not ahead_drafts.deep_enough(len(session.ahead), policy.alpha, tokens, loaded)
            # its first part hidden by the wires (+ 1: the guess of the bonus token); a longer
            # proposal pays when the round holds (the next one starts sooner), and costs one part
            # when it fails (`stop_failed`)
            or not self.ahead_cost.fits(min(tokens + 1, TUNING.ahead_chunk), idle)
        ):
            return False
        send = (
            None
            if params.penalized
            else functools.partial(self._send_ahead, session, params, policy)
        )
        pending = ahead_drafts.Ahead([*history, *draft.tokens], tokens, feed, remaining - (k + 1))
        session.ahead.append(pending)
        session.drafted_at = len(pending.assumed)
        ahead_drafts.start(self.drafter, session.id, pending, tokens, send)
        self.ahead_counts.started += 1
        self.ahead_counts.opened += opening > 0
        return True

    def _keep_draft_up(
        self, session: AheadSession, params: GenerationParams, remaining: int
    ) -> None:
        """Feed the model draft the history it missed, in the background (`ahead.keep_up`), when it
        missed at least `Tuning.keep_up` tokens (or the prompt), the reply goes on for a while, the
        stages have room, the links leave the cores idle (on a LAN the draft would take its compute
        from the stages) and speculation is not switched off (for the request or the fleet)."""
        if session.ahead and session.ahead[0].keep_up and session.ahead[0].task.done():
            session.ahead.pop(0)  # the last keep-up is over: nothing to wait for
        missed = len(session.history) - session.drafted_at
        if (
            not self.draft_ahead
            or self.drafter is None
            or params.spec_k == 0
            or self.policy.fixed_k == 0
            or session.ahead
            or missed < min(TUNING.keep_up, len(session.history))
            or remaining <= TUNING.keep_up
            or self.wire_idle < TUNING.keep_up_idle
            or self._loaded()
        ):
            return
        session.ahead.append(ahead_drafts.keep_up(self.drafter, session.id, session.history))
        session.drafted_at = len(session.history)
        self.ahead_counts.kept_up += 1

    def _send_ahead(
        self,
        session: AheadSession,
        params: GenerationParams,
        policy: KPolicy,
        ahead: ahead_drafts.Ahead,
        proposal: Draft,
    ) -> ahead_drafts.Sent | None:
        """Send the verify of the round after `ahead.after` now, if that round's result is still to
        come (it is outstanding, or sent ahead itself); then start the round after this one."""
        chain = session.ahead
        index = next((i for i, link in enumerate(chain) if link is ahead), None)
        if index is None or len(proposal.tokens) < 2:
            return None
        before = [link.sent.feed for link in chain[:index] if link.sent is not None]
        behind = before[-1] if index else session.outstanding
        if len(before) != index or behind is not ahead.after:
            return None
        end = 1 + ahead.k
        draft = Draft(proposal.tokens[1:end], proposal.ids[1:end], proposal.probs[1:end])
        history = [*ahead.assumed, proposal.tokens[0]]
        sequence = [*history, *draft.tokens]
        # the steps before it are committed when their results come (or were when sent ahead
        # themselves)
        pending = [session.outstanding, *before] if session.outstanding is not None else before
        feed = session.ledger.plan_after(pending, sequence, len(draft.tokens) + 1)
        # greedy, no penalties: nothing drawn
        decode = verify_decode(params, draft, NO_UNIFORMS, sequence, [])
        reply = asyncio.ensure_future(self.target.request(feed.step(session.id, decode)))
        self.ahead_counts.sent += 1
        self.ahead_counts.chained += index > 0
        ahead.sent = ahead_drafts.Sent(draft, feed, reply)
        if chain[-1] is ahead:
            self._maybe_draft_ahead(session, params, history, draft, feed, ahead.remaining, policy)
        return ahead.sent

    async def _settle_ahead(self, session: AheadSession) -> ahead_drafts.Ahead | None:
        """Wait for the first round started ahead (if any), learn its draft's cost; returns it
        unless it failed. It leaves the chain: the rounds after it now follow the round it becomes
        (or is dropped)."""
        if not session.ahead:
            return None
        pending = session.ahead.pop(0)
        try:
            settled = await ahead_drafts.settle(pending)
        except BaseException:
            # cancelled while waiting: the next use of the draft waits again
            session.ahead.insert(0, pending)
            raise
        if settled is not None and not settled.keep_up:  # (a keep-up's time is mostly its catch-up)
            self.ahead_cost.add(len(settled.task.result().tokens), settled.seconds)
        return settled

    async def _drop_ahead(self, session: AheadSession, commit: bool) -> None:
        """Settle every round started ahead and drop them; the verifies they sent are committed to
        the ledger in order (`commit`, the stages apply them all the same) or not (the ledger is
        being reset)."""
        while session.ahead:
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
        """The round whose verify was sent ahead, if the round before went as assumed (else it is
        dropped, and the caller drops the rounds after it)."""
        sent, ahead.sent = ahead.sent, None
        assert sent is not None
        # applied by the stages whatever its fate; the next step masks it
        session.ledger.commit(sent.feed)
        if not ahead.holds(session.history):
            sent.drop()
            return None
        self.ahead_counts.pipelined += 1
        draft_seconds = time.perf_counter() - draft_started
        waiting = time.perf_counter()
        session.outstanding = sent.feed
        policy = session.policies.get("model") or self.policy
        if not session.ahead:  # else the round after it is under way already
            self._maybe_draft_ahead(
                session, params, session.history, sent.draft, sent.feed, remaining, policy
            )
        try:
            reply = self._result(await sent.reply)
        finally:
            session.outstanding = None
        now = time.perf_counter()
        session.idle = self.wire_idle = ahead_drafts.wire_seconds(reply.trace, now - sent.sent_at)
        k = len(sent.draft.tokens)
        loaded = self._loaded()
        return Round(
            k, sent.draft, sent.feed, reply, draft_seconds, now - waiting, k, policy, loaded, True
        )
