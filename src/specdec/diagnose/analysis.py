"""Aggregates of a trace that the checks and the plots share: acceptance, costs, the verify-time fit.

Cost words: ``t1`` is the target's cost of one plain pass (a block of 1 token), seconds;
``c`` = draft cost per drafted token / ``t1``; ``v(k)`` = verify cost of a block of k tokens / ``t1``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from specdec.trace import Trace

Step = dict[str, Any]
PROMPT_BUCKET_EDGES = (0, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
MIN_SAMPLES_PER_BLOCK = 5  # steps of one block size before its typical verify time is trusted
COST_QUANTILE = 0.25  # a low quantile estimates the uncontended cost: other load only ever adds time


@dataclass
class VerifyFit:
    """Verify time vs block size k = τ + 1: typical cost per size and the line ``a + b·k`` through them."""

    medians: dict[int, float]  # k -> typical (lower-quartile) verify seconds
    counts: dict[int, int]
    intercept: float | None = None
    slope: float | None = None

    @property
    def measured(self) -> bool:
        return self.slope is not None

    def t1(self) -> float:
        """One-token pass cost: measured at k = 1, else from the line, else the cheapest block (assumed parallel)."""
        if self.counts.get(1, 0) >= MIN_SAMPLES_PER_BLOCK:
            return self.medians[1]
        if self.intercept is not None and self.slope is not None and self.intercept + self.slope > 0:
            return self.intercept + self.slope
        return min(self.medians.values()) if self.medians else 0.0

    def serial_fraction(self) -> float | None:
        """Extra cost per extra token, in units of t1: 0 = fully parallel, 1 = one pass per token."""
        if self.slope is None:
            return None
        t1 = self.t1()
        return self.slope / t1 if t1 > 0 else None

    def v(self, k: int) -> float:
        """Verify cost of a block of k tokens, in units of t1 (1 + σ(k−1); 1 when unmeasured)."""
        sigma = self.serial_fraction()
        return 1.0 + max(0.0, sigma or 0.0) * (k - 1)


@dataclass
class Bucket:
    label: str
    lo: int
    hi: int
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    requests: set[str] = field(default_factory=set)
    time: float = 0.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


@dataclass
class TraceStats:
    steps: list[Step]
    n_requests: int
    drafted: int
    accepted: int
    draft_steps: int
    emitted: int
    draft_time: float
    verify_time: float
    other_time: float
    fit: VerifyFit
    position_reached: list[int]  # steps whose position i was tested with every earlier draft accepted
    position_accepted: list[int]  # steps that accepted position i (and all before it)
    prompt_buckets: list[Bucket]
    temperatures: set[float]
    draft_cost_per_token: float | None  # typical seconds per drafted token
    c_paired: float | None  # median over steps of draft cost per token / that step's one-pass cost
    other_per_step: float
    concurrent: bool  # steps of different requests interleave (other_time then includes their work)

    @property
    def total_time(self) -> float:
        return self.draft_time + self.verify_time + self.other_time

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_tau(self) -> float:
        return self.drafted / self.draft_steps if self.draft_steps else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify pass of drafting steps, the correction token included (stop cuts ignored)."""
        return (self.accepted + self.draft_steps) / self.draft_steps if self.draft_steps else 1.0

    @property
    def t1(self) -> float:
        return self.fit.t1()

    @property
    def c(self) -> float | None:
        return self.c_paired

    def conditional_acceptance(self) -> list[float]:
        """P(position i accepted | every earlier position accepted), per 0-based position."""
        return [a / r if r else 0.0 for a, r in zip(self.position_accepted, self.position_reached)]

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
            total / (s["verify_time"] / self.fit.v(s["tau"] + 1) + s["other_time"])
            for s in self.steps
            if (total := s["draft_time"] + s["verify_time"] + s["other_time"]) > 0 and s["verify_time"] > 0
        ]
        if not units or not self.steps:
            return None
        return (self.emitted / len(self.steps)) / statistics.median(units)


