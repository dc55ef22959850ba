"""Provides the coordinator: chat sessions, speculative decoding with mask rollback, interleaved
users.

No UI code and no OpenVINO here: the coordinator speaks the wire protocol through a `Link` (ZeroMQ
in production, anything with `request()` in tests) and keeps, per session, the full token history
(so a lost stage can be rebuilt by replaying it) and a `CacheLedger` mirroring the pipeline's
physical KV slots. Several sessions generate at once simply by running as concurrent tasks: each has
one step in flight (more when behind slow links its next rounds start early,
`fleettui.runtime.ahead`), and the stages serve whatever arrives, so while stage 1 works on user A,
stage 0 works on user B."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fleettui.runtime import ahead as ahead_drafts
from fleettui.runtime.chat_format import ChatFormat, ChatMessage, TextStream
from fleettui.runtime.constraint import ConstraintError, ReplyGrammar
from fleettui.runtime.generation import (
    NO_UNIFORMS,
    Generation,
    GenerationParams,
    GenerationStats,
    Round,
    TokenCallback,
    token_logprobs,
    verify_decode,
)
from fleettui.runtime.hold import Hold
from fleettui.runtime.ledger import Feed
from fleettui.runtime.limits import validate_request
from fleettui.runtime.measures import StageLoad, round_costs
from fleettui.runtime.pipelined import AheadRounds
from fleettui.runtime.policy import KPolicy, RoundFacts, choose_drafter
from fleettui.runtime.prefill import PrefillRounds
from fleettui.runtime.runs import RunRounds, costly_run_tokens
from fleettui.runtime.session import Session
from fleettui.runtime.speculation import Draft, Drafter, PromptLookupDrafter, Sampling
from fleettui.runtime.transport import Link, LinkError, RunLink, StageLost
from fleettui.runtime.tuning import TUNING
from remote_worker import protocol

log = logging.getLogger(__name__)
MAX_RECOVERIES_PER_ROUND = 20  # a round retried this often means recovery keeps failing: give up
# tokens a grammar forces, verified at once in place of drafts (decode_spec.MAX_DRAFT: 64)
MAX_FORCED = 32


_T = TypeVar("_T")


async def _nothing() -> None:
    return None


class Coordinator(RunRounds, AheadRounds, PrefillRounds):
    """Drives a pipeline (`target` link) and an optional drafter for many concurrent sessions."""

    def __init__(
        self,
        target: Link,
        chat_format: ChatFormat | None,
        drafter: Drafter | None = None,
        max_k: int = 8,
        compaction_ratio: float = 0.5,
        compaction_minimum: int = 64,
        context_length: int | None = None,
    ) -> None:
        self.target = target
        # the model's max_position_embeddings (None: unchecked)
        self.context_length = context_length
        self.chat_format = chat_format
        self.drafter = drafter
        self.max_k = max_k if drafter is not None else 0
        self.policy = KPolicy(None if drafter is not None else 0, self.max_k)
        # With a costly model draft, prompt lookup (free) is a second candidate chosen per session
        # by rate.
        self.lookup = PromptLookupDrafter() if drafter is not None and drafter.costs_time else None
        # Tokens the pipeline may generate on its own per run (0: never; the fleet's connection sets
        # it, since only it knows whether the chain feeds its tokens back: one stage, or a last
        # stage with a loop).
        self.max_run = 0
        # ... and how many were cut short for prompt lookup (fleettui.runtime.lookup_watch)
        self.runs_cut = 0
        # The next round starts during this one when its wires leave the time
        # (fleettui.runtime.pipelined).
        self._ahead_fields(drafter)
        self.cancels: set[asyncio.Task[None]] = set()
        self.compaction_ratio = compaction_ratio
        self.compaction_minimum = compaction_minimum
        self.sessions: dict[int, Session] = {}
        # why chat() refuses when chat_format is None
        self.no_chat_reason = "this pipeline has no tokenizer"
        self._ids = itertools.count(1)
        # observers of every verify/decode result (traces for telemetry, bench)
        self.stage_load = StageLoad()
        self.result_observers: list[Callable[[protocol.Result, float], None]] = [
            self.stage_load.observe
        ]
        # Recovery (fleettui.control.recovery) pauses rounds by clearing `resume`, bumps an epoch
        # for what was lost, rebuilds every session and sets `resume` again; `fatal` ends every
        # session clearly.
        self.resume = asyncio.Event()
        self.resume.set()
        self.target_epoch = self.draft_epoch = 0
        self.fatal: str | None = None
        # a degraded fleet's rounds wait for it to be whole again, then resume exactly
        self.hold = Hold()
        self.replayed_tokens = 0
        self.stages = 1  # how many stages the last Hello crossed
        # Sessions closed here whose CLOSE a lost stage kept from the chain: the stages that
        # survived still hold them (and count them against max_sessions), so they are closed before
        # the next rebuild.
        self.unclosed: set[int] = set()

    async def hello(self, timeout: float = 30.0) -> int:
        """End-to-end handshake through every stage; returns the number of stages that answered."""
        reply = await self.target.request(protocol.Hello(0), timeout=timeout)
        if not isinstance(reply, protocol.Ack):
            raise TypeError(f"hello answered {type(reply).__name__}")
        self.stages = reply.value  # a pipelined prefill keeps one chunk in flight per stage
        return reply.value

    async def open_session(self, seed: int = 0) -> Session:
        session = Session(next(self._ids), seed)
        self.sessions[session.id] = session
        try:
            await self._guarded(session, _nothing)  # opening is the rebuild of an empty history
        except BaseException:
            self.sessions.pop(session.id, None)
            self.unclosed.add(session.id)  # the OPEN may have reached some stages
            raise
        return session

    async def close_session(self, session: Session) -> None:
        self.sessions.pop(session.id, None)
        async with (
            session.lock
        ):  # a rebuild of it in flight (a recovery's, a rebalance's) ends first
            await self._drop_ahead(session, commit=True)
            link = self.target
            try:
                await link.request(protocol.Control(protocol.Kind.CLOSE, session.id, 0))
            except (
                StageLost
            ):  # a relaunched stage never knew it; the survivors are told before the rebuild
                self.unclosed.add(session.id)
            except (
                LinkError
            ):  # a split switch closed the old chain meanwhile: its new workers never knew it
                if link is self.target:
                    raise
            if self.drafter is not None:
                with contextlib.suppress(StageLost):
                    await self.drafter.close(session.id)
            if self.lookup is not None:
                await self.lookup.close(session.id)

    # -- recovery ---------------------------------------------------------------------------------
    async def _guarded(self, session: Session, action: Callable[[], Awaitable[_T]]) -> _T:
        """Run one round of `session` (after any rebuild it needs); a lost stage pauses it and
        retries it.

        The session's RNG is rewound before a retry, so a sampled round draws the same numbers
        again."""
        spurious = 0  # failures with no loss declared since the attempt began
        while spurious < MAX_RECOVERIES_PER_ROUND:
            await self.resume.wait()
            if self.fatal is not None:
                if await self.hold.wait() and self.fatal is None:
                    continue
                raise LinkError(self.fatal + self.hold.note)
            rng_state = session.rng.bit_generator.state
            epochs = (self.target_epoch, self.draft_epoch)
            try:
                async with session.lock:
                    await self._ensure_rebuilt(session)
                    return await action()
            except StageLost as error:
                session.rng.bit_generator.state = rng_state
                log.info("session %d paused: %s", session.id, error)
                if (self.target_epoch, self.draft_epoch) == epochs:
                    spurious += 1
                await asyncio.sleep(0.05)  # let the recovery clear `resume` if it has not yet
        raise LinkError(f"session {session.id}: the pipeline kept failing during recovery")

    async def _ensure_rebuilt(self, session: Session) -> None:
        """Re-open the session and replay its history into the pipeline / draft when their epoch
        moved on."""
        target_epoch, draft_epoch = self.target_epoch, self.draft_epoch
        if session.target_epoch != target_epoch:
            self._drop_run(session)
            await self._drop_ahead(session, commit=False)
            await self._close_unclosed()
            session.ledger.reset()
            await self.target.request(protocol.Control(protocol.Kind.OPEN, session.id, 0))
            # the last token is fed by the next round, as in a normal run
            prefix = session.history[:-1]
            await self._replay(session, prefix, target_epoch)
            self.replayed_tokens += len(prefix)
            session.target_epoch = target_epoch
        if session.draft_epoch != draft_epoch:
            await self._drop_ahead(session, commit=True)
            if self.drafter is not None:
                # re-opening resets; the next proposal feeds the history
                await self.drafter.open(session.id)
            session.drafted_at = 0
            session.draft_epoch = draft_epoch

    async def _close_unclosed(self) -> None:
        """Close, on every stage, the sessions whose CLOSE was lost with a stage (a no-op where
        unknown)."""
        while (
            self.unclosed
        ):  # taken out before the send: sessions rebuilding at once send each CLOSE once
            session_id = self.unclosed.pop()
            try:
                await self.target.request(protocol.Control(protocol.Kind.CLOSE, session_id, 0))
            except BaseException:
                self.unclosed.add(session_id)
                raise

    async def rebuild_all(self) -> int:
        """Rebuild every open session now (the recovery's replay); returns the tokens replayed."""
        before = self.replayed_tokens

        async def rebuild(session: Session) -> None:
            async with session.lock:
                if session.id in self.sessions:  # not closed while it waited for its round to end
                    await self._ensure_rebuilt(session)

        await asyncio.gather(*(rebuild(session) for session in list(self.sessions.values())))
        return self.replayed_tokens - before

    async def chat(
        self,
        session: Session,
        user_text: str,
        params: GenerationParams,
        on_tokens: TokenCallback | None = None,
        raw: bool = False,
    ) -> Generation:
        """Add a user turn, generate the assistant's reply with the chat template, remember both.

        RAW: completion mode (a base model): the session is one document, USER_TEXT appended and
        continued."""
        if self.chat_format is None:
            raise RuntimeError(self.no_chat_reason)
        turn = ChatMessage("user", user_text)
        if raw:
            prompt = self.chat_format.encode_text(
                "".join(m.content for m in [*session.messages, turn])
            )
        else:  # a turn the template refuses is not remembered
            prompt = self.chat_format.encode_chat([*session.messages, turn])
        session.messages.append(turn)
        generation = await self.generate(session, prompt, params, on_tokens)
        session.messages.append(ChatMessage("assistant", generation.text))
        return generation

    async def generate(
        self,
        session: Session,
        prompt: list[int],
        params: GenerationParams,
        on_tokens: TokenCallback | None = None,
    ) -> Generation:
        """Generate a continuation of `prompt`; the cache keeps whatever prefix it already shares.

        Raises `limits.RequestError` (a ValueError naming the field) before anything is sent when
        the parameters are out of range or the prompt plus `max_tokens` does not fit the model's
        context."""
        validate_request(params, len(prompt), self.context_length)
        if session.busy:
            raise RuntimeError(f"session {session.id} is already generating")
        session.busy = True
        try:
            return await self._generate(session, list(prompt), params, on_tokens)
        finally:
            session.busy = False

    async def _generate(
        self,
        session: Session,
        prompt: list[int],
        params: GenerationParams,
        on_tokens: TokenCallback | None,
    ) -> Generation:
        try:
            generation = await self._generate_reply(session, prompt, params, on_tokens)
        except BaseException:
            self._drop_run(session)
            ahead_drafts.stop(session.ahead)
            raise  # a round started ahead is waited for by the session's next use (or its close)
        await self._finish_run(session)
        ahead_drafts.stop(session.ahead)  # the reply is complete: nothing drafted ahead is needed
        await self._drop_ahead(session, commit=True)
        return generation

    async def _generate_reply(
        self,
        session: Session,
        prompt: list[int],
        params: GenerationParams,
        on_tokens: TokenCallback | None,
    ) -> Generation:
        stats = GenerationStats(prompt_tokens=len(prompt))
        stream = TextStream(self.chat_format, params.stop) if self.chat_format is not None else None
        eos = (
            frozenset()
            if params.ignore_eos or self.chat_format is None
            else self.chat_format.eos_token_ids
        )
        started = time.perf_counter()
        # (a bad grammar fails before anything moves)
        session.grammar = grammar = self._reply_grammar(params)
        session.history = list(prompt)
        session.logprobs = []
        generated: list[int] = []
        # Prefill all but the last PREFILL_CHUNK tokens without scoring; the last chunk yields token
        # 1.
        await self._guarded(session, functools.partial(self._prefill, session))
        while len(generated) < params.max_tokens:
            remaining = params.max_tokens - len(generated)
            round_ = await self._guarded(
                session, functools.partial(self._round, session, params, remaining, generated)
            )
            k, draft, feed, result = round_.k, round_.draft, round_.feed, round_.result
            draft_seconds, verify_seconds = round_.draft_seconds, round_.verify_seconds
            prefilled = len(feed.tokens) != k + 1
            catch_up = prefilled or draft.fed > self.max_k + 1 or round_.pipelined
            own, compute = round_costs(result.trace, verify_seconds)
            facts = RoundFacts(
                k,
                result.accepted,
                draft_seconds,
                verify_seconds,
                catch_up,
                own,
                compute,
                round_.asked,
                round_.loaded,
                prefilled,
                self._several(),
                draft.computed,
                session.id,
            )
            stats.rounds += 1
            if (
                round_.forced
            ):  # the grammar's own tokens: no drafter's acceptance, no policy's lesson
                stats.forced += result.accepted
            else:
                round_.policy.record_round(facts)
                stats.drafted += k
                stats.accepted += result.accepted
            stats.k_values.append(k)
            stats.draft_seconds += draft_seconds
            stats.verify_seconds += verify_seconds
            emitted = [int(t) for t in result.tokens][: params.max_tokens - len(generated)]
            finished = ""
            for index, token in enumerate(emitted):
                if token in eos:
                    emitted = emitted[: index + 1]
                    finished = "eos"
                    break
            scored = emitted
            if grammar is not None:
                emitted = grammar.advance(emitted)  # (cut right after a trigger it completes)
                if finished and emitted[-1] not in eos:
                    finished = ""
                if grammar.stopped and not finished:
                    finished = "stop"
            if not generated:
                stats.ttft = time.perf_counter() - started
            generated.extend(emitted)
            session.history.extend(emitted)
            if (
                not prefilled
            ):  # after plain rounds, runs or prompt lookup the draft may have missed tokens
                self._keep_draft_up(session, params, params.max_tokens - len(generated))
            visible = [t for t in emitted if t not in eos]
            if params.logprobs is not None:
                # (EOS only ends)
                session.logprobs += token_logprobs(result, scored)[: len(visible)]
            delta = stream.push(visible) if stream is not None else ""
            if stream is not None and stream.stopped:
                finished = "stop"
            if on_tokens is not None:
                outcome = on_tokens(emitted, delta)
                if asyncio.iscoroutine(outcome):
                    await outcome
            if finished:
                stats.finish_reason = finished
                break
        else:
            stats.finish_reason = "length"
        if stream is not None:
            tail = stream.finish()
            if tail and on_tokens is not None:
                outcome = on_tokens([], tail)
                if asyncio.iscoroutine(outcome):
                    await outcome
        stats.tokens = len(generated)
        if grammar is not None:
            stats.constraint_complete = grammar.complete
            stats.drafts_cut = grammar.drafts_cut
        stats.seconds = time.perf_counter() - started
        session.last_stats = stats
        text = stream.text if stream is not None else ""
        return Generation(tuple(generated), text, stats, tuple(session.logprobs))

    def _reply_grammar(self, params: GenerationParams) -> ReplyGrammar | None:
        """The grammar state of a constrained reply (None without a constraint)."""
        if params.constraint is None:
            return None
        if self.chat_format is None:
            raise ConstraintError(f"cannot constrain a reply: {self.no_chat_reason}")
        return ReplyGrammar(params.constraint, self.chat_format)

    async def _round(
        self, session: Session, params: GenerationParams, remaining: int, generated: list[int]
    ) -> Round:
        """One draft + verify round (the unit a recovery retries), or the next token of a run."""
        if (
            session.run is not None
            and (ran := await self._run_round(session, remaining)) is not None
        ):
            return ran
        settling = time.perf_counter()
        # waited for when the draft is used
        keeping_up = bool(session.ahead) and session.ahead[0].keep_up
        # a round that failed: draft the fresh one
        ahead_drafts.stop_failed(session.ahead, session.history)
        ahead = None if keeping_up else await self._settle_ahead(session)
        if ahead is not None and ahead.sent is not None:
            pipelined = await self._pipelined_round(session, params, ahead, remaining, settling)
            if pipelined is not None:
                return pipelined
        if not keeping_up:
            await self._drop_ahead(session, commit=True)  # the rounds after one that went otherwise
        settled = time.perf_counter()
        await self._maybe_compact(session)
        # the wait for a round ahead counts as drafting time, a compaction does not
        draft_started = settling + (time.perf_counter() - settled)
        sampling = params.sampling
        left = remaining - 1
        loaded = self._loaded()
        drafter, policy, shared = self.drafter, self.policy, True
        if params.spec_k is not None:
            k = min(params.spec_k, self.max_k, left)
            session.wants_speculation = k > 0  # a fixed K speculates whatever the others do
        elif self.policy.fixed_k is not None or self.drafter is None:
            k = min(
                self.policy.choose(
                    free_draft=not (self.drafter is None or self.drafter.costs_time)
                ),
                left,
            )
            session.wants_speculation = k > 0
        else:
            shared = self._others_speculate(session)
            candidates = self._candidates(session)
            # a run cut short where the free lookup proposes: it drafts now (lookup_watch; K = 0
            # when the tokens the run made until the Cancel's Ack went another way)
            # runs, watched for the lookup
            watched = bool(self.max_run) and isinstance(self.target, RunLink)
            name, k = (
                ("lookup", session.cut.k)
                if session.cut
                else choose_drafter(candidates, loaded, shared, watched)
            )
            session.wants_speculation = any(policy.wants for policy in session.policies.values())
            k = min(k, left)
            policy = session.policies.get(name) or next(iter(session.policies.values()))
            drafter = self.lookup if name == "lookup" and self.lookup is not None else self.drafter
        # The first round of a reply scores the prompt's last chunk without drafts: the first token
        # never waits for a costly draft to catch up on the prompt (it does so meanwhile, for the
        # next round).
        opening = not generated and drafter is self.drafter and self.draft_ahead
        chosen, k = k, 0 if opening else k
        draft = Draft.empty()
        asked = k
        if k > 0 and drafter is not None:
            ready = None
            if ahead is not None and drafter is self.drafter:
                ready = ahead.continuation(session.history, k)
            if ready is not None:
                draft = ready
                self.ahead_counts.used += 1
            else:
                draft = await self._propose(session, drafter, k, sampling)
            # the free lookup found nothing: the model draft, if it pays now, rather than a plain
            # run (not for the first token, which never waits for the model draft to read the
            # prompt)
            second = session.policies.get("model")
            fallback = (
                self.drafter if drafter is self.lookup and not draft.tokens and generated else None
            )
            if (
                fallback is not None
                and second is not None
                and (k := second.paying_k(loaded, shared))
            ):
                policy.asked(proposed=False)  # the lookup's miss (the round is the model draft's)
                drafter, policy, asked = fallback, second, min(k, left)
                draft = await self._propose(session, drafter, asked, sampling)
        draft_seconds = self._charge_cut(
            session, policy, bool(draft.tokens), loaded, time.perf_counter() - draft_started
        )
        token_mask = None
        forced = False
        if session.grammar is not None:  # drafts the grammar rejects are never verified
            if (
                not draft.tokens
                and left > 0
                and (tokens := session.grammar.forced(min(left, MAX_FORCED)))
            ):
                # what the grammar forces: always accepted
                draft, forced = (
                    Draft.deterministic(tokens),
                    True,
                )
            kept, token_mask = session.grammar.plan(draft.tokens)
            if kept < len(draft.tokens):
                draft = Draft(
                    draft.tokens[:kept],
                    draft.ids[:kept],
                    draft.probs[:kept],
                    draft.fed,
                    draft.computed,
                )
        k = len(draft.tokens)
        # (a constrained reply never runs: every token must be scored under the mask of its true
        # position)
        runs = self.max_run and session.grammar is None and isinstance(self.target, RunLink)
        if k == 0 and left > 0 and runs and not opening:
            # nothing to verify (K = 0 chosen, or a lookup found nothing): the pipeline runs on its
            # own
            length = min(remaining, self.max_run)
            counted: tuple[KPolicy, ...] = ()
            if params.spec_k is None and self.drafter is not None and self.policy.fixed_k is None:
                # adaptive: a costly draft's policy chooses again after a while
                # (`costly_run_tokens`); a free drafter is asked at each token of the run instead
                # (`RunRounds._run_round`)
                counted = tuple(session.policies.values())
                for candidate in (candidate for candidate in counted if not candidate.free):
                    length = min(length, costly_run_tokens(candidate, loaded))
            if length > 1:
                first = await self._run_start(
                    session, params, length, generated, policy, loaded, counted
                )
                return dataclasses.replace(first, asked=asked, draft_seconds=draft_seconds)
        verify_started = time.perf_counter()
        feed = session.ledger.plan(session.history + list(draft.tokens), scored=k + 1)
        uniforms = session.rng.random(2 * (k + 1)) if not sampling.greedy else NO_UNIFORMS
        decode = verify_decode(params, draft, uniforms, session.history, generated, token_mask)
        session.outstanding = feed
        if (
            opening
        ):  # the draft reads the prompt while the stages prefill it (and drafts on, if that pays)
            if not self._maybe_draft_ahead(
                session, params, session.history, draft, feed, remaining, policy, chosen
            ):
                self._keep_draft_up(session, params, remaining)
        elif drafter is self.drafter:
            self._maybe_draft_ahead(
                session, params, session.history, draft, feed, remaining, policy
            )
        try:
            result = await self._step(session, feed, decode)
        finally:
            session.outstanding = None
        verify_seconds = time.perf_counter() - verify_started
        session.idle = self.wire_idle = ahead_drafts.wire_seconds(result.trace, verify_seconds)
        return Round(
            k,
            draft,
            feed,
            result,
            draft_seconds,
            verify_seconds,
            asked,
            policy,
            loaded,
            forced=forced,
        )

    async def _propose(
        self, session: Session, drafter: Drafter, k: int, sampling: Sampling
    ) -> Draft:
        """K drafts after the session's history (the model draft's bookkeeping: what it read, its
        cost)."""
        model = drafter is self.drafter
        if model:
            await self._drop_ahead(session, commit=True)  # a keep-up feeding the draft ends first
        proposing = time.perf_counter()
        draft = await drafter.propose(session.id, session.history, k, sampling, session.rng)
        if model:  # it read the history and made its drafts
            session.drafted_at = len(session.history) + len(draft.tokens)
            if draft.fed <= k + 2:  # (a catch-up on the history costs more)
                self.ahead_cost.add(len(draft.tokens), time.perf_counter() - proposing)
        return draft

    def _others_speculate(self, session: Session) -> bool:
        """Whether every other generating session found speculation paying in its last choice."""
        return all(
            other.wants_speculation
            for other in self.sessions.values()
            if other.busy and other is not session
        )

    def _several(self) -> bool:
        """Whether several sessions are generating now."""
        return sum(1 for other in self.sessions.values() if other.busy) > 1

    def _loaded(self) -> bool:
        """Whether sessions compete for the stages: several generate and the busiest stage is
        busy."""
        return self._several() and self.stage_load.busiest() >= TUNING.loaded_utilization

    def _candidates(self, session: Session) -> list[tuple[str, KPolicy, bool]]:
        """This session's drafter candidates: the fleet's drafter and, beside a costly one,
        prompt lookup."""
        assert self.drafter is not None
        own = "lookup" if not (self.drafter is None or self.drafter.costs_time) else "model"
        names = [(own, own == "lookup")] + (
            [("lookup", True)] if self.lookup is not None and own != "lookup" else []
        )
        for name, free in names:
            if name not in session.policies:
                session.policies[name] = self.policy.fork(name, free)
        return [(name, session.policies[name], free) for name, free in names]

    async def _step(
        self, session: Session, feed: Feed, decode: protocol.Decode | None
    ) -> protocol.Result:
        reply = self._result(await self.target.request(feed.step(session.id, decode)))
        session.ledger.commit(feed)
        return reply

    def _result(self, reply: protocol.Message) -> protocol.Result:
        """A step's reply, which must be a Result, shown to the result observers (telemetry,
        load, bench)."""
        if not isinstance(reply, protocol.Result):
            raise TypeError(f"pipeline answered a step with {type(reply).__name__}")
        received = time.time()
        for observe in self.result_observers:
            observe(reply, received)
        return reply

    async def _maybe_compact(self, session: Session) -> None:
        ledger = session.ledger
        if not ledger.needs_compaction(self.compaction_ratio, self.compaction_minimum):
            return
        reply = await self.target.request(
            protocol.Control(protocol.Kind.COMPACT, session.id, 0, ledger.cache_len)
        )
        ledger.compact()
        if not isinstance(reply, protocol.Ack) or reply.value != ledger.cache_len:
            raise RuntimeError(f"compaction of session {session.id} disagrees with the stages")
        if session.last_stats is not None:
            session.last_stats.compactions += 1
