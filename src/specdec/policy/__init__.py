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
    """A policy by name or by spec, ``name:key=value,key=value`` (e.g. ``adaptive:max_tau=8``); keyword
    arguments add to (and override) the spec's settings."""
    base, settings = parse_policy_spec(name)
    try:
        factory = POLICIES[base]
    except KeyError:
        raise InvalidRequestError(
            f"unknown policy {base!r}; choose one of: {', '.join(sorted(POLICIES))}", "policy"
        ) from None
    try:
        return factory(**{**settings, **kwargs})
    except TypeError as e:
        raise InvalidRequestError(f"bad options for policy {base!r}: {e}", "policy") from None


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``name`` or ``name:key=value,...`` -> (name, settings); values read as bool, None, int, float or text."""
    name, _, args = spec.partition(":")
    settings: dict[str, Any] = {}
    for item in filter(None, args.split(",")):
        key, eq, val = item.partition("=")
        if not eq or not key.strip():
            raise InvalidRequestError(f"bad policy option {item!r} in {spec!r}: write key=value", "policy")
        settings[key.strip().replace("-", "_")] = _value(val.strip())
    return name.strip(), settings


def split_policy_specs(text: str) -> list[str]:
    """A comma-separated list of specs, where a spec's own ``key=value`` settings also use commas:
    ``adaptive:max_tau=8,margin=0.05,heuristic`` -> ``["adaptive:max_tau=8,margin=0.05", "heuristic"]``."""
    specs: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if specs and ":" in specs[-1] and "=" in part and ":" not in part:
            specs[-1] += "," + part
        else:
            specs.append(part)
    return specs


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


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
    "parse_policy_spec",
    "split_policy_specs",
]
