"""Policies by name. Other modules add theirs to ``POLICIES``; ``make_policy`` builds one."""

from __future__ import annotations

from typing import Any, Callable

from specdec.errors import InvalidRequestError
from specdec.policy.base import Decision, Policy, StepContext
from specdec.policy.fixed import FixedPolicy

POLICIES: dict[str, Callable[..., Policy]] = {"fixed": FixedPolicy}


def make_policy(name: str, **kwargs: Any) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise InvalidRequestError(
            f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}", "policy"
        ) from None
    return factory(**kwargs)


__all__ = ["POLICIES", "Decision", "FixedPolicy", "Policy", "StepContext", "make_policy"]
