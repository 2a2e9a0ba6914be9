"""The batched simulator: arrival processes, the batched cost model, the continuous-batching runner's
invariants, the batch planner's priors, and one batched goal. Seeds are stated; each test runs in seconds."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from specdec.errors import InvalidRequestError
from specdec.policy import Decision, Policy, StepContext, make_policy
from specdec.policy.estimates import BatchCosts, StepCosts
from specdec.records import StepRecord
from specdec.simulate.arrivals import Arrivals, parse_arrivals
from specdec.simulate.costs import CPU_DEFAULT, GPU_70B, CostModel, load_costs
from specdec.simulate.goals import batched_goals
from specdec.simulate.runner import simulate_batched
from specdec.simulate.workloads import LOAD_WORKLOADS, WORKLOADS

COST = CPU_DEFAULT  # the shipped defaults, not a measured-costs file on this machine


def load(name: str = "load-mixed", requests: int = 24):
    return replace(LOAD_WORKLOADS[name], requests=requests)


# -- arrivals ------------------------------------------------------------------------------------


def test_arrival_specs_parse_and_bad_ones_are_errors() -> None:
    assert parse_arrivals("poisson:rate=20") == Arrivals("poisson", rate=20.0)
    assert parse_arrivals("clients:16") == parse_arrivals("clients:n=16") == Arrivals("clients", clients=16)
    for bad in (
        "poisson",
        "poisson:rate=0",
        "poisson:rate=x",
        "poisson:rate=2,burst=3",
        "clients:0",
        "clients:",
        "x:1",
    ):
        with pytest.raises(InvalidRequestError):
            parse_arrivals(bad)


def test_poisson_gaps_average_one_over_the_rate_and_are_seeded() -> None:
    times = Arrivals("poisson", rate=20.0).times(4000, seed=0)
    assert times is not None and times == sorted(times) and times[0] == 0.0
    assert (times[-1] - times[0]) / (len(times) - 1) == pytest.approx(1 / 20, rel=0.05)  # ~1.6% standard error
    assert times == Arrivals("poisson", rate=20.0).times(4000, seed=0)
    assert times != Arrivals("poisson", rate=20.0).times(4000, seed=1)


def test_closed_loop_keeps_n_requests_in_flight_and_each_arrives_at_a_finish() -> None:
    res = simulate_batched(make_policy("fixed", tau=2), load(requests=30), COST, 0, Arrivals("clients", clients=4))
    reqs = res.requests
    assert [r.arrival for r in reqs[:4]] == [0.0] * 4
    finishes = sorted(r.finished for r in reqs)
    for r in reqs[4:]:
        assert r.arrival in finishes  # sent the moment an earlier request finished
    for r in reqs:  # at no arrival are more than 4 requests in flight
        assert sum(q.arrival <= r.arrival < q.finished for q in reqs) <= 4


# -- the batched cost model ----------------------------------------------------------------------


def test_cpu_batched_defaults_have_the_assumed_shape() -> None:
    one = COST.verify_rows(1)
    assert 0.7e-3 <= one <= 2.5e-3  # memory-bound one-token pass
    assert 2.0 <= COST.verify_rows(16) / one <= 3.0
    assert 6.0 <= COST.verify_rows(64) / one <= 8.0
    assert COST.draft_forward(1) == pytest.approx(0.15e-3)
    assert COST.draft_forward(11) == pytest.approx(0.15e-3 * 1.5)  # +5% per further sequence
    assert COST.step_other(8) == pytest.approx(8 * 0.1e-3)
    assert "assumed" in COST.batch_source


def test_rows_table_is_read_between_and_beyond_its_sizes() -> None:
    c = replace(COST, rows_table={1: 2e-3, 9: 4e-3, 17: 8e-3})
    assert c.verify_rows(9) == 4e-3
    assert c.verify_rows(5) == pytest.approx(3e-3)
    assert c.verify_rows(25) == pytest.approx(12e-3)  # the slope of the last two sizes


def test_cost_files_old_and_new(tmp_path: Path) -> None:
    old = {"name": "cpu", "draft_per_token_s": 5e-4, "verify_base_s": 3e-3, "verify_per_extra_s": 1e-4}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    c = load_costs(str(path))
    assert (c.verify(3), c.batch_source) == (pytest.approx(3.2e-3), "")
    assert c.verify_rows(3) == c.verify(3)  # no batched figures: r rows cost a block of r tokens
    assert c.draft_forward(4) == pytest.approx(5e-4 * 1.15)
    assert CostModel.from_json(old, batch_defaults=CPU_DEFAULT).verify_rows(64) == CPU_DEFAULT.verify_rows(64)
    new = {**old, "rows_table": {"1": 2e-3, "32": 9e-3}, "draft_forward_s": 2e-4, "other_per_sequence_s": 5e-5}
    c = CostModel.from_json(new, source="x")
    assert (c.verify_rows(32), c.draft_forward(1), c.step_other(2), c.batch_source) == (9e-3, 2e-4, 1e-4, "x")
    assert CostModel.from_json(c.to_json()) == replace(c, source="file")  # round trip
    assert GPU_70B.batch_source == ""


# -- the batched runner --------------------------------------------------------------------------


class Recording(Policy):
    """Any policy, with every step's records kept by step (a plan call starts a step)."""

    def __init__(self, inner: Policy) -> None:
        self.inner, self.name, self.batch_aware = inner, inner.name, inner.batch_aware
        self.steps: list[list[StepRecord]] = []
        self.planned: list[int] = []

    def next_tau(self, ctx: StepContext) -> Decision:
        return self.inner.next_tau(ctx)

    def plan(self, ctxs: Sequence[StepContext], other_rows: int = 0, prompt_rows: int = 0) -> list[Decision]:
        self.steps.append([])
        self.planned.append(len(ctxs))
        return self.inner.plan(ctxs, other_rows, prompt_rows)

    def begin(self, ctx: StepContext) -> None:
        self.inner.begin(ctx)

    def allowance(self, request_id: str) -> int | None:
        return self.inner.allowance(request_id)

    def observe(self, record: StepRecord) -> None:
        self.steps[-1].append(record)
        self.inner.observe(record)

    def end(self, request_id, stats) -> None:  # type: ignore[no-untyped-def]
        self.inner.end(request_id, stats)


