"""A policy chooses τ each step from what it has observed; it never sees models, only records and costs.

What a policy decides and what the engine decides are kept apart: the policy says how many tokens it
wants drafted (``Decision.tau``) and, optionally, a ``DraftRule`` that the drafting loop asks after each
drafted token whether to go on. The engine alone clamps τ (no drafter, room left in the context and in
``max_new_tokens``) and enforces the verification budget; a policy may only hand the engine a smaller
allowance (``allowance``, e.g. a fleet-wide budget).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

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
    max_verify_passes: int | None  # the request's cap (its own, or the policy's allowance if smaller)
    max_tau: int  # the most the engine will draft (room left in the context window and in max_new_tokens)
    elapsed: float  # seconds since the request started
    batch_size: int = 1  # sequences sharing this step's passes
    # Target passes a plain step would chain for this request (``Engine.chain_plain``, cut to its remaining tokens,
    # context and budget; 1: none): in a step where no sequence drafts, each plain one makes this many tokens.
    chain: int = 1


@dataclass(frozen=True)
class MeasuredCosts:
    """Measured batch costs a policy starts from (``specdec tune --save-costs``, or measured as a server starts):
    seconds of a target pass by its rows, of a lockstep draft forward by the sequences drafting (the mean over a
    draft's forwards) and, by the sequences drafting, a draft's first forward and each further one (the first runs
    with the draft's weights cold behind the target's pass, and takes in the tokens the last step accepted)."""

    passes: Mapping[int, float] = field(default_factory=dict)
    draft_forwards: Mapping[int, float] = field(default_factory=dict)
    draft_lines: Mapping[int, tuple[float, float]] = field(default_factory=dict)
    # The target's ``row_granule``: a pass of more rows than one group of this many pays for the second about whole
    # (the CPU kernel's AMX build: 16); 0: its cost grows smoothly with the rows.
    row_granule: int = 0

    def __bool__(self) -> bool:
        return bool(self.passes or self.draft_forwards or self.draft_lines)


class DraftRule:
    """Asked by the drafting loop after each drafted token: keep it, and draft another?

    ``probs`` are the draft's probabilities of the tokens drafted so far (q(ŷ), the last one just drawn),
    ``tops`` its top probabilities there (its confidence; the same as ``probs`` for a greedy draft).
    """

    def keep(self, probs: Sequence[float], tops: Sequence[float]) -> bool:
        """Whether to keep the token just drawn (False drops it and ends the draft)."""
        return True

    def go_on(self, probs: Sequence[float], tops: Sequence[float]) -> bool:
        """After keeping the tokens so far, whether to draft one more."""
        return True

    def as_numbers(self) -> RuleNumbers | None:
        """The rule as numbers, for a drafter that runs the drafting loop outside Python (the CPU kernel's greedy
        draft) and evaluates it there exactly as ``keep``/``go_on`` do; None when it cannot be said so (such a
        drafter then drafts to τ and the loop cuts the draft where the rule says, at the cost of forwards)."""
        return RuleNumbers() if type(self) is DraftRule else None


@dataclass(frozen=True)
class RuleNumbers:
    """A drafting rule in numbers: ``ReachRule``'s table and thresholds (``reach_table`` None: no reach rule) and
    ``MinConfidence``'s threshold (``min_top`` 0: none)."""

    reach_table: tuple[float, ...] | None = None
    min_reach: tuple[float, ...] = ()
    min_top: float = 0.0


@dataclass(frozen=True)
class MinConfidence(DraftRule):
    """Drop the token (and stop) once the draft's top probability falls below ``threshold``."""

    threshold: float

    def keep(self, probs: Sequence[float], tops: Sequence[float]) -> bool:
        return tops[-1] >= self.threshold

    def as_numbers(self) -> RuleNumbers | None:
        return RuleNumbers(min_top=self.threshold) if type(self) is MinConfidence else None


@dataclass(frozen=True)
class ReachRule(DraftRule):
    """Stop drafting once the chance that every token drafted so far will be accepted falls too low.

    Each drafted token's chance of acceptance is read from the draft's probability p of that token (q(ŷ):
    the top probability when drafting greedily), by tenths: ``accept_by_tenth[min(int(10 p), 9)]`` (a
    calibrated table the policy supplies). Their running product is the chance that the block so far
    survives verification. After the j-th token the drafter goes on only while that chance is at least
    ``min_reach[j - 1]`` (the last entry serves deeper positions): the token that takes it below is still
    kept (its forward has run, and verifying it costs one slot), but the next draft forward is not run.
    Unlike a per-token confidence cut, every drafted token gets verified, so the policy's statistics see
    no hidden outcomes.
    """

    accept_by_tenth: tuple[float, ...]
    min_reach: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.accept_by_tenth) != 10:
            raise ValueError(f"accept_by_tenth needs 10 entries, got {len(self.accept_by_tenth)}")
        if not self.min_reach:
            raise ValueError("min_reach needs at least one threshold")

    def reach(self, before: float, prob: float) -> float:
        return before * self.accept_by_tenth[min(max(int(prob * 10), 0), 9)]

    def go_on(self, probs: Sequence[float], tops: Sequence[float]) -> bool:
        reach = 1.0
        for p in probs:
            reach = self.reach(reach, p)
        return reach >= self.min_reach[min(len(probs), len(self.min_reach)) - 1]

    def as_numbers(self) -> RuleNumbers | None:
        if type(self) is not ReachRule:
            return None
        return RuleNumbers(reach_table=tuple(self.accept_by_tenth), min_reach=tuple(self.min_reach))


@dataclass(frozen=True)
class Decision:
    tau: int  # tokens the policy wants drafted (the engine clamps it)
    reason: str
    rule: DraftRule | None = None  # asked by the drafting loop after each token


class Policy(ABC):
    name: str
    batch_aware: bool = False  # plans τ for a whole batch (``plan``) rather than one sequence at a time
    # False where the policy never drafts (the fixed policy at τ = 0): its requests' prompts are not taken into a
    # draft model that would never read them
    drafts: bool = True

    @abstractmethod
    def next_tau(self, ctx: StepContext) -> Decision: ...

    def plan(self, ctxs: Sequence[StepContext], other_rows: int = 0, prompt_rows: int = 0) -> list[Decision]:
        """Decisions for sequences sharing one step; ``other_rows``: target rows the step's other
        sequences (other policies) already put in the pass; ``prompt_rows``: rows of prompts joining in the same
        pass (deferred prefills, whatever the decisions). By default each sequence on its own."""
        return [self.next_tau(ctx) for ctx in ctxs]

    def allowance(self, request_id: str) -> int | None:
        """Verification passes this request may use at most, if the policy limits it (after ``begin``)."""
        return None

    def observe(self, record: StepRecord) -> None:  # noqa: B027 - optional hook
        """A step's record (by default ``observe_step`` hands each of a step's records here in turn)."""

    def observe_step(self, records: Sequence[StepRecord]) -> None:
        """Called once after every step with the records of this policy's sequences in it (one per sequence; they
        share the step's pass, rows and times). A policy that learns from a step as a whole overrides this."""
        for record in records:
            self.observe(record)

    def prime(self, costs: MeasuredCosts) -> None:  # noqa: B027
        """Measured costs to start from (``specdec tune --save-costs``, or measured as a server starts). Learning
        from steps goes on from there."""

    def begin(self, ctx: StepContext) -> None:  # noqa: B027 - optional hook
        """Called once when a request starts (before its first step)."""

    def end(self, request_id: str, stats: GenerationStats) -> None:  # noqa: B027 - optional hook
        """Called once when a request finishes."""
