"""Provides drafting ahead and pipelined verification: the next round starts while this one is on
the wires.

On slow links a speculative round spends most of its wall time between stages, and the cores are
idle meanwhile. So while round r is verified, the draft proposes round r + 1 on the assumption that
round r accepts every draft token and that the target's bonus token is the draft's own next guess;
as soon as that proposal is ready, round r + 1's verify step is sent too (pipelined,
PipeInfer-style), planned on a copy of the cache ledger that already holds round r's step — the
stages serve a session's steps in order, so it lands right behind round r. When round r's result
arrives:

- the assumption held (history = assumed + the guessed bonus): round r + 1's result is the next
  round, already under way or back;
- it failed: round r + 1's verify is dropped (its slots are committed to the ledger all the same and
  masked by the next step, like any rejected draft) and the next round starts afresh from the true
  history.

A proposal ahead asks the draft for `Tuning.ahead_chunk` tokens at a time. Once the round it assumed
is known to have failed (it gave fewer tokens than assumed, or a bonus other than the guess), it
ends after its current part and sends nothing, so the fresh round waits for one part, not a whole
proposal; that is also why a round may start ahead when only its first part is hidden by the wires.
The round after a reply's opening round (which scores the prompt without drafts) starts ahead too:
the draft reads the prompt and guesses the first token while the stages score the prompt.

Rounds ahead chain: once a verify is sent ahead, the draft goes on to the round after it (assuming
that one holds too), up to `Tuning.ahead_depth` verifies on the wires behind the outstanding one, so
on slow links a run of well-drafted rounds is paced by the draft, not by the round trip. A round
that fails drops every round after it.

The target verifies every token against the true prefix, so neither the draft nor a dropped verify
can change the output. Greedy only (a sampled round draws the session's RNG in the order of the
rounds); the verify is sent ahead only without penalties (they depend on the reply so far)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fleettui.runtime.ledger import Feed
from fleettui.runtime.speculation import Draft, Drafter, Sampling
from fleettui.runtime.tuning import TUNING
from remote_worker import protocol
from remote_worker.protocol import trace_records

log = logging.getLogger(__name__)
GREEDY = Sampling()
_NO_RNG = np.random.default_rng(0)  # a greedy proposal draws nothing
_NOTHING = Feed(0, 0, (), ())  # what a keep-up follows (it sends no verify)


@dataclass
class AheadCounts:
    """What drafting ahead did over a coordinator's life."""

    started: int = 0  # proposals started ahead
    used: int = 0  # ... whose drafts the next round verified
    sent: int = 0  # verifies sent ahead
    chained: int = 0  # ... behind another verify sent ahead
    pipelined: int = 0  # verifies sent ahead that became the next round
    kept_up: int = 0  # proposals that only fed the draft what it missed
    opened: int = 0  # proposals started behind an opening round


@dataclass
class Sent:
    """The verify step of the round after the one in flight, sent before that one's result came
    back."""

    draft: Draft  # its K drafts (after the guessed bonus)
    feed: Feed
    reply: asyncio.Future[protocol.Message]
    sent_at: float = field(default_factory=time.perf_counter)

    def drop(self) -> None:
        """Nobody will read the reply (its failure, if any, is retrieved here, not reported)."""
        self.reply.add_done_callback(_retrieve)


def _retrieve(future: asyncio.Future[protocol.Message]) -> None:
    if not future.cancelled():
        future.exception()


@dataclass
class Ahead:
    """A proposal of K + 1 tokens after `assumed` (a round's history and drafts), and maybe the
    next verify."""

    assumed: list[int]
    k: int  # the K of the next round (a verify sent ahead checks as many drafts)
    after: (
        Feed  # that round's step: a verify sent ahead goes right behind it, while it is outstanding
    )
    remaining: (
        int  # tokens the reply has left when the next round starts (if the rounds before held)
    )
    task: asyncio.Future[Draft] = field(init=False)
    started: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0  # how long the proposal took (set when it is done)
    sent: Sent | None = None
    # the proposal's first token, the guessed bonus (set when its first part is back)
    guess: int | None = None
    stopped: bool = False  # the round before went otherwise: draft no further, send nothing

    def holds(self, history: list[int]) -> bool:
        """Whether the round went as assumed: every draft accepted, then the draft's guess as the
        bonus."""
        if not self.task.done() or self.task.cancelled() or self.task.exception() is not None:
            return False
        return not self.failed(history) and tuple(history[-1:]) == self.task.result().tokens[:1]

    def failed(self, history: list[int]) -> bool:
        """Whether the round went otherwise than assumed, as far as is known before the proposal is
        done: a draft was rejected (the round gave fewer tokens), or the bonus is not the guess
        already back."""
        if len(history) != len(self.assumed) + 1:
            return True
        return self.guess is not None and history[-1] != self.guess

    @property
    def keep_up(self) -> bool:
        """A proposal that only feeds the draft the history (`keep_up`), not a round."""
        return self.k == 0

    def continuation(self, history: list[int], k: int) -> Draft | None:
        """The next K drafts when the round went as assumed, else None."""
        if k <= 0 or self.keep_up or not self.holds(history):
            return None
        proposal = self.task.result()
        end = 1 + k
        return Draft(proposal.tokens[1:end], proposal.ids[1:end], proposal.probs[1:end])


