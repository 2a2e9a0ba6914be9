"""Policies pinned against scripted acceptance sequences (no models), plus one engine check on tiny models."""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import replace

import pytest

from specdec.errors import InvalidRequestError
from specdec.policy import (
    AdaptivePolicy,
    ConfidencePolicy,
    Decision,
    FleetBudget,
    FleetBudgetPolicy,
    HeuristicPolicy,
    MeasuredCosts,
    MinConfidence,
    Policy,
    ReachRule,
    StepContext,
    make_policy,
    split_policy_specs,
)
from specdec.policy.adaptive import STEP_BIAS_DECAY
from specdec.policy.estimates import POLICY_TIME_DECAY
from specdec.records import GenerationStats, StepRecord

pytestmark = pytest.mark.rules

DRAFT_S, VERIFY_S, VERIFY_EXTRA_S = 0.5e-3, 4.0e-3, 0.05e-3


def ctx_for(
    rid: str, step: int, new: int, passes: int, *, max_new: int = 10_000, cap: int | None = None, prompt_len: int = 100
) -> StepContext:
    return StepContext(
        request_id=rid,
        step=step,
        prompt_len=prompt_len,
        context_len=prompt_len + new,
        new_tokens=new,
        max_new_tokens=max_new,
        verify_passes=passes,
        max_verify_passes=cap,
        max_tau=max(0, max_new - new - 1),
        elapsed=0.0,
    )


def record_for(rid: str, step: int, tau: int, n_acc: int, probs: list[float] | None = None) -> StepRecord:
    return StepRecord(
        request_id=rid,
        step=step,
        prompt_len=100,
        context_len=100,
        policy="t",
        reason="",
        tau=tau,
        draft_tokens=[0] * tau,
        accept_flags=[k < n_acc for k in range(tau)],
        n_accepted=n_acc,
        correction="plain" if tau == 0 else ("bonus" if n_acc == tau else "recovered"),
        emitted=[0] * (n_acc + 1),
        draft_time=DRAFT_S * tau,
        verify_time=VERIFY_S + VERIFY_EXTRA_S * tau,
        other_time=0.0,
        draft_token_probs=probs if probs is not None else [0.9] * tau,
    )


def drive(policy: Policy, accept: Callable[[int, int], int], steps: int, rid: str = "r", **ctx_kw: int) -> list[int]:
    """Run ``steps`` engine-like steps; ``accept(step, tau) -> n̂`` scripts the draft. Returns the τ drafted.

    As the engine does: the policy's allowance narrows the cap, which ends the request; τ is clamped."""
    taus, new, passes = [], 0, 0
    policy.begin(ctx_for(rid, 0, 0, 0, **ctx_kw))
    allowance = policy.allowance(rid)
    if allowance is not None:
        cap = ctx_kw.get("cap")
        ctx_kw = {**ctx_kw, "cap": allowance if cap is None else min(cap, allowance)}
    for step in range(steps):
        ctx = ctx_for(rid, step, new, passes, **ctx_kw)
        if ctx.max_verify_passes is not None and passes >= ctx.max_verify_passes:
            break
        d = policy.next_tau(ctx)
        tau = max(0, min(d.tau, ctx.max_tau))
        n_acc = accept(step, tau) if tau else 0
        policy.observe(record_for(rid, step, tau, n_acc))
        taus.append(tau)
        new, passes = new + n_acc + 1, passes + 1
    policy.end(rid, GenerationStats(new_tokens=new, target_passes=passes, latency=0.1))
    return taus


def bernoulli(alpha: float, seed: int = 0) -> Callable[[int, int], int]:
    rng = random.Random(seed)

    def accept(step: int, tau: int) -> int:
        n = 0
        while n < tau and rng.random() < alpha:
            n += 1
        return n

    return accept


# -- registry ---------------------------------------------------------------------------------


def test_every_policy_builds_with_no_arguments() -> None:
    for name in ("fixed", "heuristic", "confidence", "adaptive"):
        assert make_policy(name).name == name


def test_policy_specs_carry_settings() -> None:
    p = make_policy("adaptive:max_tau=8,early_stop=false,margin=0.05")
    assert isinstance(p, AdaptivePolicy) and (p.max_tau, p.early_stop, p.margin) == (8, False, 0.05)
    assert make_policy("fixed:tau=3").next_tau(ctx_for("r", 0, 0, 0)).tau == 3
    assert make_policy("fixed:tau=3", tau=5).next_tau(ctx_for("r", 0, 0, 0)).tau == 5  # keywords win
    with pytest.raises(InvalidRequestError, match="bad options for policy 'adaptive'"):
        make_policy("adaptive:colour=blue")
    with pytest.raises(InvalidRequestError, match="write key=value"):
        make_policy("adaptive:max_tau")
    assert split_policy_specs("adaptive:max_tau=8,margin=0.05,heuristic, fixed:tau=2") == [
        "adaptive:max_tau=8,margin=0.05",
        "heuristic",
        "fixed:tau=2",
    ]


def test_bad_options_name_the_argument() -> None:
    with pytest.raises(InvalidRequestError, match="threshold"):
        ConfidencePolicy(threshold=1.5)
    with pytest.raises(InvalidRequestError, match="slo_p95_s"):
        make_policy("adaptive", slo_p95_s=-1)
    with pytest.raises(InvalidRequestError, match="fleet budget"):
        make_policy("adaptive", fleet_budget=0.5)


# -- heuristic ----------------------------------------------------------------------------------


def test_heuristic_schedule_plus_two_minus_one_floor_one() -> None:
    p = HeuristicPolicy()
    # full accept at 5 -> 7; then rejections: 7 -> 6 -> 5 ... -> 1, and never below 1
    script = [lambda t: t] + [lambda t: 0] * 8
    taus = drive(p, lambda step, tau: script[step](tau), len(script))
    assert taus == [5, 7, 6, 5, 4, 3, 2, 1, 1]


def test_heuristic_count_persists_across_requests_unless_transient() -> None:
    p = HeuristicPolicy()
    drive(p, lambda s, t: t, 2, rid="a")  # 5 -> 7 -> 9
    assert drive(p, lambda s, t: 0, 1, rid="b") == [9]
    q = HeuristicPolicy(transient=True)
    drive(q, lambda s, t: t, 2, rid="a")
    assert drive(q, lambda s, t: 0, 1, rid="b") == [5]


def test_heuristic_asks_its_count_and_leaves_the_clamp_to_the_engine() -> None:
    assert HeuristicPolicy(start=9).next_tau(ctx_for("r", 0, 0, 0, max_new=4)).tau == 9


def test_confidence_asks_the_drafter_to_stop_early() -> None:
    d = ConfidencePolicy(tau=6, threshold=0.3).next_tau(ctx_for("r", 0, 0, 0))
    assert (d.tau, d.rule) == (6, MinConfidence(0.3))


# -- adaptive: fallback, recovery, goodput -----------------------------------------------------


def test_adaptive_falls_back_to_plain_steps_with_a_useless_draft() -> None:
    p = AdaptivePolicy()
    taus = drive(p, lambda s, t: 0, 200)
    assert sum(t == 0 for t in taus[-100:]) >= 90  # nearly all plain steps once it has seen enough
    d = p.next_tau(ctx_for("x", 0, 0, 0))
    assert d.tau == 0 and d.reason.startswith("fallback: best goodput") and "x plain" in d.reason


def test_adaptive_probes_with_growing_backoff_while_falling_back() -> None:
    p = AdaptivePolicy(early_stop=False)
    taus = drive(p, lambda s, t: 0, 300)
    probes = [i for i, t in enumerate(taus) if t > 0 and i > 20]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps, "no probes at all: it could never recover"
    assert gaps == sorted(gaps) and gaps[-1] == p.max_backoff  # doubling, up to the cap


def test_adaptive_recovers_when_acceptance_returns() -> None:
    p = AdaptivePolicy(early_stop=False)
    taus = drive(p, lambda s, t: 0 if s < 150 else t, 260)  # useless, then every draft accepted
    assert taus[140:150].count(0) >= 8
    assert min(taus[-20:]) >= 6, taus[150:]


def test_adaptive_drafts_more_when_acceptance_is_higher() -> None:
    low = drive(AdaptivePolicy(early_stop=False), bernoulli(0.5), 300)
    high = drive(AdaptivePolicy(early_stop=False), bernoulli(0.9), 300)
    mean_low, mean_high = sum(low[100:]) / 200, sum(high[100:]) / 200
    assert 1 <= mean_low <= 4 and mean_high >= 6, (mean_low, mean_high)


def test_adaptive_learns_long_prompts_separately() -> None:
    p = AdaptivePolicy(early_stop=False)
    for i in range(6):  # alternate requests: short prompts accept all, long prompts accept nothing
        drive(p, lambda s, t: t, 40, rid=f"s{i}", prompt_len=100)
        drive(p, lambda s, t: 0, 40, rid=f"l{i}", prompt_len=3000)
    assert p.next_tau(ctx_for("s", 0, 0, 0, prompt_len=100)).tau >= 6
    assert p.next_tau(ctx_for("l", 0, 0, 0, prompt_len=3000)).tau == 0


def _calibrated(policy: AdaptivePolicy, steps: int = 40) -> None:
    """Drafts where confident tokens (0.9) pass and doubtful ones (0.1) fail teach the calibration."""
    for i in range(steps):
        policy.observe(record_for("warm", i, 4, 3, probs=[0.9, 0.9, 0.9, 0.1]))
        policy.observe(record_for("warm", i, 4, 0, probs=[0.1, 0.5, 0.5, 0.5]))


def test_adaptive_hands_the_drafter_a_calibrated_stop_rule() -> None:
    p = AdaptivePolicy()
    assert p.next_tau(ctx_for("cold", 0, 0, 0)).rule is None  # nothing calibrated yet: no stop rule
    _calibrated(p)
    d = p.next_tau(ctx_for("r", 0, 0, 0))
    rule = d.rule
    assert isinstance(rule, ReachRule) and "P(all pass) >=" in d.reason, d.reason
    table = rule.accept_by_tenth
    assert table[9] > 0.8 and table[1] < 0.3, table  # what it was taught, through the prior
    # Confident tokens keep the draft going; one doubtful token ends it after itself.
    kept: list[float] = []
    for conf in [0.95] * 3 + [0.12] + [0.95] * 20:
        kept.append(conf)
        if not rule.go_on(kept, kept):
            break
    kept = len(kept)  # type: ignore[assignment]
    assert kept == 4, (kept, rule.min_reach)
    assert AdaptivePolicy(early_stop=False).next_tau(ctx_for("r", 0, 0, 0)).rule is None


def test_adaptive_stop_rule_threshold_follows_the_cost_of_a_draft_token() -> None:
    # A draft token that costs more (slow draft) must be surer of passing to be worth drafting.
    cheap, dear = AdaptivePolicy(), AdaptivePolicy()
    for p, draft_s in ((cheap, 0.1e-3), (dear, 1.5e-3)):
        _calibrated(p)
        for _ in range(20):
            p.costs.observe(4, 4, draft_s * 4, VERIFY_S + 4 * VERIFY_EXTRA_S, 0.0)
    r_cheap = cheap.next_tau(ctx_for("r", 0, 0, 0)).rule
    r_dear = dear.next_tau(ctx_for("r", 0, 0, 0)).rule
    assert isinstance(r_cheap, ReachRule) and isinstance(r_dear, ReachRule)
    assert r_dear.min_reach[0] > 2 * r_cheap.min_reach[0], (r_cheap.min_reach, r_dear.min_reach)


