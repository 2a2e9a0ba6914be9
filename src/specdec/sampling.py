"""Logits -> the distributions both models are judged by.

The same ``SamplingParams`` are applied to target and draft logits before the acceptance
rule (Leviathan et al. 2023 prove losslessness for whatever distribution the target
samples from, so the target's *processed* distribution is the one to reproduce).
Order as in ``transformers``: temperature, then top-k, then top-p, then min-p. ``SamplingParams`` and
``TokenLogprob`` are plain data, defined in ``specdec.sampling_params`` (no torch) and re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specdec.sampling_params import SamplingParams, TokenLogprob

__all__ = [
    "SamplingParams",
    "TokenLogprob",
    "logits_to_probs",
    "probs_by_settings",
    "processed_logits",
    "sample",
    "sample_rows",
    "sample_rows_at",
    "token_logprobs",
]


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


def probs_by_settings(blocks: Sequence[torch.Tensor], settings: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits_to_probs`` of each block of logits ``[k_i, V]`` under its own settings -> float32 ``[sum k_i, V]``, the
    blocks' rows in order. The blocks of requests alike in their settings (``SamplingParams.shaping``) go through one
    call: each row is processed alone, so its probabilities are bit for bit those of its block alone, at a fraction of
    a call a block (~0.1 ms each at 16 sampled requests)."""
    alike: dict[tuple[float, int, float, float], list[int]] = {}
    for i, params in enumerate(settings):
        alike.setdefault(params.shaping, []).append(i)
    if len(alike) == 1:
        return logits_to_probs(torch.cat(list(blocks)) if len(blocks) > 1 else blocks[0], settings[0])
    starts = [0]
    for b in blocks:
        starts.append(starts[-1] + b.shape[0])
    out = torch.empty(starts[-1], blocks[0].shape[-1], dtype=torch.float32, device=blocks[0].device)
    for members in alike.values():
        probs = logits_to_probs(torch.cat([blocks[i] for i in members]), settings[members[0]])
        at = 0
        for i in members:
            k = blocks[i].shape[0]
            out[starts[i] : starts[i] + k] = probs[at : at + k]
            at += k
    return out


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
    """One draw per row of ``probs [k, V]`` (non-negative, any positive total) -> int64 ``[k]``, every row with
    ``generator`` (``sample_rows``)."""
    return sample_rows(probs, [generator] * probs.shape[0])


def sample_rows(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One draw per row of ``probs [k, V]`` (non-negative, any positive total), row i with ``generators[i]`` ->
    int64 ``[k]``. A row's draw depends on its own probabilities and generator only, not on the rows beside it.

    By the inverse of each row's distribution function: one uniform u in [0, 1) (float64, 53 bits) from the row's
    generator, and the first token whose cumulative mass (float64) exceeds u times the row's total, so a token is
    drawn with probability its share of the total, and a token of mass 0 never (its cumulative mass equals the one
    before it). torch's ``multinomial`` draws one exponential per token of the vocabulary (an exponential race):
    250 us a draw over 8,192 tokens on a CPU, where this takes ~30 us, and a batched step of 16 sampled requests at
    tau = 2 makes 48 draws (docs/server.md, "Sampled requests")."""
    if probs.dim() != 2 or len(generators) != probs.shape[0]:
        raise ValueError(f"sample_rows() wants [rows, vocabulary] and a generator a row, got {tuple(probs.shape)}")
    dev = probs.device
    return sample_rows_at(
        probs, torch.cat([torch.rand(1, dtype=torch.float64, device=dev, generator=g) for g in generators])
    )


def sample_rows_at(probs: torch.Tensor, uniforms: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """``sample_rows`` with each row's uniform in [0, 1) given (float64 ``[k]``, or a list of floats)."""
    if probs.dim() != 2 or len(uniforms) != probs.shape[0]:
        raise ValueError(f"sample_rows_at() wants [rows, vocabulary] and a uniform a row, got {tuple(probs.shape)}")
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    if not all(0.0 < t < math.inf for t in total.flatten().tolist()):  # NaN fails both
        raise ValueError("sampling needs finite probabilities with a positive total in every row")
    u = torch.as_tensor(uniforms, dtype=torch.float64, device=probs.device)
    # u < 1 keeps u * total below the total in float64 (at most 1 - 2^-53 times it, never rounded up to it), so the
    # first cumulative mass above it is a token's with mass, and one within the vocabulary.
    return torch.searchsorted(cdf, u[:, None] * total, right=True).squeeze(-1)
