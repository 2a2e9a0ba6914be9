"""A simulator-only yardstick: the τ that maximises goodput under the *true* acceptance rates and costs.

No real policy can see these; the oracle's speedup bounds what any τ-choosing policy that does not
read draft confidence could reach on a workload, so goals can be judged against the ceiling.
"""

from __future__ import annotations

from specdec.policy.base import Decision, Policy, StepContext
from specdec.policy.estimates import expected_emitted_all
from specdec.simulate.costs import CostModel
from specdec.simulate.processes import AcceptanceProcess, SimRequest


class OraclePolicy(Policy):
    name = "oracle"

    def __init__(self, max_tau: int = 16) -> None:
        self.max_tau = max_tau
        self.view: tuple[AcceptanceProcess, SimRequest, int, CostModel] | None = None

    def see(self, process: AcceptanceProcess, req: SimRequest, start: int, cost: CostModel) -> None:
        """The runner shows the oracle the truth before each step."""
        self.view = (process, req, start, cost)

    def next_tau(self, ctx: StepContext) -> Decision:
        assert self.view is not None, "the oracle runs only inside the simulator"
        process, req, start, cost = self.view
        k = min(self.max_tau, ctx.max_tau)
        emitted = expected_emitted_all([process.rate(req, start, i) for i in range(1, k + 1)])
        times = [t * cost.draft_per_token_s + cost.verify(t + 1) + cost.other_s for t in range(k + 1)]
        tau = max(range(k + 1), key=lambda t: emitted[t] / times[t])
        return Decision(tau, f"oracle tau={tau}")
