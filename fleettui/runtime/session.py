"""Provides the coordinator's session: one user's conversation, its token history and its cache
ledgers."""

from __future__ import annotations

import asyncio

import numpy as np

from fleettui.runtime import ahead as ahead_drafts
from fleettui.runtime.chat_format import ChatMessage
from fleettui.runtime.constraint import ReplyGrammar
from fleettui.runtime.generation import GenerationStats, TokenLogprob
from fleettui.runtime.ledger import CacheLedger, Feed
from fleettui.runtime.lookup_watch import Cut
from fleettui.runtime.policy import KPolicy
from fleettui.runtime.runs import Run


class Session:
    """One user's conversation: messages, the token history and the ledgers of target and draft
    caches."""

    def __init__(self, session_id: int, seed: int) -> None:
        self.id = session_id
        self.messages: list[ChatMessage] = []
        self.history: list[int] = []
        self.ledger = CacheLedger()
        self.rng = np.random.default_rng([seed, session_id])
        self.busy = False
        self.last_stats: GenerationStats | None = None
        self.logprobs: list[
            TokenLogprob
        ] = []  # the reply's so far, when asked for (read by streams)
        self.policies: dict[
            str, KPolicy
        ] = {}  # per drafter: this session's acceptance (costs are shared)
        # Recovery: a round and a rebuild never overlap; an epoch behind the coordinator's means the
        # pipeline (or the draft) lost this session's cache and it must be replayed from `history`.
        self.lock = asyncio.Lock()
        self.target_epoch = -1
        self.draft_epoch = -1
        # what the pipeline is generating on its own (fleettui.runtime.runs)
        self.run: Run | None = None
        # a run cut short for a free drafter: the next round verifies its drafts
        self.cut: Cut | None = None
        # its last choice found speculation paying (`KPolicy.choose`, shared)
        self.wants_speculation = False
        self.ahead: list[
            ahead_drafts.Ahead
        ] = []  # the next rounds, started while a round is verified
        self.outstanding: Feed | None = None  # the verify step whose result a round is waiting for
        # seconds its last verify round spent on no stage (what drafting ahead can hide)
        self.idle = 0.0
        self.grammar: ReplyGrammar | None = None  # the constrained reply's grammar state (matcher)
        # how much of the history the model draft has read (its drafts taken as read)
        self.drafted_at = 0