@pytest.mark.parametrize("spec", ["adaptive", "fixed:tau=3", "heuristic"])
def test_every_step_records_the_batch_as_the_engine_does(spec: str) -> None:
    p = Recording(make_policy(spec))
    res = simulate_batched(p, load("load-0.8", 40), COST, 1, Arrivals("clients", clients=12), max_batch=8)
    assert p.steps and len(p.steps) == res.steps
    assert max(p.planned) == 8  # joins wait for a free slot
    for recs, planned in zip(p.steps, p.planned):
        assert len(recs) == planned
        first = recs[0]
        assert all(r.batch_size == len(recs) for r in recs)
        assert all(r.rows == sum(q.tau + 1 for q in recs) for r in recs)  # rows = Σ(τ + 1)
        assert all(r.drafting == sum(q.tau > 0 for q in recs) for r in recs)
        assert all(r.draft_passes == max(q.tau for q in recs) for r in recs)
        # The step's passes and overhead are shared (what every request waited); the prefills of requests
        # admitted between steps are not the step's (the engine leaves them out of its records).
        assert all((r.draft_time, r.verify_time) == (first.draft_time, first.verify_time) for r in recs)
        assert all(r.other_time == pytest.approx(first.other_time, abs=1e-12) for r in recs)  # (rounding)
        assert len({r.request_id for r in recs}) == len(recs)
    assert sum(r.new_tokens for r in res.requests) == sum(len(r.emitted) for s in p.steps for r in s)


def test_latency_covers_service_and_queueing() -> None:
    p = Recording(make_policy("adaptive"))
    res = simulate_batched(p, load(requests=40), COST, 2, Arrivals("poisson", rate=200.0), max_batch=4)
    service: dict[str, float] = defaultdict(float)
    for recs in p.steps:
        for r in recs:
            service[r.request_id] += r.total_time
    for i, r in enumerate(res.requests):
        assert r.finished >= r.arrival
        assert r.latency == pytest.approx(r.finished - r.arrival)
        assert r.latency >= r.prefill + service[f"sim-2-{i}"] - 1e-12
    assert res.p95_latency() > sorted(service.values())[int(0.95 * (len(service) - 1))]  # 200/s overloads 4 slots


def test_same_seed_same_result_other_seed_differs() -> None:
    w, a = load(requests=20), Arrivals("poisson", rate=50.0)
    one = simulate_batched(make_policy("adaptive"), w, COST, 3, a).summary()
    assert one == simulate_batched(make_policy("adaptive"), w, COST, 3, a).summary()
    assert one != simulate_batched(make_policy("adaptive"), w, COST, 4, a).summary()


