"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the context's last n-gram.

No model: q is one-hot on the proposed token, so the acceptance rule reduces to r <= p(ŷ)
and the recovered token is drawn from p with ŷ removed: still exactly lossless.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.drafters.base import Draft, DraftAsk, Drafter, one_hot


def lookup(context: list[int], tau: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to ``tau`` tokens following the most recent earlier match of the longest suffix n-gram."""
    n_ctx = len(context)
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        suffix = context[n_ctx - n :]
        # Scan right to left: the most recent occurrence tends to predict best.
        for start in range(n_ctx - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                follow = context[start + n : start + n + tau]
                if follow:
                    return follow
    return []


class PromptLookupDrafter(Drafter):
    name = "prompt_lookup"

    def __init__(self, vocab_size: int, device: torch.device, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def new_state(self) -> None:
        return None

    def fork(self, state: None, prompt: list[int]) -> None:
        return None  # stateless: the context is all it reads

    def propose(self, asks: Sequence[DraftAsk]) -> list[Draft]:
        drafts = []
        for ask in asks:
            found = lookup(ask.context, ask.tau, self.max_ngram, self.min_ngram) if ask.tau > 0 else []
            probs = None if ask.params.greedy or not found else one_hot(found, self.vocab_size, self.device)
            drafts.append(Draft(found, probs, [1.0] * len(found), [1.0] * len(found)))
        return drafts
