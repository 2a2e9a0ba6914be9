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
    ) -> Draft:
        """Up to ``tau`` tokens continuing ``context`` (the whole verified sequence so far).

        ``context`` only ever grows by verified tokens between calls, so a stateful
        drafter rolls itself back to the longest prefix it shares with ``context``.
        With ``min_confidence``, drafting stops before a token whose top draft
        probability falls below it.
        """


def one_hot(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[τ]`` -> ``[τ, V]``: the q of a deterministic drafter."""
    out = torch.zeros(tokens.shape[0], vocab_size, device=tokens.device)
    return out.scatter_(1, tokens[:, None], 1.0)
