"""transformers' ``num_assistant_tokens_schedule="heuristic"`` as a baseline.

transformers 4.x started at ``num_assistant_tokens=5`` (its default while "heuristic" was the default
schedule; 5.x defaults to 20 with a constant schedule and a confidence threshold, see ``confidence``):
after a step whose whole draft was accepted the count grows by 2, otherwise it shrinks by 1, never
below 1. Like transformers' "heuristic" (not "heuristic_transient") the count persists across
requests; ``transient=True`` restarts it per request.
"""

from __future__ import annotations

from specdec.errors import InvalidRequestError
from specdec.policy.base import Decision, Policy, StepContext
from specdec.records import GenerationStats, StepRecord


class HeuristicPolicy(Policy):
    name = "heuristic"

    def __init__(self, start: int = 5, transient: bool = False, max_tau: int | None = None) -> None:
        if not isinstance(start, int) or start < 1:
            raise InvalidRequestError(f"heuristic start must be an integer >= 1, got {start}", "start")
        if max_tau is not None and (not isinstance(max_tau, int) or max_tau < 1):
            raise InvalidRequestError(f"max_tau must be an integer >= 1, got {max_tau}", "max_tau")
        self.start, self.transient, self.max_tau = start, transient, max_tau
        self.shared = start  # the persistent count ("heuristic")
        self._per_request: dict[str, int] = {}  # counts of "heuristic_transient" requests

    def _count(self, request_id: str) -> int:
        return self._per_request.get(request_id, self.start) if self.transient else self.shared

    def begin(self, ctx: StepContext) -> None:
        if self.transient:
            self._per_request[ctx.request_id] = self.start

    def next_tau(self, ctx: StepContext) -> Decision:
        n = self._count(ctx.request_id)
        return Decision(n, f"heuristic count {n}")

    def observe(self, record: StepRecord) -> None:
        if record.tau == 0:
            return
        n = self._count(record.request_id)
        n = n + 2 if record.n_accepted == record.tau else max(1, n - 1)
        if self.max_tau is not None:
            n = min(n, self.max_tau)
        if self.transient:
            self._per_request[record.request_id] = n
        else:
            self.shared = n

    def end(self, request_id: str, stats: GenerationStats) -> None:
        self._per_request.pop(request_id, None)
