"""The simulator: deterministic, consistent with the closed forms, drives real policies, CLI contract."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

from specdec.cli import main
from specdec.policy import Policy, make_policy
from specdec.records import StepRecord
from specdec.simulate import WORKLOADS, load_costs, simulate
from specdec.simulate.goals import check_goals
from specdec.simulate.processes import Replay
from specdec.simulate.workloads import replay_workload

CPU = load_costs("gpu-70b")  # fixed, given numbers: independent of any measured-costs file on the machine


def small(name: str, requests: int = 12):
    return replace(WORKLOADS[name], requests=requests)


def test_same_seed_same_result_other_seed_differs() -> None:
    w = small("mixed-requests")
    a = simulate(make_policy("adaptive"), w, CPU, seed=3).summary()
    b = simulate(make_policy("adaptive"), w, CPU, seed=3).summary()
    c = simulate(make_policy("adaptive"), w, CPU, seed=4).summary()
    assert a == b
    assert a != c


def test_target_only_takes_one_pass_per_token() -> None:
    """One pass per token, and one more for a request that stops by itself: the engine's EOS is a token the
    target emits (in a pass of its own) and the output leaves out."""
    res = simulate(make_policy("fixed", tau=0), small("iid-0.8"), CPU, seed=0)
    assert {r.finish for r in res.requests} == {"length", "stop"}
    assert all(r.passes == r.new_tokens + (r.finish == "stop") for r in res.requests)
    assert res.summary()["acceptance_rate"] == 0.0


def test_mean_accepted_length_matches_the_iid_formula() -> None:
    """E[n̂+1] = (1 - α^(τ+1)) / (1 - α) for i.i.d. acceptance. Seed 1, ~4,000 steps: the standard error is
    ~0.02, so the tolerance 0.1 is 5 of them (false-failure rate over seeds < 1e-6)."""
    alpha, tau = 0.8, 4
    res = simulate(make_policy("fixed", tau=tau), replace(WORKLOADS["iid-0.8"], requests=150), CPU, seed=1)
    steps = sum(r.passes for r in res.requests)
    emitted = sum(r.new_tokens for r in res.requests)
    assert emitted / steps == pytest.approx((1 - alpha ** (tau + 1)) / (1 - alpha), abs=0.1)


def test_adaptive_falls_back_with_a_useless_draft_and_fixed_does_not() -> None:
    w = small("useless", 30)
    plain = simulate(make_policy("fixed", tau=0), w, CPU, seed=0).tokens_per_s
    assert simulate(make_policy("adaptive"), w, CPU, seed=0).tokens_per_s >= 0.97 * plain
    assert simulate(make_policy("fixed", tau=4), w, CPU, seed=0).tokens_per_s < 0.8 * plain


def test_fleet_budget_holds_in_the_writing_assistant_scenario() -> None:
    w = small("writing-assistant", 80)
    for name in ("adaptive", "fixed"):
        res = simulate(make_policy(name), w, CPU, seed=2)
        assert res.max_window_passes() <= w.fleet_budget
        assert w.slo_s is not None and res.slo_s == w.slo_s  # the scenario has a latency objective ...
        met = sum(r.latency <= w.slo_s for r in res.requests)
        assert 0 < met <= len(res.requests) and res.slo_attainment() == met / len(res.requests)  # ... and reports it


def _write_trace(path: Path) -> list[tuple[int, int]]:
    """A greedy request's trace, written as the engine writes one: (τ, n̂) per step."""
    from specdec.records import GenerationStats, RequestSummary, StepRecord, correction_kind
    from specdec.trace import JsonlTrace

    steps = [(4, 4), (4, 1), (4, 0), (4, 3), (4, 2), (4, 4)]
    stats = GenerationStats(prompt_tokens=50)
    with JsonlTrace(path) as trace:
        for i, (tau, n) in enumerate(steps):
            record = StepRecord(
                request_id="a",
                step=i,
                prompt_len=50,
                context_len=50 + stats.new_tokens,
                policy="fixed",
                reason="fixed",
                tau=tau,
                draft_tokens=[7] * tau,
                accept_flags=[k < n for k in range(tau)],
                n_accepted=n,
                correction=correction_kind(tau, n),
                emitted=[0] * (n + 1),
                draft_time=0.001,
                verify_time=0.004,
                other_time=0.0001,
            )
            stats.add(record)
            trace.on_step(record)
        trace.on_request(RequestSummary("a", "fixed", 50, stats))
    return steps