def test_stop_rule_thresholds_follow_a_lumpy_verify_curve() -> None:
    from specdec.policy.adaptive import reach_thresholds

    # Step seconds by τ: blocks up to 6 tokens cost 0.1 ms per token, the 7th token starts a new group (+2 ms).
    times = [4.0e-3 + 0.5e-3 * t + (2.0e-3 if t >= 6 else 0.0) + 0.1e-3 * t for t in range(10)]
    thr = reach_thresholds(times, [0.8] * 10, per_token=1.5e-3, cap=9)
    assert len(thr) == 8
    assert thr[4] > 1.5 * thr[1]  # going on past the 5th token crosses into the expensive block
    assert all(0 <= x <= 0.95 for x in thr)
    assert reach_thresholds(times, [0.8] * 10, 1.5e-3, cap=1) == (0.0,)  # nothing to decide at τ = 1


def test_adaptive_turns_the_stop_rule_off_when_it_measures_slower() -> None:
    # Steps drafted under the stop rule emit 2 tokens, steps without it 5, at the same cost: the policy
    # must notice and draft mostly without the rule, keeping a minority of steps on it to re-check.
    p = AdaptivePolicy()
    _calibrated(p)
    p.begin(ctx_for("r", 0, 0, 0))
    arms = []
    for step in range(400):
        d = p.next_tau(ctx_for("r", step, 3 * step, step))
        arms.append(d.rule is not None)
        n_acc = min(d.tau, 1 if d.rule is not None else 4)
        p.observe(record_for("r", step, d.tau, n_acc, probs=[0.9] * d.tau))
    assert sum(arms[:40]) >= 15  # both arms measured at first
    assert sum(arms[-200:]) <= 200 / 8 + 1, sum(arms[-200:])  # then the rule only on check steps
    assert sum(arms[-200:]) >= 200 / 32 - 1  # ... which never stop
    assert not p.arms.prefer_rule()
    d = p.next_tau(ctx_for("r", 1, 3, 1))
    assert d.rule is None and "stop rule off (measured slower)" in d.reason, d.reason


def test_arm_comparison_prefers_the_rule_until_it_is_measured_slower() -> None:
    from specdec.policy.estimates import ArmComparison

    arms = ArmComparison()
    assert arms.prefer_rule() and arms.gap() is None
    for _ in range(40):
        arms.observe(1, 4, 0.010)
        arms.observe(0, 4, 0.0101)  # 1 % apart: noise, the rule stays
    assert arms.prefer_rule() and arms.gap() == pytest.approx(0.0101 / 0.010 - 1, rel=1e-6)
    for _ in range(300):
        arms.observe(1, 4, 0.010)
        arms.observe(0, 5, 0.010)  # without the rule: 25 % more tokens for the time
    assert not arms.prefer_rule()
    assert arms.clear()


def test_arm_comparison_does_not_switch_the_rule_off_on_noise() -> None:
    from specdec.policy.estimates import ArmComparison

    rng = random.Random(0)  # deterministic
    arms = ArmComparison()
    for _ in range(60):  # per-step tokens vary 1..8 on both arms; without the rule 8 % ahead on average
        arms.observe(1, rng.randint(1, 8), 0.010)
        arms.observe(0, rng.randint(1, 8), 0.0092)
    assert arms.gap() is not None and arms.gap() < -0.03  # measured slower by more than the tolerance ...
    assert not arms.clear() and arms.prefer_rule()  # ... but within noise: the rule stays


def test_arm_decay_is_shared() -> None:
    from specdec.policy.estimates import ArmComparison

    arms = ArmComparison()
    for _ in range(50):
        arms.observe(0, 4, 0.010)
        arms.observe(1, 4, 0.010)
    before = arms.steps[0] / arms.steps[1]
    # Both arms decay with every step: a stretch where only one arm runs does not age the other's evidence
    # differently (the arms cover the same requests).
    before = arms.steps[0] / arms.steps[1]
    for _ in range(100):
        arms.observe(1, 4, 0.010)
    assert arms.steps[0] / (arms.steps[1] - sum(0.999**i for i in range(100))) == pytest.approx(before, rel=1e-6)


def test_adaptive_holds_tau_one_near_break_even_and_falls_back_below() -> None:
    # One draft in 6 accepted (α ≈ 0.17) with these costs: a drafted token is worth about what it
    # costs (1.17 / 1.14 of a plain step), so it neither speculates in earnest nor stops looking.
    p = AdaptivePolicy(early_stop=False)
    reasons, drafts = [], 0
    p.begin(ctx_for("r", 0, 0, 0))
    for step in range(200):
        d = p.next_tau(ctx_for("r", step, step, step))
        reasons.append(d.reason)
        drafts += d.tau > 0
        p.observe(record_for("r", step, d.tau, int(d.tau > 0 and drafts % 6 == 0)))
    assert sum(r.startswith("hold tau=1") for r in reasons[100:]) >= 30, reasons[100:]
    useless = drive(AdaptivePolicy(early_stop=False), lambda s, t: 0, 200)
    assert useless[100:].count(0) >= 90  # well below break-even it still falls back


def test_adaptive_detects_a_shift_within_a_request() -> None:
    # A code span where everything is accepted, then prose where nothing is: the CUSUM flags the shift
    # at once and τ falls to plain steps. Known limit: after a perfect history the deeper positions'
    # rates stay stale (nothing tests them once position 1 fails), so it takes ~20 steps, not 2.
    p = AdaptivePolicy(early_stop=False)
    p.begin(ctx_for("q", 0, 0, 0))
    taus, changes_at_switch = [], 0
    for step in range(80):
        d = p.next_tau(ctx_for("q", step, step, step))
        taus.append(d.tau)
        if step == 40:
            changes_at_switch = p._requests["q"].changes
        p.observe(record_for("q", step, d.tau, d.tau if step < 40 else 0))
        if step == 42:
            assert p._requests["q"].changes > changes_at_switch  # detected within 3 outcomes
    assert min(taus[30:40]) >= 6
    assert taus[62:].count(0) >= 9 and max(taus[62:]) <= 1 + max(p.min_backoff, 1), taus[40:]


def test_adaptive_reasons_reach_the_step_records_in_the_simulator() -> None:
    from dataclasses import replace

    from specdec.simulate import WORKLOADS, load_costs, simulate

    seen: list[StepRecord] = []
    policy = AdaptivePolicy()
    observe = policy.observe_step
    policy.observe_step = lambda rs: (seen.extend(rs), observe(rs))  # type: ignore[method-assign]
    simulate(policy, replace(WORKLOADS["phases"], requests=10), load_costs("gpu-70b"), seed=0)
    reasons = {r.reason.split(":")[0].split(" ")[0] for r in seen}
    assert all(r.reason for r in seen)
    assert {"goodput", "explore"} <= reasons, reasons


def test_adaptive_uses_the_measured_verify_curve() -> None:
    p = AdaptivePolicy()
    for k in range(1, 9):  # block of k+1 tokens costs k+1 times one token: no parallelism at all
        for _ in range(4):
            p.costs.observe(k, k, DRAFT_S * k, VERIFY_S * (k + 1), 0.0)
    assert p.costs.verify(9) == pytest.approx(VERIFY_S * 9, rel=1e-6)
    assert p.costs.verify(5) > 4 * VERIFY_S


# -- budgets ----------------------------------------------------------------------------------


def test_adaptive_raises_tau_when_the_hard_budget_is_tight() -> None:
    free = drive(AdaptivePolicy(early_stop=False), bernoulli(0.85, seed=1), 60, max_new=400)
    capped = drive(AdaptivePolicy(early_stop=False), bernoulli(0.85, seed=1), 60, max_new=400, cap=60)
    assert sum(capped[20:]) > sum(free[20:])
    assert all("budget" in r for r in [AdaptivePolicy().next_tau(ctx_for("r", 0, 0, 0, max_new=400, cap=50)).reason])


def test_fleet_ledger_keeps_every_window_at_or_under_budget_and_lends() -> None:
    rng = random.Random(7)
    ledger = FleetBudget(2.0, window=8)
    used: list[int] = []
    for i in range(300):
        allowance = ledger.open(str(i))
        u = min(allowance, rng.choice([1, 1, 1, 2, 6, 9]))  # mostly short, some long requests
        ledger.close(str(i), u)
        used.append(u)
    assert max(sum(used[i : i + 8]) for i in range(len(used) - 7)) <= 16
    assert max(used) > 2  # long requests borrowed what short ones left


def test_fleet_policy_stops_a_request_at_its_allowance() -> None:
    p = FleetBudgetPolicy(make_policy("fixed", tau=2), budget=2.0, window=4)
    taus = drive(p, lambda s, t: 0, 50)  # never accepts: needs many passes
    assert len(taus) == 2  # allowance 2: B with no history to borrow from
    assert p.ledger.allowance("r") is None  # closed at end


def test_every_policy_keeps_greedy_output_identical_in_the_engine(tiny_models: dict) -> None:
    import specdec

    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32")
    prompt = "def fibonacci(n):"
    plain = engine.generate(prompt, max_new_tokens=24, tau=0).token_ids
    for name in ("heuristic", "confidence", "adaptive"):
        res = engine.generate(prompt, max_new_tokens=24, policy=name)
        assert res.token_ids == plain, name
        assert all(r.policy == name and r.reason for r in res.records)
    capped = engine.generate(prompt, max_new_tokens=24, policy="adaptive", max_verify_passes=3)
    assert capped.stats.target_passes <= 3 and capped.token_ids == plain[: len(capped.token_ids)]


def test_draft_line_separates_the_cold_first_forward() -> None:
    """Draft seconds by depth with a cold first forward (0.4 ms, then 0.07 ms per further forward): the fitted line
    recovers both, where the mean per forward would price every further token at the first one's cost; one depth
    alone gives the proportional line."""
    from specdec.policy.estimates import DraftLine, StepCosts

    line = DraftLine()
    for _ in range(20):
        for depth in (1, 2, 4, 7):
            line.observe(depth, 0.4e-3 + 0.07e-3 * (depth - 1))
    d0, d1 = line.line()
    assert d0 == pytest.approx(0.4e-3, rel=0.05) and d1 == pytest.approx(0.07e-3, rel=0.1)
    assert line(0) == 0.0 and line(5) == pytest.approx(0.4e-3 + 4 * 0.07e-3, rel=0.05)
    alone = DraftLine()
    for _ in range(10):
        alone.observe(3, 0.9e-3)
    assert alone(1) == pytest.approx(0.3e-3) and alone(6) == pytest.approx(1.8e-3)
    # The solo step costs read it: going from 1 to 6 drafted tokens costs 5 further forwards, not 5 first ones.
    costs = StepCosts()
    for depth in (1, 2, 4, 7) * 10:
        costs.observe(depth, depth, 0.4e-3 + 0.07e-3 * (depth - 1), 1e-3, 0.0)
    times = costs.step_times(6)
    assert times[6] - times[1] == pytest.approx(5 * 0.07e-3, abs=0.05e-3)


def test_a_measured_draft_slope_prices_the_depths_steps_never_ran() -> None:
    """A batch drafting at one depth only (a plan keeps its depth) measures one point of its draft line: ridged toward
    the proportional line, the further forwards cost as much as the cold first one (depth 5 priced 1.5-2 ms dear at 16
    sequences, and the plans stayed shallow); with the slope measured apart from the steps (``prime``), the line
    through the steps' point has that slope, and a batch prices depth 5 at 3 further forwards beyond depth 2."""
    from specdec.policy.estimates import BatchCosts, DraftLine, StepCosts

    alone = DraftLine()
    for _ in range(20):
        alone.observe(2, 3.0e-3)
    assert alone.line() == pytest.approx((1.5e-3, 1.5e-3))
    assert alone.line(prior_slope=0.3e-3) == pytest.approx((2.7e-3, 0.3e-3))

    step = replace(
        record_for("r", 1, 2, 2), draft_time=3.0e-3, verify_time=9e-3, other_time=2e-3, batch_size=16, rows=48,
        drafting=16, draft_passes=2, draft_fed=32,
    )  # fmt: skip

    for measured in ({}, {1: (0.4e-3, 0.12e-3), 16: (1.2e-3, 0.4e-3)}):
        batch = BatchCosts(measured_lines=dict(measured))
        fresh = batch.pricer(16, StepCosts())
        if measured:  # before any step: the measured line itself
            assert fresh(48, 2, 16) - fresh(48, 0, 0) == pytest.approx(1.6e-3)
        for i in range(30):
            batch.observe(replace(step, verify_time=9e-3 + i * 1e-9))  # one depth, step after step
        price = batch.pricer(16, StepCosts())
        further = (price(96, 5, 16) - price(96, 2, 16)) / 3
        assert further == pytest.approx(0.4e-3 if measured else 1.5e-3, rel=0.05)
        assert price(48, 2, 16) - price(48, 0, 0) == pytest.approx(3.0e-3, rel=0.01)  # what the steps measured
    assert BatchCosts(measured_lines={1: (0.4e-3, 0.1e-3), 16: (1.9e-3, 0.4e-3)}).measured_line(6) == pytest.approx(
        (0.9e-3, 0.2e-3)
    )


