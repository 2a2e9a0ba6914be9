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


# -- drawing tokens (``specdec.sampling.sample_rows``) -------------------------------------------------------------


def test_a_draw_follows_its_distribution_and_never_takes_a_token_of_no_mass():
    """20,000 draws from a distribution with tokens of mass 0 between and after the others: the zero-mass tokens are
    never drawn, and the counts pass a chi-square test against the distribution (seed 0, false-failure rate 1e-3)."""
    from scipy.stats import chisquare

    from specdec.sampling import sample_rows

    p = torch.tensor([[0.0, 0.1, 0.0, 0.25, 0.6, 0.05, 0.0, 0.0]]) * 3.0  # any positive total
    gen = torch.Generator().manual_seed(0)
    draws = torch.cat([sample_rows(p, [gen]) for _ in range(20_000)])
    counts = torch.bincount(draws, minlength=8)
    assert counts[p[0] == 0].sum() == 0
    live = p[0] > 0
    expected = (p[0][live] / p[0].sum() * 20_000).tolist()
    assert chisquare(counts[live].tolist(), expected).pvalue > 1e-3


@pytest.mark.parametrize("u, token", [(0.0, 1), (1.0 - 2.0**-53, 3)])
def test_the_extreme_uniforms_draw_the_first_and_last_tokens_with_mass(
    monkeypatch: pytest.MonkeyPatch, u: float, token: int
):
    """u = 0 and u = 1 - 2^-53, the least and the largest uniform: the first and the last token with mass, never a
    zero-mass token before or after them (or one past the vocabulary), whatever the total."""
    import specdec.sampling as sampling

    monkeypatch.setattr(sampling.torch, "rand", lambda *a, **k: torch.tensor([u], dtype=torch.float64))
    for total in (1.0, 1.1, 3.0, 7.3e-3):
        p = torch.tensor([[0.0, 0.1, 0.3, 0.6, 0.0, 0.0]]) * total
        assert sampling.sample_rows(p, [torch.Generator()]).tolist() == [token]


def test_a_rows_draw_depends_on_its_own_row_and_generator_only():
    from specdec.sampling import sample_rows

    torch.manual_seed(3)
    probs = torch.softmax(torch.randn(5, 300) * 2, -1)
    alone = [sample_rows(probs[i : i + 1], [torch.Generator().manual_seed(i)]).item() for i in range(5)]
    together = sample_rows(probs, [torch.Generator().manual_seed(i) for i in range(5)]).tolist()
    assert together == alone


@pytest.mark.parametrize("bad", [[[0.0, 0.0, 0.0]], [[float("nan"), 0.5, 0.5]], [[float("inf"), 1.0, 0.0]]])
def test_a_distribution_without_a_finite_positive_total_is_refused(bad: list[list[float]]):
    from specdec.sampling import sample_rows

    with pytest.raises(ValueError, match="finite probabilities with a positive total"):
        sample_rows(torch.tensor(bad), [torch.Generator()])


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=20),
        dict(temperature=0.9, top_p=0.8),
        dict(temperature=1.0, min_p=0.05),
    ],
)
def test_rows_processed_together_equal_each_row_processed_alone(settings: dict):
    """The engine processes the rows of requests alike in their settings in one call (draft picks and verification):
    every row's probabilities must be bit for bit those of the row alone, or a seeded request's output would depend on
    what it is batched with."""
    from specdec.sampling import SamplingParams, logits_to_probs

    params = SamplingParams(**settings)
    torch.manual_seed(5)
    logits = torch.randn(37, 8192) * 4
    together = logits_to_probs(logits, params)
    for i in range(37):
        assert torch.equal(together[i], logits_to_probs(logits[i : i + 1], params)[0])


def test_blocks_verified_together_get_the_verdicts_each_gets_alone():
    """Ragged blocks (τ = 0 included), rejections and bonus draws mixed: ``verify_blocks`` over all of them gives each
    the verdict it gets alone with a generator in the same state (its uniforms come from its own generator)."""
    from specdec.verify import SampledBlock, verify_blocks

    torch.manual_seed(11)
    vocab = 50
    blocks = []
    for tau in (0, 1, 3, 5, 2, 4, 0, 6):
        p = torch.softmax(torch.randn(tau + 1, vocab) * 2, -1)
        q = torch.softmax(torch.randn(tau, vocab) * 2, -1)
        tokens = [int(torch.multinomial(q[t], 1)) for t in range(tau)]
        blocks.append((tokens, q, p))

    def make(seed0: int) -> list[SampledBlock]:
        return [SampledBlock(t, q, p, torch.Generator().manual_seed(seed0 + i)) for i, (t, q, p) in enumerate(blocks)]

    for seed0 in range(0, 400, 8):
        together = verify_blocks(make(seed0))
        alone = [verify_blocks([b])[0] for b in make(seed0)]
        assert together == alone
    kinds = {v.correction for v in verify_blocks(make(0))}
    assert len(kinds) > 1  # the blocks were not all alike


def test_the_residual_of_rows_is_each_rows_residual():
    torch.manual_seed(2)
    p = torch.softmax(torch.randn(6, 40), -1)
    q = torch.softmax(torch.randn(6, 40), -1)
    q[3] = p[3]  # no mass left: p itself
    rows = residual(p, q)
    for i in range(6):
        assert torch.equal(rows[i], residual(p[i], q[i]))
    assert torch.equal(rows[3], p[3])


def test_blocks_of_mixed_settings_get_each_their_own_probabilities_in_order():
    """``probs_by_settings`` over blocks of three settings, interleaved and of ragged lengths: each block's rows are bit
    for bit ``logits_to_probs`` of that block alone, in the blocks' order."""
    from specdec.sampling import SamplingParams, logits_to_probs, probs_by_settings

    torch.manual_seed(9)
    kinds = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.1, top_k=30),
        SamplingParams(top_p=0.9, temperature=1.0),
    ]
    settings = [kinds[i % 3] for i in range(8)]
    blocks = [torch.randn(1 + i % 4, 500) * 3 for i in range(8)]
    out = probs_by_settings(blocks, settings)
    alone = torch.cat([logits_to_probs(b, s) for b, s in zip(blocks, settings)])
    assert out.shape == alone.shape and torch.equal(out, alone)
