"""Provides the adaptive speculation policy: K per round and the drafter per session, from measured
rates.

Costs are fitted per pipeline (`fleettui.runtime.cost_model.CostModel`, shared by every session): a
verify's own latency alone, the busiest stage's compute under load. Acceptance is per session and
drafter."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fleettui.runtime.cost_model import CostModel
from fleettui.runtime.measures import Realized
from fleettui.runtime.tuning import TUNING


@dataclass(frozen=True)
class RoundFacts:
    """What one round of K drafts cost and gained, as the coordinator measured it (ASKED drafts were
    requested; a lookup may propose fewer)."""

    k: int
    accepted: int
    draft_seconds: float
    verify_seconds: float
    catch_up: bool = False
    own_seconds: float | None = None
    compute_seconds: float | None = None
    asked: int | None = None
    loaded: bool = False
    prefilled: bool = False
    several: bool = False  # other sessions were generating too
    # of draft_seconds, what the draft model computed (no queueing)
    draft_computed: float | None = None
    # whose round it is (a verify's after-effect is its own session's only when alone)
    session: int = 0


class KPolicy:
    """Chooses K per round to maximise expected tokens per second, K = 0 when speculation does not
    pay.

    Acceptance is modelled as i.i.d. per draft token with rate alpha (estimated with decay from how
    many drafts each verify accepted); a round with K drafts then yields (1 - alpha^(K+1)) / (1 -
    alpha) tokens and costs draft(K) + verify(K + 1) seconds, both fitted from measured timings
    (verify: see CostModel). A drafter that may propose nothing (prompt lookup) is weighted by its
    measured hit rate. When K = 0 wins, a probe every `probe_every` rounds (backing off while probes
    confirm K = 0) keeps alpha alive."""

    def __init__(
        self,
        fixed_k: int | None,
        max_k: int = 8,
        probe_every: int = 16,
        costs: CostModel | None = None,
        drafter: str = "draft",
        free: bool = False,
    ) -> None:
        self.fixed_k = fixed_k
        # a drafter that costs no time (prompt lookup): its probes are never held back
        self.free = free
        self.max_k = max_k
        self.probe_every = probe_every
        self.costs = costs or CostModel()
        self.drafter = drafter
        self._accepted = 1.0  # decayed pseudo-counts: prior alpha = 0.5
        self._rejected = 1.0
        self._hits = 1.0  # decayed: rounds where the drafter proposed something when asked
        self._asks = 1.0
        self._own = {False: Realized(), True: Realized()}  # this session's speculative rounds
        self.last_choice = 0
        self.probing = False
        # its last `choose` found speculation paying and it mostly drafts (the all-or-none rule)
        self.wants = False

    def fork(self, drafter: str, free: bool = False) -> KPolicy:
        """A fresh policy for one session and drafter, sharing this pipeline's costs and settings.

        Its prior acceptance (weight 2, as the default 1:1) leans to what the drafter achieved in
        this pipeline's other sessions, so a new session does not start from alpha = 0.5 every time;
        so does its prior hit rate (weight 2): a lookup that mostly finds nothing in this pipeline
        does not count as speculating for the all-or-none rule in a new reply's first rounds."""
        policy = KPolicy(self.fixed_k, self.max_k, self.probe_every, self.costs, drafter, free)
        accepted, rejected = self.costs.acceptance.get(drafter, (1.0, 1.0))
        share = min(max(accepted / max(accepted + rejected, 1e-9), 0.05), 0.95)
        policy._accepted, policy._rejected = 2 * share, 2 * (1 - share)
        proposed, asked = self.costs.proposals.get(drafter, (1.0, 1.0))
        policy._hits, policy._asks = 2 * min(max(proposed / max(asked, 1e-9), 0.05), 1.0), 2.0
        return policy

    @property
    def alpha(self) -> float:
        return self._accepted / (self._accepted + self._rejected)

    @property
    def hit_rate(self) -> float:
        return self._hits / self._asks

    def record_round(self, facts: RoundFacts) -> None:
        """Learn from one round of K drafts.

        `catch_up` rounds (the first after a new prompt, which also prefilled the target or the
        draft) still teach acceptance but not costs: counting a prefill as the cost of a plain
        decode step would make K = 0 look slow forever. The realized tokens per second skip only
        `prefilled` rounds (the target took part of a new prompt): a draft's catch-up is the price
        of speculating now and then. `own_seconds` / `compute_seconds` come from the stages' trace
        (`round_costs`); without them the wall time stands for both."""
        k, accepted, asked, loaded = facts.k, facts.accepted, facts.asked, facts.loaded
        draft_seconds, verify_seconds = facts.draft_seconds, facts.verify_seconds
        self.costs.generating[loaded] += draft_seconds + verify_seconds
        own_seconds, compute_seconds = facts.own_seconds, facts.compute_seconds
        catch_up, prefilled = facts.catch_up, facts.prefilled
        plain_rate = self.costs.achieved("plain", loaded).rate  # before this round counts
        plain_seconds = 1.0 / plain_rate if plain_rate > 0 else None
        if asked:
            self.asked(proposed=k > 0)
        if k > 0:
            self.learn_acceptance(k, accepted)
            # a free drafter's probe costs only its lookup, so it is never held back; nor is a probe
            # before plain decoding has been measured
            if plain_seconds is None or self.free:
                self.costs.last_drafted[(self.drafter, loaded)] = (
                    self.costs.generating[loaded],
                    draft_seconds,
                )
            else:
                self.costs.charge_probe(
                    self.drafter,
                    loaded,
                    accepted + 1,
                    draft_seconds + verify_seconds,
                    plain_seconds,
                )
            if not catch_up:
                # several sessions queue at one draft: its cost per proposal is what it computed
                computed = facts.draft_computed
                self.costs.draft(self.drafter).add(
                    k, computed if facts.several and computed is not None else draft_seconds
                )
        elif not prefilled:
            self.costs.charge_after_probe(loaded, draft_seconds + verify_seconds, plain_seconds)
        if not catch_up:
            self.costs.latency.add(k + 1, verify_seconds if own_seconds is None else own_seconds)
            self.costs.compute.add(
                k + 1, verify_seconds if compute_seconds is None else compute_seconds
            )
        if (
            not prefilled
        ):  # what choosing this arm really cost, a draft's catch-up on the history included
            self._realize(facts, plain_seconds)

    def _realize(self, facts: RoundFacts, plain_seconds: float | None) -> None:
        """Add a round to the realized rates: a speculative one to its drafter's, a plain one to
        plain's, or, in the `Tuning.after_verify_rounds` after a verify, what it took beyond plain's
        rate to that verify's drafter (and a round at plain's rate to plain's, so plain is still
        judged when every other round drafts).

        The pipeline's record holds a session alone, or several on loaded stages. Several sessions
        on stages with room wait for each other at the draft and in the coordinator: their rates are
        not what a session alone gets, and a session alone would inherit them (its own record speaks
        once it has rounds). Such rounds go to each session's own record only. A probe under load is
        one session speculating among plain ones: its rate is what it takes from them, not what all
        speculating would give, so it teaches costs and acceptance only."""
        k, loaded = facts.k, facts.loaded
        seconds = facts.draft_seconds + facts.verify_seconds
        pipeline = loaded or not facts.several
        lone = loaded and k > 0 and self.probing
        if k > 0:
            if lone:
                self.costs.after_verify.pop(loaded, None)
                return
            self._own[loaded].add(facts.accepted + 1, seconds)
            if pipeline:
                self.costs.achieved(self.drafter, loaded).add(facts.accepted + 1, seconds)
                self.costs.after_verify[loaded] = (
                    self.drafter,
                    TUNING.after_verify_rounds,
                    facts.session,
                )
            return
        if (
            not pipeline
        ):  # several sessions on stages with room: plain's rate alone is no yardstick here
            return
        after = self.costs.after_verify.pop(loaded, None)
        if after is not None and plain_seconds is not None:
            drafter, left, session = after
            if left > 1:
                self.costs.after_verify[loaded] = (drafter, left - 1, session)
            # on loaded stages another session's steps slow down too: the pipeline's record is
            # charged; a session's own record only for its own steps
            self.charge(drafter, loaded, seconds - plain_seconds, own=session == facts.session)
            # a round at plain's own rate: plain keeps its rate and its count of rounds grows
            self.costs.achieved("plain", loaded).add(1, plain_seconds)
        else:
            self.costs.achieved("plain", loaded).add(1, seconds)

    def charge(self, drafter: str, loaded: bool, seconds: float, own: bool = True) -> None:
        """Add `seconds` that speculating with `drafter` cost beyond its rounds (their after-effect
        on plain steps, a run cut short for it) to its realized rates: the pipeline's and, if `own`
        and it is this policy's drafter, this session's."""
        self.costs.achieved(drafter, loaded).stretch(seconds)
        if own and drafter == self.drafter:
            self._own[loaded].stretch(seconds)

    def learn_acceptance(self, k: int, accepted: int, decay: float = 0.97) -> None:
        """Count K drafts of which a verify accepted `accepted` (this session's and the
        pipeline's)."""
        self._accepted = self._accepted * decay + accepted
        self._rejected = self._rejected * decay + (1 if accepted < k else 0)
        shared = self.costs.acceptance.setdefault(self.drafter, [1.0, 1.0])
        shared[0] = shared[0] * decay + accepted
        shared[1] = shared[1] * decay + (1 if accepted < k else 0)

    def asked(self, proposed: bool, decay: float = 0.97) -> None:
        """Count one request to the drafter and whether it proposed anything (a lookup may find
        nothing)."""
        self._asks = self._asks * decay + 1
        self._hits = self._hits * decay + (1 if proposed else 0)
        shared = self.costs.proposals.setdefault(self.drafter, [1.0, 1.0])
        shared[0] = shared[0] * decay + (1 if proposed else 0)
        shared[1] = shared[1] * decay + 1

    def could_pay(self, loaded: bool) -> bool:
        """Whether some K would beat plain decoding by `Tuning.probe_ceiling` at a high acceptance
        (the session's alpha, at least `Tuning.probe_acceptance`; True while a cost is unknown). If
        not, no acceptance this drafter can be expected to reach makes it pay, and probing it only
        costs. Not judged at perfect acceptance: that would let the extrapolated cost of a long
        verify decide. Plain decoding costs what it realizes (`plain_seconds`)."""
        plain = self.plain_seconds(loaded)
        if plain is None:
            return True
        alpha = min(max(self.alpha, TUNING.probe_acceptance), 0.999)
        for k in range(1, self.fair_k(loaded) + 1):
            verify = self.costs.verify(k + 1, loaded)
            draft = 0.0 if self.free else self.costs.draft(self.drafter).predict(k)
            tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
            if (
                verify is None
                or draft is None
                or tokens * plain > TUNING.probe_ceiling * (draft + verify)
            ):
                return True
        return False

    def _rounds_left(self, loaded: bool) -> int:
        """Plain rounds left, by the pipeline's probe schedule, before this drafter is probed
        again."""
        arm = (self.drafter, loaded)
        return self.costs.probe_intervals.get(arm, self.probe_every) - self.costs.since_probe.get(
            arm, 0
        )

    def probe_due(self, loaded: bool) -> bool:
        """Whether this round is a probe's while K = 0 wins: due by the rounds since the last one,
        affordable in time (`CostModel.probe_affordable`) and able to pay at all (`could_pay`)."""
        return (
            self._rounds_left(loaded) <= 1
            and self.costs.probe_affordable(self.drafter, loaded)
            and self.could_pay(loaded)
        )

    def rounds_until_probe(self, loaded: bool) -> int:
        """Plain rounds left before this drafter is probed again while K = 0 wins (at least 1; a
        probe due by its rounds but not yet affordable in time is `probe_every` rounds away, so runs
        keep their length)."""
        left = self._rounds_left(loaded)
        if left <= 1 and not self.probe_due(loaded):
            return self.probe_every
        return max(1, left)

    def plain_round(self, loaded: bool) -> None:
        """Count a plain round `choose` was not asked about (a run's later tokens) toward the
        next probe."""
        arm = (self.drafter, loaded)
        self.costs.since_probe[arm] = self.costs.since_probe.get(arm, 0) + 1

    def plain_seconds(self, loaded: bool) -> float | None:
        """Seconds a token of plain decoding costs: what plain rounds realize once measured, if
        faster than a 1-token verify's fitted latency: plain decoding runs (`Step.run`) without the
        round trip through the coordinator that every verify pays, and judged against that round
        trip a weak drafter would look paying. A miss or a reply's first round still pays the round
        trip (`expected_rate`)."""
        plain = self.costs.verify(1, loaded)
        if plain is None:
            return None
        realized = self.costs.achieved("plain", loaded)
        if realized.rounds >= TUNING.min_realized_rounds and realized.rate > 0:
            return min(plain, 1.0 / realized.rate)
        return plain

    def expected_rate(
        self,
        k: int,
        free_draft: bool = False,
        loaded: bool = False,
        hit: float | None = None,
        extra: float = 0.0,
    ) -> float | None:
        """Tokens per second of rounds of K drafts at the policy's alpha. `hit`: the share of rounds
        in which the drafter proposes (its measured hit rate by default; 1 where it is known to
        propose, as after a run cut short for it); `extra`: seconds each such round costs beyond
        draft and verify (a Cancel)."""
        plain = self.costs.verify(1, loaded)
        verify = self.costs.verify(k + 1, loaded)
        if verify is None or plain is None:
            return None
        draft = 0.0
        if k > 0 and not free_draft:
            predicted = self.costs.draft(self.drafter).predict(k)
            if predicted is None:
                return None
            draft = predicted
        if k == 0:
            return 1.0 / max(self.plain_seconds(loaded) or plain, 1e-6)
        alpha = min(self.alpha, 0.999)
        tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
        hit = self.hit_rate if hit is None else hit
        # a miss (nothing proposed) is a plain step at the cost of the lookup
        return (hit * tokens + (1 - hit)) / max(
            draft + hit * (verify + extra) + (1 - hit) * plain, 1e-6
        )

    def exploring(self, free_draft: bool = False, loaded: bool = False) -> bool:
        """Whether the costs to choose K are still unknown (the plain step's or the draft's)."""
        return self.expected_rate(min(TUNING.exploring_k, self.max_k), free_draft, loaded) is None

    def measuring_soon(self, loaded: bool = False) -> bool:
        """Whether a run should end early so this drafter is measured: its costs are unknown and,
        asked, it mostly proposes: a prompt lookup that keeps finding nothing would otherwise cut
        every run short, at a round trip through the coordinator each time."""
        return self.hit_rate >= TUNING.measurable_hit_rate and self.exploring(loaded=loaded)

    def fair_k(self, loaded: bool) -> int:
        """The largest K this session may verify now: `max_k` alone; under load (other sessions wait
        behind each step at the busiest stage) the largest K whose verify costs that stage at most
        `Tuning.fair_verify_cost` plain steps, so one user's well-drafted rounds do not starve the
        others. While verifies of one size only were measured in this regime their cost is taken
        flat in K, so no K beyond an exploring one (`Tuning.exploring_k`): on one core a verify's
        cost grows with every token."""
        verify = (
            self.costs.compute if loaded and self.costs.compute.measured else self.costs.latency
        )
        largest = self.max_k if verify.sloped else min(TUNING.exploring_k, self.max_k)
        if not loaded or not self.costs.compute.measured:
            return largest
        plain = self.costs.compute.predict(1) or 0.0
        fair = 0
        for k in range(1, largest + 1):
            cost = self.costs.compute.predict(k + 1)
            if cost is None or cost > TUNING.fair_verify_cost * plain:
                break
            fair = k
        return fair

    def best_k(self, free_draft: bool = False, loaded: bool = False) -> int:
        """The K with the highest expected rate now (no probe, no bookkeeping; 0 while costs are
        unknown)."""
        if self.fixed_k is not None:
            return self.fixed_k
        rates = {k: rate or 0.0 for k, rate in self._rates(free_draft, loaded).items()}
        return max(rates, key=rates.__getitem__)

    def _rates(self, free_draft: bool, loaded: bool) -> dict[int, float | None]:
        """The expected rate of each K this session may verify now, as K is chosen by: on loaded
        stages a K > 0 counts `Tuning.loaded_margin` less (None: a cost still unknown)."""
        rates = {
            k: self.expected_rate(k, free_draft, loaded) for k in range(self.fair_k(loaded) + 1)
        }
        if loaded:
            rates = {
                k: rate / TUNING.loaded_margin if k and rate is not None else rate
                for k, rate in rates.items()
            }
        return rates

    def losing(self, loaded: bool) -> bool:
        """Whether speculating has measurably yielded fewer tokens per second than not: by the
        session's own record once it has enough rounds (else the pipeline's), and under load by the
        pipeline's as well, since there a session's own rate also grows by what its longer verifies
        take from the others."""
        costs = self.costs
        return costs.losing(self.drafter, loaded, self._own[loaded]) or (
            loaded and costs.losing(self.drafter, loaded)
        )

    def paying_k(self, loaded: bool = False, shared: bool = True) -> int:
        """`best_k` of this drafter, or 0 while it has measurably yielded fewer tokens per second
        than plain decoding (`CostModel.losing`) or, under load, while another session would not
        speculate."""
        if (loaded and not shared) or self.losing(loaded):
            return 0
        return self.best_k(free_draft=self.free, loaded=loaded)

    def choose(
        self,
        free_draft: bool = False,
        loaded: bool = False,
        shared: bool = True,
        shadowed: bool = False,
    ) -> int:
        """K for this round. Under load, `shared` says whether every other generating session wants
        to speculate too: if one does not, this session decodes plainly as well (probes apart),
        since its longer verifies would lengthen that session's every turn at the busy stage and
        only it would gain. `wants` keeps what it would choose regardless, for the others."""
        self.probing = False
        self.wants = False
        if self.fixed_k is not None:
            self.last_choice = self.fixed_k
            return self.fixed_k
        rates = self._rates(free_draft, loaded)
        unknown = [k for k, rate in rates.items() if rate is None]
        if unknown:  # measure before modelling: K=0 first, then a mid-size K for the draft's cost
            choice = 0 if 0 in unknown else min(TUNING.exploring_k, self.max_k)
            self.probing = choice > 0
        else:
            choice = modelled = max(rates, key=lambda k: rates[k] or 0.0)
            if choice and self.losing(loaded):
                choice = 0  # the model says it pays, the measured tokens per second say it does not
            # it speculates for the all-or-none rule only if it mostly drafts when asked: a lookup
            # that seldom finds anything may still pay by the model, but its session decodes
            # plainly, and the other sessions' verifies would then slow it down for nothing
            self.wants = choice > 0 and self.hit_rate >= TUNING.measurable_hit_rate
            if loaded and not shared:
                choice = 0  # all or none on loaded stages: another session would not speculate
            if choice:
                self.took(choice, probe=False, loaded=loaded)
            elif self.probe_due(loaded) and (modelled or not shadowed):
                # A probe makes a costly draft catch up on everything since its last use: back off
                # while probes keep confirming K = 0, so exploring stays a small share of the work.
                # Interval and count are the pipeline's: sessions take turns probing, none starts
                # afresh. A drafter whose runs are watched (`shadowed`, prompt lookup) learns its
                # acceptance in their shadow: it is probed only to measure again a loss the model
                # disputes, never to keep alpha alive (a probe's cut run and failed verify cost more
                # than the shadow).
                choice = min(2, self.max_k)
                self.took(choice, probe=True, loaded=loaded)
            else:
                self.plain_round(loaded)
        self.last_choice = choice
        return choice

    def took(self, k: int, probe: bool, loaded: bool) -> None:
        """Count a round of K > 0 drafts chosen for this drafter (a `probe` while K = 0 wins, which
        backs the next probe off; else the probe interval starts over) toward the pipeline's probe
        schedule."""
        arm = (self.drafter, loaded)
        self.costs.since_probe[arm] = 0
        interval = self.costs.probe_intervals.get(arm, self.probe_every)
        self.costs.probe_intervals[arm] = min(2 * interval, 512) if probe else self.probe_every
        self.probing, self.last_choice = probe, k


def choose_drafter(
    policies: Sequence[tuple[str, KPolicy, bool]],
    loaded: bool,
    shared: bool = True,
    shadowed: bool = False,
) -> tuple[str, int]:
    """(drafter name, K) for one round among candidates (name, that drafter's policy, is it free).

    A candidate that is still exploring or probing goes first (free drafters before costly ones);
    otherwise the candidate whose best K has the highest expected rate wins. ("", 0) = no
    speculation this round. `shared`: see `KPolicy.choose`; `shadowed`: runs are watched for the
    free drafters (`lookup_watch`)."""
    best: tuple[float, str, int] = (-1.0, "", 0)
    for name, policy, free in sorted(policies, key=lambda item: not item[2]):
        k = policy.choose(free_draft=free, loaded=loaded, shared=shared, shadowed=free and shadowed)
        if policy.probing:
            return name, k
        rate = policy.expected_rate(k, free, loaded) or 0.0
        if rate > best[0]:
            best = (rate, name if k > 0 else "", k)
    return best[1], best[2]
