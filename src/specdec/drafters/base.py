"""Drafting behind one small interface: per-request state, then ``propose`` for every sequence of a step.

``propose`` takes the asks of all sequences sharing a step and drafts them in lockstep: one draft
forward per draft position over every sequence still drafting (``lockstep``, the one drafting loop).
A drafter keeps its state by position, like the caches: after verification the engine tells it how
many tokens of the context stand (``rollback``), and the next ``propose`` feeds what came after.
The interface imports no torch: the simulator's drafter (``specdec.simulate.pair``) is one too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from specdec.drafters.loop import Draft, DraftAsk, Pick, lockstep

if TYPE_CHECKING:
    import torch

__all__ = ["Draft", "DraftAsk", "Drafter", "Pick", "lockstep", "one_hot"]


class Drafter(ABC):
    name: str
    vocab_size: int
    # Whether ``propose`` takes in whatever of the context the state has not seen (a draft model's catch-up): then a
    # request whose prefill is deferred into its first step skips ``prefill``, and its first draft forward takes
    # the prompt in.
    catches_up: bool = False

    @abstractmethod
    def new_state(self) -> Any:
        """Per-request state (e.g. the draft model's KV cache)."""

    def prefill(self, state: Any, prompt: list[int]) -> None:  # noqa: B027 - optional hook
        """Take in a new request's prompt before its first step (as the target's prefill does)."""

    def fork(self, state: Any, prompt: list[int]) -> Any:
        """A new state equal to ``state`` right after ``prefill(state, prompt)``, independent of it from then on
        (the n samples of one prompt). This default prefills again; drafters with state copy it instead."""
        new = self.new_state()
        self.prefill(new, prompt)
        return new

    def take_in(self, items: Sequence[tuple[Any, list[int], int, int]]) -> None:  # noqa: B027 - optional hook
        """Prompt pieces of sequences whose deferred prompt the steps take in: each ``(state, context, start, n)``
        puts ``context[:start + n]`` in the state (what it lacks of it), all in one pass where the drafter has
        one. Drafters that do not catch up (``catches_up`` false) were prefilled at start and ignore it."""

    def rollback(self, state: Any, length: int) -> None:  # noqa: B027 - optional hook
        """Only the first ``length`` tokens of what the drafter has seen stand (the rest were rejected)."""

    def keep(self, state: Any, tokens: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """Keep what the state holds of ``tokens`` (a prompt) in the drafter's prefix cache now, for requests arriving
        while this one runs (a draft model's; ``release`` keeps the whole context at the end)."""

    def release(self, state: Any, tokens: Sequence[int] = ()) -> None:  # noqa: B027 - optional hook
        """The request is over: free (or hand back) its state. ``tokens``: the request's context, of which the state
        holds a prefix (a draft model's prefix cache keeps it)."""

    @abstractmethod
    def propose(self, asks: Sequence[DraftAsk]) -> list[Draft]:
        """Up to ``ask.tau`` tokens continuing each ``ask.context``, for all asks at once."""


def one_hot(tokens: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[τ]`` -> ``[τ, V]``: the q of a deterministic drafter."""
    import torch  # here, not at the top: the interface loads without torch (the simulator's drafter)

    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    return torch.zeros(len(tokens), vocab_size, device=device).scatter_(1, ids[:, None], 1.0)
