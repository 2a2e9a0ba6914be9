"""Drive the engine's own step (``specdec.engine.Engine``) on a simulated model pair: what is simulated is what ships.

The simulator makes an ``Engine`` on ``specdec.simulate.pair``: a target side that verifies greedily against
each request's hidden true continuation, a drafter that runs the engine's ``lockstep`` loop drawing each
token's acceptance from the workload's process, and a virtual clock charged from the cost model. Every
request is an engine ``Generation`` advanced by ``Engine.step``: the policies' plans, the τ clamp, the
verification cap and allowances, commits, finish rules (``length``, EOS ``stop``, ``verify_budget``), records
and stats are the engine's, written once. The drivers here only admit requests, charge the rest of each step
(policy, bookkeeping) and collect outcomes. All randomness is seeded per (seed, request), so every policy meets
the same requests and the same acceptance stream where their choices coincide.

``simulate`` runs the requests one after another, each alone (decode throughput, no queueing), priced by the
one-request cost figures. ``simulate_batched`` serves them as ``specdec serve`` does under an arrival process
(``arrivals.py``): continuous batching of up to ``max_batch`` sequences (a request joins between steps, its
prefill a pass of its own that the others wait for, and leaves the moment it finishes), each step one
``Engine.step`` over them all, priced by the batched cost model: one target pass by its total rows, a draft
forward by the sequences in it, the rest by sequences.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from specdec.engine import Engine, Generation
from specdec.policy.base import Policy
from specdec.policy.budget import FleetBudgetPolicy
from specdec.records import FinishReason
from specdec.simulate.arrivals import Arrivals
from specdec.simulate.costs import CostModel
from specdec.simulate.oracle import OraclePolicy
from specdec.simulate.pair import NoText, SimClock, SimDrafter, SimTarget, World
from specdec.simulate.processes import SimRequest
from specdec.simulate.workloads import Workload


@dataclass
class RequestOutcome:
    prompt_len: int
    new_tokens: int
    passes: int
    latency: float
    prefill: float
    finish: FinishReason
    drafted: int
    accepted: int
    arrival: float = 0.0  # batched runs: seconds from the run's start to the request's arrival
    finished: float = 0.0  # ... and to its finish (latency = finished - arrival, queueing included)


@dataclass
class RunResult:
    policy: str
    workload: str
    cost: str
    seed: int
    slo_s: float | None
    window: int
    requests: list[RequestOutcome] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        decode = sum(r.latency - r.prefill for r in self.requests)
        return sum(r.new_tokens for r in self.requests) / decode if decode > 0 else 0.0

    def p95_latency(self) -> float:
        lat = sorted(r.latency for r in self.requests)
        return lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else 0.0

    def slo_attainment(self) -> float | None:
        if self.slo_s is None or not self.requests:
            return None
        return sum(r.latency <= self.slo_s for r in self.requests) / len(self.requests)

    def max_window_passes(self) -> float:
        """Highest mean passes per request over any window of ``window`` consecutive requests."""
        p = [r.passes for r in self.requests]
        w = min(self.window, len(p))
        return max(sum(p[i : i + w]) / w for i in range(len(p) - w + 1)) if p else 0.0

    def summary(self) -> dict[str, Any]:
        n = max(1, len(self.requests))
        drafted = sum(r.drafted for r in self.requests)
        return {
            "policy": self.policy,
            "workload": self.workload,
            "cost": self.cost,
            "seed": self.seed,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_request": sum(r.new_tokens for r in self.requests) / n,
            "passes_mean": sum(r.passes for r in self.requests) / n,
            "passes_max": max((r.passes for r in self.requests), default=0),
            "max_window_passes": self.max_window_passes(),
            "p95_latency_s": self.p95_latency(),
            "slo_attainment": self.slo_attainment(),
            "budget_cut": sum(r.finish == "verify_budget" for r in self.requests) / n,
            "acceptance_rate": sum(r.accepted for r in self.requests) / drafted if drafted else 0.0,
        }


def simulate(policy: Policy, workload: Workload, cost: CostModel, seed: int, label: str | None = None) -> RunResult:
    """Run every request of ``workload`` through ``policy`` (one long-lived instance, as in the engine)."""
    policy, world, reqs = _setup(policy, workload, cost, seed)
    clock = SimClock(cost, random.Random())
    engine = _engine(world, clock)
    result = RunResult(label or policy.name, workload.name, cost.name, seed, workload.slo_s, workload.budget_window)
    for req in reqs:
        clock.rng = random.Random(f"{seed}/{req.index}/time")  # each request's timings: a stream of its own
        gen = _start(engine, world, policy, req, workload.max_verify_passes)
        while not gen.done and not gen.out_of_budget():
            clock.rest(1)
            engine.step([gen])
        result.requests.append(_outcome(gen, gen.stats.latency))
    return result


def _setup(policy: Policy, workload: Workload, cost: CostModel, seed: int) -> tuple[Policy, World, list[SimRequest]]:
    """The run's policy (under the workload's fleet budget, if any), its world and requests, the oracle shown
    the truth."""
    if workload.fleet_budget is not None:
        policy = FleetBudgetPolicy(policy, workload.fleet_budget, workload.budget_window)
    process = workload.process(seed)
    reqs = workload.make_requests(seed)
    for req in reqs:
        process.prepare(req, random.Random(f"{seed}/{req.index}/prepare"))
    world = World(process, reqs, seed)
    oracle = getattr(policy, "inner", policy)
    if isinstance(oracle, OraclePolicy):
        oracle.see(process, {_request_id(seed, req): req for req in reqs}, cost)
    return policy, world, reqs


def _engine(world: World, clock: SimClock) -> Engine:
    return Engine(SimTarget(world, clock), NoText(), SimDrafter(world, clock), clock=clock)


def _request_id(seed: int, req: SimRequest) -> str:
    return f"sim-{seed}-{req.index}"


def _start(engine: Engine, world: World, policy: Policy, req: SimRequest, cap: int | None) -> Generation:
    """The request as the engine starts one: validated, prefilled (charged), its policy told."""
    return engine.start(
        world.prompt(req),
        max_new_tokens=req.max_new_tokens,
        max_verify_passes=cap,
        request_id=_request_id(world.seed, req),
        policy=policy,
    )


def _outcome(gen: Generation, latency: float, arrival: float = 0.0, finished: float = 0.0) -> RequestOutcome:
    stats = gen.stats
    return RequestOutcome(
        stats.prompt_tokens,
        stats.new_tokens,
        stats.target_passes,
        latency,
        stats.prefill_time,
        stats.finish_reason,
        stats.drafted,
        stats.accepted,
        arrival=arrival,
        finished=finished,
    )


@dataclass
class LoadResult(RunResult):
    """A batched run under an arrival process. Throughput is the server's: tokens over the whole run, from
    the first arrival to the last finish; latency is per request, arrival to finish (queueing included)."""

    arrivals: str = ""
    max_batch: int = 1
    steps: int = 0  # batched steps (target passes, prefills not counted)
    sequence_steps: int = 0  # Σ sequences per step
    rows: int = 0  # Σ target rows per step
    drafting_steps: int = 0  # sequence-steps that drafted

    @property
    def makespan(self) -> float:
        if not self.requests:
            return 0.0
        return max(r.finished for r in self.requests) - min(r.arrival for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        span = self.makespan
        return sum(r.new_tokens for r in self.requests) / span if span > 0 else 0.0

    @property
    def mean_tau(self) -> float:
        """Draft tokens per sequence-step (τ after the clamp and the stop rule, 0 for plain steps)."""
        return sum(r.drafted for r in self.requests) / self.sequence_steps if self.sequence_steps else 0.0

    def mean_latency(self) -> float:
        return sum(r.latency for r in self.requests) / len(self.requests) if self.requests else 0.0

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update(
            arrivals=self.arrivals,
            max_batch=self.max_batch,
            mean_latency_s=self.mean_latency(),
            makespan_s=self.makespan,
            mean_batch=self.sequence_steps / self.steps if self.steps else 0.0,
            rows_per_pass=self.rows / self.steps if self.steps else 0.0,
            mean_tau=self.mean_tau,
            drafting_share=self.drafting_steps / self.sequence_steps if self.sequence_steps else 0.0,
        )
        return out


@dataclass
class _InFlight:
    """A request in a batched run: its engine generation and when it arrived and was admitted."""

    index: int
    gen: Generation
    arrival: float
    started: float  # admitted (its prefill begins): the engine's clock for the request starts here


def simulate_batched(
    policy: Policy,
    workload: Workload,
    cost: CostModel,
    seed: int,
    arrivals: Arrivals,
    max_batch: int = 16,
    label: str | None = None,
) -> LoadResult:
    """Serve every request of ``workload`` arriving by ``arrivals`` with continuous batching (see the module)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    policy, world, reqs = _setup(policy, workload, cost, seed)
    clock = SimClock(cost, random.Random(f"{seed}/batch/time"), batched=True)
    engine = _engine(world, clock)
    result = LoadResult(
        label or policy.name,
        workload.name,
        cost.name,
        seed,
        workload.slo_s,
        workload.budget_window,
        arrivals=arrivals.label,
        max_batch=max_batch,
    )
    times = arrivals.times(len(reqs), seed)
    # Arrival time by request index, filled in order: all at once (open loop), or N at 0 and then one per
    # finish (closed loop: a client sends its next request the moment its last one finishes).
    arrive: list[float] = list(times) if times is not None else [0.0] * min(arrivals.clients, len(reqs))
    nxt = 0
    waiting: deque[int] = deque()
    active: list[_InFlight] = []
    outcomes: dict[int, RequestOutcome] = {}

    def settle() -> None:
        """Collect the requests the engine finished; a closed-loop client sends its next one now."""
        for seq in [s for s in active if s.gen.done]:
            latency = seq.started + seq.gen.stats.latency - seq.arrival
            outcomes[seq.index] = _outcome(seq.gen, latency, seq.arrival, seq.arrival + latency)
            active.remove(seq)
            if times is None and len(arrive) < len(reqs):
                arrive.append(clock.now)

    while len(outcomes) < len(reqs):
        while nxt < len(arrive) and arrive[nxt] <= clock.now:
            waiting.append(nxt)
            nxt += 1
        if not active and not waiting:
            clock.wait_until(arrive[nxt])  # idle until the next arrival
            continue
        while waiting and len(active) < max_batch:
            index, started = waiting.popleft(), clock.now
            gen = _start(engine, world, policy, reqs[index], workload.max_verify_passes)  # the others wait
            active.append(_InFlight(index, gen, arrive[index], started))
        live = [s.gen for s in active if not s.gen.out_of_budget()]  # the engine's check (it finishes them)
        if live:
            clock.rest(len(live))
            record = next(e.record for e in engine.step(live) if e is not None)
            result.steps += 1
            result.sequence_steps += record.batch_size
            result.rows += record.rows
            result.drafting_steps += record.drafting
        settle()
    result.requests = [outcomes[i] for i in range(len(reqs))]
    return result
