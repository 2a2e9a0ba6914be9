"""Policies by name. Other modules add theirs to ``POLICIES``; ``make_policy`` builds one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specdec.errors import InvalidRequestError
from specdec.policy.adaptive import AdaptivePolicy, make_adaptive
from specdec.policy.base import Decision, DraftRule, MeasuredCosts, MinConfidence, Policy, ReachRule, StepContext
from specdec.policy.budget import FleetBudget, FleetBudgetPolicy
from specdec.policy.confidence import ConfidencePolicy
from specdec.policy.fixed import DEFAULT_TAU, FixedPolicy
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


def request_policy(policy: str | None, tau: int | None) -> str | None:
    """The one reading of a request's ``policy`` and ``tau`` (CLI, Python API and HTTP share it): ``tau=N``
    means the fixed policy ``fixed:tau=N``; with any other policy it is an error, never silently dropped.
    Returns the policy spec, or None for the engine's default."""
    if tau is None:
        return policy
    if not isinstance(tau, int) or isinstance(tau, bool) or tau < 0:
        raise InvalidRequestError(f"tau must be an integer >= 0, got {tau!r}", "tau")
    if policy is not None:
        name, settings = parse_policy_spec(policy)
        if name != "fixed":
            raise InvalidRequestError(
                f"tau={tau} sets the fixed policy; it cannot be combined with policy {policy!r} "
                f"(its own settings bound τ, e.g. {name}:max_tau={max(tau, 1)})",
                "tau",
            )
        if "tau" in settings and settings["tau"] != tau:
            raise InvalidRequestError(f"tau={tau} conflicts with policy {policy!r}", "tau")
    return f"fixed:tau={tau}"


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
    "DEFAULT_TAU",
    "POLICIES",
    "DraftRule",
    "MinConfidence",
    "ReachRule",
    "request_policy",
    "AdaptivePolicy",
    "ConfidencePolicy",
    "Decision",
    "FixedPolicy",
    "FleetBudget",
    "FleetBudgetPolicy",
    "MeasuredCosts",
    "HeuristicPolicy",
    "Policy",
    "StepContext",
    "make_policy",
    "parse_policy_spec",
    "split_policy_specs",
]