@pytest.mark.parametrize("spec", ["adaptive", "fixed:tau=4"])
def test_budgets_hold_in_batches(spec: str) -> None:
    capped = replace(load(requests=30), max_verify_passes=9)
    res = simulate_batched(make_policy(spec), capped, COST, 0, Arrivals("clients", clients=16))
    assert max(r.passes for r in res.requests) <= 9 and any(r.finish == "verify_budget" for r in res.requests)
    fleet = replace(WORKLOADS["writing-assistant"], requests=80)
    res = simulate_batched(make_policy(spec), fleet, COST, 0, Arrivals("clients", clients=8))
    assert fleet.fleet_budget is not None and res.max_window_passes() <= fleet.fleet_budget


# -- the batch planner's priors, and a batched goal -----------------------------------------------


def test_batch_costs_price_drafting_against_the_measured_pass_before_any_solo_step() -> None:
    # A server that starts busy: 32-row passes measured (~10 ms), no one-sequence step, no draft forward yet.
    costs = BatchCosts()
    for _ in range(5):
        rec = StepRecord("r", 1, 10, 10, "p", "", 0, [], [], 0, "plain", [1], 0.0, 9.5e-3, 3e-3)  # not a first step
        costs.observe(replace(rec, batch_size=32, rows=32))
    solo = StepCosts()
    plain = costs.step_time(32, 0, 0, 32, solo)
    one_deep = costs.step_time(64, 1, 32, 32, solo)
    assert plain == pytest.approx(12.5e-3, rel=0.01)
    assert one_deep - plain < 15e-3  # a draft forward priced in ms, not the solo prior's 0.1 s


def test_a_batched_goal_heavy_load() -> None:
    goals = batched_goals(load("load-0.8", 48), COST, seeds=[0], requests=48, loads=(1, 32))
    by_name = {g.name: g for g in goals}
    heavy = next(g for n, g in by_name.items() if "clients:32" in n and "0.95x" in n)
    assert heavy.passed, heavy.detail
    assert next(g for n, g in by_name.items() if "fixed tau=4 slower" in n).passed
    assert all(g.passed for g in goals), [g.line() for g in goals if not g.passed]


def test_a_switch_from_plain_steps_does_not_teach_the_cost_of_a_draft_depth() -> None:
    """After plain steps a draft model first takes in their tokens (``draft_fed``): that step's draft seconds are
    a switch's price, not what drafting one token costs while drafting goes on. Learnt as a depth's, a batch
    that explored one token after 8 plain steps found drafting dear and stayed plain (issue 15's server at 16
    clients, 0.84x of fixed tau = 3 in process)."""
    base = StepRecord("r", 0, 10, 10, "p", "", 1, [5], [True], 1, "bonus", [5, 6], 0.0, 9.5e-3, 3e-3)
    switch = replace(base, draft_time=4e-3, batch_size=16, rows=32, drafting=16, draft_passes=1, draft_fed=144)
    steady = replace(base, draft_time=0.5e-3, batch_size=16, rows=32, drafting=16, draft_passes=1, draft_fed=24)
    costs = BatchCosts()
    costs.observe(switch)
    assert not costs.draft_forward.seen and not costs.draft_lines
    costs.observe(steady)
    assert costs.draft_forward(16, 1.0) == pytest.approx(0.5e-3)
    # The one-sequence costs of the adaptive policy skip it the same way (and a first step whose prompt joined
    # the pass teaches no block cost either).
    policy = make_policy("adaptive")
    policy.observe(replace(base, draft_time=4e-3, drafting=1, draft_passes=1, draft_fed=9))
    assert policy.costs.draft_per_token is None  # type: ignore[attr-defined]
    line = policy.costs.line()  # type: ignore[attr-defined]
    policy.observe(
        replace(base, draft_time=0.4e-3, verify_time=40e-3, drafting=1, draft_passes=1, draft_fed=2, rows=30)
    )
    assert policy.costs.draft_per_token is None and policy.costs.line() == line  # type: ignore[attr-defined]
    policy.observe(replace(base, draft_time=0.4e-3, drafting=1, draft_passes=1, draft_fed=2, rows=2))
    assert policy.costs.draft_per_token == pytest.approx(0.4e-3)  # type: ignore[attr-defined]
