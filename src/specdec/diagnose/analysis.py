"""Aggregates of a trace that the checks and the plots share: acceptance, costs, the verify-time fit.

The counting is ``specdec.analysis.StepAggregate``'s (one definition of α, accepted length, per-position
acceptance and the verify fit for every reader); this module adds what is diagnose's own: prompt-length
buckets, interleaving, the paired draft cost and the speedup models.

Cost words: ``t1`` is the target's cost of one plain pass (a block of 1 token), seconds;
``c`` = draft cost per drafted token / ``t1``; ``v(k)`` = verify cost of a block of k tokens / ``t1``.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass, field

from specdec.analysis import StepAggregate, VerifyFit, low_quantile
from specdec.records import StepRecord, steady_rest
from specdec.trace import Trace

PROMPT_BUCKET_EDGES = (0, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
COST_QUANTILE = 0.25  # a low quantile estimates the uncontended cost: other load only ever adds time


@dataclass
class Bucket:
    label: str
    lo: int
    hi: int
    drafting: list[StepRecord] = field(default_factory=list)  # the steps with τ > 0 of its requests
    requests: set[str] = field(default_factory=set)
    time: float = 0.0  # step seconds of its requests, every step

    @functools.cached_property
    def agg(self) -> StepAggregate:
        return StepAggregate.of(self.drafting)

    @property
    def drafted(self) -> int:
        return self.agg.drafted

    @property
    def alpha(self) -> float:
        return self.agg.alpha or 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.agg.accepted_length or 0.0


@dataclass
class TraceStats:
    steps: list[StepRecord]
    agg: StepAggregate
    n_requests: int
    fit: VerifyFit
    prompt_buckets: list[Bucket]
    temperatures: set[float]
    draft_cost_per_token: float | None  # typical seconds per drafted token
    c_paired: float | None  # median over steps of draft cost per token / that step's one-pass cost
    other_per_step: float
    concurrent: bool  # steps of different requests interleave (other_time then includes their work)
    # The steps each of one sequence: the costs are read from these alone (a batched step's times are its whole
    # batch's: its pass holds every sequence's rows, its draft every sequence's forwards). ``batch_goodput`` reads
    # the batched ones.
    timed_steps: list[StepRecord] = field(default_factory=list)
    timed: StepAggregate = field(default_factory=lambda: StepAggregate.of([]))
    batch: BatchDepths | None = None  # the batched steps by depth at the batch size most ran (``main_batch``)
    predicted_steps: int = 0  # steps that drafted from predicted outputs: left out of ``steps`` and the analysis

    @property
    def drafted(self) -> int:
        return self.agg.drafted

    @property
    def costs_readable(self) -> bool:
        """Most steps ran one sequence, so the cost checks' figures (verify fit, c, overhead, speedup) describe the
        trace. In a batching server's trace the few one-sequence steps (a batch's last request, solo runs beside it)
        are not the trace's costs: the cost checks stay silent and ``batch_goodput`` speaks for its steps."""
        return bool(self.timed_steps) and 2 * len(self.timed_steps) >= len(self.steps)

    @property
    def accepted(self) -> int:
        return self.agg.accepted

    @property
    def draft_steps(self) -> int:
        return self.agg.draft_steps

    @property
    def emitted(self) -> int:
        return self.agg.emitted

    @property
    def draft_time(self) -> float:
        return self.timed.draft_time

    @property
    def verify_time(self) -> float:
        return self.timed.verify_time

    @property
    def other_time(self) -> float:
        return self.timed.other_time

    @property
    def policy_time(self) -> float:
        return self.timed.policy_time

    @property
    def position_reached(self) -> list[int]:
        """Steps whose position i was tested with every earlier draft accepted."""
        return self.agg.reached

    @property
    def position_accepted(self) -> list[int]:
        """Steps that accepted position i (and all before it)."""
        return self.agg.passed

    @property
    def total_time(self) -> float:
        return self.timed.total_time

    @property
    def alpha(self) -> float:
        return self.agg.alpha or 0.0

    @property
    def mean_tau(self) -> float:
        return self.agg.mean_tau or 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify pass of drafting steps, the correction token included (stop cuts ignored)."""
        return self.agg.accepted_length or 1.0

    @property
    def t1(self) -> float:
        return self.fit.t1()

    @property
    def c(self) -> float | None:
        return self.c_paired

    def conditional_acceptance(self) -> list[float]:
        """P(position i accepted | every earlier position accepted), per 0-based position."""
        return self.agg.conditional_acceptance()

    def expected_length(self, tau: int) -> float:
        """Tokens per pass at this τ from the measured per-position acceptance (last rate carried on)."""
        rates = self.conditional_acceptance() or [self.alpha]
        total, alive = 1.0, 1.0
        for i in range(tau):
            alive *= rates[min(i, len(rates) - 1)]
            total += alive
        return total

    def model_speedup(self, tau: int, with_overhead: bool = False) -> float:
        """Tokens per pass over the step's cost in target passes: L(τ) / (τ·c + v(τ+1) [+ o])."""
        c = self.c or 0.0
        o = self.other_per_step / self.t1 if with_overhead and self.t1 > 0 else 0.0
        return self.expected_length(tau) * (1 + o) / (tau * c + self.fit.v(tau + 1) + o)

    def achieved_speedup(self) -> float | None:
        """Tokens per step over the step's cost in plain-decoding steps (one pass + that step's host time).

        Each step is measured against its own verify pass (scaled to one token by v(k)), so load that
        slows the whole machine cancels; the median step cost damps isolated stalls.
        """
        units = [
            total / (s.verify_time / self.fit.v(s.tau + 1) + s.other_time)
            for s in self.timed_steps
            if (total := s.draft_time + s.verify_time + s.other_time) > 0 and s.verify_time > 0
        ]
        if not units:
            return None
        return (self.timed.emitted / len(self.timed_steps)) / statistics.median(units)


