"""The one aggregate of step records (specdec.analysis) and reading records back from trace lines, by hand numbers."""

from __future__ import annotations

import pytest

from specdec.analysis import StepAggregate, calibration, low_quantile
from specdec.records import GenerationStats, RequestSummary, StepRecord, correction_kind


def rec(tau: int, n: int, emitted: int | None = None, draft: float = 0.0, verify: float = 0.01, **kw) -> StepRecord:
    """A step drafting τ tokens of which n are accepted; ``emitted`` tokens reached the output (default n + 1)."""
    return StepRecord(
        request_id=kw.pop("request_id", "r"),
        step=0,
        prompt_len=4,
        context_len=4,
        policy="fixed",
        reason="",
        tau=tau,
        draft_tokens=[5] * tau,
        accept_flags=[i < n for i in range(tau)],
        n_accepted=n,
        correction=correction_kind(tau, n),
        emitted=[1] * (n + 1 if emitted is None else emitted),
        draft_time=draft,
        verify_time=verify,
        other_time=kw.pop("other", 0.001),
        **kw,
    )


def test_acceptance_figures_by_hand() -> None:
    # τ=4 n̂=4 (bonus), τ=4 n̂=1, τ=0 (plain), τ=2 n̂=2 cut by a stop after 1 token
    agg = StepAggregate.of([rec(4, 4), rec(4, 1), rec(0, 0), rec(2, 2, emitted=1)])
    assert (agg.steps, agg.draft_steps, agg.drafted, agg.accepted, agg.accepted_out) == (4, 3, 10, 7, 6)
    assert (agg.rejections, agg.emitted) == (1, 5 + 2 + 1 + 1)
    assert agg.alpha == pytest.approx(0.7)  # the rule: 7 of 10
    assert agg.output_alpha == pytest.approx(0.6)  # the stop kept one of the last step's two
    assert agg.per_token_alpha == pytest.approx(6 / 7)  # 6 accepted, 1 rejection
    assert agg.tokens_per_pass == pytest.approx(9 / 4)
    assert agg.accepted_length == pytest.approx(1 + 7 / 3)
    # position i is reached when every earlier draft passed: the τ=4 n̂=1 step reached 0 and 1, passed 0
    assert agg.reached == [3, 3, 1, 1] and agg.passed == [3, 2, 1, 1]
    assert agg.conditional_acceptance() == pytest.approx([1.0, 2 / 3, 1.0, 1.0])
    agg.add(rec(3, 0))  # position 0 tested and failed
    assert agg.reached == [4, 3, 1, 1] and agg.passed == [3, 2, 1, 1]
    # shrinkage: each rate one pseudo-count toward the one before, the first toward 0.5; unseen positions carry on
    p0 = (3 + 0.5) / 5
    p1 = (2 + p0) / 4
    p2 = (1 + p1) / 2
    p3 = (1 + p2) / 2
    assert agg.shrunk_rates(6) == pytest.approx([p0, p1, p2, p3, p3, p3])


def test_empty_aggregate_has_no_ratios() -> None:
    agg = StepAggregate()
    assert agg.alpha is agg.output_alpha is agg.per_token_alpha is agg.tokens_per_pass is agg.accepted_length is None
    plain = StepAggregate.of([rec(0, 0), rec(0, 0)])
    assert plain.alpha is None and plain.tokens_per_pass == 1.0 and plain.draft_per_token == []


def test_output_alpha_is_what_generation_stats_report() -> None:
    records = [rec(4, 4), rec(4, 1), rec(0, 0), rec(2, 2, emitted=1), rec(3, 0)]
    stats = GenerationStats()
    for r in records:
        stats.add(r)
    agg = StepAggregate.of(records)
    assert agg.output_alpha == stats.acceptance_rate and agg.tokens_per_pass == stats.mean_accepted_length


def test_verify_fit_recovers_a_line_and_costs_by_block() -> None:
    # verify = 2 ms + 1 ms per extra token, six steps per block size k = 1..4 (τ = 0..3), draft 0.5 ms per token
    records = [rec(t, 0, verify=0.002 + 0.001 * t, draft=0.0005 * t) for t in range(4) for _ in range(6)]
    agg = StepAggregate.of(records)
    fit = agg.verify_fit(0.25)
    assert fit.slope == pytest.approx(0.001) and fit.intercept == pytest.approx(0.001)
    assert fit.t1() == pytest.approx(0.002) and fit.serial_fraction() == pytest.approx(0.5)
    assert fit.v(3) == pytest.approx(2.0)
    assert agg.verify_table() == pytest.approx({1: 0.002, 2: 0.003, 3: 0.004, 4: 0.005})
    assert agg.verify_table(min_count=7) == {}
    assert agg.draft_per_token == pytest.approx([0.0005] * 18)
    assert sorted(agg.draft_by_tau) == [1, 2, 3]
    # too few samples per size: no line, t1 is the cheapest block
    sparse = StepAggregate.of(records[::6]).verify_fit(0.25)
    assert sparse.slope is None and sparse.t1() == pytest.approx(0.002) and sparse.v(5) == 1.0
    assert low_quantile([5.0, 1.0, 3.0, 2.0], 0.25) == 2.0


def test_calibration_reads_the_drafts_confidence() -> None:
    old = rec(2, 1, draft_token_probs=[0.95, 0.15])  # before draft_confidence: the probs field held it (greedy)
    assert old.confidences() == [0.95, 0.15]
    assert calibration([old]) == [(0.1, 0.0, 1), (0.9, 1.0, 1)]
    new = rec(2, 1, draft_token_probs=[0.5, 0.5])
    new.draft_confidence = [0.95, 0.15]  # type: ignore[attr-defined]  # the field the engine now records
    assert new.confidences() == [0.95, 0.15] and calibration([new]) == calibration([old])


def test_step_record_round_trips_and_reads_old_lines() -> None:
    r = rec(3, 1, draft=0.002, draft_token_probs=[0.9, 0.2, 0.1], target_token_probs=[0.8, 0.1, 0.3])
    line = r.to_json() | {"ts": 123.0}
    assert StepRecord.from_json(line) == r
    old = {k: v for k, v in line.items() if k not in ("draft_token_probs", "target_token_probs")}
    back = StepRecord.from_json(old)  # a line written before those fields existed: their defaults
    assert back.draft_token_probs == [] and back.target_token_probs == [] and back.tau == 3
    with pytest.raises(KeyError, match="n_accepted"):
        StepRecord.from_json({k: v for k, v in line.items() if k != "n_accepted"})


def test_request_summary_round_trips() -> None:
    stats = GenerationStats(prompt_tokens=4, new_tokens=9, steps=3, target_passes=3, drafted=8, accepted=6)
    stats.finish_reason = "stop"
    s = RequestSummary("r", "adaptive", 4, stats, settings={"temperature": 0.0}, prompt_ids=[1, 2, 3, 4])
    back = RequestSummary.from_json(s.to_json())
    assert back == s and back.stats.acceptance_rate == 0.75
    bare = RequestSummary.from_json({"request_id": "x", "policy": "fixed", "prompt_len": 2, "new_tokens": 5})
    assert bare.prompt_ids is None and bare.settings == {} and bare.stats.new_tokens == 5
