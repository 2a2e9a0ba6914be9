"""Logits -> the distributions both models are judged by.

The same ``SamplingParams`` are applied to target and draft logits before the acceptance
rule (Leviathan et al. 2023 prove losslessness for whatever distribution the target
samples from, so the target's *processed* distribution is the one to reproduce).
Order as in ``transformers``: temperature, then top-k, then top-p, then min-p. ``SamplingParams`` and
``TokenLogprob`` are plain data, defined in ``specdec.sampling_params`` (no torch) and re-exported here.
"""

from __future__ import annotations

import torch

from specdec.sampling_params import SamplingParams, TokenLogprob

__all__ = ["SamplingParams", "TokenLogprob", "logits_to_probs", "processed_logits", "sample", "token_logprobs"]


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits [k, V]`` -> float32 logits of the distribution sampled from: tempered, with -inf outside top-k,
    top-p and min-p (a token kept when its probability is at least ``min_p`` times the most likely one's, after
    top-k and top-p, which leave that one). Greedy requests: the logits unchanged (temperature 1)."""
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
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits [k, V]`` -> float32 probabilities ``[k, V]``.

    Greedy requests get the untempered softmax (used only for confidence and traces;
    greedy selection takes the argmax of the logits).
    """
    return torch.softmax(processed_logits(logits, params), dim=-1)


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
