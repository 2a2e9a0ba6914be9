"""The acceptance rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023), as pure tensor functions.

Names: ``draft_tokens`` ŷ_1..ŷ_τ, ``draft_probs`` q, ``target_probs`` p. For each draft position t:
    accepted_t  <=>  r_t <= p_t(ŷ_t) / q_t(ŷ_t),   r_t ~ U(0, 1]
(so q <= p is accepted outright). Only the consecutively accepted prefix counts:
    n̂ = min{t : not accepted_t} - 1   (τ when nothing is rejected).
The step then emits one more token ȳ from the target:
    *recovered*: at a rejection, ȳ ~ norm(max(0, p_{n̂+1} - q_{n̂+1}))   (greedy: argmax p_{n̂+1})
    *bonus*:     all τ accepted,  ȳ ~ p_{τ+1}                              (greedy: argmax p_{τ+1})
    *plain*:     τ = 0, the same bonus draw: a plain target decoding step.
Every step emits [ŷ_1..ŷ_n̂, ȳ]: n̂ + 1 tokens, never a rejected draft token.
A step's outcome is a ``Verdict`` (plain data in ``specdec.records``, re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.records import Verdict, correction_kind
from specdec.sampling import sample

__all__ = [
    "Verdict",
    "accept_mask",
    "first_rejection",
    "residual",
    "verdict_greedy",
    "verify_greedy",
    "verify_sampling",
    "verify_with_uniforms",
]


def accept_mask(target_p: torch.Tensor, draft_q: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``[τ]`` bools: r <= p/q, written r*q <= p so that q = 0 never divides.

    A token the target gives zero mass is never accepted (guards q = 0 = p and r = 0).
    """
    return (target_p > 0) & (r * draft_q <= target_p)


def first_rejection(flags: torch.Tensor) -> int:
    """n̂: the number of leading True values in ``flags [τ]``."""
    return int((flags.long().cumprod(0)).sum().item())


def residual(target_p: torch.Tensor, draft_q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over ``[V]``; falls back to p when p == q (no mass left, never at a real rejection)."""
    diff = (target_p - draft_q).clamp_min(0)
    total = diff.sum()
    return diff / total if total > 0 else target_p


def verify_sampling(
    draft_tokens: torch.Tensor,  # [τ] int64
    draft_probs: torch.Tensor,  # [τ, V]
    target_probs: torch.Tensor,  # [τ+1, V]
    generator: torch.Generator,
) -> Verdict:
    tau = draft_tokens.shape[0]
    r = 1.0 - torch.rand(tau, generator=generator, device=target_probs.device)  # U(0, 1]
    return verify_with_uniforms(draft_tokens, draft_probs, target_probs, r, generator)


def verify_with_uniforms(
    draft_tokens: torch.Tensor,  # [τ]
    draft_probs: torch.Tensor,  # [τ, V]
    target_probs: torch.Tensor,  # [τ+1, V]
    r: torch.Tensor,  # [τ] the uniforms, given (for hand-built tests)
    generator: torch.Generator,
) -> Verdict:
    tau = draft_tokens.shape[0]
    idx = torch.arange(tau, device=target_probs.device)
    p_tok = target_probs[idx, draft_tokens]
    q_tok = draft_probs[idx, draft_tokens]
    flags = accept_mask(p_tok, q_tok, r)
    n = first_rejection(flags)
    if n < tau:
        dist = residual(target_probs[n], draft_probs[n])
    else:
        dist = target_probs[tau]
    y = int(sample(dist[None], generator).item())
    return Verdict(
        accept_flags=flags.tolist(),
        n_accepted=n,
        tokens=draft_tokens[:n].tolist() + [y],
        correction=correction_kind(tau, n),
        target_token_probs=p_tok.tolist(),
        draft_token_probs=q_tok.tolist(),
    )


def verify_greedy(
    draft_tokens: torch.Tensor | Sequence[int],  # [τ]
    target_logits: torch.Tensor,  # [τ+1, V]
) -> Verdict:
    """Temperature 0: a draft token is accepted iff it is the target's argmax there."""
    best = target_logits.argmax(dim=-1).tolist()  # [τ+1]
    tokens = draft_tokens.tolist() if isinstance(draft_tokens, torch.Tensor) else list(draft_tokens)
    return verdict_greedy(tokens, best)


def verdict_greedy(draft_tokens: Sequence[int], best: Sequence[int]) -> Verdict:
    """The greedy verdict from the target's argmax at each of the τ+1 rows (``best``): the draft's longest prefix
    that agrees with it, then the target's token at the first disagreement (or the bonus token)."""
    tau = len(draft_tokens)
    flags = [int(d) == int(b) for d, b in zip(draft_tokens, best[:tau])]
    n = flags.index(False) if False in flags else tau
    return Verdict(
        accept_flags=flags,
        n_accepted=n,
        tokens=[int(t) for t in draft_tokens[:n]] + [int(best[n])],
        correction=correction_kind(tau, n),
        target_token_probs=[],
        draft_token_probs=[],
    )