def test_excess_fit_recovers_a_line_and_keeps_its_slope_at_zero_or_above() -> None:
    """The excess beyond what was measured apart as a + c·x (decayed least squares, the slope ridged toward its
    prior): recovered from steps whose size varies; a slope the data would make negative is held at 0 (a size must
    not look cheaper the larger it is) and the level refitted without it. Seeded data, no noise: cannot flake."""
    from specdec.policy.estimates import ExcessFit

    rng = random.Random(0)
    fit = ExcessFit()
    assert fit.coefficients() == (0.0, 0.0) and fit.weight == 0.0
    for _ in range(300):
        shape = rng.uniform(3.0, 16.0)
        fit.observe(shape, 2e-3 + 0.25e-3 * shape)
    a, c = fit.coefficients()
    assert (a, c) == pytest.approx((2e-3, 0.25e-3), rel=0.04)  # the ridge pulls the slope ~2% toward 0 here
    assert fit(12.0) == pytest.approx(2e-3 + 3e-3, rel=0.01)

    falling = ExcessFit()
    for i in range(200):
        shape = 4.0 + i % 12
        falling.observe(shape, 6e-3 - 0.2e-3 * shape)  # dearer the shorter the step: noise, not a cost
    a, c = falling.coefficients()
    assert c == 0.0
    weights = [falling.decay ** (199 - i) for i in range(200)]  # the level: the mean excess, as decayed
    mean = sum(w * (6e-3 - 0.2e-3 * (4.0 + i % 12)) for i, w in enumerate(weights)) / sum(weights)
    assert a == pytest.approx(mean, rel=1e-6)


def test_a_batch_planners_excess_fit_keeps_a_shape_slope_where_its_steps_ran_one_depth() -> None:
    """Steps of one depth alone (one shape, 13 ms) whose drafts and passes measured 3 ms beyond it: the batch planner's
    fit (its shape slope ridged toward EXCESS_SHAPE_PRIOR) prices a shallower step's shape (5 ms) below the deep one's
    excess by about the prior's slope, where a fit ridged toward 0 prices every shape at the same 3 ms (the constant
    that made every shallower depth look dear). Spread data still moves the slope where it is. No noise: cannot
    flake."""
    from specdec.policy.estimates import EXCESS_SHAPE_PRIOR, ExcessFit, batch_excess_fit

    flat, planner = ExcessFit(), batch_excess_fit()
    for _ in range(200):
        flat.observe(13.0, 3e-3)
        planner.observe(13.0, 3e-3)
    assert flat(5.0) == pytest.approx(3e-3, rel=1e-3)
    assert planner(13.0) == pytest.approx(3e-3, rel=1e-3)
    assert planner(5.0) == pytest.approx(3e-3 - 8 * EXCESS_SHAPE_PRIOR, rel=0.02)
    spread = batch_excess_fit()
    for i in range(300):
        shape = 4.0 + i % 12
        spread.observe(shape, -1e-3 + 0.1e-3 * shape)
    assert spread.coefficients()[1] == pytest.approx(0.1e-3, rel=0.1)  # the prior pulls it ~5% here


def test_a_plain_step_is_not_priced_below_its_share_of_shapes_measured_on_a_busy_machine() -> None:
    """Shapes measured apart from the steps while the machine was busy (every pass and draft line 1.6x what it costs
    quiet), then 200 steps of 4 sequences at depth 5 alone, each at its quiet cost (the shape ÷ 1.6): their excess is
    a share of the shape below zero. Read on the fitted line (slope ridged toward the prior, the intercept carrying
    the rest), a plain step's small shape went far below its cost (a traced server priced its plain 4-sequence steps at
    0.75-1.11 ms where they took 1.96 and flipped between plain and shallow steps, session 76); below the shapes the
    steps ran, the excess keeps the share it had at the least of them. Steps of two depths learn the share as the
    line's slope (below 0, no steeper than the line through 0). A positive excess at a shallower shape still reads on
    the line. No noise: cannot flake."""
    from specdec.policy.estimates import StepCosts, batch_excess_fit

    policy = shaped_policy()
    batch = policy.batch_costs
    busy, rest = 1.6, 0.5e-3
    for i in range(200):
        steps = [
            replace(
                record_for(f"s{k}", i + 1, 5, 3),
                other_time=rest,
                draft_time=(batch.measured_shape(24, 5, 4) - batch.measured_pass(24)) / busy,
                verify_time=batch.measured_pass(24) / busy,
                batch_size=4,
                rows=24,
                drafting=4,
                draft_passes=5,
                draft_fed=8,
            )
            for k in range(4)
        ]
        batch.observe_step(steps)
    assert batch.shaped_excess
    price = batch.pricer(4, StepCosts())
    deep = batch.measured_shape(24, 5, 4) / busy + rest
    assert price(24, 5, 4) == pytest.approx(deep, rel=0.02)
    for rows, depth in ((4, 0), (8, 1), (12, 2)):
        truth = batch.measured_shape(rows, depth, 4) / busy + rest
        assert price(rows, depth, 4) == pytest.approx(truth, rel=0.05), (rows, depth)
    # Steps of two depths (plain 3 steps in 5, depth 2 the others: a plan flipping between them), 16 sequences: their
    # excess is a share of each shape (and 10% more for the event loop's share), and each depth is priced at its own
    # cost. Held to a slope of 0 or more, the line put the mean excess on both: plain too cheap, depth 2 too dear.
    policy = shaped_policy()
    batch = policy.batch_costs
    for i in range(200):
        depth = 2 if i % 5 in (1, 3) else 0
        rows = 16 * (depth + 1)
        draft = batch.measured_shape(rows, depth, 16) - batch.measured_pass(rows)
        steps = [
            replace(
                record_for(f"s{k}", i + 1, depth, depth),
                other_time=rest,
                draft_time=draft * 1.1 / busy,
                verify_time=batch.measured_pass(rows) * 1.1 / busy,
                batch_size=16,
                rows=rows,
                drafting=16 if depth else 0,
                draft_passes=depth,
                draft_fed=32 if depth else 0,
            )
            for k in range(16)
        ]
        batch.observe_step(steps)
    price = batch.pricer(16, StepCosts())
    for rows, depth in ((16, 0), (48, 2), (32, 1), (64, 3)):
        truth = batch.measured_shape(rows, depth, 16) * 1.1 / busy + rest
        assert price(rows, depth, 16) == pytest.approx(truth, rel=0.05), (rows, depth)
    # Where the steps ran beyond their shapes, a smaller shape still reads on the line (its slope the prior's).
    above = batch_excess_fit()
    for _ in range(100):
        above.observe(4.0, 3e-3)
    a, c = above.coefficients()
    assert c > 0.0 and above(2.0) == pytest.approx(a + 2.0 * c)


def test_a_first_batch_after_lone_requests_prices_its_rest_as_a_share_more_per_sequence_not_proportionally() -> None:
    """A server's lone requests teach the rest of a one-sequence step (0.6 ms here); the first batch of 16 that follows
    has no rest of its own measured yet. Priced proportionally (16 x 0.6 = 9.6 ms), every plain or shallow step looked
    as dear as that fixed cost, and a fresh server's first plans at 16 clients went 5-7 deep; a step of 16 sequences
    rests 1.2-1.6 ms through a server. Each further sequence adds REST_SEQUENCE_GROWTH of a lone one's rest until
    measured; a measured size still reads as measured. Deterministic."""
    from specdec.policy.estimates import REST_SEQUENCE_GROWTH, BatchCosts, StepCosts

    costs = BatchCosts()
    for step in range(1, 6):
        costs.observe_step([replace(record_for("lone", step, 2, 2), other_time=0.6e-3, batch_size=1, rows=3)])
    rest = costs.rest(16, StepCosts())
    assert rest == pytest.approx(0.6e-3 * (1 + REST_SEQUENCE_GROWTH * 15), rel=0.05)
    assert 1.0e-3 < rest < 2.5e-3
    for step in range(6, 12):  # a batch of 16's own rests, once measured, are what it reads
        costs.observe_step(
            [replace(record_for(f"s{k}", step, 2, 2), other_time=1.4e-3, batch_size=16, rows=48) for k in range(16)]
        )
    assert costs.rest(16, StepCosts()) == pytest.approx(1.4e-3, rel=0.05)


def test_a_batch_step_is_priced_as_its_shapes_their_excess_by_the_shape_and_a_rest_by_its_sequences() -> None:
    """The two parts of what a server's steps cost beyond their quiet shapes, each learnt against its own size: the
    drafts' and passes' excess grows with the shape (a share of the kernel's time goes to the event loop), the rest
    with the sequences (commits, detokenising, messages). A server's levels run more sequences and longer steps
    together: 4 sequences at depth 7 and 16 at depth 7, each step's kernel excess 20% of its shape less 0.5 ms and its
    rest 0.3 + 0.1 ms a sequence. Priced, a 16-sequence step at depth 2 (never run) costs its shape, its excess at
    that shape and the 16 sequences' rest; fitted as one line in both sizes the excess would have gone on either
    size (the fit before session 59 put it on the sequences: that depth priced by the deep steps' excess). Seeded
    data, no noise: cannot flake."""
    from specdec.policy.estimates import EXCESS_WARM, StepCosts

    policy = shaped_policy()
    batch = policy.batch_costs

    def shape(depth: int, n: int) -> float:
        return batch.measured_shape(n * (depth + 1), depth, n)

    def kernel_excess(s: float) -> float:
        return 0.2 * s - 0.5e-3

    for i in range(300):
        n = 4 if i % 2 else 16
        draft = batch.measured_shape(0, 7, n) - batch.measured_pass(0)
        rows = n * 8
        records = [
            replace(
                record_for(f"s{k}", i + 1, 7, 3),
                other_time=0.3e-3 + 0.1e-3 * n,
                draft_time=draft,
                verify_time=batch.measured_pass(rows) + kernel_excess(shape(7, n)),
                batch_size=n,
                rows=rows,
                drafting=n,
                draft_passes=7,
                draft_fed=2 * n,
            )
            for k in range(n)
        ]
        batch.observe_step(records)
    assert batch.excess.weight >= EXCESS_WARM and batch.shaped_excess
    price = batch.pricer(16, StepCosts())
    for depth in (2, 7):
        truth = shape(depth, 16) + kernel_excess(shape(depth, 16)) + 0.3e-3 + 1.6e-3
        assert price(16 * (depth + 1), depth, 16) == pytest.approx(truth, rel=0.02)
    assert batch.pricer(4, StepCosts())(8, 1, 4) == pytest.approx(
        shape(1, 4) + kernel_excess(shape(1, 4)) + 0.7e-3, rel=0.02
    )


# Shapes measured apart from the steps, for the excess tests: a target pass by rows, a draft line by sequences.
SHAPE_PASSES = {16: 2.5e-3, 32: 4.2e-3, 64: 8.0e-3, 128: 15.6e-3}
SHAPE_LINES = {1: (0.2e-3, 0.05e-3), 16: (0.63e-3, 0.33e-3)}


