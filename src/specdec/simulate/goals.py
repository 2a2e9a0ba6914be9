"""The policy goals of issue 5, checked in the simulator over seeds, with the figures behind each verdict; and
issue 15's batch-aware τ goals, under load (closed-loop clients, continuous batching) on cost models that
carry batched figures (``cpu``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from specdec.simulate.arrivals import Arrivals
from specdec.simulate.costs import CostModel, load_costs
from specdec.simulate.report import policy_factory
from specdec.simulate.runner import LoadResult, simulate, simulate_batched
from specdec.simulate.workloads import LOAD_WORKLOADS, WORKLOADS, Workload

FIXED_TAUS = (1, 2, 3, 4, 5, 6, 8, 10, 12)
LOAD_CLIENTS = (1, 4, 16, 32)  # closed-loop clients of the batched goals (the load test's levels)
LOAD_FIXED_TAUS = (1, 2, 3, 4, 6, 8)
LOAD_MAX_BATCH = 32
LOAD_REQUESTS_PER_CLIENT = 4  # requests per run: this many per client, at least 32


@dataclass
class Goal:
    name: str
    passed: bool
    detail: str

    def line(self) -> str:
        return f"[{'PASS' if self.passed else 'FAIL'}] {self.name}: {self.detail}"


def _tps(spec: str, w: Workload, cost: CostModel, seeds: list[int]) -> float:
    factory = policy_factory(spec)
    vals = [simulate(factory(), w, cost, s).tokens_per_s for s in seeds]
    return sum(vals) / len(vals)


def _best_fixed(w: Workload, cost: CostModel, seeds: list[int]) -> tuple[int, float]:
    return max(((t, _tps(f"fixed:tau={t}", w, cost, seeds)) for t in FIXED_TAUS), key=lambda x: x[1])


def check_goals(cost_names: list[str], seeds: list[int], requests: int | None = None) -> list[Goal]:
    goals: list[Goal] = []
    for cname in cost_names:
        cost = load_costs(cname)
        for w in WORKLOADS.values():
            if requests is not None:
                w = replace(w, requests=requests)
            if w.kind in ("stationary", "switching"):
                goals.append(_vs_fixed(w, cost, seeds))
            elif w.kind == "useless":
                goals.append(_useless(w, cost, seeds))
            elif w.fleet_budget is not None:
                goals.append(_fleet(w, cost, seeds))
        every = [replace(w, requests=requests or 30) for w in WORKLOADS.values()]
        goals.append(_hard_cap(every, cost, seeds))
        goals.append(_fleet_everywhere(every, cost, seeds))
    for cname in cost_names:  # after every one-request goal, so their lines read as before
        cost = load_costs(cname)
        if cost.batch_source:
            for w in LOAD_WORKLOADS.values():
                goals.extend(batched_goals(w, cost, seeds, requests))
    return goals


def _load_runs(
    spec: str, w: Workload, cost: CostModel, seeds: list[int], clients: int, requests: int | None
) -> list[LoadResult]:
    n = requests or max(32, LOAD_REQUESTS_PER_CLIENT * clients)
    w = replace(w, requests=n)
    factory = policy_factory(spec)
    return [
        simulate_batched(factory(), w, cost, s, Arrivals("clients", clients=clients), LOAD_MAX_BATCH) for s in seeds
    ]


def _mean(vals: list[float]) -> float:
    return sum(vals) / len(vals)


def batched_goals(
    w: Workload, cost: CostModel, seeds: list[int], requests: int | None = None, loads: tuple[int, ...] = LOAD_CLIENTS
) -> list[Goal]:
    """Issue 15's batch-aware τ under closed-loop load (``loads`` clients, continuous batching up to
    LOAD_MAX_BATCH): adaptive within 5% of the best of plain and every fixed τ at each load; it speculates at
    the lightest load and drafts less at the heaviest; fixed τ = 4 at the heaviest load is slower than plain."""
    goals: list[Goal] = []
    taus: dict[int, float] = {}
    plain_at: dict[int, float] = {}
    fixed4_at: dict[int, float] = {}
    for clients in loads:
        runs = {
            spec: _load_runs(spec, w, cost, seeds, clients, requests)
            for spec in ["adaptive", "fixed:tau=0", *(f"fixed:tau={t}" for t in LOAD_FIXED_TAUS)]
        }
        tps = {spec: _mean([r.tokens_per_s for r in rs]) for spec, rs in runs.items()}
        p95 = {spec: _mean([r.p95_latency() for r in rs]) for spec, rs in runs.items()}
        fixed = {t: tps[f"fixed:tau={t}"] for t in LOAD_FIXED_TAUS}
        best_tau = max(fixed, key=lambda t: fixed[t])
        plain, adaptive = tps["fixed:tau=0"], tps["adaptive"]
        bar = max(plain, fixed[best_tau])
        taus[clients] = _mean([r.mean_tau for r in runs["adaptive"]])
        plain_at[clients], fixed4_at[clients] = plain, fixed[4]
        goals.append(
            Goal(
                f"{w.name} clients:{clients} [{cost.name}] batched adaptive >= 0.95x max(plain, best fixed)",
                adaptive >= 0.95 * bar,
                f"adaptive {adaptive:.0f} tok/s = {adaptive / bar:.3f}x (plain {plain:.0f}, best fixed tau={best_tau} "
                f"{fixed[best_tau]:.0f}); adaptive mean tau {taus[clients]:.2f}, "
                f"rows/pass {_mean([r.summary()['rows_per_pass'] for r in runs['adaptive']]):.1f}; p95 latency "
                f"adaptive {p95['adaptive']:.2f} s, plain {p95['fixed:tau=0']:.2f} s",
            )
        )
    light, heavy = loads[0], loads[-1]
    goals.append(
        Goal(
            f"{w.name} light load clients:{light} [{cost.name}] adaptive speculates (mean tau > 1)",
            taus[light] > 1.0,
            f"mean tau {taus[light]:.2f} per sequence-step",
        )
    )
    goals.append(
        Goal(
            f"{w.name} heavy load clients:{heavy} [{cost.name}] adaptive drafts less than at clients:{light}",
            taus[heavy] < taus[light],
            f"mean tau {taus[heavy]:.2f} vs {taus[light]:.2f}; by load "
            + ", ".join(f"{c}: {t:.2f}" for c, t in taus.items()),
        )
    )
    goals.append(
        Goal(
            f"{w.name} heavy load clients:{heavy} [{cost.name}] fixed tau=4 slower than plain batched",
            fixed4_at[heavy] < plain_at[heavy],
            ", ".join(f"clients:{c} fixed tau=4 {fixed4_at[c] / plain_at[c]:.3f}x plain" for c in loads),
        )
    )
    return goals


def _vs_fixed(w: Workload, cost: CostModel, seeds: list[int]) -> Goal:
    tau, best = _best_fixed(w, cost, seeds)
    adaptive = _tps("adaptive", w, cost, seeds)
    oracle = _tps("oracle", w, cost, seeds)
    informed = _tps("oracle:confidence=true", w, cost, seeds)
    ratio = adaptive / best
    need = 0.97 if w.kind == "stationary" else 1.10
    return Goal(
        f"{w.name} [{cost.name}] adaptive >= {need:.2f}x best fixed",
        ratio >= need,
        f"adaptive {adaptive:.1f} tok/s = {ratio:.3f}x best fixed tau={tau} ({best:.1f}); "
        f"known-rate oracle {oracle / best:.3f}x, with the confidence stop {informed / best:.3f}x",
    )


def _useless(w: Workload, cost: CostModel, seeds: list[int]) -> Goal:
    plain = _tps("fixed:tau=0", w, cost, seeds)
    adaptive = _tps("adaptive", w, cost, seeds) / plain
    fixed = _tps("fixed:tau=4", w, cost, seeds) / plain
    return Goal(
        f"{w.name} [{cost.name}] adaptive within 3% of target-only, fixed tau=4 not",
        adaptive >= 0.97 and fixed < 0.97,
        f"adaptive {adaptive:.3f}x target-only, fixed tau=4 {fixed:.3f}x",
    )


def _fleet(w: Workload, cost: CostModel, seeds: list[int]) -> Goal:
    assert w.fleet_budget is not None
    worst, parts = 0.0, []
    for spec in ("adaptive", "fixed:tau=4", "heuristic", "confidence"):
        factory = policy_factory(spec)
        runs = [simulate(factory(), w, cost, s) for s in seeds]
        peak = max(r.max_window_passes() for r in runs)
        worst = max(worst, peak)
        slo = sum(r.slo_attainment() or 0.0 for r in runs) / len(runs)
        tpr = sum(r.summary()["tokens_per_request"] for r in runs) / len(runs)
        parts.append(f"{spec}: window max {peak:.2f}, {tpr:.2f} tok/req, SLO met {100 * slo:.0f}%")
    return Goal(
        f"{w.name} [{cost.name}] fleet average <= B={w.fleet_budget:g} over every {w.budget_window}-request window",
        worst <= w.fleet_budget + 1e-9,
        "; ".join(parts),
    )


def _hard_cap(workloads: list[Workload], cost: CostModel, seeds: list[int], cap: int = 6) -> Goal:
    """Every shipped workload under ``max_verify_passes=cap``: no request may take more passes."""
    worst, parts = 0, []
    for spec in ("adaptive", "fixed:tau=4", "heuristic"):
        peak, tokens, n = 0, 0.0, 0
        for w in workloads:
            runs = [simulate(policy_factory(spec)(), replace(w, max_verify_passes=cap), cost, s) for s in seeds]
            peak = max([peak] + [r.summary()["passes_max"] for r in runs])
            tokens += sum(sum(q.new_tokens for q in r.requests) for r in runs)
            n += sum(len(r.requests) for r in runs)
        worst = max(worst, peak)
        parts.append(f"{spec}: max {peak} passes, {tokens / n:.1f} tok/req")
    return Goal(
        f"hard cap max_verify_passes={cap} [{cost.name}] never exceeded on any of {len(workloads)} workloads",
        worst <= cap,
        "; ".join(parts),
    )


def _fleet_everywhere(workloads: list[Workload], cost: CostModel, seeds: list[int], budget: float = 2.0) -> Goal:
    """Every shipped workload with ``adaptive:fleet_budget=B``: every window of requests averages ≤ B."""
    worst, tokens, n, worst_name = 0.0, 0.0, 0, ""
    for w in workloads:
        w = replace(w, fleet_budget=None)  # the policy's own ledger, not the workload's
        for s in seeds:
            run = simulate(policy_factory(f"adaptive:fleet_budget={budget:g},budget_window=32")(), w, cost, s)
            run.window = 32
            peak = run.max_window_passes()
            if peak > worst:
                worst, worst_name = peak, w.name
            tokens += sum(q.new_tokens for q in run.requests)
            n += len(run.requests)
    return Goal(
        f"fleet mode adaptive:fleet_budget={budget:g} [{cost.name}] <= B over every 32-request window, all workloads",
        worst <= budget + 1e-9,
        f"window max {worst:.2f} passes/request ({worst_name}), {tokens / n:.2f} tok/req",
    )
