"""Unit tests of the speculation policy: own cost vs queueing, loaded vs alone, and the drafter
choice."""

from __future__ import annotations

import numpy as np
import pytest

from fleettui.runtime.cost_model import CostModel
from fleettui.runtime.measures import LinearCost, StageLoad, round_costs
from fleettui.runtime.policy import KPolicy, RoundFacts, choose_drafter
from fleettui.runtime.tuning import TUNING
from remote_worker import protocol


def _trace(*stages: tuple[float, float, float, float]) -> np.ndarray:
    """Per stage (received, started, finished, sent) -> the flat protocol trace."""
    return np.array([[index, *times] for index, times in enumerate(stages)], np.float64).reshape(-1)


def test_round_costs_take_the_queue_out_of_the_wall_time() -> None:
    # stage 0 waited 20 ms behind another session, computed 8 ms; stage 1 computed 5 ms
    trace = _trace((0.000, 0.020, 0.028, 0.029), (0.030, 0.030, 0.035, 0.036))
    own, compute = round_costs(trace, wall_seconds=0.040)
    assert own == pytest.approx(0.020) and compute == pytest.approx(0.008)
    assert round_costs(np.zeros(0), 0.05) == (0.05, 0.05)


def _multi_user_rounds(policy: KPolicy, rounds: int = 40) -> None:
    """Two users on 2 stages with a self-draft as costly as the target: each verify waits ~as long
    as the other session's step (queue), computes 6 ms + 1 ms per extra token, and drafting costs 6
    ms per token."""
    for _ in range(rounds):
        for k in (0, 3, 6):
            compute = 0.006 + 0.001 * k
            queue = 0.030
            wall = queue + 2 * compute + 0.002
            trace = _trace(
                (0.0, queue, queue + compute, queue + compute),
                (0.1, 0.1, 0.1 + compute, 0.1 + compute),
            )
            own, busiest = round_costs(trace, wall)
            policy.record_round(
                RoundFacts(k, int(0.7 * k), 0.006 * k, wall, False, own, busiest, asked=k)
            )


def test_loaded_pipeline_is_costed_by_compute_not_by_queueing() -> None:
    wall_only = KPolicy(None, max_k=8)
    for _ in range(40):  # the old model: wall time only, where the queue makes verifying look free
        for k in (0, 3, 6):
            wall_only.record_round(
                RoundFacts(k, int(0.7 * k), 0.006 * k, 0.030 + 2 * (0.006 + 0.001 * k) + 0.002)
            )
    assert wall_only.choose(loaded=True) >= 3  # what the bench saw: K ~ 6 while losing
    policy = KPolicy(None, max_k=8)
    _multi_user_rounds(policy)
    # the draft's compute cannot be paid for by a cheap verify
    assert policy.choose(loaded=True) == 0
    rate_zero = policy.expected_rate(0, loaded=True)
    assert rate_zero is not None and rate_zero == pytest.approx(1 / 0.006, rel=0.05)


def test_alone_a_slow_link_still_pays_for_speculation() -> None:
    policy = KPolicy(None, max_k=8)
    for _ in range(40):
        for k in (0, 3, 6):
            compute = 0.006 + 0.001 * k
            wall = 0.100 + 2 * compute  # 50 ms hops, nothing queued
            trace = _trace(
                (0.0, 0.0, compute, compute), (0.05, 0.05, 0.05 + compute, 0.05 + compute)
            )
            own, busiest = round_costs(trace, wall)
            policy.record_round(RoundFacts(k, k, 0.002 * k, wall, False, own, busiest, asked=k))
    assert policy.choose(loaded=False) >= 6


