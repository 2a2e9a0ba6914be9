"""Drive real policy objects through synthetic steps: what is simulated is what ships.

Each step asks the policy for a ``Decision`` with a ``StepContext`` built like the engine's, draws
the draft's acceptance from the workload's process, charges time from the cost model, and feeds the
policy a ``StepRecord`` built like the engine's. The hard cap, τ clamp and stop decisions follow
the engine's rules. All randomness is seeded per (seed, request), so every policy meets the same
requests and the same acceptance stream where their choices coincide.

``simulate`` runs the requests one after another, each alone (decode throughput, no queueing).
``simulate_batched`` serves them as the engine's batched step does under an arrival process
(``arrivals.py``): continuous batching of up to ``max_batch`` sequences (a request joins between steps,
its prefill a pass of its own that the others wait for, and leaves the moment it finishes); each step
plans every sequence's τ (``Policy.plan``: batch-aware policies see the whole batch), drafts them all
through the engine's lockstep loop (one draft forward per depth over the sequences still drafting, each
drawing from its own acceptance stream), and charges the batched cost model: one target pass by its
total rows, a draft forward by the sequences in it, the rest by sequences.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from specdec.drafters.loop import DraftAsk, Pick, lockstep
from specdec.policy.base import Decision, Policy, StepContext
from specdec.policy.budget import FleetBudgetPolicy
from specdec.records import FinishReason, GenerationStats, StepRecord, correction_kind
from specdec.simulate.arrivals import Arrivals
from specdec.simulate.costs import CostModel
from specdec.simulate.oracle import OraclePolicy
from specdec.simulate.processes import AcceptanceProcess, SimRequest, draft_confidence
from specdec.simulate.workloads import Workload


class _Greedy:
    """Synthetic drafts are judged by their acceptance draws alone: the loop sees a greedy request."""

    greedy = True


_GREEDY = _Greedy()
_NO_GENERATOR: Any = None  # simulated drafts draw from the runner's own random stream


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
    if workload.fleet_budget is not None:
        policy = FleetBudgetPolicy(policy, workload.fleet_budget, workload.budget_window)
    process = workload.process(seed)
    result = RunResult(label or policy.name, workload.name, cost.name, seed, workload.slo_s, workload.budget_window)
    for req in workload.make_requests(seed):
        process.prepare(req, random.Random(f"{seed}/{req.index}/prepare"))
        result.requests.append(_run_request(policy, process, req, cost, workload.max_verify_passes, seed))
    return result


def _run_request(
    policy: Policy, process: AcceptanceProcess, req: SimRequest, cost: CostModel, cap: int | None, seed: int
) -> RequestOutcome:
    rng = random.Random(f"{seed}/{req.index}/accept")
    jit = random.Random(f"{seed}/{req.index}/time")
    rid = f"sim-{seed}-{req.index}"
    end = min(req.max_new_tokens, req.length)
    prefill = cost.noisy(cost.prefill_per_token_s * req.prompt_len, jit)
    clock, new, passes, drafted, accepted = prefill, 0, 0, 0, 0
    records: list[StepRecord] = []

    def context() -> StepContext:
        return StepContext(
            request_id=rid,
            step=len(records),
            prompt_len=req.prompt_len,
            context_len=req.prompt_len + new,
            new_tokens=new,
            max_new_tokens=req.max_new_tokens,
            verify_passes=passes,
            max_verify_passes=cap,
            max_tau=max(0, req.max_new_tokens - new - 1),
            elapsed=clock,
        )

    policy.begin(context())
    allowance = policy.allowance(rid)  # the engine's rule: a policy's allowance narrows the request's cap
    if allowance is not None:
        cap = allowance if cap is None else min(cap, allowance)
    finish: FinishReason | None = None
    while finish is None:
        if cap is not None and passes >= cap:
            finish = "verify_budget"
            break
        ctx = context()
        oracle = getattr(policy, "inner", policy)
        if isinstance(oracle, OraclePolicy):
            oracle.see(process, req, new, cost)
        decision = policy.next_tau(ctx)
        asked = max(0, min(decision.tau, ctx.max_tau))  # the engine's clamp
        draws: list[bool] = []

        def draw(rows: list[int], *_: Any, draws: list[bool] = draws, start: int = new) -> list[Pick]:
            ok = rng.random() < process.rate(req, start, len(draws) + 1)
            draws.append(ok)
            conf = draft_confidence(ok, rng)
            return [Pick(int(ok), conf, conf)]

        # The engine's drafting loop, with a simulated draft forward: token 1 = accepted, 0 = rejected.
        (draft,) = lockstep([DraftAsk(None, [], asked, _GREEDY, _NO_GENERATOR, decision.rule)], draw, draw)
        flags, confs = [bool(t) for t in draft.tokens], draft.token_probs
        dropped = len(draws) - len(flags)  # a confidence cut still ran the forward that made the dropped token
        tau = len(flags)
        n_acc = flags.index(False) if False in flags else tau
        forwards = tau + dropped
        draft_t = cost.noisy(forwards * cost.draft_per_token_s, jit) if forwards else 0.0
        verify_t = cost.noisy(cost.verify(tau + 1), jit)
        other_t = cost.noisy(cost.other_s, jit)
        emitted = min(n_acc + 1, end - new)
        record = _sim_record(
            rid,
            len(records),
            req.prompt_len,
            new,
            policy.name,
            decision,
            flags,
            confs,
            emitted,
            (draft_t, verify_t, other_t),
            verify_passes=passes + 1,
            max_verify_passes=cap,
        )
        records.append(record)
        clock += draft_t + verify_t + other_t
        passes += 1
        new += emitted
        drafted += tau
        accepted += min(n_acc, emitted)
        policy.observe(record)
        if new >= end:
            finish = "length" if new >= req.max_new_tokens else "stop"
    policy.end(rid, _stats(req.prompt_len, records, prefill, clock, finish))
    return RequestOutcome(req.prompt_len, new, passes, clock, prefill, finish, drafted, accepted)


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
class _Seq:
    """A request in flight in a batched run."""

    req: SimRequest
    rid: str
    rng: random.Random
    arrival: float
    started: float  # admitted (its prefill begins): the engine's clock for the request starts here
    prefill: float
    cap: int | None
    new: int = 0
    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    records: list[StepRecord] = field(default_factory=list)

    @property
    def end(self) -> int:
        return min(self.req.max_new_tokens, self.req.length)

    def context(self, batch_size: int, clock: float) -> StepContext:
        return StepContext(
            request_id=self.rid,
            step=len(self.records),
            prompt_len=self.req.prompt_len,
            context_len=self.req.prompt_len + self.new,
            new_tokens=self.new,
            max_new_tokens=self.req.max_new_tokens,
            verify_passes=self.passes,
            max_verify_passes=self.cap,
            max_tau=max(0, self.req.max_new_tokens - self.new - 1),
            elapsed=clock - self.started,
            batch_size=batch_size,
        )


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
    if workload.fleet_budget is not None:
        policy = FleetBudgetPolicy(policy, workload.fleet_budget, workload.budget_window)
    process = workload.process(seed)
    reqs = workload.make_requests(seed)
    for req in reqs:
        process.prepare(req, random.Random(f"{seed}/{req.index}/prepare"))
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
    jit = random.Random(f"{seed}/batch/time")
    clock, nxt = 0.0, 0
    waiting: deque[int] = deque()
    active: list[_Seq] = []
    outcomes: dict[int, RequestOutcome] = {}

    def finish(seq: _Seq, reason: FinishReason) -> None:
        policy.end(seq.rid, _stats(seq.req.prompt_len, seq.records, seq.prefill, clock - seq.started, reason))
        outcomes[seq.req.index] = RequestOutcome(
            seq.req.prompt_len,
            seq.new,
            seq.passes,
            clock - seq.arrival,
            seq.prefill,
            reason,
            seq.drafted,
            seq.accepted,
            arrival=seq.arrival,
            finished=clock,
        )
        active.remove(seq)
        if times is None and len(arrive) < len(reqs):
            arrive.append(clock)

    while len(outcomes) < len(reqs):
        while nxt < len(arrive) and arrive[nxt] <= clock:
            waiting.append(nxt)
            nxt += 1
        if not active and not waiting:
            clock = arrive[nxt]  # idle until the next arrival
            continue
        while waiting and len(active) < max_batch:
            req = reqs[waiting.popleft()]
            seq = _Seq(
                req,
                f"sim-{seed}-{req.index}",
                random.Random(f"{seed}/{req.index}/accept"),
                arrive[req.index],
                clock,
                cost.noisy(cost.prefill_per_token_s * req.prompt_len, jit),
                workload.max_verify_passes,
            )
            clock += seq.prefill  # a pass of its own, before the next step: the others wait
            policy.begin(seq.context(1, clock))
            allowance = policy.allowance(seq.rid)  # the engine's rule: an allowance narrows the request's cap
            if allowance is not None:
                seq.cap = allowance if seq.cap is None else min(seq.cap, allowance)
            active.append(seq)
        for seq in [s for s in active if s.cap is not None and s.passes >= s.cap]:
            finish(seq, "verify_budget")  # the engine's one check, at the step's start
        if not active:
            continue
        live = list(active)
        ctxs = [seq.context(len(live), clock) for seq in live]
        oracle = getattr(policy, "inner", policy)
        if isinstance(oracle, OraclePolicy):  # shown the truth for each sequence in turn (it plans alone)
            decisions = []
            for seq, ctx in zip(live, ctxs):
                oracle.see(process, seq.req, seq.new, cost)
                decisions.append(policy.next_tau(ctx))
        else:
            decisions = policy.plan(ctxs, 0)
        taus = [max(0, min(d.tau, ctx.max_tau)) for d, ctx in zip(decisions, ctxs)]  # the engine's clamp
        draws: list[list[bool]] = [[] for _ in live]
        forwards: list[int] = []  # sequences in each lockstep draft forward

        def forward(
            rows: list[int],
            *_: Any,
            live: list[_Seq] = live,
            draws: list[list[bool]] = draws,
            forwards: list[int] = forwards,
        ) -> list[Pick]:
            forwards.append(len(rows))
            picks = []
            for i in rows:
                seq = live[i]
                ok = seq.rng.random() < process.rate(seq.req, seq.new, len(draws[i]) + 1)
                draws[i].append(ok)
                conf = draft_confidence(ok, seq.rng)
                picks.append(Pick(int(ok), conf, conf))
            return picks

        asks = [DraftAsk(None, [], tau, _GREEDY, _NO_GENERATOR, d.rule) for tau, d in zip(taus, decisions)]
        drafts = lockstep(asks, forward, forward)  # the engine's drafting loop, over every sequence at once
        rows = sum(len(d.tokens) + 1 for d in drafts)
        drafting = sum(1 for d in drafts if d.tokens)
        depth = max(len(d.tokens) for d in drafts)
        draft_t = cost.noisy(sum(cost.draft_forward(n) for n in forwards), jit) if forwards else 0.0
        verify_t = cost.noisy(cost.verify_rows(rows), jit)
        other_t = cost.noisy(cost.step_other(len(live)), jit)
        clock += draft_t + verify_t + other_t
        result.steps += 1
        result.sequence_steps += len(live)
        result.rows += rows
        result.drafting_steps += drafting
        done: list[tuple[_Seq, FinishReason]] = []
        for seq, decision, draft in zip(live, decisions, drafts):
            flags, confs = [bool(t) for t in draft.tokens], draft.token_probs
            tau = len(flags)
            n_acc = flags.index(False) if False in flags else tau
            emitted = min(n_acc + 1, seq.end - seq.new)
            record = _sim_record(
                seq.rid,
                len(seq.records),
                seq.req.prompt_len,
                seq.new,
                policy.name,
                decision,
                flags,
                confs,
                emitted,
                (
                    draft_t,
                    verify_t,
                    other_t,
                ),  # the step's times, shared (what the request waited), as the engine records
                verify_passes=seq.passes + 1,
                max_verify_passes=seq.cap,
                batch_size=len(live),
                rows=rows,
                drafting=drafting,
                draft_passes=depth,
            )
            seq.records.append(record)
            seq.passes += 1
            seq.new += emitted
            seq.drafted += tau
            seq.accepted += min(n_acc, emitted)
            policy.observe(record)
            if seq.new >= seq.end:
                done.append((seq, "length" if seq.new >= seq.req.max_new_tokens else "stop"))
        for seq, reason in done:
            finish(seq, reason)
    result.requests = [outcomes[i] for i in range(len(reqs))]
    return result


def _sim_record(
    rid: str,
    step: int,
    prompt_len: int,
    new: int,
    policy: str,
    decision: Decision,
    flags: list[bool],
    confs: list[float],
    emitted: int,
    times: tuple[float, float, float],
    **batch: Any,
) -> StepRecord:
    """A synthetic step's record, built as the engine builds its records (token ids are placeholders)."""
    tau = len(flags)
    n_acc = flags.index(False) if False in flags else tau
    return StepRecord(
        request_id=rid,
        step=step,
        prompt_len=prompt_len,
        context_len=prompt_len + new,
        policy=policy,
        reason=decision.reason,
        tau=tau,
        draft_tokens=[0] * tau,
        accept_flags=flags,
        n_accepted=n_acc,
        correction=correction_kind(tau, n_acc),
        emitted=[0] * emitted,
        draft_time=times[0],
        verify_time=times[1],
        other_time=times[2],
        draft_token_probs=confs,
        draft_confidence=confs,
        tau_planned=decision.tau,
        **batch,
    )


def _stats(
    prompt_len: int, records: list[StepRecord], prefill: float, latency: float, finish: FinishReason
) -> GenerationStats:
    """A simulated request's stats, counted from its records as the engine counts them (``GenerationStats.add``)."""
    stats = GenerationStats(prompt_tokens=prompt_len, prefill_time=prefill, latency=latency, finish_reason=finish)
    for record in records:
        stats.add(record)
    return stats
