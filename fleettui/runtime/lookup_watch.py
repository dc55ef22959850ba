"""Provides the watch a run keeps for a free drafter (prompt lookup), asked at each token the run
makes.

A lookup proposes where the text repeats, which can be any token: asked only where runs happen to
end it misses most repeats, and cutting runs at fixed lengths for its sake costs a restart each
time. So the run itself is watched. Where the lookup would propose, either
- a verify of its drafts is expected to pay, the Cancel's time included (`cut_k`): the run is cut
  short there (`RunRounds._end_run_early`) and the round after it verifies the drafts; or
- it is not: the run goes on, and its next tokens say how many of the drafts a verify would have
  accepted (`Shadow`). The lookup's acceptance is learnt at no cost, so a lookup that is seldom
  right never costs a verify to find out."""

from __future__ import annotations

from dataclasses import dataclass

from fleettui.runtime.policy import KPolicy
from fleettui.runtime.tuning import TUNING


@dataclass
class Cut:
    """A run cut short for a free drafter: its policy, the K to verify (0 once a token the run made
    until the Cancel's Ack differed from the drafts it was cut for: the repeat ended there), what
    the Cancel took."""

    policy: KPolicy
    k: int
    seconds: float = 0.0
    session: int = 0

    def charge(self, drafted: bool, policy: KPolicy, loaded: bool) -> float:
        """What the round after the cut adds to its drafting time: the Cancel's time if the cut's
        drafter drafts it (`drafted` by `policy`), else nothing: the run's tokens made meanwhile
        contradicted its drafts (or the lookup finds nothing now) and a new run starts, a round trip
        through the chain. The drafter's realized rate is then charged the Cancel's time, and the
        plain rounds right after it what they take beyond plain's rate, as after a verify
        (`KPolicy._realize`). Charged to plain decoding, those restarts would lower plain's realized
        rate and make every drafter look paying."""
        if drafted and policy is self.policy:
            return self.seconds
        self.policy.charge(self.policy.drafter, loaded, self.seconds)
        self.policy.costs.after_verify[loaded] = (
            self.policy.drafter,
            TUNING.after_verify_rounds,
            self.session,
        )
        return 0.0


@dataclass
class Shadow:
    """A lookup's drafts the run is not cut for (or is cut for: until the Cancel's Ack), compared
    with the tokens the run makes next; `differed` once one of them was not the draft at its
    place."""

    tokens: tuple[int, ...]
    matched: int = 0
    differed: bool = False

    def follow(self, token: int, policy: KPolicy) -> Shadow | None:
        """Compare the run's next token; once a draft differs or all matched, teach `policy` the
        acceptance a verify would have had and end (None)."""
        if token == self.tokens[self.matched]:
            self.matched += 1
            if self.matched < len(self.tokens):
                return self
        else:
            self.differed = True
        policy.learn_acceptance(len(self.tokens), self.matched)
        return None


def cut_k(policy: KPolicy, loaded: bool) -> tuple[int, bool]:
    """(K, is it a probe) to cut a run for where the free drafter proposes; K = 0: let the run go
    on.

    K is the best by the modelled rate (acceptance i.i.d. at the policy's alpha, the verify's fitted
    cost plus the Cancel's, `RunRounds._end_run_early`) if that beats plain decoding. If it does but
    the realized rates say speculating has lost (`KPolicy.losing`: what the model does not see, like
    OpenVINO's slower steps after a verify), the run is cut only when a probe is due. Never on
    loaded stages: there a cut's verify and the restart after it take the busiest stage from the
    other sessions; the lookup is still asked where runs end, and still measured in the shadow."""
    if policy.fixed_k is not None:
        return policy.fixed_k, False
    costs = policy.costs
    plain = costs.verify(1, loaded)
    if loaded or plain is None:
        return 0, False
    # unknown, a Cancel is taken to cost a plain step (its round trip), so no run is cut on the
    # prior alpha
    cut = costs.cut.predict(1)
    cut = plain if cut is None else cut
    # where the run is cut, the lookup does propose: its hit rate is 1 there
    rates = {
        k: policy.expected_rate(k, True, loaded, hit=1.0, extra=cut) or 0.0
        for k in range(policy.fair_k(loaded) + 1)
    }
    best = max(rates, key=rates.__getitem__)
    if best and policy.losing(loaded):
        return (min(2, policy.max_k), True) if policy.probe_due(loaded) else (0, False)
    return best, False


def take_cut(policy: KPolicy, k: int, probe: bool, loaded: bool) -> None:
    """The bookkeeping `KPolicy.choose` does for a round of K drafts, for the round after a cut."""
    policy.took(k, probe, loaded)
    policy.wants = not probe