def test_drafter_choice_is_per_measured_rate() -> None:
    costs = CostModel()
    model, lookup = (
        KPolicy(None, 8, costs=costs, drafter="model"),
        KPolicy(None, 8, costs=costs, drafter="lookup"),
    )
    for _ in range(40):
        for k in (0, 2, 4):
            # slow draft, 50% accepted
            model.record_round(RoundFacts(k, k // 2, 0.012 * k, 0.015 + 0.001 * k, asked=k))
            # free, accepted (repetitive text)
            lookup.record_round(RoundFacts(k, k, 0.0, 0.015 + 0.001 * k, asked=k))
    name, k = choose_drafter([("model", model, False), ("lookup", lookup, True)], loaded=False)
    assert name == "lookup" and k >= 4
    # lookup that never finds anything, a model draft that is slower than the target: no speculation
    costs = CostModel()
    model, lookup = (
        KPolicy(None, 8, costs=costs, drafter="model"),
        KPolicy(None, 8, costs=costs, drafter="lookup"),
    )
    for _ in range(40):
        for k in (0, 2, 4):
            model.record_round(RoundFacts(k, k // 2, 0.020 * k, 0.015 + 0.001 * k, asked=k))
            lookup.record_round(RoundFacts(0, 0, 0.0, 0.015, asked=k))  # asked k, proposed nothing
    assert lookup.hit_rate < 0.2
    choices = [
        choose_drafter([("model", model, False), ("lookup", lookup, True)], loaded=False)
        for _ in range(20)
    ]
    # never the slow model draft; asking the free lookup costs nothing when it finds nothing
    assert sum(1 for name, k in choices if name == "model" and k > 0) <= 2  # only backed-off probes


def test_a_new_drafter_is_explored_before_it_is_judged() -> None:
    costs = CostModel()
    model = KPolicy(None, 8, costs=costs, drafter="model")
    lookup = KPolicy(None, 8, costs=costs, drafter="lookup")
    model.record_round(RoundFacts(0, 0, 0.0, 0.015))
    name, k = choose_drafter([("model", model, False), ("lookup", lookup, True)], loaded=False)
    # the draft's cost is unknown: measured once before it is judged
    assert (name, k) == (
        "model",
        3,
    )
    model.record_round(RoundFacts(3, 0, 0.090, 0.018, asked=3))  # slow and useless
    name, k = choose_drafter([("model", model, False), ("lookup", lookup, True)], loaded=False)
    assert name != "model"


def test_measured_tokens_per_second_overrule_a_model_that_says_speculation_pays() -> None:
    """The stages' traces make verifying K + 1 tokens look nearly free, but every speculative round
    really took longer per token than a plain one (an overhead the model does not see): speculation
    stops."""
    policy = KPolicy(None, max_k=8)
    for _ in range(20):
        for k in (0, 3):
            trace = _trace((0.0, 0.0, 0.010, 0.010))  # 10 ms compute whatever K
            own, busiest = round_costs(trace, 0.010)
            wall = 0.010 if k == 0 else 0.050  # measured: 4 tokens in 50 ms < 1 token in 10 ms
            policy.record_round(RoundFacts(k, k, 0.001 * k, wall, False, own, busiest, asked=k))
    model_choice = max(range(9), key=lambda k: policy.expected_rate(k) or 0.0)
    assert model_choice > 0  # what the fitted costs alone would pick
    assert policy.costs.losing("draft", loaded=False)
    assert policy.choose() == 0
    assert not policy.costs.losing("draft", loaded=True)  # several users at once: measured apart


def test_several_sessions_on_idle_stages_do_not_teach_a_session_alone_that_speculation_loses() -> (
    None
):
    """Four users on stages with room wait for each other at the draft: their speculative rounds are
    slow per token while their plain ones are not. That stays in each session's own record; the
    pipeline's record, which a new session alone starts from, keeps what a session alone achieved,
    and the draft's fitted cost is what it computed (the bench's 10 ms rows: one user measured after
    four went from 1.9x to 0.9x, its speculation off, the draft's fit for 4 tokens 58 -> 213 ms)."""
    policy = KPolicy(None, max_k=8)
    trace = _trace((0.0, 0.0, 0.010, 0.010))
    own, busiest = round_costs(trace, 0.010)
    for _ in range(10):  # one session alone: 4 tokens in 20 ms beat 1 token in 10 ms
        for k, wall in ((0, 0.010), (3, 0.020)):
            policy.record_round(RoundFacts(k, k, 0.001 * k, wall, False, own, busiest, asked=k))
    assert not policy.costs.losing("draft", loaded=False)
    several = policy.fork("draft")
    for _ in range(
        40
    ):  # four at once, stages not loaded: they queue at the one draft (3 ms of compute)
        for k, queued in ((0, 0.0), (3, 0.150)):
            facts = RoundFacts(
                k,
                k,
                queued,
                0.050,
                False,
                own,
                busiest,
                asked=k,
                several=True,
                draft_computed=0.001 * k,
            )
            several.record_round(facts)
    assert several.choose() == 0  # its own record: speculation lost for it
    alone = policy.fork("draft")
    assert not policy.costs.losing("draft", loaded=False)
    draft = policy.costs.draft("draft").predict(3)
    assert draft is not None and draft < 0.01  # the draft's cost is its compute, not the queue
    assert alone.choose() > 0


def test_a_runs_later_tokens_bring_the_next_probe_as_close_as_plain_rounds_would() -> None:
    """While K = 0 wins, a probe comes every `probe_every` plain rounds; a run's tokens after its
    first are such rounds too (`plain_round`), so a run of 16 tokens does not postpone the probe by
    16 choices."""
    policy = KPolicy(None, 8, probe_every=16, drafter="model")
    for _ in range(40):
        for k in (
            0,
            2,
            4,
        ):  # a cheap draft that is never right: K = 0 wins, full acceptance would pay
            policy.record_round(RoundFacts(k, 0, 0.004 * k, 0.015 + 0.001 * k, asked=k))
    policy.costs.generating[False] += (
        60.0  # long after the last draft: the probes' time budget is no limit
    )
    assert policy.choose() == 0 and policy.rounds_until_probe(False) == 15
    for _ in range(14):
        policy.plain_round(False)  # the run started by that choice: 15 tokens, 14 after its first
    assert policy.rounds_until_probe(False) == 1
    assert policy.choose() == 2 and policy.probing  # the probe is due at the very next choice
    assert policy.rounds_until_probe(True) == 16  # the loaded arm keeps its own schedule


def test_a_draft_that_full_acceptance_could_not_make_pay_is_never_probed() -> None:
    """A self-draft as large as the target on the stages' own cores (1 stage, 1 user): K drafts cost
    more than the K + 1 plain steps they could save, so no acceptance makes it pay and probing it
    only costs (two probes of ~50 ms per 128 tokens cost that bench row 4-9 %). A draft that could
    pay is probed."""
    for per_token, probed in ((0.016, False), (0.004, True)):
        policy = KPolicy(None, 8, probe_every=4, drafter="model")
        for _ in range(40):
            for k in (0, 2, 4):  # acceptance high, and still K = 0 wins for the costly draft
                accepted = k if per_token > 0.01 else 0
                policy.record_round(
                    RoundFacts(k, accepted, per_token * k, 0.015 + 0.002 * k, asked=k)
                )
        policy.costs.generating[False] += (
            60.0  # long after the last draft: the time budget is no limit
        )
        assert policy.could_pay(False) is probed
        choices = [policy.choose() for _ in range(12)]
        assert (max(choices) > 0) is probed
        if not probed:  # nor are runs cut short for its sake
            assert policy.rounds_until_probe(False) == 4


def test_a_draft_could_pay_by_its_acceptance_against_the_rate_plain_runs_realize() -> None:
    """Measured on 2 emulated PCs x 1 user: a 1-token verify's fitted latency 12.4 ms (+3.3 ms per
    token), plain runs realizing 10.4 ms a token, the self-draft 7.7 ms + 7 ms per token at alpha
    0.95. At perfect acceptance K = 16 read as paying (17 tokens in 184 ms: 1.14x the verify's
    latency), so the draft was probed for ~45 ms every other reply while it realized 72 tok/s
    against plain's 96. At its acceptance, against what plain decoding realizes, no K pays. A draft
    1 ms a token still could."""
    for per_token, could in ((0.007, False), (0.001, True)):
        policy = KPolicy(None, 16, drafter="model")
        for size in (1, 2, 3, 5, 9):
            for _ in range(4):
                policy.costs.latency.add(size, 0.0124 + 0.0033 * (size - 1))
        for k in (1, 2, 4, 8):
            for _ in range(4):
                policy.costs.draft("model").add(k, 0.0077 * (per_token / 0.007) + per_token * k)
        for _ in range(40):
            policy.costs.achieved("plain", False).add(1, 0.0104)
        policy._accepted, policy._rejected = 19.0, 1.0  # alpha 0.95
        assert policy.could_pay(False) is could
    # no plain rate yet: the verify's latency stands for it
    unmeasured = KPolicy(None, 16, drafter="model")
    for size in (1, 2, 3):
        unmeasured.costs.latency.add(size, 0.0124 + 0.0033 * (size - 1))
    unmeasured.costs.draft("model").add(2, 0.004)
    assert unmeasured.could_pay(False)


def test_plain_decoding_is_judged_by_the_rate_its_runs_realize() -> None:
    """Plain decoding runs without the round trip through the coordinator every verify pays: 10.4
    against a 1-token verify's 12 ms on 2 emulated PCs x 1 user. Judged against the verify's
    latency, a prompt lookup accepting 0.3 of its drafts "beat" plain at K = 1 (1.3 tokens for a
    14.5 ms verify) and runs were cut for it, 3-8 failed verifies a reply on text that did not
    repeat. Until plain's rate is measured, or when it realizes less than the verify's latency, the
    latency stands for it."""
    from fleettui.runtime.lookup_watch import cut_k

    policy = KPolicy(None, 8, drafter="lookup", free=True)
    for size in (1, 2, 3):
        for _ in range(4):
            policy.costs.latency.add(size, 0.012 + 0.0025 * (size - 1))
    # a run's Cancel, as measured: its tokens meanwhile are the reply's
    policy.costs.cut.add(1, 0.00005)
    policy._accepted, policy._rejected = 3.0, 7.0  # alpha 0.3
    assert policy.plain_seconds(False) == pytest.approx(0.012)
    assert cut_k(policy, False) == (1, False)  # against the verify's latency: cut
    for _ in range(40):
        policy.costs.achieved("plain", False).add(1, 0.0104)
    assert policy.plain_seconds(False) == pytest.approx(0.0104)
    assert policy.expected_rate(0) == pytest.approx(1 / 0.0104)
    assert cut_k(policy, False) == (0, False) and policy.choose(free_draft=True) == 0
    policy._accepted, policy._rejected = 9.0, 1.0  # alpha 0.9: a repeat pays all the same
    assert cut_k(policy, False)[0] > 0
    slow = KPolicy(None, 8, drafter="lookup", free=True)  # plain realizing less than the latency
    slow.costs.latency.add(1, 0.012)
    for _ in range(40):
        slow.costs.achieved("plain", False).add(1, 0.020)
    assert slow.plain_seconds(False) == pytest.approx(0.012)


def test_the_restart_after_a_cut_that_verified_nothing_is_the_lookups_not_plain_decodings() -> None:
    """A run cut for a lookup whose drafts the run's own tokens contradicted verifies nothing and
    restarts: its first token pays a round trip through the coordinator. Charged to plain decoding,
    such restarts dragged plain's realized rate from 96 to 77-85 tok/s and the self-draft, judged
    against it, was chosen at K = 6-16 (0.78x plain in the next reply). The Cancel and what the
    plain rounds after it take beyond plain's rate go to the lookup's realized rate."""
    from fleettui.runtime.lookup_watch import Cut

    policy = KPolicy(None, 8, drafter="lookup", free=True)
    for _ in range(40):
        policy.record_round(RoundFacts(0, 0, 0.0, 0.0104, session=5))  # plain runs: 10.4 ms a token
    policy.record_round(RoundFacts(2, 2, 0.0, 0.022, session=5))  # one verify the lookup won
    for _ in range(3):
        policy.record_round(RoundFacts(0, 0, 0.0, 0.0104, session=5))
    plain, lookup = policy.costs.achieved("plain", False), policy.costs.achieved("lookup", False)
    plain_rate, lookup_seconds = plain.rate, lookup.seconds
    cut = Cut(policy, 0, seconds=0.001, session=5)  # its K: 0, the run's tokens went another way
    assert cut.charge(False, policy, False) == 0.0  # nothing drafted after it: no drafting time
    policy.record_round(RoundFacts(0, 0, 0.0, 0.025, session=5))  # the new run's first token
    assert plain.rate == pytest.approx(plain_rate, rel=1e-3)
    assert lookup.seconds == pytest.approx(
        lookup_seconds + 0.001 + (0.025 - 1 / plain_rate), rel=1e-3
    )


def test_a_costly_drafters_probes_take_a_bounded_share_of_the_generating_time() -> None:
    """A probe of a costly draft makes it catch up on everything it missed (0.1-0.2 s on the stages'
    own cores in the bench): while K = 0 wins, a probe due by its rounds waits until the time spent
    generating since the drafter last drafted is at least its cost / TUNING.probe_share (idle time
    does not count), and a run meanwhile keeps its length. A free drafter (prompt lookup) is never
    held back."""
    costs = CostModel()
    policy = KPolicy(None, 8, probe_every=4, costs=costs, drafter="model")
    for _ in range(40):
        for k in (
            0,
            2,
            4,
        ):  # a cheap draft that is never right: K = 0 wins, full acceptance would pay
            policy.record_round(RoundFacts(k, 0, 0.004 * k, 0.015 + 0.001 * k, asked=k))
    # the last speculative round took 0.016 + 0.019 s for 1 token that a plain round makes in 0.015
    # s: it lost 0.020 s, so the next probe is affordable after 0.020 / 0.02 = 1.0 s more of
    # generating
    choices = []
    for _ in range(20):  # 20 plain rounds of 15 ms: rounds alone would probe 4 times
        choices.append(policy.choose())
        policy.record_round(RoundFacts(0, 0, 0.0, 0.015))
    assert choices == [0] * 20
    assert policy.rounds_until_probe(False) == 4  # blocked by time: a run is not cut to one token
    while not costs.probe_affordable("model", False):  # a long reply of plain rounds
        policy.record_round(RoundFacts(0, 0, 0.0, 0.015))
    assert 1.0 <= costs.generating[False] - costs.last_drafted[("model", False)][0] <= 1.0 + 0.016
    assert policy.rounds_until_probe(False) == 1
    assert policy.choose() == 2 and policy.probing  # due by rounds long ago, affordable now
    policy.record_round(RoundFacts(2, 1, 0.150, 0.016, asked=2))  # the probe confirms K = 0
    assert not costs.probe_affordable("model", False) and costs.probe_affordable("model", True)
    lookup = policy.fork("lookup", free=True)
    lookup.record_round(RoundFacts(2, 0, 0.0003, 0.016, asked=2))  # a free drafter's miss
    lookup.record_round(RoundFacts(0, 0, 0.0, 0.016))
    assert costs.probe_affordable("lookup", False)  # charged its lookup time only: never held back


def test_a_probes_cost_includes_the_slower_plain_steps_after_it() -> None:
    """Measured on one stage: while the draft caught up the stage idled, and its next plain steps
    ran slower (13, 12, 11 ms against 9). A probe is charged what it lost against plain decoding:
    its own round beyond its tokens' plain time, plus the excess of the TUNING.after_probe_rounds
    plain rounds after it."""
    from fleettui.runtime.tuning import TUNING

    costs = CostModel()
    policy = KPolicy(None, 8, costs=costs, drafter="model")
    for _ in range(20):
        policy.record_round(RoundFacts(0, 0, 0.0, 0.010))  # plain: 10 ms a token
    policy.record_round(RoundFacts(2, 0, 0.055, 0.020, asked=2))  # a probe: 75 ms for 1 token
    assert costs.last_drafted[("model", False)][1] == pytest.approx(0.065)
    for _ in range(TUNING.after_probe_rounds):
        policy.record_round(RoundFacts(0, 0, 0.0, 0.015))  # each 5 ms slower than plain
    charged = costs.last_drafted[("model", False)][1]
    # (the slow rounds count as plain decoding too: its rate drifts, each later excess is a little
    # smaller)
    assert (
        0.065 + TUNING.after_probe_rounds * 0.003
        < charged
        < 0.065 + TUNING.after_probe_rounds * 0.005 + 1e-9
    )
    policy.record_round(RoundFacts(0, 0, 0.0, 0.030))  # past the after-effect: not the probe's
    assert costs.last_drafted[("model", False)][1] == pytest.approx(charged)
    alone = CostModel()  # before plain decoding was measured, a probe costs its drafting
    KPolicy(None, 8, costs=alone, drafter="model").record_round(
        RoundFacts(2, 0, 0.055, 0.020, asked=2)
    )
    assert alone.last_drafted[("model", False)][1] == pytest.approx(0.055)


def test_stage_load_is_the_busiest_stages_share_of_the_recent_window() -> None:
    """Sessions compete for the stages only while they are busy: behind slow links they mostly
    wait."""
    load = StageLoad(window=1.0)
    assert load.busiest(now=100.0) == 0.0
    for index in range(
        10
    ):  # ten results in the last second: stage 0 computed 30 ms each, stage 1 60 ms
        trace = _trace((0.0, 0.0, 0.030, 0.031), (0.04, 0.04, 0.100, 0.101))
        load.observe(
            protocol.Result(1, index, np.zeros(1, np.int64), 0, trace=trace), 99.1 + 0.09 * index
        )
    assert load.busiest(now=100.0) == pytest.approx(0.6)
    assert load.busiest(now=101.5) == 0.0  # all of it older than the window


def test_best_k_and_a_new_sessions_prior_follow_the_pipelines_acceptance() -> None:
    """`best_k` is the argmax of `choose` without its probes; a session forked later starts from the
    acceptance the drafter reached in the pipeline's other sessions, not from 0.5."""
    base = KPolicy(None, 8)
    assert base.best_k() == 0  # no costs measured yet
    first = base.fork("model")
    for _ in range(
        30
    ):  # 50 ms hops: a verify costs its round trip, a draft token 8 ms; all accepted
        first.record_round(RoundFacts(0, 0, draft_seconds=0.0, verify_seconds=0.150))
        first.record_round(RoundFacts(4, 4, draft_seconds=0.032, verify_seconds=0.155))
        first.record_round(RoundFacts(8, 8, draft_seconds=0.064, verify_seconds=0.160))
    assert first.best_k() == 8
    second = base.fork("model")
    assert second.alpha > 0.9 and base.fork("lookup").alpha == pytest.approx(0.5)
    assert KPolicy(3, 8).best_k() == 3  # a fixed K is the best K


def test_under_load_a_free_drafter_verifies_at_most_a_fair_share_of_the_busiest_stage() -> None:
    """Measured on 2 emulated PCs with 2 users: a prompt lookup accepting 9 of 9 drafts verified 9
    tokens in 23 ms against 8 ms for a plain step, and the other user, waiting behind each verify,
    fell from 60 to 22 tok/s. Under load a verify may cost the busiest stage at most
    TUNING.fair_verify_cost plain steps; alone, or with the stages idle, the whole max_k stays
    open."""
    from fleettui.runtime.tuning import TUNING

    policy = KPolicy(None, max_k=8, drafter="lookup")
    for _ in range(20):
        for k in (0, 2, 4, 8):
            compute = 0.008 + 0.0017 * k
            trace = _trace((0.0, 0.0, compute, compute), (0.1, 0.1, 0.1 + compute, 0.1 + compute))
            own, busiest = round_costs(trace, 2 * compute + 0.003)
            policy.record_round(
                RoundFacts(
                    k, k, 0.0, 2 * compute + 0.003, False, own, busiest, asked=k, loaded=True
                )
            )
    fair = policy.fair_k(loaded=True)
    assert fair == 2  # 8 + 1.7 * 2 = 11.4 ms <= 1.5 x 8 ms < 8 + 1.7 * 3
    assert policy.costs.compute.predict(
        fair + 1
    ) <= TUNING.fair_verify_cost * policy.costs.compute.predict(1)
    # every draft accepted: the cap binds
    assert policy.choose(free_draft=True, loaded=True) == fair
    assert policy.best_k(free_draft=True, loaded=True) == fair
    assert policy.fair_k(loaded=False) == 8 and policy.choose(free_draft=True, loaded=False) == 8


def test_on_loaded_stages_speculation_is_all_or_none() -> None:
    """A drafter that pays on loaded stages is used only while every other generating session would
    speculate too (`shared`); alone, or with stages idle, the rule does not apply. `wants` keeps the
    unconstrained choice, which is what the other sessions ask about."""
    policy = KPolicy(None, max_k=8, drafter="lookup")
    for _ in range(20):
        for k in (0, 2):
            compute = 0.008 + 0.001 * k
            trace = _trace((0.0, 0.0, compute, compute))
            own, busiest = round_costs(trace, compute + 0.002)
            policy.record_round(
                RoundFacts(k, k, 0.0, compute + 0.002, False, own, busiest, asked=k, loaded=True)
            )
    chosen = policy.choose(free_draft=True, loaded=True, shared=True)
    assert chosen > 0 and policy.wants
    assert policy.choose(free_draft=True, loaded=True, shared=False) == 0 and policy.wants
    assert policy.paying_k(loaded=True, shared=False) == 0
    # not loaded: no one waits
    assert policy.choose(free_draft=True, loaded=False, shared=False) > 0
    assert choose_drafter([("lookup", policy, True)], loaded=True, shared=False) == ("", 0)


def test_a_verifys_after_effect_on_plain_steps_is_charged_to_its_drafter() -> None:
    """OpenVINO runs the first 1-token steps after a verify of several tokens slower. A drafter
    whose verifies look cheap (4 tokens in 25 ms against 10 ms per plain token) but slow the 3 plain
    steps after each by 20 ms has really lost: the excess is its, and plain keeps its own rate."""
    policy = KPolicy(None, max_k=8)
    for _ in range(30):
        policy.record_round(RoundFacts(0, 0, 0.0, 0.010))
    for _ in range(10):
        policy.record_round(RoundFacts(3, 3, 0.001, 0.024, asked=3))
        for wall in (0.030, 0.030, 0.030, 0.010, 0.010):
            policy.record_round(RoundFacts(0, 0, 0.0, wall))
    assert abs(policy.costs.achieved("plain", loaded=False).rate - 100.0) < 1.0
    assert policy.costs.achieved("draft", loaded=False).rate < 100.0
    assert policy.costs.losing("draft", loaded=False) and policy.choose() == 0


def test_plain_rounds_never_push_the_verify_sizes_out_of_the_fit() -> None:
    """Plain rounds far outnumber verifies: with one window for all sizes a reply's plain steps
    pushed every verify out of it, the fit lost its slope and a verify of 17 tokens looked as cheap
    as a plain step (a lookup on loaded emulated PCs chose K = 16: 52-60 ms against 8 ms). Each size
    keeps its own samples."""
    cost = LinearCost()
    for size in (3, 5):
        for _ in range(4):
            cost.add(size, 0.004 * size)
    for _ in range(500):
        cost.add(1, 0.008)
    assert cost.sloped
    assert cost.predict(17) > 4 * cost.predict(1)


def test_no_k_beyond_an_exploring_one_until_a_verifys_slope_is_measured() -> None:
    """Measured at one size only, a verify's cost is taken flat in K: every K would look as cheap as
    the one measured. On one core it is not (12-15 ms for 2 tokens, 17-21 ms for 4, against 8 ms
    plain), so no K beyond TUNING.exploring_k is verified until a second size gives the slope; then
    the whole max_k is open."""
    policy = KPolicy(None, max_k=16, drafter="lookup")
    for _ in range(10):
        policy.record_round(RoundFacts(0, 0, 0.0, 0.008, asked=1))
    assert not policy.costs.latency.sloped
    assert policy.fair_k(loaded=False) == TUNING.exploring_k
    for _ in range(10):
        policy.record_round(RoundFacts(3, 3, 0.0, 0.009, asked=3))
    assert policy.costs.latency.sloped and policy.fair_k(loaded=False) == 16


def test_a_lookup_that_seldom_proposes_does_not_count_as_speculating_for_the_others() -> None:
    """On loaded stages a session speculates only while every other one does (all or none). A lookup
    that proposes in 1 ask of 10 may still pay by the model, but its session decodes plainly, and
    another session's verifies would slow it for nothing (2 emulated PCs x 2 users: 40 against 77
    tok/s, 0.81x no speculation together): it does not `want` speculation."""
    policy = KPolicy(None, max_k=8, drafter="lookup")
    for _ in range(20):
        for k in (0, 2):
            policy.record_round(RoundFacts(k, k, 0.0, 0.008 + 0.001 * k, asked=k))
    assert policy.choose(free_draft=True) > 0 and policy.wants
    for index in range(60):
        policy.asked(proposed=index % 10 == 0)
    assert policy.hit_rate < TUNING.measurable_hit_rate
    assert policy.choose(free_draft=True) > 0 and not policy.wants


def test_a_lookup_learning_in_the_runs_shadow_is_probed_only_to_recheck_a_measured_loss() -> None:
    """Where runs are watched for prompt lookup its acceptance is learnt in their shadow, free. A
    probe then only costs (a cut run, a verify of drafts the model expects to fail: 1-3 per reply of
    128 tokens on one stage), so while the model says K = 0 it is not probed; a lookup the model
    says pays but the realized rates say lost is probed, to measure that loss again. Without the
    shadow, probes keep alpha alive."""
    lookup = KPolicy(None, 8, probe_every=4, drafter="lookup", free=True)
    for _ in range(40):
        for k in (0, 2, 4):  # a lookup that is never right: K = 0 wins
            lookup.record_round(RoundFacts(k, 0, 0.0, 0.010 + 0.002 * k, asked=k))
    assert max(lookup.choose(free_draft=True, shadowed=True) for _ in range(12)) == 0
    assert max(lookup.choose(free_draft=True, shadowed=False) for _ in range(12)) == 2
    right = KPolicy(None, 8, probe_every=4, drafter="lookup", free=True)
    for _ in range(40):
        right.record_round(RoundFacts(0, 0, 0.0, 0.010))
        right.record_round(RoundFacts(3, 3, 0.0, 0.016, asked=3))
    right.charge("lookup", loaded=False, seconds=10.0)  # its realized rate lost (after-effects)
    assert right.expected_rate(3, True) > right.expected_rate(0, True) and right.losing(False)
    assert max(right.choose(free_draft=True, shadowed=True) for _ in range(12)) == 2


def test_a_new_sessions_prior_hit_rate_follows_the_pipelines_lookups() -> None:
    """Each reply is a new session: with a prior hit rate of 1 every new session's lookup counted as
    speculating for the all-or-none rule until its own misses wore the prior down, and each reply's
    first rounds verified drafts on loaded stages (2 emulated PCs x 2 users, 6 rounds each way:
    0.95x no speculation median with that prior, 0.98x with the pipeline's). A new session leans to
    what the lookup found in this pipeline's other sessions (weight 2, as alpha)."""
    base = KPolicy(None, 8)
    first = base.fork("lookup", free=True)
    # nothing measured yet: the lookup is asked before judged
    assert first.hit_rate == pytest.approx(1.0)
    for index in range(100):
        first.asked(proposed=index % 10 == 0)
    second = base.fork("lookup", free=True)
    assert second.hit_rate < TUNING.measurable_hit_rate and base.fork(
        "model"
    ).hit_rate == pytest.approx(1.0)
    for _ in range(3):  # its own reply repeats itself: a few hits make it count again
        second.asked(proposed=True)
    assert second.hit_rate >= TUNING.measurable_hit_rate