def analyse(trace: Trace) -> TraceStats:
    steps = trace.steps
    drafting = [s for s in steps if s["tau"] > 0]
    max_tau = max((s["tau"] for s in steps), default=0)
    reached, accepted = [0] * max_tau, [0] * max_tau
    for s in drafting:
        n = min(s["n_accepted"], s["tau"])
        for i in range(min(n + 1, s["tau"])):
            reached[i] += 1
        for i in range(n):
            accepted[i] += 1
    per_token = [s["draft_time"] / s["tau"] for s in drafting]
    fit = fit_verify(steps)
    paired = [
        s["draft_time"] / s["tau"] / (s["verify_time"] / fit.v(s["tau"] + 1)) for s in drafting if s["verify_time"] > 0
    ]
    return TraceStats(
        steps=steps,
        n_requests=len(trace.requests),
        drafted=sum(s["tau"] for s in drafting),
        accepted=sum(min(s["n_accepted"], s["tau"]) for s in drafting),
        draft_steps=len(drafting),
        emitted=sum(len(s["emitted"]) for s in steps),
        draft_time=sum(s["draft_time"] for s in steps),
        verify_time=sum(s["verify_time"] for s in steps),
        other_time=sum(s["other_time"] for s in steps),
        fit=fit,
        position_reached=reached,
        position_accepted=accepted,
        prompt_buckets=prompt_buckets(trace),
        temperatures={t for r in trace.requests if (t := r.temperature) is not None},
        draft_cost_per_token=_quantile(per_token, COST_QUANTILE) if per_token else None,
        c_paired=statistics.median(paired) if paired else None,
        other_per_step=statistics.median(s["other_time"] for s in steps) if steps else 0.0,
        concurrent=_interleaved(steps, trace),
    )


def fit_verify(steps: list[Step]) -> VerifyFit:
    by_k: dict[int, list[float]] = {}
    for s in steps:
        by_k.setdefault(s["tau"] + 1, []).append(s["verify_time"])
    medians = {k: _quantile(v, COST_QUANTILE) for k, v in sorted(by_k.items())}
    counts = {k: len(v) for k, v in by_k.items()}
    fit = VerifyFit(medians=medians, counts=counts)
    pts = [(k, medians[k]) for k in medians if counts[k] >= MIN_SAMPLES_PER_BLOCK]
    # Two sizes only count when both are well sampled: a line through two noisy points proves nothing.
    enough = len(pts) >= 3 or (len(pts) == 2 and min(counts[k] for k, _ in pts) >= 4 * MIN_SAMPLES_PER_BLOCK)
    if enough and max(k for k, _ in pts) - min(k for k, _ in pts) >= 2:
        # Least squares through the per-size medians: each size counts once, outliers are already damped.
        mk = sum(k for k, _ in pts) / len(pts)
        mt = sum(t for _, t in pts) / len(pts)
        sxx = sum((k - mk) ** 2 for k, _ in pts)
        fit.slope = sum((k - mk) * (t - mt) for k, t in pts) / sxx
        fit.intercept = mt - fit.slope * mk
    return fit


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def prompt_buckets(trace: Trace) -> list[Bucket]:
    """Acceptance by prompt length, in power-of-two buckets; empty buckets dropped."""
    edges = list(PROMPT_BUCKET_EDGES) + [1 << 62]
    buckets = [Bucket(label=_bucket_label(lo, hi), lo=lo, hi=hi) for lo, hi in zip(edges, edges[1:])]
    for req in trace.requests:
        b = next(b for b in buckets if b.lo <= req.prompt_len < b.hi)
        b.requests.add(req.key)
        for s in req.steps:
            b.time += s["draft_time"] + s["verify_time"] + s["other_time"]
            if s["tau"] > 0:
                b.steps += 1
                b.drafted += s["tau"]
                b.accepted += min(s["n_accepted"], s["tau"])
    return [b for b in buckets if b.requests]


def _bucket_label(lo: int, hi: int) -> str:
    return f"{lo}+" if hi >= 1 << 62 else f"{lo}-{hi - 1}"


def _interleaved(steps: list[Step], trace: Trace) -> bool:
    """True when another request's step was written between two steps of one request."""
    order = sorted((s.get("ts", 0.0), i, r.key) for i, r in enumerate(trace.requests) for s in r.steps)
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
