"""Drafting behind one small interface: per-request state, then ``propose`` each step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.sampling import SamplingParams


@dataclass
class Draft:
    tokens: torch.Tensor  # [τ'] int64, τ' <= the τ asked for (a drafter may propose fewer)
    # [τ', V] the draft distribution q each token was drawn from; None from a greedy draft model, whose
    # distributions greedy verification never reads (computing them costs a softmax over the vocabulary).
    probs: torch.Tensor | None
    confidence: list[float] = field(default_factory=list)  # the draft's top probability at each position


@dataclass(frozen=True)
class ReachRule:
    """Stop drafting once the chance that every token drafted so far will be accepted falls too low.

    Each drafted token's chance of acceptance is read from the draft's probability p of that token (the
    top probability when drafting greedily, q(ŷ) when sampling; what step records carry), by tenths:
    ``accept_by_tenth[min(int(10 p), 9)]`` (a calibrated table the policy supplies). Their running
    product is the chance that the block so far survives verification. After the j-th token the drafter
    goes on only while that chance is at least ``min_reach[j - 1]`` (the last entry serves deeper
    positions): the token that takes it below is still kept (its forward has run, and verifying it
    costs one slot), but the next draft forward is not run. Unlike a per-token confidence cut, every
    drafted token gets verified, so the policy's statistics see no hidden outcomes.
    """

    accept_by_tenth: tuple[float, ...]
    min_reach: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.accept_by_tenth) != 10:
            raise ValueError(f"accept_by_tenth needs 10 entries, got {len(self.accept_by_tenth)}")
        if not self.min_reach:
            raise ValueError("min_reach needs at least one threshold")

    def reach(self, before: float, confidence: float) -> float:
        return before * self.accept_by_tenth[min(max(int(confidence * 10), 0), 9)]

    def go_on(self, reach: float, drafted: int) -> bool:
        """Whether to draft another token after ``drafted`` tokens whose joint chance is ``reach``."""
        return reach >= self.min_reach[min(drafted, len(self.min_reach)) - 1]


class Drafter(ABC):
    name: str

    @abstractmethod
    def new_state(self) -> Any:
        """Per-request state (e.g. the draft model's KV cache)."""

    @abstractmethod
    def propose(
        self,
        state: Any,
        context: list[int],
        tau: int,
        params: SamplingParams,
        generator: torch.Generator,
        min_confidence: float | None = None,
        reach_rule: ReachRule | None = None,
    ) -> Draft:
        """Up to ``tau`` tokens continuing ``context`` (the whole verified sequence so far).

        ``context`` only ever grows by verified tokens between calls, so a stateful
        drafter rolls itself back to the longest prefix it shares with ``context``.
        With ``min_confidence``, drafting stops before a token whose top draft
        probability falls below it; with ``reach_rule``, drafting stops after the
        token where the rule's chance that the whole draft survives falls too low.
        Drafters without a confidence signal may ignore both.
        """


def one_hot(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[τ]`` -> ``[τ, V]``: the q of a deterministic drafter."""
    out = torch.zeros(tokens.shape[0], vocab_size, device=tokens.device)
    return out.scatter_(1, tokens[:, None], 1.0)
