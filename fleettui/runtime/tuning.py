"""Provides the speculation runtime's tuning: every constant the K policy, its cost model, the runs
and the rounds started ahead decide by, in one frozen dataclass documented once.

The evidence for each value is in docs/performance.md#tuning-constants.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tuning:
    # -- the K policy (`fleettui.runtime.policy.KPolicy`) OpenVINO's CPU plugin runs the first
    # 1-token steps after a multi-token verify slower: what this many plain rounds after a verify
    # take beyond plain's rate is charged to its drafter.
    after_verify_rounds: int = 3
    # a drafter is probed only if a high acceptance would beat plain by this (`could_pay`) ...
    probe_ceiling: float = 1.05
    # ... at its measured acceptance, or this if lower
    probe_acceptance: float = 0.9
    # below it, a drafter of unknown costs does not cut runs short (`measuring_soon`)
    measurable_hit_rate: float = 0.5
    # under load a verify may cost the busiest stage at most this many plain steps, since every
    # other session's next token waits behind it (`fair_k`)
    fair_verify_cost: float = 1.5
    # on loaded stages a drafter's expected rate must beat plain decoding by this factor: what its
    # verifies do to the other sessions' steps is outside the fitted costs
    loaded_margin: float = 1.1
    # the K that measures a verify's slope (and a draft's cost) first
    exploring_k: int = 3

    # -- the cost model (`fleettui.runtime.cost_model.CostModel`)
    # decayed plain rounds before realized rates may overrule the model ...
    min_realized_rounds: float = 6.0
    # ... and speculative ones: a losing drafter is not tried six times per session
    min_speculative_rounds: float = 2.0
    # while K = 0 wins, probing a drafter takes at most this share of the generating time, so
    # exploring stays within the bench's bar of speculation >= 0.98x no speculation
    probe_share: float = 0.02
    # a probe costs more than its drafting, since the steps after the stage idled run slower: its
    # cost is its round beyond its tokens' plain time, plus what this many plain rounds after it
    # took beyond theirs
    after_probe_rounds: int = 8
    # the busiest stage computing this share of the time: sessions compete for it (`StageLoad`)
    loaded_utilization: float = 0.5

    # -- runs: the last stage loops tokens back to the first without the coordinator (`runs`)
    # with adaptive speculation the policy chooses again after this many run tokens ...
    run_tokens_adaptive: int = 16
    # ... after this many while it has not measured the draft yet ...
    run_tokens_exploring: int = 2
    # ... and after this many while no acceptance could make the costly draft pay (`could_pay`):
    # neither a choice nor a probe of it is due, and each restart leaves the stages idle for a round
    # trip through the coordinator
    run_tokens_unpaying: int = 128

    # -- rounds started ahead on slow links (`fleettui.runtime.ahead`)
    # verifies sent ahead at most, behind the one outstanding
    ahead_depth: int = 3
    # history tokens the draft may miss (plain rounds, runs) before it is fed in the background ...
    keep_up: int = 8
    # ... when a round leaves at least this many seconds on the wires (not on a LAN)
    keep_up_idle: float = 0.005
    # the chance the rounds before must hold for a second or third round to start ahead
    ahead_holds: float = 0.5
    # tokens a proposal ahead asks the draft for at a time: a round that failed stops it in between
    ahead_chunk: int = 2


TUNING = Tuning()
