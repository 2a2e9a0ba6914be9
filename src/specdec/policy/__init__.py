"""Policies by name. Other modules add theirs to ``POLICIES``; ``make_policy`` builds one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specdec.errors import InvalidRequestError
from specdec.policy.adaptive import AdaptivePolicy, make_adaptive
from specdec.policy.base import Decision, Policy, StepContext
from specdec.policy.budget import FleetBudget, FleetBudgetPolicy
from specdec.policy.confidence import ConfidencePolicy
from specdec.policy.fixed import FixedPolicy
from specdec.policy.heuristic import HeuristicPolicy

POLICIES: dict[str, Callable[..., Policy]] = {
    "fixed": FixedPolicy,
    "heuristic": HeuristicPolicy,
    "confidence": ConfidencePolicy,
    "adaptive": make_adaptive,  # AdaptivePolicy, wrapped in FleetBudgetPolicy when fleet_budget= is given
}


def make_policy(name: str, **kwargs: Any) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise InvalidRequestError(
            f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}", "policy"
        ) from None
    return factory(**kwargs)


__all__ = [
    "POLICIES",
    "AdaptivePolicy",
    "ConfidencePolicy",
    "Decision",
    "FixedPolicy",
    "FleetBudget",
    "FleetBudgetPolicy",
    "HeuristicPolicy",
    "Policy",
    "StepContext",
    "make_policy",
]
