"""The acceptance rule alone, on hand-built numbers (no models, no caches)."""

from __future__ import annotations

import pytest
import torch

from specdec.verify import accept_mask, first_rejection, residual, verify_greedy, verify_with_uniforms

pytestmark = pytest.mark.rules

V = 6


def _build(ratios_and_draws: list[tuple[float, float]]):
    """Draft tokens 0..τ-1 with q(ŷ_t) = 0.5 and p(ŷ_t) = 0.5 * ratio; returns (tokens, q, p, r)."""
    tau = len(ratios_and_draws)
    tokens = torch.arange(tau) % V
    q = torch.full((tau, V), 0.5 / (V - 1))
    p = torch.zeros(tau + 1, V)
    for t, (ratio, _) in enumerate(ratios_and_draws):
        q[t, tokens[t]] = 0.5
        p[t, tokens[t]] = 0.5 * ratio
        p[t, (tokens[t] + 1) % V] = 1 - 0.5 * ratio  # the residual's mass sits on the next id
    p[tau, 5] = 1.0  # bonus position: one-hot on token 5
    r = torch.tensor([draw for _, draw in ratios_and_draws])
    return tokens, q, p, r


def test_accept_when_draw_below_ratio():
    # p = 0.6, q = 0.8: ratio 0.75; r = 0.7 <= 0.75 -> accepted
    assert accept_mask(torch.tensor([0.6]), torch.tensor([0.8]), torch.tensor([0.7])).tolist() == [True]
    # r = 0.8 > 0.75 -> rejected
    assert accept_mask(torch.tensor([0.6]), torch.tensor([0.8]), torch.tensor([0.8])).tolist() == [False]


def test_q_below_p_accepted_outright():
    assert accept_mask(torch.tensor([0.5]), torch.tensor([0.2]), torch.tensor([1.0])).tolist() == [True]


def test_n_accepted_is_first_rejection_minus_one():
    # (ratio, draw): accepts, accepts, rejects 3 (0.6 > 0.5), accepts 4, rejects 5 -> n̂ = 2
    tokens, q, p, r = _build([(0.7, 0.4), (0.9, 0.8), (0.5, 0.6), (0.8, 0.3), (0.6, 0.7)])
    v = verify_with_uniforms(tokens, q, p, r, torch.Generator().manual_seed(0))
    assert v.accept_flags == [True, True, False, True, False]
    assert v.n_accepted == 2
    assert v.tokens[:2] == tokens[:2].tolist()
    assert len(v.tokens) == 3 and v.correction == "recovered"


def test_first_token_rejected_emits_only_the_correction():
    tokens, q, p, r = _build([(0.3, 0.9), (1.0, 0.1)])
    v = verify_with_uniforms(tokens, q, p, r, torch.Generator().manual_seed(0))
    assert v.n_accepted == 0
    assert len(v.tokens) == 1
    # residual at position 1: max(0, p - q) has mass only on token (0 + 1) % V = 1
    assert v.tokens == [1]


def test_all_accepted_takes_bonus_from_position_tau_plus_one():
    tokens, q, p, r = _build([(1.0, 0.5), (0.9, 0.2), (0.8, 0.1)])
    v = verify_with_uniforms(tokens, q, p, r, torch.Generator().manual_seed(0))
    assert v.n_accepted == 3 and v.correction == "bonus"
    assert v.tokens == tokens.tolist() + [5]  # p[τ] is one-hot on 5


def test_accept_reject_accept_keeps_only_the_prefix():
    tokens, q, p, r = _build([(0.9, 0.1), (0.2, 0.9), (1.0, 0.0)])
    v = verify_with_uniforms(tokens, q, p, r, torch.Generator().manual_seed(0))
    assert v.accept_flags == [True, False, True]
    assert v.n_accepted == 1
    # the accepted third draft is dropped; the correction comes from the residual at position 2
    assert v.tokens == [tokens[0].item(), (tokens[1].item() + 1) % V]


def test_zero_draft_probability_does_not_divide():
    flags = accept_mask(torch.tensor([0.3, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([0.5, 0.5]))
    assert flags.tolist() == [True, False]  # p > 0 with q = 0 accepts; p = 0 never does


def test_residual_of_equal_distributions_is_finite():
    p = torch.tensor([0.2, 0.3, 0.5])
    out = residual(p, p.clone())
    assert torch.isfinite(out).all() and torch.allclose(out.sum(), torch.tensor(1.0))


def test_residual_normalises_positive_part():
    out = residual(torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.7, 0.1, 0.2]))
    assert torch.allclose(out, torch.tensor([0.0, 1.0, 0.0]))


def test_first_rejection_counts_leading_trues():
    assert first_rejection(torch.tensor([True, True, False, True])) == 2
    assert first_rejection(torch.tensor([False, True])) == 0
    assert first_rejection(torch.tensor([True, True])) == 2
    assert first_rejection(torch.tensor([], dtype=torch.bool)) == 0


def test_tau_zero_is_a_plain_step():
    p = torch.zeros(1, V)
    p[0, 3] = 1.0
    v = verify_with_uniforms(
        torch.empty(0, dtype=torch.long), torch.empty(0, V), p, torch.empty(0), torch.Generator().manual_seed(0)
    )
    assert v.tokens == [3] and v.correction == "plain" and v.n_accepted == 0


def test_greedy_accepts_matching_argmax_prefix():
    logits = torch.full((4, V), -1.0)
    for t, best in enumerate([2, 4, 1, 0]):
        logits[t, best] = 1.0
    v = verify_greedy(torch.tensor([2, 4, 3]), logits)  # accepts 2, 4; rejects 3 (target says 1)
    assert v.accept_flags == [True, True, False]
    assert v.tokens == [2, 4, 1] and v.correction == "recovered"
    v = verify_greedy(torch.tensor([2, 4, 1]), logits)  # all accepted; bonus = argmax at τ+1 = 0
    assert v.tokens == [2, 4, 1, 0] and v.correction == "bonus"
