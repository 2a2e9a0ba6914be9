"""Draft up to a fixed τ, stopping early when the draft's top probability falls below a threshold.

The baseline of transformers 5.x assisted generation (``assistant_confidence_threshold=0.4``), here
with a fixed threshold; the drafting loop applies it (a ``MinConfidence`` rule) token by token.
"""

from __future__ import annotations

from specdec.errors import InvalidRequestError
from specdec.policy.base import Decision, MinConfidence, Policy, StepContext


class ConfidencePolicy(Policy):
    name = "confidence"

    def __init__(self, tau: int = 8, threshold: float = 0.4) -> None:
        if not isinstance(tau, int) or tau < 1:
            raise InvalidRequestError(f"tau must be an integer >= 1, got {tau}", "tau")
        if not 0.0 <= threshold < 1.0:
            raise InvalidRequestError(f"confidence threshold must be in [0, 1), got {threshold}", "threshold")
        self.tau, self.threshold = tau, threshold

    def next_tau(self, ctx: StepContext) -> Decision:
        return Decision(
            self.tau, f"up to {self.tau}, stop below confidence {self.threshold:g}", MinConfidence(self.threshold)
        )
