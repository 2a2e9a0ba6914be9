from __future__ import annotations

from specdec.errors import InvalidRequestError
from specdec.policy.base import Decision, Policy, StepContext


class FixedPolicy(Policy):
    """Always draft τ tokens (τ = 0: plain target decoding)."""

    name = "fixed"

    def __init__(self, tau: int = 4) -> None:
        if not isinstance(tau, int) or tau < 0:
            raise InvalidRequestError(f"tau must be an integer >= 0, got {tau}", "tau")
        self.tau = tau

    def next_tau(self, ctx: StepContext) -> Decision:
        if not ctx.can_draft or self.tau == 0:
            return Decision(0, "fixed tau=0" if ctx.can_draft else "no drafter")
        tau = min(self.tau, ctx.max_tau)
        return Decision(tau, f"fixed tau={self.tau}" + (f", clamped to {tau}" if tau < self.tau else ""))
