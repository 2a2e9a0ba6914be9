"""Simulator-only yardsticks that see the *true* acceptance rates and costs.

``oracle``: the τ that maximises goodput under the true rates. It bounds what any policy that picks τ
per step, without reading the draft's confidence, could reach on a workload.
``oracle:confidence=true``: that τ plus ``adaptive``'s confidence stop rule, fed the true rates and the
simulator's exact confidence model instead of learned ones: what ``adaptive`` would reach if it had
nothing to learn. Neither is an upper bound on everything (a better stop rule could beat the second).
"""

from __future__ import annotations

from collections.abc import Mapping

from specdec.policy.adaptive import REACH_DEPTH, reach_thresholds
from specdec.policy.base import Decision, Policy, ReachRule, StepContext
from specdec.policy.estimates import expected_emitted_all, posterior_by_tenth, reach_weighted_mean
from specdec.simulate.costs import CostModel
from specdec.simulate.processes import AcceptanceProcess, SimRequest, confidence_tenths


class OraclePolicy(Policy):
    name = "oracle"

    def __init__(self, max_tau: int = 16, confidence: bool = False) -> None:
        self.max_tau, self.confidence = max_tau, confidence
        if confidence:
            self.name = "oracle+confidence"
            self._tenths = confidence_tenths(True), confidence_tenths(False)
        self.view: tuple[AcceptanceProcess, Mapping[str, SimRequest], CostModel] | None = None

    def see(self, process: AcceptanceProcess, requests: Mapping[str, SimRequest], cost: CostModel) -> None:
        """The runner shows the oracle the truth before a run: the process, each request by its id, the costs
        (each step's context then says which request and where in it: ``request_id``, ``new_tokens``)."""
        self.view = (process, requests, cost)

    def next_tau(self, ctx: StepContext) -> Decision:
        assert self.view is not None, "the oracle runs only inside the simulator"
        process, requests, cost = self.view
        req, start = requests[ctx.request_id], ctx.new_tokens
        k = min(self.max_tau, ctx.max_tau)
        rates = [process.rate(req, start, i) for i in range(1, k + 1)]
        emitted = expected_emitted_all(rates)
        times = [t * cost.draft_per_token_s + cost.verify(t + 1) + cost.other_s for t in range(k + 1)]
        tau = max(range(k + 1), key=lambda t: emitted[t] / times[t])
        if not (self.confidence and tau):
            return Decision(tau, f"oracle tau={tau}")
        # adaptive's stop rule (see AdaptivePolicy._decide) with the true rates and likelihoods
        prior = min(max(reach_weighted_mean(rates[:tau]), 1e-6), 1 - 1e-6)
        cap = min(k, tau + REACH_DEPTH)
        table = posterior_by_tenth(prior, *self._tenths)
        thresholds = reach_thresholds(times, rates, times[tau] / emitted[tau], cap)
        return Decision(cap, f"oracle tau={tau}, up to {cap}", ReachRule(table, thresholds))
