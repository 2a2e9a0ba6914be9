"""One aggregate of step records: acceptance and step costs, derived the same way for every reader.

``diagnose``, ``tune``, ``bench``, the simulator's cost fit and trace replay, and distillation's
acceptance report build a ``StepAggregate`` from ``StepRecord`` objects (``StepRecord.from_json`` for
trace lines) and read the figures below from it instead of counting for themselves. Each figure has
one definition here; where readers need different figures they read differently named ones:

- ``alpha``: Σ n̂ / Σ τ, the acceptance rule's outcomes (``diagnose``, ``tune``).
- ``output_alpha``: accepted draft tokens that reached the output / Σ τ; a stop condition can cut the
  last step of a request short (``GenerationStats.acceptance_rate``; ``bench``, the simulator).
- ``per_token_alpha``: output-accepted / (output-accepted + rejections): Leviathan et al.'s α, the chance
  that a *reached* draft token is accepted (Σ n̂ / Σ τ undercounts it: drafts after a rejection are
  never tried).
- ``tokens_per_pass``: emitted tokens per verify pass, correction tokens and plain steps included
  (``GenerationStats.mean_accepted_length``).
- ``accepted_length``: 1 + Σ n̂ / drafting steps: the rule's tokens per drafting pass, stop cuts ignored.
- per-position acceptance: ``reached[i]`` steps tested 0-based position i (every earlier draft accepted),
  ``passed[i]`` accepted it; ``conditional_acceptance()`` = passed / reached, ``shrunk_rates()`` the same
  with one pseudo-count toward the position before (deep positions are rarely reached).
- costs: verify seconds by block size k = τ + 1, draft seconds per token and by τ, other seconds per step;
  ``verify_table`` (a statistic per block size) and ``verify_fit`` (the line a + b·k through them).

A figure whose denominator is 0 is None; each reader says what it shows then. No torch here.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from specdec.records import StepRecord

MIN_SAMPLES_PER_BLOCK = 5  # steps of one block size before its typical verify time is trusted (verify_fit)


def low_quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile by rank (no interpolation): ``sorted(values)[⌊q·n⌋]``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class StepAggregate:
    steps: int = 0  # verify passes
    draft_steps: int = 0  # steps that drafted (τ > 0)
    drafted: int = 0  # Σ τ
    accepted: int = 0  # Σ n̂ (at most τ per step): the acceptance rule's outcomes
    accepted_out: int = 0  # Σ min(n̂, len(emitted)): accepted draft tokens that reached the output
    rejections: int = 0  # drafting steps that ended in a rejection (n̂ < τ)
    emitted: int = 0  # Σ len(emitted)
    draft_time: float = 0.0
    verify_time: float = 0.0
    other_time: float = 0.0
    policy_time: float = 0.0  # of other_time, the policies' own work (their plans and learning)
    reached: list[int] = field(default_factory=list)  # by 0-based draft position
    passed: list[int] = field(default_factory=list)
    verify_by_block: dict[int, list[float]] = field(default_factory=dict)  # k = τ + 1 -> each step's seconds
    draft_by_tau: dict[int, list[float]] = field(default_factory=dict)  # τ > 0 -> each step's draft seconds
    draft_per_token: list[float] = field(default_factory=list)  # each drafting step's draft seconds / τ
    other: list[float] = field(default_factory=list)  # each step's other seconds

    @classmethod
    def of(cls, records: Iterable[StepRecord]) -> StepAggregate:
        agg = cls()
        for r in records:
            agg.add(r)
        return agg

    def add(self, r: StepRecord) -> None:
        tau = r.tau
        n = min(r.n_accepted, tau)
        self.steps += 1
        self.emitted += len(r.emitted)
        self.accepted_out += r.n_emitted_accepted
        self.draft_time += r.draft_time
        self.verify_time += r.verify_time
        self.other_time += r.other_time
        self.policy_time += r.policy_time
        self.verify_by_block.setdefault(tau + 1, []).append(r.verify_time)
        self.other.append(r.other_time)
        if tau <= 0:
            return
        self.draft_steps += 1
        self.drafted += tau
        self.accepted += n
        self.rejections += n < tau
        self.draft_by_tau.setdefault(tau, []).append(r.draft_time)
        self.draft_per_token.append(r.draft_time / tau)
        if len(self.reached) < tau:
            grow = tau - len(self.reached)
            self.reached += [0] * grow
            self.passed += [0] * grow
        for i in range(min(n + 1, tau)):
            self.reached[i] += 1
        for i in range(n):
            self.passed[i] += 1

    # -- acceptance ---------------------------------------------------------------------------------

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def output_alpha(self) -> float | None:
        return self.accepted_out / self.drafted if self.drafted else None

    @property
    def per_token_alpha(self) -> float | None:
        tried = self.accepted_out + self.rejections
        return self.accepted_out / tried if tried else None

    @property
    def tokens_per_pass(self) -> float | None:
        return self.emitted / self.steps if self.steps else None

    @property
    def accepted_length(self) -> float | None:
        return (self.accepted + self.draft_steps) / self.draft_steps if self.draft_steps else None

    @property
    def mean_tau(self) -> float | None:
        return self.drafted / self.draft_steps if self.draft_steps else None

    def conditional_acceptance(self) -> list[float]:
        """P(position i accepted | every earlier position accepted), per 0-based position (0 where never reached)."""
        return [a / r if r else 0.0 for a, r in zip(self.passed, self.reached)]

    def shrunk_rates(self, depth: int, first_prior: float = 0.5) -> list[float]:
        """The first ``depth`` conditional rates, each shrunk by one pseudo-count toward the rate of the position
        before (the first toward ``first_prior``): positions never reached carry the last rate on."""
        rates, prev = [], first_prior
        for i in range(depth):
            w, t = (self.passed[i], self.reached[i]) if i < len(self.reached) else (0, 0)
            prev = (w + prev) / (t + 1)
            rates.append(prev)
        return rates

    # -- costs --------------------------------------------------------------------------------------

    @property
    def total_time(self) -> float:
        return self.draft_time + self.verify_time + self.other_time

    @property
    def verify_times(self) -> list[float]:
        """Every step's verify seconds, whatever its block size."""
        return [v for times in self.verify_by_block.values() for v in times]

    def verify_table(
        self, stat: Callable[[list[float]], float] = statistics.median, min_count: int = 1
    ) -> dict[int, float]:
        """``stat`` of the verify seconds of each block size seen at least ``min_count`` times, by size."""
        return {k: stat(v) for k, v in sorted(self.verify_by_block.items()) if len(v) >= min_count}

    def verify_fit(self, quantile: float) -> VerifyFit:
        """Typical verify seconds per block size (the ``quantile``, by rank) and the line through the sizes seen
        at least ``MIN_SAMPLES_PER_BLOCK`` times (see ``VerifyFit``)."""
        medians = self.verify_table(lambda v: low_quantile(v, quantile))
        counts = {k: len(v) for k, v in self.verify_by_block.items()}
        fit = VerifyFit(medians=medians, counts=counts)
        pts = [(k, medians[k]) for k in medians if counts[k] >= MIN_SAMPLES_PER_BLOCK]
        # Two sizes only count when both are well sampled: a line through two noisy points proves nothing.
        enough = len(pts) >= 3 or (len(pts) == 2 and min(counts[k] for k, _ in pts) >= 4 * MIN_SAMPLES_PER_BLOCK)
        if enough and max(k for k, _ in pts) - min(k for k, _ in pts) >= 2:
            # Least squares through the per-size values: each size counts once, outliers are already damped.
            mk = sum(k for k, _ in pts) / len(pts)
            mt = sum(t for _, t in pts) / len(pts)
            sxx = sum((k - mk) ** 2 for k, _ in pts)
            fit.slope = sum((k - mk) * (t - mt) for k, t in pts) / sxx
            fit.intercept = mt - fit.slope * mk
        return fit


@dataclass
class VerifyFit:
    """Verify time vs block size k = τ + 1: typical cost per size and the line ``a + b·k`` through them.

    Cost words: ``t1`` is the target's cost of one plain pass (a block of 1 token), seconds; ``v(k)`` the
    verify cost of a block of k tokens in units of ``t1``.
    """

    medians: dict[int, float]  # k -> typical verify seconds
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


def calibration(records: Iterable[StepRecord]) -> list[tuple[float, float, int]]:
    """P(draft token accepted | the draft's confidence in it), by tenths: (bin low, rate, tokens) for bins seen.

    Only tested positions count (the accepted prefix and the first rejection). The confidence is the
    draft's top probability (``StepRecord.confidences``)."""
    wins, trials = [0] * 10, [0] * 10
    for r in records:
        conf = r.confidences()
        for k in range(min(r.n_accepted + 1, r.tau, len(conf))):
            b = min(int(conf[k] * 10), 9)
            trials[b] += 1
            wins[b] += k < r.n_accepted
    return [(b / 10, wins[b] / trials[b], trials[b]) for b in range(10) if trials[b]]
