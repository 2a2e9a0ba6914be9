from __future__ import annotations

from specdec.errors import InvalidRequestError
from specdec.policy.base import Decision, Policy, StepContext

DEFAULT_TAU = 4  # the fixed policy's τ when none is given (CLI, Python API and HTTP alike)


class FixedPolicy(Policy):
    """Always draft τ tokens (τ = 0: plain target decoding)."""

    name = "fixed"

    def __init__(self, tau: int = DEFAULT_TAU) -> None:
        if not isinstance(tau, int) or tau < 0:
            raise InvalidRequestError(f"tau must be an integer >= 0, got {tau}", "tau")
        self.tau = tau
        self.drafts = tau > 0

    def next_tau(self, ctx: StepContext) -> Decision:
        return Decision(self.tau, f"fixed tau={self.tau}")