def test_replay_reproduces_the_recorded_greedy_run_at_its_own_tau(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    steps = _write_trace(trace)
    assert Replay.from_trace(trace).requests[0]["ok"][:6] == [True, True, True, True, None, True]
    w = replay_workload(str(trace))
    seen: list[tuple[int, int]] = []
    policy = make_policy("fixed", tau=4)
    original = policy.observe
    policy.observe = lambda rec: (seen.append((rec.tau, rec.n_accepted)), original(rec))  # type: ignore[method-assign]
    simulate(policy, w, CPU, seed=0)
    assert seen[:5] == steps[:5]


def test_cli_table_json_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    code = main(
        [
            "simulate",
            "--workload",
            "iid-0.8",
            "--requests",
            "4",
            "--seeds",
            "1",
            "--policy",
            "adaptive",
            "--policy",
            "fixed:tau=3",
            "--cost",
            "gpu-70b",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "adaptive" in table and "fixed:tau=3" in table
    rows = json.loads(out.read_text())["results"]
    assert {r["policy"] for r in rows} == {"adaptive", "fixed:tau=3"}
    assert all(r["speedup"] > 1 for r in rows)
    assert main(["simulate", "--workload", "nope"]) == 2
    assert "unknown workload 'nope'" in capsys.readouterr().err
    assert main(["simulate", "--workload", "iid-0.8", "--policy", "fixed:tau"]) == 2
    assert main(["simulate", "--workload", "iid-0.8", "--cost", "missing.json"]) == 2


def test_plot_writes_a_png_or_says_matplotlib_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "p.png"
    code = main(
        [
            "simulate",
            "--workload",
            "iid-0.6",
            "--requests",
            "3",
            "--seeds",
            "1",
            "--policy",
            "adaptive",
            "--plot",
            str(png),
        ]
    )
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert code == 2 and "matplotlib" in capsys.readouterr().err
    else:
        assert code == 0 and png.read_bytes()[:4] == b"\x89PNG"


def test_goal_check_reports_every_goal_with_figures() -> None:
    goals = check_goals(["gpu-70b"], seeds=[0], requests=6)
    names = " ".join(g.name for g in goals)
    for expected in ("iid-0.8", "phases", "useless", "writing-assistant", "hard cap"):
        assert expected in names
    # each verdict carries the figures it rests on, in the form of its kind
    figures = {
        "adaptive >= ": r"adaptive \d+\.\d tok/s = \d\.\d{3}x best fixed tau=\d+ \(\d+\.\d\); known-rate oracle \d\.\d{3}x",
        "within 3% of target-only": r"adaptive \d\.\d{3}x target-only, fixed tau=4 \d\.\d{3}x",
        "fleet average": r"adaptive: window max \d\.\d\d, \d+\.\d\d tok/req, SLO met \d+%",
        "hard cap": r"adaptive: max \d+ passes, \d+\.\d tok/req",
        "fleet mode": r"window max \d\.\d\d passes/request \(.+\), \d+\.\d\d tok/req",
    }
    for g in goals:
        kind = [k for k in figures if k in g.name]
        assert len(kind) == 1, g.name
        assert re.match(figures[kind[0]], g.detail), (g.name, g.detail)
    assert next(g for g in goals if g.name.startswith("hard cap")).passed


def test_a_reach_rule_in_the_runner_keeps_the_token_it_stops_at_and_charges_its_forwards() -> None:
    from specdec.policy import Decision, Policy, ReachRule, StepContext

    class OneThenStop(Policy):
        name = "one-then-stop"
        records: list[StepRecord] = []

        def next_tau(self, ctx: StepContext) -> Decision:
            # every drafted token is judged certain to fail: the first takes the chance to 0, drafting stops
            return Decision(8, "t", ReachRule((0.0,) * 10, (0.5,)))

        def observe(self, record: StepRecord) -> None:
            self.records.append(record)

    p = OneThenStop()
    simulate(p, small("iid-0.8", 3), replace(CPU, jitter=0.0), seed=0)
    drafting = [r for r in p.records if r.tau]
    assert drafting and all(r.tau == 1 for r in drafting)
    assert all(r.draft_time == pytest.approx(CPU.draft_per_token_s) for r in drafting)  # one forward, not two


def test_the_informed_oracle_beats_the_tau_only_oracle_under_the_assumed_confidence_model() -> None:
    w = small("iid-0.8", 30)
    tau_only = simulate(make_policy_or_oracle("oracle"), w, CPU, seed=0).tokens_per_s
    informed = simulate(make_policy_or_oracle("oracle:confidence=true"), w, CPU, seed=0).tokens_per_s
    assert informed > 1.03 * tau_only


def make_policy_or_oracle(spec: str):
    from specdec.simulate.report import policy_factory

    return policy_factory(spec)()


# -- the simulator runs the engine's step ------------------------------------------------------------------


def _recording(spec: str) -> tuple[Policy, dict[str, list[StepRecord]]]:
    """A policy whose records (the engine's) are kept by request id."""
    policy = make_policy(spec)
    seen: dict[str, list[StepRecord]] = defaultdict(list)
    original = policy.observe
    policy.observe = lambda rec: (seen[rec.request_id].append(rec), original(rec))  # type: ignore[method-assign]
    return policy, seen


def test_a_change_to_the_engines_step_shows_in_simulated_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both drivers step requests with ``Engine.step``: narrow the engine's τ clamp (``max_tau``) to 1 and every
    simulated step drafts at most one token, though the policy asks for four; the records carry the fields the
    engine fills (its pass count against the cap, the batch, the rows)."""
    from specdec.engine import Generation
    from specdec.simulate.arrivals import Arrivals
    from specdec.simulate.runner import simulate_batched

    context = Generation.context_for_policy
    monkeypatch.setattr(
        Generation, "context_for_policy", lambda g, n: replace(context(g, n), max_tau=min(1, context(g, n).max_tau))
    )
    w = replace(small("iid-0.9"), max_verify_passes=40)
    policy, seen = _recording("fixed:tau=4")
    res = simulate(policy, w, CPU, seed=0)
    assert sum(r.passes for r in res.requests) == sum(len(recs) for recs in seen.values())
    for recs in seen.values():
        assert all(r.tau_planned == 4 and r.tau <= 1 and r.rows == r.tau + 1 and r.batch_size == 1 for r in recs)
        assert [r.verify_passes for r in recs] == list(range(1, len(recs) + 1))
        assert all(r.max_verify_passes == 40 for r in recs)
    assert any(r.tau == 1 for recs in seen.values() for r in recs)
    policy, seen = _recording("fixed:tau=4")
    simulate_batched(policy, w, CPU, 0, Arrivals("clients", clients=4), max_batch=4)
    recs = [r for rs in seen.values() for r in rs]
    assert all(r.tau <= 1 for r in recs) and max(r.batch_size for r in recs) == 4


def test_simulated_greedy_output_is_the_hidden_true_continuation() -> None:
    """Verification is the engine's commit of the simulated target's greedy verdicts: whatever is drafted, the
    output is the request's true continuation (lossless by construction), and requests finish by the engine's
    rules: at EOS (``stop``: ``length`` tokens of a request that stops by itself), at ``max_new_tokens``
    (``length``), or when their passes are spent (``verify_budget``)."""
    from specdec.simulate.pair import World

    w, seed = small("iid-0.6", 20), 5
    policy, seen = _recording("fixed:tau=4")
    res = simulate(policy, w, CPU, seed)
    reqs = w.make_requests(seed)
    world = World(w.process(seed), reqs, seed)
    for req, out in zip(reqs, res.requests):
        recs = seen[f"sim-{seed}-{req.index}"]
        n = min(req.length, req.max_new_tokens)
        assert [t for r in recs for t in r.emitted] == [world.token(req, p) for p in range(n)]
        assert out.new_tokens == n and out.finish == ("stop" if req.length < req.max_new_tokens else "length")
    assert {r.finish for r in res.requests} == {"stop", "length"}
    assert any(not all(r.accept_flags) for recs in seen.values() for r in recs)  # rejected drafts never emitted
    capped = simulate(make_policy("fixed", tau=0), replace(w, max_verify_passes=5), CPU, seed)
    assert all(r.passes <= 5 for r in capped.requests)
    assert {r.finish for r in capped.requests} == {"verify_budget"}
    assert all(r.new_tokens == 5 for r in capped.requests)
