"""Logits -> the distributions both models are judged by.

The same ``SamplingParams`` are applied to target and draft logits before the acceptance
rule (Leviathan et al. 2023 prove losslessness for whatever distribution the target
samples from, so the target's *processed* distribution is the one to reproduce).
Order as in ``transformers``: temperature, then top-k, then top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k}", "top_k")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device) -> torch.Generator:
        """One generator per request: same seed, same output."""
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits [k, V]`` -> float32 logits of the distribution sampled from: tempered, with -inf outside top-k
    and top-p. Greedy requests: the logits unchanged (temperature 1)."""
    logits = logits.float()
    if params.greedy:
        return logits
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p; the top token always stays.
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits [k, V]`` -> float32 probabilities ``[k, V]``.

    Greedy requests get the untempered softmax (used only for confidence and traces;
    greedy selection takes the argmax of the logits).
    """
    return torch.softmax(processed_logits(logits, params), dim=-1)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log probability under the target's processed distribution, and the ``top`` most
    likely tokens of that distribution as (token id, log probability), most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]

    def to_json(self) -> dict[str, object]:
        return {"token": self.token, "logprob": self.logprob, "top": [list(t) for t in self.top]}


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams, k: int) -> list[TokenLogprob]:
    """``tokens[j]``'s log probability under row ``j`` of ``logits [>= len(tokens), V]`` (already processed by
    the request's logit rules), after temperature/top-k/top-p, with the ``k`` most likely alternatives
    (tokens of probability 0 left out). Each row is computed alone, so a row's values do not depend on the
    rows beside it in a verify block."""
    out = []
    for j, token in enumerate(tokens):
        lp = torch.log_softmax(processed_logits(logits[j : j + 1], params), dim=-1)[0]
        top: list[tuple[int, float]] = []
        if k > 0:
            values, ids = torch.topk(lp, min(k, lp.shape[-1]))
            top = [(int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist()) if v != float("-inf")]
        out.append(TokenLogprob(token, float(lp[token]), top))
    return out


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of ``probs [k, V]`` -> int64 ``[k]``."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