def analyse(trace: Trace) -> TraceStats:
    # Steps that drafted from a request's predicted output (``prediction``) say how well the prediction matched, not
    # the drafter: the analysis is the drafter's (an exact prediction alone would read as implausible acceptance).
    steps = [s for s in trace.steps if not s.predicted]
    agg = StepAggregate.of(steps)
    timed_steps = [s for s in steps if s.batch_size <= 1]
    timed = StepAggregate.of(timed_steps)
    fit = timed.verify_fit(COST_QUANTILE)
    paired = [
        s.draft_time / s.tau / (s.verify_time / fit.v(s.tau + 1))
        for s in timed_steps
        if s.tau > 0 and s.verify_time > 0
    ]
    return TraceStats(
        steps=steps,
        agg=agg,
        n_requests=len(trace.requests),
        fit=fit,
        prompt_buckets=prompt_buckets(trace),
        temperatures={t for r in trace.requests if (t := r.temperature) is not None},
        draft_cost_per_token=low_quantile(timed.draft_per_token, COST_QUANTILE) if timed.draft_per_token else None,
        c_paired=statistics.median(paired) if paired else None,
        other_per_step=statistics.median(timed.other) if timed_steps else 0.0,
        concurrent=_interleaved(trace),
        timed_steps=timed_steps,
        timed=timed,
        batch=main_batch(steps),
        predicted_steps=len(trace.steps) - len(steps),
    )


@dataclass
class DepthGoodput:
    """The batched steps of one policy and batch size at one lockstep depth: what they made and took."""

    sequences: int  # sequences in each of these steps
    depth: int  # lockstep draft forwards (the deepest draft of the step); 0: plain
    policy: str = ""  # the steps' policy (a load test's trace holds several: the policy's steps and fixed τ's)
    steps: int = 0
    tokens: int = 0  # emitted over the steps' records
    seconds: float = 0.0  # each step's draft + pass + its rest (``batch_goodput``)
    rest: float = 0.0  # of which the rests (the engine's and the policy's work around the passes)

    @property
    def tokens_per_ms(self) -> float:
        return self.tokens / self.seconds / 1e3 if self.seconds > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.seconds / self.steps if self.steps else 0.0

    @property
    def rest_ms_per_step(self) -> float:
        return 1e3 * self.rest / self.steps if self.steps else 0.0

    @property
    def pass_ms_per_step(self) -> float:
        """A step's draft and pass (its time less its rest)."""
        return self.ms_per_step - self.rest_ms_per_step


