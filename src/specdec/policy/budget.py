"""Fleet-average verification budget: at most B target passes per request on average, over every
window of W consecutive requests, with short requests lending what they leave unused to long ones.

The ledger gives each request an *allowance* when it begins (in begin order, request j):

    allowance_j = min(⌊share·B⌋, ⌊B·W - Σ_{i=j-W+1..j-1} u_i⌋)

where u_i is request i's passes once it has finished, or its whole allowance while it is still in
flight (a reservation: it may still use them). Missing history counts as B per request. Each
request then uses at most its allowance, so every window of W requests sums to ≤ B·W; and since
the window ending at j-1 already held, allowance_j ≥ u_{j-W} ≥ 1 whenever requests use a pass.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from specdec.errors import InvalidRequestError
from specdec.policy.base import Decision, MeasuredCosts, Policy, StepContext
from specdec.records import GenerationStats, StepRecord


@dataclass
class _Entry:
    allowance: int
    used: int | None = None  # None while in flight

    @property
    def committed(self) -> int:
        return self.allowance if self.used is None else self.used


class FleetBudget:
    """The ledger. Pure accounting: it never sees a model or a record."""

    def __init__(self, budget: float, window: int = 64, max_share: float = 4.0) -> None:
        if not budget >= 1:
            raise InvalidRequestError(
                f"fleet budget must be >= 1 target pass per request, got {budget}", "fleet_budget"
            )
        if not isinstance(window, int) or window < 1:
            raise InvalidRequestError(f"budget window must be a positive integer, got {window}", "budget_window")
        if not max_share >= 1:
            raise InvalidRequestError(f"max_share must be >= 1, got {max_share}", "max_share")
        self.budget, self.window, self.max_share = float(budget), window, float(max_share)
        self._recent: deque[_Entry] = deque(maxlen=max(window - 1, 0))
        self._open: OrderedDict[str, _Entry] = OrderedDict()

    def open(self, request_id: str) -> int:
        prev = sum(e.committed for e in self._recent) + self.budget * (self.window - 1 - len(self._recent))
        room = math.floor(self.budget * self.window - prev + 1e-9)
        entry = _Entry(allowance=max(0, min(math.floor(self.max_share * self.budget + 1e-9), room)))
        if self._recent.maxlen:
            self._recent.append(entry)
        self._open[request_id] = entry
        return entry.allowance

    def allowance(self, request_id: str) -> int | None:
        entry = self._open.get(request_id)
        return entry.allowance if entry else None

    def close(self, request_id: str, used: int) -> None:
        entry = self._open.pop(request_id, None)
        if entry is not None:
            entry.used = min(used, entry.allowance)


class FleetBudgetPolicy(Policy):
    """Runs any policy under a fleet-average budget: each request's allowance goes to the engine, which
    stops the request there (the engine alone enforces caps), and the inner policy sees it as the
    request's ``max_verify_passes`` (so budget-aware policies raise τ)."""

    def __init__(self, inner: Policy, budget: float = 2.0, window: int = 64, max_share: float = 4.0) -> None:
        self.inner = inner
        self.name = inner.name
        self.batch_aware = inner.batch_aware
        self.ledger = FleetBudget(budget, window, max_share)

    def begin(self, ctx: StepContext) -> None:
        allowance = self.ledger.open(ctx.request_id)
        cap = allowance if ctx.max_verify_passes is None else min(allowance, ctx.max_verify_passes)
        self.inner.begin(replace(ctx, max_verify_passes=cap))

    def allowance(self, request_id: str) -> int | None:
        return self.ledger.allowance(request_id)

    def next_tau(self, ctx: StepContext) -> Decision:
        return self.inner.next_tau(ctx)

    def plan(self, ctxs: Sequence[StepContext], other_rows: int = 0, prompt_rows: int = 0) -> list[Decision]:
        return self.inner.plan(ctxs, other_rows, prompt_rows)

    def prime(self, costs: MeasuredCosts) -> None:
        self.inner.prime(costs)

    def observe(self, record: StepRecord) -> None:
        self.inner.observe(record)

    def observe_step(self, records: Sequence[StepRecord]) -> None:
        self.inner.observe_step(records)

    def end(self, request_id: str, stats: GenerationStats) -> None:
        self.ledger.close(request_id, stats.target_passes)
        self.inner.end(request_id, stats)