def shaped_policy() -> AdaptivePolicy:
    policy = AdaptivePolicy()
    policy.prime(MeasuredCosts(SHAPE_PASSES, {}, SHAPE_LINES))
    return policy


def shaped_step(
    policy: AdaptivePolicy, i: int, depth: int, accepted: int, beyond: float, rest: float
) -> list[StepRecord]:
    """Step ``i`` of 16 sequences drafting ``depth`` tokens (``accepted`` of each kept): its draft as its measured line,
    its pass its measured shape + ``beyond``, its rest ``rest``."""
    batch = policy.batch_costs
    rows = 16 * (depth + 1)
    draft = SHAPE_LINES[16][0] + SHAPE_LINES[16][1] * (depth - 1)
    return [
        replace(
            record_for(f"s{k}", i + 1, depth, accepted),
            other_time=rest,
            draft_time=draft,
            verify_time=batch.measured_pass(rows) + beyond,
            batch_size=16,
            rows=rows,
            drafting=16,
            draft_passes=depth,
            draft_fed=32,
        )
        for k in range(16)
    ]


def test_a_batch_plan_prices_a_depth_it_left_by_the_measured_shapes_plus_the_steps_excess() -> None:
    """Shapes measured apart from the steps (a pass by rows, a draft line by sequences). A server's first steps ran
    depth 2 (48 rows) cold, 7 ms beyond their shapes; it then ran depth 5 for 150 steps, 3 ms beyond them and a
    rest of 1.5 ms. Every depth, the one left and a plain step too, is priced as its shapes plus the one excess the
    recent steps measure beyond theirs: 4.5 ms, whatever depth measured it."""
    from specdec.policy.estimates import EXCESS_WARM, StepCosts

    policy = shaped_policy()
    batch = policy.batch_costs
    assert batch.shaped and batch.measured_pass(48) == pytest.approx(6.1e-3) and batch.measured_pass(96) == 11.8e-3

    # Before any step: the curves (primed with the same shapes; nothing measured beyond them yet).
    assert batch.pricer(16, StepCosts())(48, 2, 16) == pytest.approx(6.1e-3 + 0.96e-3, rel=0.05)
    for i in range(10):
        batch.observe_step(shaped_step(policy, i, 2, 1, 7e-3, 1.5e-3))
    assert batch.excess.weight >= EXCESS_WARM
    for i in range(150):
        batch.observe_step(shaped_step(policy, 10 + i, 5, 4, 3e-3, 1.5e-3))
    price = batch.pricer(16, StepCosts())
    shape2 = 6.1e-3 + 0.63e-3 + 0.33e-3
    assert price(48, 2, 16) == pytest.approx(shape2 + 4.5e-3, abs=0.1e-3)
    assert price(96, 5, 16) == pytest.approx(11.8e-3 + 0.63e-3 + 4 * 0.33e-3 + 4.5e-3, abs=0.1e-3)
    assert price(16, 0, 0) == pytest.approx(2.5e-3 + 4.5e-3, abs=0.1e-3)


def test_a_shallow_depth_is_priced_by_an_excess_that_grows_with_the_shape_not_by_the_deep_steps_level() -> None:
    """A server whose steps cost 3 ms + 0.3x their measured shapes beyond them (what traced servers measured: the
    event loop's streaming and the rest grow with a longer step), while the policy runs depth 5 and explores depth 6
    one step in 8, every step making the same tokens (acceptance does not follow the depth). A depth it never runs
    (2) is priced from the excess's slope on the shape (shrunk toward 0 by the ridge: its one explored depth is a
    narrow spread): most of the way from the deep steps' level to what such a step costs, never below it. Learnt as a
    level (or against the tokens a step makes, the regressor before session 48) it would be priced 2 ms too dear, the
    deep steps' excess carried to the shallow one. Seeded data, no noise: cannot flake."""
    from specdec.policy.estimates import StepCosts

    policy = shaped_policy()
    batch = policy.batch_costs

    def shape(depth: int) -> float:
        return batch.measured_shape(16 * (depth + 1), depth, 16)

    def excess(depth: int) -> float:
        return 3e-3 + 0.3 * shape(depth)

    for i in range(240):
        depth = 6 if i % 8 == 7 else 5
        batch.observe_step(shaped_step(policy, i, depth, 1, excess(depth) - 1e-3, 1e-3))
    price = batch.pricer(16, StepCosts())
    assert price(96, 5, 16) == pytest.approx(shape(5) + excess(5), abs=0.2e-3)
    truth2, level = shape(2) + excess(2), excess(5) - excess(2)  # what a level would overprice depth 2 by
    assert level > 1.9e-3
    assert truth2 - 0.1e-3 <= price(48, 2, 16) <= truth2 + 0.4 * level