def batch_goodput(steps: list[StepRecord]) -> dict[tuple[str, int, int], DepthGoodput]:
    """Goodput by (policy, sequences, depth) of the steps shared by several sequences (a batching server's), steps
    with prompt rows left out (their prefill is a request's, once). A step is the records that share its pass: the
    same draft and verify times, rows and batch size; its policy is its first record's (a load test runs one mode at a
    time). Its time is its draft and pass plus its rest, the least other time of its records whose request stepped
    before (``steady_rest``: the others carry their requests' waits, or only the moment since their admission)."""
    by_step: dict[tuple[float, float, int, int], list[StepRecord]] = {}
    for s in steps:
        if s.batch_size > 1 and not s.prompt_rows:
            by_step.setdefault(s.pass_key, []).append(s)
    out: dict[tuple[str, int, int], DepthGoodput] = {}
    for (verify, draft, _, n), records in by_step.items():
        depth = max(r.draft_passes for r in records)
        policy = records[0].policy
        g = out.setdefault((policy, n, depth), DepthGoodput(n, depth, policy))
        steady = steady_rest(records)
        rest = steady.other_time if steady is not None else min(r.other_time for r in records)
        g.steps += 1
        g.tokens += sum(len(r.emitted) for r in records)
        g.seconds += draft + verify + rest
        g.rest += rest
    return out


@dataclass
class BatchDepths:
    """``batch_goodput`` at the batch size most steps ran: what the check and the report's plot read."""

    sequences: int
    rows: list[DepthGoodput]  # by policy (the most steps first), then depth
    all_steps: int  # batched steps at every size, every policy (prompt-row steps left out)

    @property
    def policies(self) -> list[str]:
        """The policies of the rows, the one with the most steps first."""
        return list(dict.fromkeys(g.policy for g in self.rows))

    def of(self, policy: str) -> list[DepthGoodput]:
        return [g for g in self.rows if g.policy == policy]


def main_batch(steps: list[StepRecord]) -> BatchDepths | None:
    table = batch_goodput(steps)
    if not table:
        return None
    by_size: dict[int, int] = {}
    for (_, n, _), g in table.items():
        by_size[n] = by_size.get(n, 0) + g.steps
    n = max(by_size, key=lambda size: (by_size[size], size))
    here = [g for (_, size, _), g in table.items() if size == n]
    by_policy: dict[str, int] = {}
    for g in here:
        by_policy[g.policy] = by_policy.get(g.policy, 0) + g.steps
    rows = sorted(here, key=lambda g: (-by_policy[g.policy], g.policy, g.depth))
    return BatchDepths(n, rows, sum(by_size.values()))


def prompt_buckets(trace: Trace) -> list[Bucket]:
    """Acceptance by prompt length, in power-of-two buckets; empty buckets dropped."""
    edges = list(PROMPT_BUCKET_EDGES) + [1 << 62]
    buckets = [Bucket(label=_bucket_label(lo, hi), lo=lo, hi=hi) for lo, hi in zip(edges, edges[1:])]
    for req in trace.requests:
        b = next(b for b in buckets if b.lo <= req.prompt_len < b.hi)
        b.requests.add(req.key)
        for s in req.steps:
            b.time += s.draft_time + s.verify_time + s.other_time
            if s.tau > 0 and not s.predicted:
                b.drafting.append(s)
    return [b for b in buckets if b.requests]


def _bucket_label(lo: int, hi: int) -> str:
    return f"{lo}+" if hi >= 1 << 62 else f"{lo}-{hi - 1}"


def _interleaved(trace: Trace) -> bool:
    """True when another request's step was written between two steps of one request."""
    order = sorted((ts, i, r.key) for i, r in enumerate(trace.requests) for ts in r.written)
    seen_done: set[str] = set()
    last = None
    for _, _, key in order:
        if key != last:
            if key in seen_done:
                return True
            if last is not None:
                seen_done.add(last)
            last = key
    return False
