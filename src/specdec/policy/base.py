"""A policy chooses τ each step from what it has observed; it never sees models, only records and costs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from specdec.drafters.base import ReachRule
from specdec.records import GenerationStats, StepRecord


@dataclass(frozen=True)
class StepContext:
    """What the engine tells the policy before a step."""

    request_id: str
    step: int  # steps already taken in this request
    prompt_len: int
    context_len: int
    new_tokens: int  # emitted so far
    max_new_tokens: int
    verify_passes: int  # target passes used so far (prefill not counted)
    max_verify_passes: int | None  # hard cap for this request, if any
    max_tau: int  # the engine's clamp (room left in the context window and in max_new_tokens)
    elapsed: float  # seconds since the request started
    can_draft: bool  # False when the engine has no drafter


@dataclass(frozen=True)
class Decision:
    tau: int
    reason: str
    min_confidence: float | None = None  # ask the drafter to stop early below this top probability
    reach_rule: ReachRule | None = None  # ask the drafter to stop once the draft's survival chance falls too low
    stop: bool = False  # end the request now with finish reason "verify_budget" (budget policies)


class Policy(ABC):
    name: str

    @abstractmethod
    def next_tau(self, ctx: StepContext) -> Decision: ...

    def observe(self, record: StepRecord) -> None:  # noqa: B027 - optional hook
        """Called after every step with its record."""

    def begin(self, ctx: StepContext) -> None:  # noqa: B027 - optional hook
        """Called once when a request starts (before its first step)."""

    def end(self, request_id: str, stats: GenerationStats) -> None:  # noqa: B027 - optional hook
        """Called once when a request finishes."""
