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
from dataclasses import dataclass

import torch

from specdec.records import Verdict, correction_kind
from specdec.sampling import sample_rows

__all__ = [
    "SampledBlock",
    "Verdict",
    "accept_mask",
    "first_rejection",
    "residual",
    "verdict_greedy",
    "verdicts_with_uniforms",
    "verify_blocks",
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
    """norm(max(0, p - q)) over the vocabulary (the last dimension: one row ``[V]`` or rows ``[k, V]``); a row where
    p == q (no mass left, never at a real rejection) falls back to p."""
    diff = (target_p - draft_q).clamp_min(0)
    total = diff.sum(-1, keepdim=True)
    return torch.where(total > 0, diff / total.clamp_min(torch.finfo(diff.dtype).tiny), target_p)


def verify_sampling(
    draft_tokens: torch.Tensor,  # [τ] int64
    draft_probs: torch.Tensor,  # [τ, V]
    target_probs: torch.Tensor,  # [τ+1, V]
    generator: torch.Generator,
) -> Verdict:
    """One block's verdict (``verify_blocks`` with one block)."""
    return verify_blocks([SampledBlock(draft_tokens.tolist(), draft_probs, target_probs, generator)])[0]


def verify_with_uniforms(
    draft_tokens: torch.Tensor,  # [τ]
    draft_probs: torch.Tensor,  # [τ, V]
    target_probs: torch.Tensor,  # [τ+1, V]
    r: torch.Tensor,  # [τ] the uniforms, given (for hand-built tests)
    generator: torch.Generator,
) -> Verdict:
    """One block's verdict with its uniforms given (``verdicts_with_uniforms``)."""
    block = SampledBlock(draft_tokens.tolist(), draft_probs, target_probs, generator)
    return verdicts_with_uniforms([block], [r])[0]


@dataclass
class SampledBlock:
    """One sampled sequence's verify block: its draft, q at each draft position, p at each of its τ+1 rows (both
    processed: the distributions sampled from), and the request's generator."""

    draft_tokens: list[int]  # [τ]
    draft_probs: torch.Tensor  # [τ, V]
    target_probs: torch.Tensor  # [τ+1, V]
    generator: torch.Generator


def verify_blocks(blocks: Sequence[SampledBlock]) -> list[Verdict]:
    """Each block's verdict under the rule above. A block draws its uniforms from its own generator, τ of them and
    then one for its last token (``sample_rows``), so its verdict does not depend on the blocks beside it; the work is
    shared: one acceptance test over every block's draft tokens, one draw over every block's last distribution
    (where a block at a time cost ~0.1 ms each at 16 sampled requests)."""
    rs = [1.0 - torch.rand(len(b.draft_tokens), generator=b.generator, device=b.target_probs.device) for b in blocks]
    return verdicts_with_uniforms(blocks, rs)  # r ~ U(0, 1]


def verdicts_with_uniforms(blocks: Sequence[SampledBlock], rs: Sequence[torch.Tensor]) -> list[Verdict]:
    """``verify_blocks`` with each block's τ uniforms given (``rs``)."""
    if not blocks:
        return []
    taus = [len(b.draft_tokens) for b in blocks]
    p_toks: list[torch.Tensor] = []
    q_toks: list[torch.Tensor] = []
    for b, tau in zip(blocks, taus):
        if tau:
            t = torch.tensor(b.draft_tokens, dtype=torch.long, device=b.target_probs.device)
            idx = torch.arange(tau, device=t.device)
            p_toks.append(b.target_probs[idx, t])
            q_toks.append(b.draft_probs[idx, t].to(t.device))
    if p_toks:
        p_all, q_all = torch.cat(p_toks), torch.cat(q_toks)
        flags_all = accept_mask(p_all, q_all, torch.cat([r for r, tau in zip(rs, taus) if tau]).to(p_all.device))
        flat_flags, flat_p, flat_q = flags_all.tolist(), p_all.tolist(), q_all.tolist()
    else:
        flat_flags, flat_p, flat_q = [], [], []
    # Each block's accepted prefix, then the distribution of its last token: the residual at its first rejection, p
    # at its bonus row.
    ns: list[int] = []
    last_p: list[torch.Tensor] = []
    last_q: list[torch.Tensor | None] = []
    at = 0
    for b, tau in zip(blocks, taus):
        flags = flat_flags[at : at + tau]
        n = flags.index(False) if False in flags else tau
        ns.append(n)
        last_p.append(b.target_probs[n])
        last_q.append(b.draft_probs[n].to(b.target_probs.device) if n < tau else None)
        at += tau
    dists = torch.stack(last_p)
    rejected = [i for i, q in enumerate(last_q) if q is not None]
    if rejected:
        dists[rejected] = residual(dists[rejected], torch.stack([q for q in last_q if q is not None]))
    ys = sample_rows(dists, [b.generator for b in blocks]).tolist()
    out = []
    at = 0
    for b, tau, n, y in zip(blocks, taus, ns, ys):
        out.append(
            Verdict(
                accept_flags=flat_flags[at : at + tau],
                n_accepted=n,
                tokens=[int(t) for t in b.draft_tokens[:n]] + [int(y)],
                correction=correction_kind(tau, n),
                target_token_probs=flat_p[at : at + tau],
                draft_token_probs=flat_q[at : at + tau],
            )
        )
        at += tau
    return out


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