def test_a_pass_curve_prices_a_size_from_its_neighbourhood_not_its_one_slow_step() -> None:
    """Passes of 40-120 rows costing 2 ms + 0.1 ms per row (±4%), each size seen twice, and one step at 80 rows
    pre-empted (twice as long): the curve at 80 is pulled toward its neighbourhood (its own mean alone: +37%), and
    sizes between those seen follow the line, not the slow neighbour."""
    from specdec.policy.estimates import CurveEWMA

    def truth(rows: int) -> float:
        return 2e-3 + 0.1e-3 * rows

    curve, alone = CurveEWMA(), CurveEWMA(window=1.0)
    for c in (curve, alone):
        for rep in range(2):
            for rows in range(40, 121, 8):
                c.observe(rows, truth(rows) * (1.04 if (rows // 8 + rep) % 2 else 0.96))
        c.observe(80, 2 * truth(80))
    assert alone(80, 1.0) > 1.3 * truth(80)  # a size's own mean
    assert curve(80, 1.0) - truth(80) < 0.75 * (alone(80, 1.0) - truth(80))
    assert curve(84, 1.0) == pytest.approx(truth(84), rel=0.15) and curve(60, 1.0) == pytest.approx(truth(60), rel=0.08)
    assert curve(1, 1.0) == curve(40, 1.0) and curve(10_000, 1.0) > curve(120, 1.0)  # flat below, growing beyond


def test_a_pass_curve_between_sizes_measured_a_doubling_apart_is_their_line() -> None:
    """A server measures its passes at 1, 2, 4 .. 128 rows as it starts. A size half way between two of them in log
    size (48 between 32 and 64, 96 between 64 and 128: depth 2 and 5 of 16 sequences) has the lower one at the edge of
    its neighbourhood: it must lie on the line between the two, not at the upper one's cost (it was priced as 64 rows,
    and the plans never chose depth 2 at 16 sequences)."""
    from specdec.policy.estimates import CurveEWMA

    measured = {1: 2.1e-3, 2: 1.9e-3, 4: 2.0e-3, 8: 2.4e-3, 16: 3.3e-3, 32: 5.4e-3, 64: 9.1e-3, 128: 16.5e-3}
    curve = CurveEWMA()
    for rows, seconds in measured.items():
        curve.observe(rows, seconds)
    for rows, lo, hi in ((48, 32, 64), (96, 64, 128), (24, 16, 32), (12, 8, 16)):
        line = measured[lo] + (measured[hi] - measured[lo]) * (rows - lo) / (hi - lo)
        assert curve(rows, 1.0) == pytest.approx(line, rel=0.02), rows
    assert all(curve(rows, 1.0) == pytest.approx(seconds) for rows, seconds in measured.items())


def test_a_pass_curve_answers_from_its_cache_what_it_would_compute_afresh() -> None:
    """The curve keeps its neighbourhood fits between observations (a plan and the step bias ask for the same sizes);
    any observation near a kept size must drop it. Random observations and queries (seed 5), every answer compared with
    the same curve asked with nothing kept."""
    from specdec.policy.estimates import CurveEWMA

    rng = random.Random(5)
    curve = CurveEWMA()
    for _ in range(2000):
        if rng.random() < 0.4:
            rows = rng.choice([rng.randint(1, 24), rng.randint(1, 300)])
            curve.observe(rows, 1e-3 + 1e-4 * rows * rng.uniform(0.8, 1.6))
        elif curve.seen:
            rows = rng.randint(1, 320)
            got = curve(rows, 1.0)
            kept, curve._within_cache = curve._within_cache, {}
            assert got == curve(rows, 1.0), rows
            curve._within_cache = kept


def test_a_plain_batch_probes_one_deeper_whatever_its_costs_predict() -> None:
    """Drafting priced far above its worth (costs learnt at a bad moment): the batch plan goes plain, but a step now
    and then drafts one token anyway (after EXPLORE_EVERY steps, then twice as far apart while each confirms the
    plan), so the draft's cost gets measured again (a server at 4 clients had stayed plain for good)."""
    from specdec.policy.adaptive import EXPLORE_EVERY

    policy = AdaptivePolicy()
    for step in range(20):  # one-sequence steps where a drafted token cost 50 ms: drafting never pays
        policy.observe(replace_times(record_for("warm", step, 2, 2), draft=0.1))
    for i in range(4):
        policy.begin(ctx_for(f"b{i}", 0, 0, 0))
    taus = []
    for step in range(4 * EXPLORE_EVERY):
        plan = policy.plan([ctx_for(f"b{i}", step, step, step) for i in range(4)])
        taus.append(max(d.tau for d in plan))
    assert taus.count(0) >= 3 * EXPLORE_EVERY  # plain, as predicted ...
    assert 2 <= sum(t > 0 for t in taus) <= 4  # ... but a step now and then drafts (8 steps in, then 16 later)


def flat_batch_records(plan: list[Decision], step: int) -> list[StepRecord]:
    """The records of a 16-sequence step run as ``plan`` decided, on flat costs (drafts and rows nearly free): its
    requests s0..s15, each draft keeping 5 tokens at most and every one below that."""
    depth = max(d.tau for d in plan)
    return [
        replace(
            record_for(f"s{k}", step, d.tau, min(d.tau, 5)),
            draft_time=0.1e-3 + 0.01e-3 * depth,
            verify_time=2.0e-3 + 0.002e-3 * 16 * (depth + 1),
            other_time=0.5e-3,
            batch_size=16,
            rows=16 * (depth + 1),
            drafting=16,
            draft_passes=depth,
            draft_fed=16,
        )
        for k, d in enumerate(plan)
    ]


def test_a_drafting_batch_explores_one_deeper_and_halfway_down_in_turn() -> None:
    """A batch drafting deep on flat predictions (drafts and rows nearly free, 5 tokens of a draft kept): its exploring
    steps look one deeper and halfway down in turn (from depth 6: 7, then 3; halfway down alone where one deeper is
    not predicted nearly as good), so the cost curves and the excess fit see shapes on both sides of the depth it
    runs. Explored one deeper only, a server at 16 clients drifted from depth 3 to 7-8 within its first plans, its
    excess fitted on deep steps alone priced depth 3 at 22 ms a step where τ = 3's steps took 15, and it never ran a
    shallow step to learn otherwise (0.83-0.92x τ = 3 in four load tests, session 53).
    Deterministic (no random draws): cannot flake."""
    from specdec.policy.adaptive import EXPLORE_EVERY

    policy = AdaptivePolicy()
    policy.prime(MeasuredCosts({16: 2.0e-3, 128: 2.2e-3}, {}, {16: (0.1e-3, 0.01e-3)}))
    ctxs = [ctx_for(f"s{k}", 0, 0, 0) for k in range(16)]
    for ctx in ctxs:
        policy.begin(ctx)
    policy._batch_depth = 6
    explored: list[tuple[int, int]] = []  # (the exploring step's depth, the plan's)
    for step in range(16 * EXPLORE_EVERY):  # (the explorations space out while the depth holds: 8, 16, 32 ... apart)
        plan = policy.plan([ctx_for(f"s{k}", step, 8 * step, step) for k in range(16)])
        depth = max(d.tau for d in plan)
        if "explore" in plan[0].reason:  # against the depth the plan searched (kept for the steps after it)
            explored.append((depth, policy._batch_depth))
        policy.observe_step(flat_batch_records(plan, step + 1))
    assert len(explored) >= 4
    assert all(d in (base + 1, (base + 1) // 2) for d, base in explored), explored
    # both ways (the mutant, one deeper only, never explores below its depth), and never one deeper twice running
    up = [d > base for d, base in explored]
    assert any(up) and not all(up), explored
    assert not any(a and b for a, b in zip(up, up[1:])), explored


def test_a_batch_explores_on_the_step_after_its_plan_not_on_the_plans_own_step() -> None:
    """A batch that replays its plans explores on the first step a plan is replayed on, never on the step the plan is
    made on: that step carries the policy's fresh plan and its learning of the steps before (through a server, the
    event loop's backlog then runs beside the next pass: such steps measured 0-15% slower than replayed ones at the same
    depth, a bias against the depth explored). Every other step of the plan replays its depth. Deterministic."""
    from specdec.policy.adaptive import EXPLORE_EVERY

    policy = AdaptivePolicy()
    policy.prime(MeasuredCosts({16: 2.0e-3, 128: 2.2e-3}, {}, {16: (0.1e-3, 0.01e-3)}))
    for k in range(16):
        policy.begin(ctx_for(f"s{k}", 0, 0, 0))
    policy._batch_depth = 6
    planned, explored, depths = [], [], []
    for step in range(16 * EXPLORE_EVERY):
        until = policy._reuse_until
        plan = policy.plan([ctx_for(f"s{k}", step, 8 * step, step) for k in range(16)])
        if policy._reuse_until != until:  # a plan made afresh on this step
            planned.append(step)
        if "explore" in plan[0].reason:
            explored.append(step)
        depths.append(max(d.tau for d in plan))
        policy.observe_step(flat_batch_records(plan, step + 1))
    assert len(explored) >= 4 and len(planned) >= 8
    assert all(step - 1 in planned for step in explored), (planned, explored)
    assert not set(explored) & set(planned)
    for step in explored:  # the step after it is the plan's depth again (replayed)
        if step + 1 < len(depths) and step + 1 not in planned:
            assert depths[step + 1] == depths[step - 1] != depths[step], (step, depths)


def test_a_rotating_batch_explores_with_the_requests_its_next_step_holds() -> None:
    """32 requests served by steps of 16 (``--max-batch 16``): the steps rotate between two halves, and the step after
    a plan holds none of the plan's requests. The exploration the plan decided runs there, with the requests that step
    holds (each given its plan on joining), and the step after that replays the plan's depth. Deterministic."""
    policy = AdaptivePolicy()
    policy.prime(MeasuredCosts({16: 2.0e-3, 128: 2.2e-3}, {}, {16: (0.1e-3, 0.01e-3)}))
    halves = [[f"a{k}" for k in range(16)], [f"b{k}" for k in range(16)]]
    for rid in halves[0] + halves[1]:
        policy.begin(ctx_for(rid, 0, 0, 0))
    policy._batch_depth, policy._explored = 6, -100  # an exploration is due at the next plan
    steps = [policy.plan([ctx_for(rid, i, 8 * i, i) for rid in halves[i % 2]]) for i in range(3)]
    assert not any("explore" in d.reason for d in steps[0])  # the plan's own step
    depth = max(d.tau for d in steps[0])
    assert all("explore" in d.reason for d in steps[1]) and max(d.tau for d in steps[1]) != depth
    assert all(policy._requests[rid].plan is not None for rid in halves[1])
    assert not any("explore" in d.reason for d in steps[2]) and max(d.tau for d in steps[2]) == depth


def test_with_row_groups_a_look_down_lands_where_the_next_depth_would_begin_a_group() -> None:
    """Where a pass pays for each group of 16 rows it begins (the AMX build), an exploration below the depth looks at
    the deepest depth at most halfway down whose next depth begins a further group: 4 sequences at depth 7 (32 rows,
    two groups) look at depth 3 (16 rows, one group), not at 4 (20 rows: a second group for 4 more rows, the price of
    depth 7's pass for fewer tokens), and from depth 9 at 3 too; 16 sequences at depth 7 at 4 (80 rows, five groups
    full), at depth 3 at 2; 5 sequences at depth 7 at 2 (15 rows). Where the depth's own pass begins a group it leaves
    part empty and the depth below begins none, at the depth below (8 sequences at depth 4). Without groups, halfway
    down. Deterministic."""
    from specdec.policy.adaptive import _look_down

    def rows(n: int, other: int = 0) -> list[int]:
        return [other + n * (d + 1) for d in range(12)]

    assert _look_down(rows(4), 7, 16) == 3
    assert _look_down(rows(4), 9, 16) == 3
    assert _look_down(rows(16), 7, 16) == 4
    assert _look_down(rows(16), 3, 16) == 2
    assert _look_down(rows(5), 7, 16) == 2
    assert _look_down(rows(1), 7, 16) == 4  # every depth in one group: halfway
    assert _look_down(rows(4), 7, 0) == 4 and _look_down(rows(16), 3, 0) == 2
    assert _look_down(rows(4, other=6), 7, 16) == 1  # another policy's 6 rows: depth 2's 18 rows begin a second group
    # Depth 4's own pass begins a group it leaves part empty, depth 3's fills its groups: the look goes to depth 3.
    assert _look_down(rows(8), 4, 16) == 3  # 40 rows (a third group for 8) against 32
    assert _look_down(rows(7), 4, 16) == 3  # 35 against 28
    assert _look_down(rows(8), 4, 0) == 2  # without groups: halfway


def test_a_batchs_explorations_space_out_while_they_confirm_its_depth_and_come_back_when_it_moves() -> None:
    """An exploring step runs a depth predicted worse than the plan's. While the plan after one keeps the depth, the
    next comes twice as many steps later than the last did, up to EXPLORE_EVERY_SETTLED; a plan that moves the depth
    brings them back to EXPLORE_EVERY apart. The batch of the test above: its plans move the depth in their first
    steps and then hold it, so both rules act. Deterministic (no random draws): cannot flake."""
    from specdec.policy.adaptive import EXPLORE_EVERY, EXPLORE_EVERY_SETTLED, REPLAN_EVERY

    policy = AdaptivePolicy()
    policy.prime(MeasuredCosts({16: 2.0e-3, 128: 2.2e-3}, {}, {16: (0.1e-3, 0.01e-3)}))
    for k in range(16):
        policy.begin(ctx_for(f"s{k}", 0, 0, 0))
    explored: list[int] = []  # the steps that explored
    depths: list[int] = []  # the plan's depth after each step's plan
    for step in range(30 * EXPLORE_EVERY):
        plan = policy.plan([ctx_for(f"s{k}", step, 8 * step, step) for k in range(16)])
        if "explore" in plan[0].reason:
            explored.append(step)
        depths.append(policy._batch_depth)
        policy.observe_step(flat_batch_records(plan, step + 1))
    gap, moved, settled = EXPLORE_EVERY, 0, 0
    for a, b in zip(explored, explored[1:]):
        # the plan after an exploration is the one REPLAN_EVERY steps later (16 sequences: plans replayed between)
        if depths[a + REPLAN_EVERY] != depths[a]:
            gap, moved = EXPLORE_EVERY, moved + 1
        else:
            gap = min(2 * gap, EXPLORE_EVERY_SETTLED)
        settled += gap == EXPLORE_EVERY_SETTLED
        assert b - a == gap, (explored, depths)
    assert moved >= 1 and settled >= 3, (explored, depths)  # both rules acted


def replace_times(record: StepRecord, *, draft: float) -> StepRecord:
    return replace(record, draft_time=draft)


def primed_for_batch(ctxs: list[StepContext]) -> AdaptivePolicy:
    """An adaptive policy priced as the batch-plan tests here: a plain 16-sequence step 4 ms, +1 ms of pass per 16
    rows, +1 ms of draft per depth; ``ctxs``' requests begun."""
    policy = AdaptivePolicy()
    policy.prime(MeasuredCosts({16: 4e-3, 32: 5e-3, 48: 6e-3, 64: 7e-3, 80: 8e-3}, {16: 1e-3}))
    for ctx in ctxs:
        policy.begin(ctx)
    return policy


def test_prompt_rows_joining_a_batch_step_are_priced_in_but_do_not_make_every_depth_look_cheap() -> None:
    """Priced as below (a plain 16-sequence step 4 ms, +1 ms of pass per 16 rows, +1 ms of draft per depth; acceptance
    0.6): depth 1 is best. 200 prompt rows joining the pass add ~12.6 ms to every depth's step (the curve's slope beyond
    80 rows). Counted as part of the step, depth 3 would win (34.8 tokens in ~22.6 ms against 25.6 in ~18.6): the
    prefill's seconds would hide what each
    depth costs. They are the prompts' own, in the step whatever the depth: the plan stays at depth 1, and the whole
    step's prediction in its reason counts them."""
    ctxs = [ctx_for(f"s{i}", 0, 0, 0) for i in range(16)]
    policy = primed_for_batch(ctxs)
    plan = policy.plan(ctxs, prompt_rows=200)
    assert max(d.tau for d in plan) == 1
    assert re.search(
        r"25\.6 tokens in 18\.\d\d ms predicted \(step bias \+0\.00 ms, 200 prompt rows 12\.\d\d ms\)", plan[0].reason
    )
    # A step with prompt rows teaches no step bias (its prefill is a request's cost, once).
    records = []
    for i in range(16):
        record = replace(record_for(f"s{i}", 0, 1, 1), draft_time=1e-3, verify_time=18e-3, other_time=7e-3)
        records.append(replace(record, batch_size=16, rows=232, prompt_rows=200, drafting=16, draft_passes=1))
    policy.observe_step(records)
    assert policy._step_bias == [0.0, 0.0]


def test_a_batch_plan_prices_its_steps_with_what_they_measured_beyond_the_curves() -> None:
    """Priced: a plain 16-sequence step 4 ms, each depth +1 ms of pass and +1 ms of draft, acceptance at its 0.6
    prior. Alone, the predicted ratio peaks at depth 1 (25.6 tokens in 6 ms, 4.27 tokens/ms; depth 2 3.92). Where the
    batch's steps measure 6 ms more than their plans priced (what the curves do not see yet: a pass dearer than its
    neighbours, prompts joining a replayed plan), each depth's price carries it: depth 1 2.13 tokens/ms, depth 2
    2.24 (5% more, past the 3% a further position must add), depth 3 2.18. The bias is measured, step by step,
    as the records' seconds less the price of the plan they were served by."""
    ctxs = [ctx_for(f"s{i}", 0, 0, 0) for i in range(16)]

    policy = primed_for_batch(ctxs)
    assert policy.step_bias() == 0.0
    plan = policy.plan(ctxs)
    assert max(d.tau for d in plan) == 1  # the priced ratio's best
    assert "25.6 tokens in 6.00 ms predicted (step bias +0.00 ms)" in plan[0].reason
    # Each record of a step carries its passes and its own other time: the time since its request's last step. The
    # requests that stepped before carry the step's own rest, 7 ms, of it 0.5 ms the policy's own work (its learning
    # and plan). One request was admitted just before the step (its rest runs from its admission: 0.4 ms), another
    # waited 150 ms for its prompt to come in by pieces: neither is the step's. The step weighs one step; its pass took
    # 6 ms more than priced, and its rest is not priced yet (the rest curve has seen no step).
    records = []
    for i in range(16):
        rest, step = {5: (0.4e-3, 0), 6: (150e-3, 0)}.get(i, (7e-3, 3))
        record = replace(record_for(f"s{i}", step, 1, 1), draft_time=1e-3, verify_time=11e-3, other_time=rest)
        records.append(replace(record, batch_size=16, rows=32, drafting=16, draft_passes=1, policy_time=0.5e-3))
    policy.observe_step(records)
    # The plan is replayed for the next steps (a batch of 16), so what the step teaches waits until a plan reads it.
    assert policy._step_bias[1] == 0.0
    policy.learn()
    assert policy.batch_costs.other(16, 0.0) == pytest.approx(7e-3)  # the step's rest: not 0.4 ms, not 150 ms
    assert policy.batch_costs.policy_time == pytest.approx([0.5e-3, 1.0])
    assert policy._step_bias[1] == pytest.approx(1.0)
    # 12 ms of draft and pass measured, 6 priced; its rest less the policy's work in it, plus that work's mean a step
    # before this one (none yet): 6.5 ms.
    assert policy._step_bias[0] == pytest.approx(12.5e-3)
    assert policy.step_bias() == 0.0  # one step measured: not yet trusted
    # The same step against its plan's prediction, at its depth: 32 tokens made where the plan expected 16 × 1.6, in
    # 18.5 ms priced 6 (more than twice off: counted as twice, ``DepthCalibration``).
    assert policy.depth_calibration(16)._sums[1] == pytest.approx([32.0, 25.6, 18.5e-3, 18.5e-3 / 2, 1.0])
    # A step whose plan was made afresh carries the policy's replanning (3 ms here): its depth is charged the policy's
    # mean a step instead (0.5 ms so far), so its rest of 10.5 ms measures 8 where the rest curve prices 7.
    price = policy.batch_costs.pricer(16, policy.costs)(32, 1, 16)
    fresh = [replace(r, step=r.step + 1, other_time=10.5e-3, policy_time=3e-3) for r in records]
    policy.observe_step(fresh)
    policy.learn()
    assert policy._step_bias[0] == pytest.approx(STEP_BIAS_DECAY**16 * 12.5e-3 + (1e-3 + 11e-3 + 8e-3 - price))
    assert policy.batch_costs.policy_time == pytest.approx([POLICY_TIME_DECAY * 0.5e-3 + 3e-3, POLICY_TIME_DECAY + 1.0])

    biased = primed_for_batch(ctxs)
    biased._step_bias = [5 * 6e-3, 5.0]  # five steps' worth, 6 ms over their prices
    assert biased.step_bias() == pytest.approx(6e-3)
    plan = biased.plan(ctxs)
    assert max(d.tau for d in plan) == 2
    assert "tokens in 14.00 ms predicted (step bias +6.00 ms)" in plan[0].reason


def test_the_step_bias_is_left_out_where_steps_are_priced_by_their_measured_shapes_and_excess() -> None:
    """Where a step is priced as its measured shapes plus the excess the steps measured beyond them (a server that
    measured its passes at start: ``BatchCosts.shaped_excess``), that excess is what the steps cost beyond their
    prices, and the step bias (a constant on every depth) would count it twice: it is not added, however much the
    steps measured beyond their prices. Learnt from transients (a 20 ms pass where 9 is usual), it pushed the batch
    plans deep and kept them there (docs/policy.md, session 58). Without measured shapes the bias still prices every
    depth; ``step_bias=False`` never adds it."""
    ctxs = [ctx_for(f"s{i}", 0, 0, 0) for i in range(16)]
    shaped = primed_for_batch(ctxs)
    passes = {16: 4e-3, 32: 5e-3, 48: 6e-3, 64: 7e-3, 80: 8e-3}
    shaped.prime(MeasuredCosts(passes, {16: 1e-3}, draft_lines={16: (1e-3, 1e-3)}))
    assert shaped.batch_costs.shaped
    for _ in range(4):  # the steps' excess beyond their shapes, warm
        shaped.batch_costs.excess.observe(6.0, 1e-3)
    assert shaped.batch_costs.shaped_excess
    shaped._step_bias = [5 * 6e-3, 5.0]
    assert shaped.step_bias() == 0.0
    assert "(step bias +0.00 ms)" in shaped.plan(ctxs)[0].reason

    unshaped = primed_for_batch(ctxs)
    assert not unshaped.batch_costs.shaped_excess
    unshaped._step_bias = [5 * 6e-3, 5.0]
    assert unshaped.step_bias() == pytest.approx(6e-3)
    off = AdaptivePolicy(step_bias=False)
    off._step_bias = [5 * 6e-3, 5.0]
    assert off.step_bias() == 0.0


def test_a_request_joining_a_replayed_batch_plan_gets_a_plan_of_its_own() -> None:
    """A batch plan is replayed for the steps after it; a request that joins meanwhile runs at the batch's depth with a
    plan of its own (its expected tokens by τ), as each request the plan made was given: its outcomes are tested
    against that plan's rates, and a step holding it is measured against the plans' predicted tokens (the depth
    calibration), where without a plan its expected tokens were unknown and the step was left out."""
    ctxs = [ctx_for(f"s{i}", 0, 0, 0) for i in range(16)]
    policy = primed_for_batch(ctxs)
    first = policy.plan(ctxs)
    depth = max(d.tau for d in first)
    late = ctx_for("late", 0, 0, 0)
    policy.begin(late)
    batch = [ctx_for(f"s{i}", 1, 2, 1) for i in range(1, 16)] + [late]
    replayed = policy.plan(batch)  # s0 left, "late" joined: the plan replayed
    assert "joined, at its depth" in replayed[-1].reason and replayed[-1].tau == depth
    joined = policy._requests["late"]
    assert joined.plan is not None and len(joined.plan.emitted) > depth
    assert joined.predicted_latency is not None
    records = [
        replace(
            record_for(ctx.request_id, 1, depth, depth),
            draft_time=1e-3 * depth,
            verify_time=5e-3,
            other_time=1e-3,
            batch_size=16,
            rows=16 * (depth + 1),
            drafting=16,
            draft_passes=depth,
        )
        for ctx in batch
    ]
    steps_before = sum(e[4] for e in policy.depth_calibration(16)._sums.values())
    policy.observe_step(records)
    policy.learn()
    # The step was measured against the plans' tokens: the joined request's plan among them.
    assert sum(e[4] for e in policy.depth_calibration(16)._sums.values()) > steps_before
    assert policy.depth_calibration(16)._sums[depth][1] == pytest.approx(
        sum(policy._requests[ctx.request_id].plan.emitted[depth] for ctx in batch)
    )


def test_requests_rotated_into_a_replayed_batch_plan_are_planned_once_per_plan() -> None:
    """With more requests than ``max_batch`` a server rotates its steps over them: half the requests were not in the
    step whose plan is replayed. Each of those gets its plan (expected tokens by τ) when it first steps under the
    replayed plan and keeps it, and its decision, until the next plan, as the plan's own requests do; the code before
    derived it again at every step of that half."""
    from specdec.policy.adaptive import REPLAN_EVERY

    first_half = [ctx_for(f"a{i}", 0, 0, 0) for i in range(16)]
    second_half = [ctx_for(f"b{i}", 0, 0, 0) for i in range(16)]
    policy = primed_for_batch(first_half + second_half)
    planned: list[str] = []
    own_plan = policy._plan_in_batch

    def counting(req: object, ctx: StepContext, k: int) -> None:
        planned.append(ctx.request_id)
        own_plan(req, ctx, k)  # type: ignore[arg-type]

    policy._plan_in_batch = counting  # type: ignore[method-assign]
    fresh = policy.plan(first_half)
    assert sorted(planned) == sorted(c.request_id for c in first_half)
    depth = max(d.tau for d in fresh)
    planned.clear()
    decisions: list[list[object]] = []
    for step in range(1, REPLAN_EVERY):  # the plan's replays, the halves in turn
        half = second_half if step % 2 else first_half
        decisions.append(policy.plan([ctx_for(c.request_id, step, step, step) for c in half]))
    assert sorted(planned) == sorted(c.request_id for c in second_half)  # each once, at its first step
    rotated = [d for step, ds in enumerate(decisions, 1) if step % 2 for d in ds]
    assert all(d.tau == depth and "joined, at its depth" in d.reason for d in rotated)  # type: ignore[attr-defined]
    assert decisions[0] == decisions[2]  # the same decisions, kept
    # The next plan is made afresh for the half it sees; the other half's kept decisions are dropped with the old plan.
    planned.clear()
    policy.plan([ctx_for(c.request_id, REPLAN_EVERY, 9, 9) for c in second_half])
    assert sorted(planned) == sorted(c.request_id for c in second_half) and not policy._joined


def test_depth_calibration_weighs_what_each_depths_steps_measured_against_their_predictions() -> None:
    """Ratios of sums (not a mean of per-step ratios, which leans against the depths whose tokens spread most), each
    depth's shrunk toward the pool of every depth run by ``prior`` steps (the pool toward 1), decayed per step, an
    outlier price clipped; a depth never run takes the pool's when shallower than the deepest run, the deepest's when
    deeper. (Without decay here: ``test_a_depth_explored_now_and_then_keeps_what_its_steps_measured`` has it.)"""
    from specdec.policy.estimates import DepthCalibration

    def shrunk(own: float, steps: float, toward: float, k: float = 4.0) -> float:
        return (steps * own + k * toward) / (steps + k)

    cal = DepthCalibration(decay=1.0, own_decay=1.0, prior=4.0)
    assert cal.factor(3) == 1.0  # nothing measured
    for tokens in (2.0, 10.0):  # per-step ratios 0.4 and 2.0 (mean 1.2); the sums' ratio is 12/10
        cal.observe(2, tokens, 5.0, 1e-3, 1e-3)
    pool = shrunk(1.2, 2, 1.0)  # only depth 2 run: the pool is depth 2's sums
    assert cal.factor(2) == pytest.approx(shrunk(1.2, 2, pool))
    assert cal.factor(1) == pytest.approx(pool)  # shallower than the deepest run: the pool
    assert cal.factor(7) == cal.factor(2)  # deeper: the deepest run's
    cal.observe(4, 5.0, 5.0, 2e-3, 1e-3)  # took twice its price
    pool_tokens, pool_time = shrunk(17 / 15, 3, 1.0), shrunk(3e-3 / 4e-3, 3, 1.0)
    assert cal.factor(4) == pytest.approx(shrunk(1.0, 1, pool_tokens) * shrunk(0.5, 1, pool_time))
    assert cal.factor(3) == cal.factor(1) == pytest.approx(pool_tokens * pool_time)  # between or below: the pool
    assert cal.factor(9) == cal.factor(4)
    cal.observe(6, 5.0, 5.0, 1e-3, 1.0)  # priced at 1,000x: counted as twice off
    assert cal.factor(6) > cal.factor(4)
    decaying = DepthCalibration(decay=0.5, prior=4.0, seen=1.0)
    decaying.observe(2, 5.0, 5.0, 2e-3, 1e-3)
    decaying.observe(5, 5.0, 5.0, 1e-3, 1e-3)
    assert decaying._sums[2][4] == 0.5  # one step later: below ``seen``, so depth 2 is no longer a depth run
    assert decaying.factor(2) == decaying.factor(5) == 1.0


def test_a_depth_explored_now_and_then_keeps_what_its_steps_measured() -> None:
    """A batch runs depth 4 and explores depth 3 once in 32 steps (a plan's exploration). Depth 4's steps make 0.85 of
    the goodput their plans predicted, depth 3's 1.05: a pass of 40 rows begins a third group of the kernel's 16 rows
    for 8 of them and costs what its curve does not see (a traced server at 8 clients: depth 4 2.9 tokens/ms where
    τ = 3's steps made 3.8). A depth's sums age with its own steps (``own_decay``) and only slowly with every step
    (``decay``): after 640 steps depth 3's factor reads about what its explorations measured, 0.14 above depth 4's.
    Aged by every step at 0.99 (until session 62), its few recent explorations weighed less than the prior toward the
    pool, depth 4's own ratio: 0.10 above, less than the predictions put depth 4 ahead by, and the plan held depth
    4."""
    from specdec.policy.estimates import DepthCalibration

    def run(cal: DepthCalibration) -> DepthCalibration:
        for step in range(640):
            if step % 32 == 31:
                cal.observe(3, 1.05 * 25.0, 25.0, 6e-3, 6e-3)
            else:
                cal.observe(4, 0.85 * 28.0, 28.0, 8e-3, 8e-3)
        return cal

    cal = run(DepthCalibration())
    assert cal.factor(4) == pytest.approx(0.85, abs=0.02)
    assert cal.factor(3) > 0.98 and cal.factor(3) - cal.factor(4) > 0.12  # its own 1.05, shrunk toward the pool
    old = run(DepthCalibration(decay=0.99, own_decay=1.0))  # the old ageing: the pool's pull holds depth 3 near 4's
    assert old.factor(3) < 0.96 and old.factor(3) - old.factor(4) < cal.factor(3) - cal.factor(4) - 0.03


def test_a_depth_run_a_hundred_times_does_not_hold_the_plan_against_depths_run_a_few() -> None:
    """Every depth's predictions 10% short (the estimates err alike at every depth): depth 6 run for 100 steps, depth 3
    twice, with a worse step among them. Each depth's factor is shrunk toward the pool, so depth 3's reads near
    depth 6's (shrunk toward 1 and borrowed by the depths between, it read 0.95 against 1.10, and a server at 4
    clients held depth 6 where depth 3 served 5% more)."""
    from specdec.policy.estimates import DepthCalibration

    cal = DepthCalibration(decay=1.0, own_decay=1.0, prior=4.0)
    for _ in range(100):
        cal.observe(6, 1.1 * 20.0, 20.0, 7e-3, 7e-3)
    cal.observe(3, 0.8 * 13.0, 13.0, 4e-3, 4e-3)
    cal.observe(3, 1.1 * 13.0, 13.0, 4e-3, 4e-3)
    assert cal.factor(6) == pytest.approx(1.1, abs=0.01)
    assert cal.factor(3) > 1.0 and abs(cal.factor(3) - cal.factor(6)) < 0.06
    assert cal.factor(4) == cal.factor(5) == cal.factor(1) == pytest.approx(cal.factor(6), abs=0.01)


def test_a_batch_plan_leaves_a_depth_whose_steps_measured_less_than_it_predicted() -> None:
    """Priced as above (a plain 16-sequence step 4 ms, each depth +1 ms of pass and +1 ms of draft, acceptance 0.6):
    depth 1 predicts the best goodput (4.27 tokens/ms; plain 4.0, depth 2 3.92). Where the steps run at depth 1 have
    made 20% less than predicted, and nothing deeper or shallower has run, every depth from 1 on borrows that
    (the pool of the depths run: depth 1's alone), plain too: the plan stays at 1. Where plain steps measured as
    predicted, depth 1 reads 0.81 of its 4.27 tokens/ms (0.8 shrunk toward the pool of both, 0.9) against plain's 0.99
    of 4.0, and the plan goes plain; the step's reason shows each depth's factor."""
    ctxs = [ctx_for(f"s{i}", 0, 0, 0) for i in range(16)]

    def depth_1_short(policy: AdaptivePolicy) -> None:
        for _ in range(60):  # 60 steps at depth 1, each 0.8x the predicted tokens in the predicted time
            policy.depth_calibration(16).observe(1, 0.8 * 25.6, 25.6, 6e-3, 6e-3)

    policy = primed_for_batch(ctxs)
    depth_1_short(policy)
    assert max(d.tau for d in policy.plan(ctxs)) == 1
    policy = primed_for_batch(ctxs)  # a fresh plan (a batch's plan serves a few steps)
    depth_1_short(policy)
    for _ in range(60):  # and as many plain steps that measured what they predicted
        policy.depth_calibration(16).observe(0, 16.0, 16.0, 4e-3, 4e-3)
    plan = policy.plan(ctxs)
    assert max(d.tau for d in plan) == 0
    assert re.search(r"steps' measured/predicted 0\.99/0\.81/0\.81/", plan[0].reason), plan[0].reason


def test_a_depth_calibration_learnt_on_small_batches_does_not_price_a_batch_of_16() -> None:
    """Steps of 4 sequences at depth 1 that made 20% less than predicted teach the calibration of batches of 4-7 only:
    a plan for 16 sequences prices depth 1 as before (its class, 16-31, has measured nothing), and chooses as a policy
    that never saw those steps does; one for 4 sequences reads the shortfall."""
    ctxs = [ctx_for(f"s{i}", 0, 0, 0) for i in range(16)]
    fresh = primed_for_batch(ctxs)
    want = [d.tau for d in fresh.plan(ctxs)]
    policy = primed_for_batch(ctxs)
    for _ in range(60):
        policy.depth_calibration(4).observe(1, 0.8 * 6.4, 6.4, 3e-3, 3e-3)
    assert policy.depth_calibration(4).factor(1) < 0.85 and policy.depth_calibration(5).factor(1) < 0.85
    assert policy.depth_calibration(16).factor(1) == policy.depth_calibration(31).factor(1) == 1.0
    assert policy.depth_calibration(16) is not policy.depth_calibration(4)
    assert policy.depth_calibration(2) is policy.depth_calibration(3) is not policy.depth_calibration(4)
    assert [d.tau for d in policy.plan(ctxs)] == want
    # Learnt from steps: a step of 4 sequences goes to the 4-7 class.
    records = [
        replace(record_for(f"s{i}", 1, 1, 1), draft_time=1e-3, verify_time=4e-3, other_time=1e-3) for i in range(4)
    ]
    records = [replace(r, batch_size=4, rows=8, drafting=4, draft_passes=1) for r in records]
    small = primed_for_batch(ctxs[:4])
    small.plan(ctxs[:4])
    small.observe_step(records)
    small.learn()
    assert sum(e[4] for e in small.depth_calibration(4)._sums.values()) == pytest.approx(1.0)
    assert not small.depth_calibration(16)._sums


def test_the_batch_depth_search_holds_the_last_depth_against_noise_and_reaches_back_past_a_dip() -> None:
    """The search from the last plan's depth (``_search_depth``, DEPTH_MARGIN 0.03, plain's margin 0.03): a
    shallower depth predicted within 3% of the last one does not move the plan (the predictions move by that much
    from plan to plan), one predicted clearly better does, from any distance; a deeper one is asked 3% a position;
    a depth past a dip is reached (the search from depth 1 upward stopped at the dip); drafting only beats plain by
    the margin."""
    from specdec.policy.adaptive import _search_depth

    # Goodput flat across the depths, depth 1 predicted 1.6% above the last plan's depth 2: stays (it moved before).
    flat = [2.67, 3.82, 3.76, 3.70, 3.71]
    assert _search_depth(flat, 2, 0.03) == 2
    assert _search_depth(flat, None, 0.03) == 1  # no plan before: from depth 1
    # Last at 5, a dip at depth 2: depth 1 predicted 2% better than 5 does not take the plan; 5% better does.
    dip = [2.40, 3.06, 2.70, 2.90, 2.95, 3.00, 2.98]
    assert _search_depth(dip, 5, 0.03) == 5
    assert _search_depth([2.40, 3.15, *dip[2:]], 5, 0.03) == 1
    # From depth 1 the deep depth past the dip: asked 3% a position (12% for depth 5), reached when it has it.
    assert _search_depth([2.40, 3.00, 2.70, 2.90, 3.10, 3.37, 3.20], 1, 0.03) == 5
    assert _search_depth([2.40, 3.00, 2.70, 2.90, 3.10, 3.30, 3.20], 1, 0.03) == 1
    # A shallower depth clearly better, far below: taken at once (asked 3%, not 3% a position).
    assert _search_depth([2.46, 2.99, 3.37, 3.52, 3.34, 3.25, 3.21, 3.14], 7, 0.03) == 3
    # Plain unless the depth found beats it by the margin; a last depth past the caps is read at the deepest priced.
    assert _search_depth([3.00, 3.05, 3.08, 3.02], 2, 0.03) == 0
    assert _search_depth([3.00, 3.20, 3.25], 6, 0.03) == 2
    assert _search_depth([3.00], 2, 0.03) == 0


def test_the_depth_margin_is_a_setting_of_the_policy() -> None:
    """``adaptive:depth_margin=M`` sets what each further depth is asked (the search's DEPTH_MARGIN): the deep depth
    past the dip above, 10% over depth 1 four positions on, is reached at 0.02 a position and not at 0.03; a margin
    outside [0, 1) is refused by name."""
    from specdec.policy.adaptive import DEPTH_MARGIN, _search_depth

    rates = [2.40, 3.00, 2.70, 2.90, 3.10, 3.30, 3.20]
    assert _search_depth(rates, 1, 0.03, 0.02) == 5
    assert _search_depth(rates, 1, 0.03, 0.03) == 1
    assert make_policy("adaptive").depth_margin == DEPTH_MARGIN  # type: ignore[attr-defined]
    assert make_policy("adaptive:depth_margin=0.01").depth_margin == 0.01  # type: ignore[attr-defined]
    with pytest.raises(InvalidRequestError, match="depth_margin"):
        make_policy("adaptive:depth_margin=1.5")


def test_cost_estimates_learn_a_pause_as_at_most_a_few_times_their_usual_cost() -> None:
    """A pass, a draft or a one-sequence step measured at ~50x its usual cost (a machine's or a collector's pause: a
    144 ms draft forward where 0.3 ms is usual) is learnt as OUTLIER_FACTOR times it, once its size or depth has been
    seen; a lasting change still comes through, a bounded step at a time."""
    from specdec.policy.estimates import OUTLIER_FACTOR, CurveEWMA, DraftLine, StepCosts

    curve = CurveEWMA(decay=0.9)
    for _ in range(10):
        curve.observe(16, 3e-3)
    curve.observe(16, 150e-3)
    assert curve._at[16][1] < 3e-3 * OUTLIER_FACTOR / 2  # ~4 ms; learnt as is, ~19 ms
    assert curve._at[16][1] > 3e-3 * 1.1  # ... but it moved
    for _ in range(40):  # the pass really is 50x dearer now
        curve.observe(16, 150e-3)
    assert curve._at[16][1] == pytest.approx(150e-3, rel=0.05)
    first = CurveEWMA()
    first.observe(4, 150e-3)  # nothing to hold it to yet: learnt as is
    assert first._at[4][1] == 150e-3

    line = DraftLine()
    for depth in (2, 3, 2, 3, 2, 3):
        line.observe(depth, 0.5e-3 + 0.2e-3 * (depth - 1))
    line.observe(3, 144e-3)
    d0, d1 = line.line()
    assert d0 + 2 * d1 < 2e-3  # 0.9 ms usual at depth 3; learnt as is, ~8 ms

    solo = StepCosts()
    for _ in range(10):
        solo.observe(2, 2, 1e-3, 2e-3, 0.0)
    solo.observe(2, 2, 1e-3, 150e-3, 0.0)
    assert solo._by_block[3][1] < 2e-3 * OUTLIER_FACTOR / 2


def test_a_size_the_steps_left_behind_weighs_less_than_its_neighbours_measured_since() -> None:
    """The machine's speed drifts. Passes of 8, 12 and 16 rows measured slow (2.0 / 2.75 / 3.0 ms), then a long stretch
    at 8 and 16 rows only, both faster now (1.6 / 2.6 ms): the 12-row price follows its neighbours (~2.1 ms, their line)
    rather than keeping its old 2.75 at full weight (a depth priced by it looks worse than it is and, not run, is never
    measured again); one new observation at 12 rows then mostly replaces the old mean. Without the aging (``age``
    1.0) the price stays ~2.6 and one observation moves it by a tenth."""
    from specdec.policy.estimates import CurveEWMA

    def curve(age: float) -> CurveEWMA:
        c = CurveEWMA(age=age)
        for _ in range(20):
            for rows, ms in ((8, 2.0), (12, 2.75), (16, 3.0)):
                c.observe(rows, ms * 1e-3)
        for _ in range(200):
            c.observe(8, 1.6e-3)
            c.observe(16, 2.6e-3)
        return c

    aged, kept = curve(CurveEWMA.age), curve(1.0)
    assert aged(12, 0.0) == pytest.approx(2.1e-3, rel=0.05)
    assert kept(12, 0.0) > 2.5e-3  # the mutant: the old mean at full weight
    aged.observe(12, 2.1e-3)
    assert aged._at[12][1] == pytest.approx(2.1e-3, rel=0.05)
    kept.observe(12, 2.1e-3)
    assert kept._at[12][1] > 2.6e-3


def test_a_batch_plan_made_with_many_prompt_rows_replays_the_depth_of_a_step_without_them() -> None:
    """A pass curve that turns dear beyond ~200 rows (5 ms per 16 rows there, 0.5 ms below 64), a draft forward 1 ms,
    acceptance 0.6. The step where 16 requests join at once carries their 207 prompt rows: drafted rows on top of a
    223-row pass cost 5 ms each 16, so that step goes plain (16 tokens in 4 ms of its own against 25.6 in ~10 ms at
    depth 1). The steps the plan is replayed for have no prompt rows, where depth 1 pays (25.6 tokens in 5.5 ms): they
    run depth 1, not the prompt step's plain (replayed as made, a server at 16 clients sat plain for 8 steps at each
    such join and served 0.64-0.81x tau = 3)."""
    from specdec.policy.adaptive import REPLAN_EVERY

    ctxs = [ctx_for(f"s{i}", 0, 0, 0) for i in range(16)]
    policy = AdaptivePolicy()
    passes = {16: 4.0e-3, 32: 4.5e-3, 48: 5.0e-3, 64: 5.5e-3, 208: 35e-3, 224: 40e-3, 240: 45e-3, 256: 50e-3}
    policy.prime(MeasuredCosts(passes, {16: 1e-3}))
    for ctx in ctxs:
        policy.begin(ctx)
    first = policy.plan(ctxs, prompt_rows=207)
    assert {d.tau for d in first} == {0}
    steps = [ctx_for(f"s{i}", 1, 1, 1) for i in range(16)]
    for _ in range(REPLAN_EVERY - 1):
        replayed = policy.plan(steps)
        assert {d.tau for d in replayed} == {1}
        assert "replayed without the 207 prompt rows" in replayed[0].reason
    policy.plan(steps)  # planned afresh, on a step without prompt rows (this one explores one deeper): depth 1 again
    assert policy._batch_depth == 1


# A pass table measured on the AMX build (session 57, the default target, 64 tokens of context): 17 rows cost what 32 do,
# the second row group whole.
GROUPED_PASSES = {1: 1.26e-3, 8: 1.58e-3, 16: 1.86e-3, 17: 2.43e-3, 32: 2.42e-3, 64: 3.81e-3, 128: 6.51e-3}


def test_a_pass_past_one_row_group_is_priced_as_the_second_group_not_as_a_share_of_it() -> None:
    """On the AMX build a pass of 17-32 rows runs two row groups of tiles: 20 rows cost what 32 do (4 sequences at depth
    4 measured 4.33 ms against 3.04 at depth 3, 16 rows, in a server's trace). Read on a line from 16 to 32 rows, a
    20-row pass was priced a quarter of the way, and the error moved to the steps' excess, pricing 16 rows too dear
    alike: a policy at 4 clients ran depths 4-7 at 0.80-0.92x a fixed τ = 3. With the target's row groups
    (``MeasuredCosts.row_granule``) the first row past the first group is measured and no price is read across that
    edge; past the second group (balanced groups of fewer rows, a further one costing a share of one) the line stands."""
    from specdec.policy.estimates import BatchCosts

    grouped = BatchCosts(measured_passes=dict(GROUPED_PASSES))
    grouped.set_granule(16)
    smooth = BatchCosts(measured_passes={r: s for r, s in GROUPED_PASSES.items() if r != 17})
    assert grouped.measured_pass(16) == smooth.measured_pass(16) == 1.86e-3  # the first group: as measured
    assert grouped.measured_pass(12) == smooth.measured_pass(12)
    assert grouped.measured_pass(20) == pytest.approx(2.43e-3, abs=0.02e-3)  # between 17 and 32
    assert smooth.measured_pass(20) == pytest.approx(2.0e-3, abs=0.01e-3)  # a quarter of the way: 18% too cheap
    unmeasured = BatchCosts(measured_passes=dict(smooth.measured_passes))  # a cost file without 17
    unmeasured.set_granule(16)
    assert unmeasured.measured_pass(20) == unmeasured.measured_pass(32) == 2.42e-3
    for rows in (40, 48, 62, 80):  # past the second group: the line between the sizes measured
        assert grouped.measured_pass(rows) == pytest.approx(smooth.measured_pass(rows))

    # The policy takes the groups from the measured costs; a setting can turn them off.
    policy = AdaptivePolicy()
    policy.prime(MeasuredCosts(GROUPED_PASSES, {}, SHAPE_LINES, row_granule=16))
    assert policy.batch_costs.granule == 16 and policy.batch_costs.verify.granule == 16
    off = AdaptivePolicy(row_granule=0)
    off.prime(MeasuredCosts(GROUPED_PASSES, {}, SHAPE_LINES, row_granule=16))
    assert off.batch_costs.granule == 0 and off.batch_costs.verify.granule == 0
    with pytest.raises(InvalidRequestError, match="row_granule"):
        AdaptivePolicy(row_granule=-1)


def test_the_steps_pass_curve_reads_a_size_only_from_its_own_row_group() -> None:
    """The curve the steps teach (``CurveEWMA``) fits each size over the sizes seen near it; across a row group's edge
    that fit pulled 16 rows, run rarely (a policy at depths 4-7 explores depth 3 now and then), toward the dear
    20-24-row passes beside it. With the groups set, 16 rows read the first group's sizes only, 20 and 24 the
    second's."""
    from specdec.policy.estimates import CurveEWMA

    def curve(granule: int) -> CurveEWMA:
        c = CurveEWMA()
        c.set_granule(granule)
        for i in range(20):
            for rows, seconds in ((12, 2.9e-3), (16, 3.0e-3), (20, 4.3e-3), (24, 4.5e-3), (32, 5.0e-3)):
                if rows != 16 or i % 10 == 0:  # 16 rows twice
                    c.observe(rows, seconds)
        return c

    grouped, smooth = curve(16), curve(0)
    assert grouped(16, 0.0) == pytest.approx(3.0e-3, rel=0.03)
    assert smooth(16, 0.0) > 3.2e-3  # pulled up by 20 and 24 rows
    assert grouped(20, 0.0) == pytest.approx(4.3e-3, rel=0.03)
    # An unseen size next to a group's edge: its own group's neighbours, not a line across the edge
    assert grouped(18, 0.0) == pytest.approx(4.3e-3, rel=0.05)
    assert smooth(18, 0.0) < 3.9e-3
    assert grouped(14, 0.0) == pytest.approx(2.95e-3, rel=0.03)


def test_a_batch_planned_plain_from_costs_measured_dear_explores_two_steps_and_comes_to_draft() -> None:
    """A batch of 16 primed with drafting priced 1.6x what it costs (passes beyond 16 rows and the draft's line
    measured on a busy machine) plans plain. Its explorations from plain draft one token, and a draft that sat out
    plain steps first takes their tokens in (a catch-up, 16 sequences x the steps since, that no depth pays while
    drafting goes on: learnt from no cost or calibration). Each exploration from plain runs two steps, so the second
    measures what drafting costs (here 32 tokens in 3.8 ms against a plain step's 16 in 2.5); the batch then drafts.
    Explored one step at a time (the code before session 78) it never measured a steady drafting step and held every
    step plain (in process, at 16 sequences from such a cost file: 0.83-0.93x τ = 2). Deterministic."""
    dear = 1.6
    policy = AdaptivePolicy()
    # what the passes (1 ms + 1/16 ms a row) and the draft's forwards (0.3 ms each) cost, drafting shapes measured dear
    passes = {rows: (1.0e-3 + rows * 0.0625e-3) * (dear if rows > 16 else 1.0) for rows in (16, 32, 48, 64, 80)}
    policy.prime(MeasuredCosts(passes, {16: dear * 0.3e-3}, {16: (dear * 0.3e-3, dear * 0.3e-3)}))
    for k in range(16):
        policy.begin(ctx_for(f"s{k}", 0, 0, 0))
    plain_since = 0  # plain steps since the draft last drafted (its catch-up at the next drafting step)
    depths = []
    for step in range(240):
        plan = policy.plan([ctx_for(f"s{k}", step, 3 * step, step) for k in range(16)])
        depth = max(d.tau for d in plan)
        depths.append(depth)
        fed = 16 * (plain_since + 1) if depth else 0  # each sequence's tokens the draft has not taken in, then 1
        records = [
            replace(
                record_for(f"s{k}", step + 1, d.tau, min(d.tau, 2)),  # every draft keeps 2 tokens at most
                draft_time=0.3e-3 * depth + 0.02e-3 * (fed - 16 if fed > 16 else 0),
                verify_time=1.0e-3 + 0.0625e-3 * 16 * (depth + 1),
                other_time=0.5e-3,
                batch_size=16,
                rows=16 * (depth + 1),
                drafting=16 if depth else 0,
                draft_passes=depth,
                draft_fed=fed,
            )
            for k, d in enumerate(plan)
        ]
        plain_since = 0 if depth else plain_since + 1
        policy.observe_step(records)
    assert depths[:8].count(0) == 8  # plain, as its costs predict ...
    assert sum(d > 0 for d in depths[-80:]) >= 70, depths  # ... until its explorations measured drafting


def test_a_chained_plain_step_is_priced_as_its_passes_with_one_rest() -> None:
    """``chained_plain_price``: the first pass at the step's rows with its rest, then each later pass over the
    sequences still chaining, without the rest again."""
    from specdec.policy.estimates import chained_plain_price

    rest = 1.0

    def price(rows: int, depth: int, drafting: int) -> float:  # a pass of 0.1 + 0.01 a row, and the rest
        assert depth == drafting == 0
        return 0.1 + 0.01 * rows + rest

    # one pass a sequence: the step's own price
    assert chained_plain_price(price, rest, 20, [1, 1, 1]) == pytest.approx(price(20, 0, 0))
    # chains of 4, 4, 2: pass 2 over three sequences, passes 3 and 4 over two
    want = price(20, 0, 0) + (0.1 + 0.03) + 2 * (0.1 + 0.02)
    assert chained_plain_price(price, rest, 20, [4, 4, 2]) == pytest.approx(want)


@pytest.mark.parametrize(("chain", "depth", "priced"), [(1, 1, None), (4, 0, "64.0 tokens in 10.00 ms")])
def test_a_batch_plan_prices_plain_as_its_chained_step(chain: int, depth: int, priced: str | None) -> None:
    """The engine's chain of plain passes (``StepContext.chain``) in the batch plan: 16 sequences' plain step of 4
    chained passes makes 64 tokens in 4 passes of 2 ms and one rest of 2 ms (10 ms: 6.4 tokens/ms), where one pass a
    step makes 16 in 4 ms and drafting a token each pays better (depth 1). Deterministic (no draws)."""
    from dataclasses import replace

    policy = AdaptivePolicy()
    passes = {16: 2.0e-3, 32: 4.0e-3, 64: 8.0e-3, 128: 16e-3}  # compute-bound: 0.125 ms a row
    policy.prime(MeasuredCosts(passes, {16: 0.05e-3}, {16: (0.05e-3, 0.05e-3)}))
    for _ in range(50):  # the step's rest, as steps measured it
        policy.batch_costs.other.observe(16, 2.0e-3)
    ctxs = [replace(ctx_for(f"s{k}", 1, 8, 1), chain=chain) for k in range(16)]
    for ctx in ctxs:
        policy.begin(ctx)
    plan = policy.plan(ctxs)
    assert max(d.tau for d in plan) == depth, plan[0].reason
    if priced is not None:
        assert priced in plan[0].reason
