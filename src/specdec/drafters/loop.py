"""The one drafting loop (``lockstep``) and what it trades in, without torch: the engine's drafters and the
simulator's synthetic drafts run the same loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from specdec.policy.base import DraftRule

if TYPE_CHECKING:
    import torch


class Settings(Protocol):
    @property
    def greedy(self) -> bool: ...


@dataclass
class DraftAsk:
    """One sequence's request for a draft."""

    state: Any  # the drafter's per-sequence state (``new_state``)
    context: list[int]  # the whole verified sequence so far
    tau: int  # the most tokens to draft (the engine's clamp of the policy's τ)
    params: Settings  # the request's sampling settings (``SamplingParams``)
    generator: Any  # the request's ``torch.Generator`` (the simulator draws from its own stream)
    rule: DraftRule | None = None  # asked after each token: keep it, go on?
    # The request's logit rules (``logits_rules.RulesState``; None when none is active): a drafter that has
    # logits applies them at each position with its own context, context + the tokens drafted before it.
    logit_rules: Any = None


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)  # ŷ1..ŷτ', τ' <= the τ asked for
    # [τ', V] the distribution q each token was drawn from, for sampled requests; None for greedy ones
    # (greedy verification never reads q, and a softmax over the vocabulary per token costs time).
    probs: torch.Tensor | None = None
    token_probs: list[float] = field(default_factory=list)  # q(ŷ_t): the draft's probability of its token
    tops: list[float] = field(default_factory=list)  # the draft's top probability at each position
    # Tokens of the context the drafter took in before its first token (a draft model's catch-up rows): 1-2 for a
    # sequence that drafted its previous step, one more per plain step since. 0 for drafters without a model.
    fed: int = 0


class Pick(NamedTuple):
    """One drafted token of one sequence: what the draft's distribution said about it. (A tuple: a step of 16
    sequences drafting 3 deep makes 48 of them, read once each.)"""

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
    dists: list[list[Any]] = [[] for _ in asks]
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
        if qs and not ask.params.greedy:
            import torch

            d.probs = torch.stack(qs)
    return drafts
