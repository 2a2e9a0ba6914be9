"""Drafting behind one small interface: per-request state, then ``propose`` for every sequence of a step.

``propose`` takes the asks of all sequences sharing a step and drafts them in lockstep: one draft
forward per draft position over every sequence still drafting (``lockstep``, the one drafting loop).
A drafter keeps its state by position, like the caches: after verification the engine tells it how
many tokens of the context stand (``rollback``), and the next ``propose`` feeds what came after.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.policy.base import DraftRule
from specdec.sampling import SamplingParams


@dataclass
class DraftAsk:
    """One sequence's request for a draft."""

    state: Any  # the drafter's per-sequence state (``new_state``)
    context: list[int]  # the whole verified sequence so far
    tau: int  # the most tokens to draft (the engine's clamp of the policy's τ)
    params: SamplingParams
    generator: torch.Generator
    rule: DraftRule | None = None  # asked after each token: keep it, go on?


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)  # ŷ1..ŷτ', τ' <= the τ asked for
    # [τ', V] the distribution q each token was drawn from, for sampled requests; None for greedy ones
    # (greedy verification never reads q, and a softmax over the vocabulary per token costs time).
    probs: torch.Tensor | None = None
    token_probs: list[float] = field(default_factory=list)  # q(ŷ_t): the draft's probability of its token
    tops: list[float] = field(default_factory=list)  # the draft's top probability at each position


@dataclass
class Pick:
    """One drafted token of one sequence: what the draft's distribution said about it."""

    token: int
    prob: float  # q(ŷ): the probability of the token drawn (greedy: the top probability)
    top: float  # the top probability (the draft's confidence)
    dist: torch.Tensor | None = None  # q over the vocabulary (sampled drafts only)


def lockstep(
    asks: Sequence[DraftAsk],
    first: Callable[[list[int]], list[Pick]],
    feed: Callable[[list[int], list[int]], list[Pick]],
) -> list[Draft]:
    """The drafting loop, for every sequence of a step at once.

    ``first(rows)`` gives the first token of each listed sequence (catching up on its context);
    ``feed(rows, tokens)`` feeds each listed sequence its last drafted token and gives the next. Each
    depth is one call over the sequences still drafting; a sequence stops at its τ, when its rule drops
    a token, or when its rule says not to go on (the forward for a token never drafted is not run).
    """
    drafts = [Draft() for _ in asks]
    active = [i for i, a in enumerate(asks) if a.tau > 0]
    dists: list[list[torch.Tensor]] = [[] for _ in asks]
    picks = first(active) if active else []
    while active:
        going: list[int] = []
        for i, pick in zip(active, picks):
            d, rule = drafts[i], asks[i].rule
            if rule is not None and not rule.keep([*d.token_probs, pick.prob], [*d.tops, pick.top]):
                continue
            d.tokens.append(pick.token)
            d.token_probs.append(pick.prob)
            d.tops.append(pick.top)
            if pick.dist is not None:
                dists[i].append(pick.dist)
            if len(d.tokens) < asks[i].tau and (rule is None or rule.go_on(d.token_probs, d.tops)):
                going.append(i)
        active = going
        if active:
            picks = feed(active, [drafts[i].tokens[-1] for i in active])
    for d, qs, ask in zip(drafts, dists, asks):
        if not ask.params.greedy:
            d.probs = torch.stack(qs) if qs else None
    return drafts


class Drafter(ABC):
    name: str
    vocab_size: int

    @abstractmethod
    def new_state(self) -> Any:
        """Per-request state (e.g. the draft model's KV cache)."""

    def prefill(self, state: Any, prompt: list[int]) -> None:  # noqa: B027 - optional hook
        """Take in a new request's prompt before its first step (as the target's prefill does)."""

    def rollback(self, state: Any, length: int) -> None:  # noqa: B027 - optional hook
        """Only the first ``length`` tokens of what the drafter has seen stand (the rest were rejected)."""

    def release(self, state: Any) -> None:  # noqa: B027 - optional hook
        """The request is over: free (or hand back) its state."""

    @abstractmethod
    def propose(self, asks: Sequence[DraftAsk]) -> list[Draft]:
        """Up to ``ask.tau`` tokens continuing each ``ask.context``, for all asks at once."""


def one_hot(tokens: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[τ]`` -> ``[τ, V]``: the q of a deterministic drafter."""
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    return torch.zeros(len(tokens), vocab_size, device=device).scatter_(1, ids[:, None], 1.0)