def deep_enough(chain: int, alpha: float, k: int, loaded: bool) -> bool:
    """Whether a round may start behind `chain` rounds started ahead already: at most
    `Tuning.ahead_depth`, and beyond the first only while the stages are not `loaded` (a dropped
    verify takes compute from other sessions) and the rounds before it likely hold (each needs its K
    drafts and the guessed bonus accepted, `alpha` per token): a round that fails drops every one
    after it, and a proposal under way delays the fresh round that follows the failure."""
    if chain >= TUNING.ahead_depth:
        return False
    return chain == 0 or (not loaded and alpha ** ((k + 1) * chain) >= TUNING.ahead_holds)


def keep_up(drafter: Drafter, session: int, history: list[int]) -> Ahead:
    """Feed the draft `history` in the background (it proposes one token, unused): after plain
    rounds or runs, or while the stages prefill a prompt, so the next round pays for its K drafts
    only, not for the draft's catch-up on what it missed. Waited for like a round ahead, but only
    when the draft is used."""
    return start(drafter, session, Ahead(list(history), 0, _NOTHING, 0), 0)


SendAhead = Callable[[Ahead, Draft], Sent | None]


def start(
    drafter: Drafter, session: int, ahead: Ahead, tokens: int, send: SendAhead | None = None
) -> Ahead:
    """Propose `tokens` + 1 greedy tokens after `ahead.assumed` in the background (the first one
    guesses the bonus); then `send` may start the next round's verify with them."""
    ahead.task = asyncio.ensure_future(_propose(ahead, drafter, session, tokens, send))

    def done(task: asyncio.Future[Draft]) -> None:
        ahead.seconds = time.perf_counter() - ahead.started
        # the exception is retrieved here (no "never retrieved" warning); the next proposal reports
        # the loss
        if not task.cancelled() and task.exception() is not None:
            log.debug("session %d: drafting ahead failed: %s", session, task.exception())

    ahead.task.add_done_callback(done)
    return ahead


def stop_failed(chain: list[Ahead], history: list[int]) -> None:
    """Stop the proposals of `chain` (the rounds started ahead, in order) once its first one is
    known to have failed: each drops every round after it, and the draft then serves the fresh round
    sooner."""
    if chain and not chain[0].keep_up and chain[0].failed(history):
        stop(chain)


def stop(chain: list[Ahead]) -> None:
    """Let every proposal of `chain` end after the part it is drafting now, and send no verify."""
    for ahead in chain:
        ahead.stopped = True


async def _propose(
    ahead: Ahead, drafter: Drafter, session: int, tokens: int, send: SendAhead | None
) -> Draft:
    """`tokens` + 1 greedy tokens after `ahead.assumed`, asked for `Tuning.ahead_chunk` at a time
    (each part feeds the last token of the part before) until done or stopped: a stopped proposal
    ends short and sends nothing."""
    parts: list[Draft] = []
    drafted: list[int] = []
    while len(drafted) < tokens + 1 and not ahead.stopped:
        count = min(TUNING.ahead_chunk, tokens + 1 - len(drafted))
        part = await drafter.propose(session, [*ahead.assumed, *drafted], count, GREEDY, _NO_RNG)
        if not part.tokens:
            break
        parts.append(part)
        drafted += part.tokens
        ahead.guess = drafted[0]
    proposal = _joined(parts)
    if send is not None and not ahead.stopped and len(proposal.tokens) == tokens + 1:
        ahead.sent = send(ahead, proposal)
        if ahead.sent is not None:
            # the request sends on its first step: before anything after this proposal
            await asyncio.sleep(0)
    return proposal


def _joined(parts: list[Draft]) -> Draft:
    """One proposal from its parts, in order (the draft's catch-up is the first part's)."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return Draft.empty()
    computed = [part.computed for part in parts]
    return Draft(
        tuple(token for part in parts for token in part.tokens),
        np.concatenate([part.ids for part in parts]),
        np.concatenate([part.probs for part in parts]),
        fed=parts[0].fed,
        computed=None if None in computed else sum(c for c in computed if c is not None),
    )


async def settle(ahead: Ahead | None) -> Ahead | None:
    """Wait until `ahead`'s proposal is done (the draft serves one request per session at a time);
    None if it failed (then it sent no verify).

    The wait is shielded: a cancelled caller leaves the proposal to finish (a proposal cut off
    halfway would leave the draft's cache and its ledger apart), and the next settle waits for it
    again."""
    if ahead is None:
        return None
    with contextlib.suppress(Exception):
        await asyncio.shield(ahead.task)
    if ahead.task.cancelled() or ahead.task.exception() is not None:
        return None
    return ahead


def wire_seconds(trace: np.ndarray, wall_seconds: float) -> float:
    """Seconds of a round's wall time its step spent on no stage (on the wires, in the
    coordinator)."""
    records = trace_records(trace)
    if not records:
        return 0.0
    at_stages = sum(
        max(finished - received, 0.0) for _stage, received, _started, finished, _sent in records
    )
    return max(wall_seconds - at_stages, 0.0)


@dataclass
class AheadCost:
    """Seconds per drafted token — what drafting K + 1 tokens ahead will take: the median of the
    last `WINDOW` proposals, so one slow one (the draft's first inference, a proposal queued behind
    another session's) does not hold drafting ahead off for the rounds a decayed mean would need to
    forget it."""

    WINDOW = 7
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=AheadCost.WINDOW))

    @property
    def per_token(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.samples.append(seconds / tokens)

    def fits(self, tokens: int, idle_seconds: float) -> bool:
        """Whether drafting `tokens` ahead is hidden by `idle_seconds` of the round it overlaps."""
        per_token = self.per_token
        return per_token is not None and per_token * tokens <= idle_seconds
