"""Drive real policy objects through synthetic steps: what is simulated is what ships.

Each step asks the policy for a ``Decision`` with a ``StepContext`` built like the engine's, draws
the draft's acceptance from the workload's process, charges time from the cost model, and feeds the
policy a ``StepRecord`` built like the engine's. The hard cap, τ clamp and stop decisions follow
the engine's rules. All randomness is seeded per (seed, request), so every policy meets the same
requests and the same acceptance stream where their choices coincide.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from specdec.drafters.base import DraftAsk, Pick, lockstep
from specdec.policy.base import Policy, StepContext
from specdec.policy.budget import FleetBudgetPolicy
from specdec.records import FinishReason, GenerationStats, StepRecord
from specdec.sampling import SamplingParams
from specdec.simulate.costs import CostModel
from specdec.simulate.oracle import OraclePolicy
from specdec.simulate.processes import AcceptanceProcess, SimRequest, draft_confidence
from specdec.simulate.workloads import Workload

_GREEDY = SamplingParams()
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
        record = StepRecord(
            request_id=rid,
            step=len(records),
            prompt_len=req.prompt_len,
            context_len=req.prompt_len + new,
            policy=policy.name,
            reason=decision.reason,
            tau=tau,
            draft_tokens=[0] * tau,
            accept_flags=flags,
            n_accepted=n_acc,
            correction="plain" if tau == 0 else ("bonus" if n_acc == tau else "recovered"),
            emitted=[0] * emitted,
            draft_time=draft_t,
            verify_time=verify_t,
            other_time=other_t,
            draft_token_probs=confs,
            draft_confidence=confs,
            tau_planned=decision.tau,
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
    stats = GenerationStats(
        prompt_tokens=req.prompt_len,
        new_tokens=new,
        steps=passes,
        target_passes=passes,
        drafted=drafted,
        accepted=accepted,
        prefill_time=prefill,
        latency=clock,
        finish_reason=finish,
        draft_time=sum(r.draft_time for r in records),
        verify_time=sum(r.verify_time for r in records),
        other_time=sum(r.other_time for r in records),
    )
    policy.end(rid, stats)
    return RequestOutcome(req.prompt_len, new, passes, clock, prefill, finish, drafted, accepted)
