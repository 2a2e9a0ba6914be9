"""A request's sampling settings and its tokens' log probabilities, as plain data (no torch).

``specdec.sampling`` re-exports both with the functions that apply them to logits; they live here so that the
engine's step (``specdec.engine``) imports without torch: the simulator runs it with a simulated target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k}", "top_k")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def temperature_only(self) -> bool:
        """Sampled with a temperature alone (no top-k, top-p or min-p): its distribution is softmax(logits / T)."""
        return not self.greedy and self.top_k == 0 and self.top_p >= 1.0 and self.min_p == 0.0

    @property
    def shaping(self) -> tuple[float, int, float, float]:
        """What shapes the distribution sampled from (all but the seed): rows of requests alike in it are processed
        together (``logits_to_probs`` treats each row alone)."""
        return (self.temperature, self.top_k, self.top_p, self.min_p)

    def generator(self, device: torch.device) -> torch.Generator:
        """One generator per request: same seed, same output."""
        import torch

        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log probability under the target's processed distribution, and the ``top`` most
    likely tokens of that distribution as (token id, log probability), most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]

    def to_json(self) -> dict[str, object]:
        return {"token": self.token, "logprob": self.logprob, "top": [list(t) for t in self.top]}
