"""Online estimates the adaptive policy plans with: acceptance by draft position, and step costs.

Acceptance is kept as *conditional* rates a_k = P(ŷ_k accepted | ŷ_1..ŷ_{k-1} accepted), so a step
with τ drafted and n̂ accepted says: positions 1..n̂ passed, position n̂+1 failed (when n̂ < τ), and
nothing about later positions. From the rates (Leviathan et al. 2023, eq. 1 generalised to
per-position rates):

    E[n̂ + 1 | τ] = 1 + Σ_{k=1..τ} Π_{j<=k} a_j
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.records import StepRecord, steady_rest


def expected_emitted_all(rates: list[float]) -> list[float]:
    """``[E[n̂+1 | τ] for τ = 0..len(rates)]``: tokens one step emits, the correction token included."""
    out, total, survive = [1.0], 1.0, 1.0
    for a in rates:
        survive *= a
        total += survive
        out.append(total)
    return out


@dataclass
class PositionRates:
    """EWMA success/trial counts per draft position, read back shrunk toward a prior.

    ``decay`` is applied per observation of a position, so a position seen every step and
    one seen rarely both remember their last ~1/(1-decay) outcomes.
    """

    max_pos: int = 32
    decay: float = 0.9
    prior_weight: float = 2.0
    wins: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)
    version: int = 0  # bumped by every change: readers cache what they derive from the counts by it

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.wins = [0.0] * self.max_pos
        self.trials = [0.0] * self.max_pos
        self.version += 1

    def update(self, tau: int, n_accepted: int) -> None:
        self.version += 1
        decay, wins, trials = self.decay, self.wins, self.trials
        tested = n_accepted + 1 if n_accepted < tau else tau  # min(n_accepted + 1, tau, max_pos), without the call
        if tested > self.max_pos:
            tested = self.max_pos
        passed = n_accepted if n_accepted < tested else tested
        for k in range(passed):
            wins[k] = decay * wins[k] + 1.0
            trials[k] = decay * trials[k] + 1.0
        if passed < tested:  # the first rejected
            wins[passed] = decay * wins[passed]
            trials[passed] = decay * trials[passed] + 1.0

    def rates(self, parent: list[float] | None, first_prior: float, n: int | None = None) -> list[float]:
        """The first ``n`` shrunk rates. Each position's prior is ``parent[k]`` when given, else the
        rate of position k-1 (flat extrapolation beyond what was tried; data soon corrects it)."""
        out: list[float] = []
        for k in range(min(self.max_pos, self.max_pos if n is None else n)):
            prior = parent[k] if parent is not None else (out[k - 1] if k else first_prior)
            out.append((self.wins[k] + self.prior_weight * prior) / (self.trials[k] + self.prior_weight))
        return out


# A cost observed at more than this many times what its size (CurveEWMA) or depth (DraftLine) has measured, once it
# has OUTLIER_AFTER observations' worth there, is learnt as this many times: a machine's pause or a collector's (a
# 144 ms draft forward where 0.3 ms is usual) otherwise priced that size for the next dozen steps. A lasting change
# still comes through: each such observation moves the estimate up, and the bound with it.
OUTLIER_FACTOR = 4.0
OUTLIER_AFTER = 2.0


@dataclass
class DraftLine:
    """Seconds of a draft by its depth (lockstep forwards), d(p) = d0 + d1·(p − 1): decayed least squares over the
    steps that drafted, ridge toward the proportional line (d0 = d1, what one depth alone says).

    The first forward of a step costs more than the others: the target's pass has just streamed its weights
    through the caches, so the draft's come back from memory (the default draft: ~0.5 ms on one thread, then
    ~0.15 ms per further forward). Priced per forward, that cold start made every further token look as dear as
    the first, and a policy drafting one token measured only that, and kept drafting one.
    """

    decay: float = 0.95
    spread: float = 0.5  # the proportional prior weighs as much as depths spread by this much
    measured_spread: float = 1.0  # a measured slope (``line(prior_slope=)``) weighs as much as depths spread by this
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # S1, Sx, Sy, Sxx, Sxy over x = p - 1

    def observe(self, passes: int, seconds: float, weight: float = 1.0) -> None:
        s = self._sums
        if s[0] >= OUTLIER_AFTER:
            d0, d1 = self.line()
            seconds = min(seconds, OUTLIER_FACTOR * (d0 + d1 * (passes - 1)))
        x, y = float(passes - 1), seconds
        keep = self.decay**weight
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            s[i] = keep * s[i] + weight * v

    @property
    def seen(self) -> bool:
        return self._sums[0] > 0

    def mean_depth(self) -> float:
        """The observed steps' mean depth (weighted as the fit weighs them)."""
        return self._sums[1] / self._sums[0] + 1.0

    def line(self, prior_slope: float | None = None) -> tuple[float, float]:
        """(d0, d1), the slope ridged toward ``prior_slope`` (seconds per further forward, measured apart from the
        steps) where given, else toward the proportional line. Steps alone hardly spread in depth (a batch plan keeps
        its depth, exploring one further now and then), so the prior decides the slope between the depths run and
        those never run: proportional, every forward as dear as the cold first one, it priced a batch of 16 at depth
        5 1.5-2 ms above what its steps measured, and the plans stayed at depth 2 where 4-5 served 15% more."""
        n, sx, sy, sxx, sxy = self._sums
        mx, my = sx / n, sy / n
        var, cov = max(sxx / n - mx * mx, 0.0), sxy / n - mx * my
        if prior_slope is None:
            prior, lam = my / (mx + 1.0), self.spread**2  # proportional: every forward alike
        else:
            prior, lam = prior_slope, self.measured_spread**2
        d1 = min(max(0.0, (cov + lam * prior) / (var + lam)), my / max(mx, 1e-9) if mx > 0 else math.inf)
        return max(my - d1 * mx, 0.0), d1

    def __call__(self, depth: int) -> float:
        return self.upto(max(depth, 0))[-1]

    def upto(self, depth: int) -> list[float]:
        """Seconds of a draft of 0..``depth`` forwards, from one fit of the line (``line`` refits from the sums)."""
        d0, d1 = self.line()
        return [0.0] + [d0 + d1 * (p - 1) for p in range(1, depth + 1)]


@dataclass
class StepCosts:
    """Measured step costs: draft seconds per token, verify seconds by block size, other per step.

    Verify time is fitted as v(k) = v0 + v1·(k-1) over block sizes k = τ+1 by decayed least
    squares, with a weak prior on the slope until two block sizes have been seen; block sizes
    seen often enough use their own EWMA (the measured curve, not the line).
    """

    decay: float = 0.95
    prior_slope_frac: float = 0.05  # until measured: a block costs 5% more per extra token
    prior_draft_frac: float = 0.1  # until measured: c = 0.1
    draft_per_token: float | None = None
    other: float | None = None
    draft: DraftLine = field(default_factory=DraftLine)  # seconds of a step's draft by its forwards
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # S1, Sx, Sy, Sxx, Sxy
    _by_block: dict[int, list[float]] = field(default_factory=dict)  # k -> [weight, mean]
    _times: dict[int, list[float]] = field(default_factory=dict, repr=False, compare=False)  # step_times, until observe

    def observe(self, tau: int, forwards: int, draft_time: float, verify_time: float, other_time: float) -> None:
        self._times.clear()
        if forwards > 0 and draft_time > 0:
            self.draft_per_token = self._ewma(self.draft_per_token, draft_time / forwards)
            self.draft.observe(forwards, draft_time)
        self.other = self._ewma(self.other, other_time)
        k = tau + 1
        w_mean = self._by_block.setdefault(k, [0.0, 0.0])
        if w_mean[0] >= OUTLIER_AFTER:
            verify_time = min(verify_time, OUTLIER_FACTOR * w_mean[1])
        x, y = float(k - 1), verify_time
        s = self._sums
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            s[i] = self.decay * s[i] + v
        w_mean[0] = self.decay * w_mean[0] + 1.0
        w_mean[1] += (y - w_mean[1]) / w_mean[0]

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    @property
    def seen(self) -> bool:
        return self._sums[0] > 0

    def line(self) -> tuple[float, float]:
        """(v0, v1) of the verify-time line; ridge toward the prior slope."""
        n, sx, sy, sxx, sxy = self._sums
        if n <= 0:
            return 1.0, self.prior_slope_frac
        mx, my = sx / n, sy / n
        var, cov = sxx / n - mx * mx, sxy / n - mx * my
        lam = 0.25  # prior strength, in units of squared block-size spread
        v1_prior = self.prior_slope_frac * max(my - self.prior_slope_frac * mx, 1e-9)
        v1 = max(0.0, (cov + lam * v1_prior) / (var + lam))
        return max(my - v1 * mx, 1e-9), v1

    def verify(self, k: int, line: tuple[float, float] | None = None) -> float:
        own = self._by_block.get(k)
        if own is not None and own[0] >= 3.0:
            return own[1]
        v0, v1 = line or self.line()
        return v0 + v1 * (k - 1)

    def step_times(self, max_tau: int) -> list[float]:
        """Predicted seconds of a step drafting τ = 0..max_tau tokens (computed once between observations)."""
        cached = self._times.get(max_tau)
        if cached is not None:
            return cached
        line = self.line()  # once per call: it is refitted from the sums every time
        verify = [self.verify(tau + 1, line) for tau in range(max_tau + 1)]
        o = self.other or 0.0
        if self.draft.seen:
            drafts = self.draft.upto(max_tau)
        else:
            drafts = [tau * self.prior_draft_frac * verify[0] for tau in range(max_tau + 1)]
        times = self._times[max_tau] = [d + v + o for d, v in zip(drafts, verify)]
        return times


@dataclass
class ConfidenceCalibration:
    """How the draft's probability of its token (in 10 bins) predicts acceptance, EWMA with a calibrated prior.

    ``table(prior)`` combines a *current* acceptance estimate with the evidence of each bin by Bayes' rule,
    prior odds times the likelihood ratio P(bin | accepted) / P(bin | rejected): the same draft probability
    means more in a hard stretch (prior 0.2) than in an easy one (prior 0.9). The likelihoods are only
    unbiased when fed every verified draft token (a confidence cut would hide the low bins).
    """

    decay: float = 0.99
    prior_weight: float = 3.0
    wins: list[float] = field(default_factory=lambda: [0.0] * 10)
    trials: list[float] = field(default_factory=lambda: [0.0] * 10)

    _likelihoods: tuple[list[float], list[float]] | None = field(default=None, repr=False, compare=False)

    def update(self, record_probs: list[float], tau: int, n_accepted: int) -> None:
        self._likelihoods = None
        decay, wins, trials = self.decay, self.wins, self.trials
        tested = n_accepted + 1 if n_accepted < tau else tau  # min(n_accepted + 1, tau, len(probs)), without the call
        for k in range(tested if tested < len(record_probs) else len(record_probs)):
            b = int(record_probs[k] * 10)
            if b > 9:
                b = 9
            wins[b] = decay * wins[b] + (1.0 if k < n_accepted else 0.0)
            trials[b] = decay * trials[b] + 1.0

    @property
    def total(self) -> float:
        return sum(self.trials)

    def likelihoods(self) -> tuple[list[float], list[float]]:
        """P(bin | accepted), P(bin | rejected), each with the prior's pseudo-counts (cached until an update)."""
        if self._likelihoods is not None:
            return self._likelihoods
        acc = [self.wins[b] + self.prior_weight * (b + 0.5) / 10 for b in range(10)]
        rej = [self.trials[b] - self.wins[b] + self.prior_weight * (9.5 - b) / 10 for b in range(10)]
        sa, sr = sum(acc), sum(rej)
        self._likelihoods = [x / sa for x in acc], [x / sr for x in rej]
        return self._likelihoods

    def table(self, prior: float) -> tuple[float, ...]:
        """P(accept | draft probability in each tenth) for a token whose acceptance prior is ``prior``:
        what a drafter's stop rule reads."""
        return posterior_by_tenth(prior, *self.likelihoods())


def posterior_by_tenth(prior: float, accepted: list[float], rejected: list[float]) -> tuple[float, ...]:
    """Bayes' rule per bin: prior odds times the likelihood ratio P(bin | accepted) / P(bin | rejected)."""
    out = []
    for a, r in zip(accepted, rejected):
        la, lr = prior * a, (1.0 - prior) * r
        out.append(la / (la + lr) if la + lr > 0 else prior)
    return tuple(out)


def reach_weighted_mean(rates: list[float]) -> float:
    """Mean conditional acceptance over the drafted positions, each weighted by the chance it is reached."""
    reach, weight, mean = 1.0, 0.0, 0.0
    for a in rates:
        weight, mean, reach = weight + reach, mean + reach * a, reach * a
    return mean / weight


@dataclass
class ArmComparison:
    """Goodput (emitted tokens per second) of steps drafted with the stop rule (arm 1) and without (arm 0).

    The stop rule rests on assumptions the data may break (acceptance independent from token to token,
    calibrated tables); the policy keeps a minority of steps on the other arm and uses the rule unless it
    measures slower by more than noise. Both arms decay with every step observed, whichever arm it
    took, so the two cover the same stretch of requests (acceptance differs widely from prompt to
    prompt: an arm that remembered further back would be compared with other prompts). Each arm's
    goodput is a ratio estimate Σtokens/Σseconds; its standard error comes from the residuals
    tokens − goodput·seconds (delta method).
    """

    decay: float = 0.999  # per step: the last ~1,000 steps (per-step goodput is noisy: ±50% between prompts)
    min_steps: float = 30.0
    z: float = 2.0  # a difference counts once it exceeds z standard errors
    # per arm: Σ1, Σtokens, Σseconds, Σtokens², Σseconds², Σtokens·seconds
    sums: list[list[float]] = field(default_factory=lambda: [[0.0] * 6, [0.0] * 6])

    @property
    def steps(self) -> list[float]:
        return [self.sums[0][0], self.sums[1][0]]

    def observe(self, arm: int, tokens: int, seconds: float) -> None:
        for a in (0, 1):
            self.sums[a] = [self.decay * v for v in self.sums[a]]
        for i, v in enumerate((1.0, tokens, seconds, tokens * tokens, seconds * seconds, tokens * seconds)):
            self.sums[arm][i] += v

    def goodput(self, arm: int) -> float | None:
        n, t, sec = self.sums[arm][:3]
        if n < self.min_steps or sec <= 0:
            return None
        return t / sec

    def stderr(self, arm: int) -> float | None:
        rate = self.goodput(arm)
        if rate is None:
            return None
        n, _, sec, tt, ss, ts = self.sums[arm]
        resid = max(tt - 2 * rate * ts + rate * rate * ss, 0.0) / n
        return math.sqrt(resid / n) / (sec / n)

    def gap(self) -> float | None:
        """Goodput with the rule / without − 1, once both arms are measured."""
        with_rule, without = self.goodput(1), self.goodput(0)
        return None if with_rule is None or without is None else with_rule / without - 1.0

    def clear(self) -> bool:
        """Whether the arms differ by more than ``z`` standard errors of the difference."""
        g1, g0, e1, e0 = self.goodput(1), self.goodput(0), self.stderr(1), self.stderr(0)
        if g1 is None or g0 is None or e1 is None or e0 is None:
            return False
        return abs(g1 - g0) > self.z * math.hypot(e1, e0)

    def prefer_rule(self, tolerance: float = 0.03) -> bool:
        """The rule, unless measured slower than no rule by more than ``tolerance`` and more than noise."""
        gap = self.gap()
        return gap is None or gap >= -tolerance or not self.clear()


MIN_NEARNESS = 0.05  # CurveEWMA: a size nearer than this (in log size, 1 = the same) to the window's edge is left out


@dataclass
class CurveEWMA:
    """A cost measured at integer sizes (rows of a pass, sequences drafting), EWMA per size; sizes never
    seen are interpolated between seen neighbours, flat below the smallest (a memory-bound floor) and
    extended beyond the largest along a slope fitted over every seen size, shrunk toward a prior slope
    (``growth``: the share of its one-size cost that each further size adds, 1.0 proportional) so that two
    neighbouring sizes' noise (31 and 32 rows) cannot make it steep."""

    decay: float = 0.9
    growth: float = 1.0
    spread: float = 4.0  # the prior slope weighs as much as sizes spread by this much
    # A size's estimate is the fit over the sizes seen within this factor of it (1: its own mean alone), ...
    window: float = 1.5
    neighbours: float = 2.0  # ... weighing as much as this many observations of its own
    # A size's weight is kept by this much for every ``epoch`` observations of the curve (of any size) that pass without
    # one of its own: the machine's speed drifts (memory bandwidth moves by 5-10% between and within runs), and a size
    # the steps left behind kept a mean from another time at full weight, beside neighbours measured now. A depth priced
    # by it then looked worse than it was and, not run, was never measured again (a batch of 4 priced its 12-row pass
    # at 2.75 ms where it took 2.2 and ran depth 1 instead of 2 for a whole run). Aged, such a size weighs less than its
    # neighbourhood's fit, and its next observation mostly replaces it.
    age: float = 0.85
    epoch: int = 16
    _at: dict[int, list[float]] = field(default_factory=dict)  # size -> [weight, mean, epoch of its last observation]
    _ticks: int = field(default=0, repr=False, compare=False)  # observations so far
    _epoch: int = field(default=0, repr=False, compare=False)  # _ticks // epoch
    _sizes: list[int] = field(default_factory=list, repr=False, compare=False)  # sorted(_at), kept as sizes come
    _logs: dict[int, float] = field(default_factory=dict, repr=False, compare=False)  # log of each size seen
    # The curve within the seen range by size, until an observation within ``window`` of it or the next epoch (plans and
    # the step bias ask for the same few sizes between observations; each answer is a fit over its neighbourhood).
    _within_cache: dict[int, float] = field(default_factory=dict, repr=False, compare=False)
    # Each size's neighbourhood for ``_local``: (size seen, its nearness, its distance), until a new size is seen.
    _near: dict[int, list[tuple[int, float, int]]] = field(default_factory=dict, repr=False, compare=False)
    # Row groups (``set_granule``; 0: none): a size within one group is read only from sizes within one, a larger one
    # only from larger ones.
    granule: int = field(default=0, compare=False)

    def set_granule(self, granule: int) -> None:
        """Read a size within one row group of ``granule`` rows only from sizes within one, a larger size only from
        larger ones (a pass past one group pays for the second about whole: a fit or a line across that edge priced the
        first group's last rows too dear and the second's first ones too cheap); 0: from every size near it."""
        if granule != self.granule:
            self.granule = granule
            self._near.clear()
            self._within_cache.clear()

    def _group(self, size: int) -> int:
        """0 for a size within one row group, 1 beyond (the edge that costs a whole group: ``measured_pass``)."""
        return 1 if self.granule and size > self.granule else 0

    def observe(self, size: int, seconds: float, weight: float = 1.0) -> None:
        if size not in self._at:
            bisect.insort(self._sizes, size)
            self._logs[size] = math.log(size) if size > 0 else 0.0
            self._near.clear()
        self._ticks += 1
        now = self._ticks // self.epoch
        cache = self._within_cache
        if now != self._epoch:  # every weight has aged: every fit with it
            self._epoch = now
            cache.clear()
        w_mean = self._at.setdefault(size, [0.0, 0.0, now])
        w = self._weight(w_mean)
        if w >= OUTLIER_AFTER:
            seconds = min(seconds, OUTLIER_FACTOR * w_mean[1])
        w_mean[0] = w = self.decay**weight * w + weight
        w_mean[1] += weight * (seconds - w_mean[1]) / w
        w_mean[2] = now
        if cache:
            lo, hi = size / self.window, size * self.window
            for cached in [c for c in cache if lo <= c <= hi]:
                del cache[cached]

    def _weight(self, at: list[float]) -> float:
        """A size's weight now: as at its last observation, aged by the epochs since."""
        since = self._epoch - at[2]
        return at[0] * self.age**since if since else at[0]

    @property
    def seen(self) -> bool:
        return bool(self._at)

    def slope(self) -> float:
        """Cost per further size beyond the largest seen: weighted least squares over the seen sizes, ridge
        toward the prior slope through the largest (a(1 + growth·(size - 1)) meeting its measured cost)."""
        top = max(self._at)
        prior = self.growth * self._at[top][1] / (1.0 + self.growth * (top - 1))
        points = [(s, self._weight(v), v[1]) for s, v in self._at.items()]
        w = sum(p[1] for p in points)
        mx = sum(p[1] * p[0] for p in points) / w
        my = sum(p[1] * p[2] for p in points) / w
        var = sum(p[1] * (p[0] - mx) ** 2 for p in points) / w
        cov = sum(p[1] * (p[0] - mx) * (p[2] - my) for p in points) / w
        lam = self.spread**2
        return max(0.0, (cov + lam * prior) / (var + lam))

    def _local(self, size: int) -> float | None:
        """The curve at ``size`` from the sizes seen within a factor ``window`` of it: a linear fit weighted by each
        size's weight and its nearness (triangular in log size). None with fewer than two sizes of some nearness
        there: a fit over one point is that point's cost, and a size half way in log between two seen ones (48 rows
        between 32 and 64, each measured as a server starts) has the lower one at the window's edge, of nearness 0,
        so it was priced as the upper one (a depth-2 step of 16 sequences as 64 rows: 9.1 ms instead of ~7.3, and
        the plans left out the depth that served best at 16 clients)."""
        near = self._near.get(size)
        if near is None:
            near = self._near[size] = self._neighbourhood(size)
        if len(near) < 2:
            return None
        if len(near) == 2 and size in self._at:
            # One other size near: a line through two points passes through the size's own mean whatever its weight, so
            # an old mean would price it alone. The line between the sizes seen on either side instead.
            return self._between(size)
        at, weight = self._at, self._weight
        sw = sx = sy = sxx = sxy = 0.0
        for s, nearness, x in near:
            v = at[s]
            mean = v[1]
            w = weight(v) * nearness
            wx = w * x
            sw += w
            sx += wx
            sy += w * mean
            sxx += wx * x
            sxy += wx * mean
        if sw <= 0.0:
            return None
        mx, my = sx / sw, sy / sw
        var = sxx / sw - mx * mx
        return my - (((sxy / sw - mx * my) / var) if var > 1e-9 else 0.0) * mx

    def _neighbourhood(self, size: int) -> list[tuple[int, float, int]]:
        """The sizes seen within a factor ``window`` of ``size``, nearer than MIN_NEARNESS to its edge: each with its
        nearness (1 at ``size``, 0 at the window's edge, triangular in log size) and its distance from ``size``."""
        sizes = self._sizes
        lo, hi = bisect.bisect_left(sizes, size / self.window), bisect.bisect_right(sizes, size * self.window)
        if hi - lo < 2:
            return []
        scale = 1.0 / math.log(self.window)
        logs, here = self._logs, math.log(size)
        group = self._group(size)
        out = []
        for s in sizes[lo:hi]:
            if self._group(s) != group:  # (all 0 without row groups)
                continue
            nearness = 1.0 - abs(logs[s] - here) * scale
            if nearness > MIN_NEARNESS:
                out.append((s, nearness, s - size))
        return out

    def __call__(self, size: int, fallback: float) -> float:
        if not self._at:
            return fallback
        sizes = self._sizes
        if size < sizes[0]:  # below every seen size: flat
            return self._within(sizes[0])
        if size > sizes[-1]:  # beyond: along the fitted slope
            return max(1e-9, self._within(sizes[-1]) + self.slope() * (size - sizes[-1]))
        return self._within(size)

    def _within(self, size: int) -> float:
        """The curve at a size within the seen range. A neighbourhood's fit is kept until an observation within
        ``window`` of the size (plans and the step bias ask for the same few sizes between observations)."""
        cached = self._within_cache.get(size)
        if cached is not None:
            return cached
        at = self._at.get(size)
        if self.window > 1.0:
            # A busy server's steps scatter over many sizes, each seen a few times, and a step's time is noisy (±8%
            # typical, 2x when a thread is pre-empted): each size's own mean alone made neighbouring depths' prices
            # jump by 5-8 ms, and the plans followed the noise. The curve is its neighbourhood's fit, a size's own
            # mean weighing in as its observations build up.
            local = self._local(size)
            if local is not None:
                if at is not None:
                    own = self._weight(at)
                    local = (own * at[1] + self.neighbours * local) / (own + self.neighbours)
                value = self._within_cache[size] = max(local, 1e-9)
                return value
        if at is not None:
            return at[1]
        between = self._between(size)  # between two seen sizes, none other near: the line between them (not kept)
        assert between is not None  # within the seen range, not seen itself
        return between

    def _between(self, size: int) -> float | None:
        """The line between the nearest sizes seen below and above ``size`` (None at either end of the seen range)."""
        sizes = self._sizes
        i, j = bisect.bisect_left(sizes, size), bisect.bisect_right(sizes, size)
        if i == 0 or j == len(sizes):
            return None
        lo, hi = sizes[i - 1], sizes[j]
        a, b = self._at[lo][1], self._at[hi][1]
        if self.granule:  # not across a group's edge: the seen size of its own group, where one side has one
            group = self._group(size)
            if self._group(lo) != group and self._group(hi) == group:
                return b
            if self._group(hi) != group and self._group(lo) == group:
                return a
        return a + (b - a) * (size - lo) / (hi - lo)


EXCESS_WARM = 3.0  # steps' worth an ExcessFit needs before a batch plan prices with it
EXCESS_SHAPE_UNIT = 1e3  # the kernel's ExcessFit's size, a step's shape, in milliseconds (its ridge is in ms²)
# The slope a batch planner's kernel excess is ridged toward on the shape: a server's drafts and passes measured
# 0.15-0.25 ms beyond their shapes per ms of shape (the event loop and the clients take the cores from the kernel for
# a share of the step: a traced server at 1-16 clients, session 59; with the rest in it the whole excess grew ~0.3 ms
# per ms, sessions 47-48). Ridged toward 0, steps of one depth alone (a policy runs one, and explores one deeper)
# fitted the excess as a constant, which prices every shallower depth too dear by as much as it amortises: after a
# server's lighter loads a policy at 16 clients held depths 5-6 at 0.79-0.83x the tokens of τ = 2 (session 51). Data
# spread over shapes moves the slope where it is.
EXCESS_SHAPE_PRIOR = 0.2e-3  # seconds of excess per millisecond of shape
# The least slope a batch planner's excess may take on the shape: a step then still costs at least half its shape's
# growth. Below zero the excess says the shapes were measured dear (a server primed while another process ran: every
# pass and draft a share dearer, 1.6x in a busy-priming test, session 77), which is a share of each shape; held at 0
# that share went into the intercept, a 16-sequence step of depth 2 priced at 13.9-14.9 ms where such steps took 12.4
# and a plain one at 4.5 where it took 5.2, and a server at 16 clients ran 160 of its 257 steps plain (3.0 tokens/ms
# against depth 2's 3.3).
EXCESS_SHAPE_FLOOR = -0.5e-3  # seconds of excess per millisecond of shape
POLICY_TIME_DECAY = 0.97  # per batch step: the mean of the policy's own work spans a few replanning cycles


def batch_excess_fit() -> ExcessFit:
    """The ExcessFit a batch planner learns its drafts' and passes' excess with: by the step's shape in milliseconds,
    its slope ridged toward EXCESS_SHAPE_PRIOR."""
    return ExcessFit(prior=EXCESS_SHAPE_PRIOR, least_slope=EXCESS_SHAPE_FLOOR)


def rest_fit() -> ExcessFit:
    """The ExcessFit a batch planner learns a step's rest with (all but its draft and pass): by the step's sequences,
    its slope free (ridged weakly toward 0)."""
    return ExcessFit(ridge=4.0)


class ExcessFit:
    """Seconds a step spends beyond what was measured apart from the steps, as a line in one of the step's sizes,
    e(x) = a + c·x: decayed least squares, c ridged toward ``prior`` (``ridge`` is in the size's units squared) and
    kept at ``least_slope`` or above (0 by default: a machine's noise must not make a size look cheaper the larger it
    is; a step's shape, measured dear, may take a negative excess per unit of shape, ``EXCESS_SHAPE_FLOOR``).

    A batch planner keeps two (``BatchCosts``): its drafts' and passes' time beyond their shapes measured quietly, by
    the shape (a server's event loop streams the last step's tokens and its clients send the next requests while the
    kernel runs, taking the cores from it for a share of the step), and a step's rest, by its sequences (commits,
    detokenising, the server's messages: a cost per sequence). Fitted as one line in both sizes (until session 59) the
    two were one excess, and sizes that grow together (a server's busier levels run more sequences and longer steps)
    left the fit free to put it all on either: traced at 1-16 clients, it put 0.2-0.4 ms on each sequence and none on
    the shape, priced a 16-sequence step of depth 2 at 13 ms where such steps took 8.3 (depth 7: 20 against 19), and
    the plans held depth 7 at 0.8x the tokens of τ = 2 or 3. Learnt size by size (the curves), each size kept what it
    cost when last run, and sizes not run again (a start's cold passes: 48 rows priced at 10.7 ms where they take 7.7)
    priced the shallow depths out (``docs/policy.md``, session 33); learnt as a level, a constant fitted on the deep
    steps a policy runs priced the shallow depths 30-40% too dear (sessions 47-48), and they were never run to
    correct it."""

    def __init__(self, decay: float = 0.98, ridge: float = 16.0, prior: float = 0.0, least_slope: float = 0.0) -> None:
        self.decay, self.ridge, self.prior, self.least_slope = decay, ridge, prior, least_slope
        self._sums = [0.0] * 5  # decayed Σ of w, x, y, x², x·y
        self._fit: tuple[float, float] | None = None

    @property
    def weight(self) -> float:
        return self._sums[0]

    def observe(self, x: float, seconds: float) -> None:
        self._fit = None
        keep, s = self.decay, self._sums
        for i, v in enumerate((1.0, x, seconds, x * x, x * seconds)):
            s[i] = keep * s[i] + v

    def coefficients(self) -> tuple[float, float]:
        """(a, c), refitted after an observation."""
        if self._fit is not None:
            return self._fit
        n, sx, sy, sxx, sxy = self._sums
        if n <= 0.0:
            return 0.0, 0.0
        mx, my = sx / n, sy / n
        # centred variance and covariance times n, the ridge added toward the prior slope
        c = (sxy - n * mx * my + self.ridge * self.prior) / (sxx - n * mx * mx + self.ridge)
        c = max(c, self.least_slope_at(mx, my))
        self._fit = (my - c * mx, c)
        return self._fit

    def least_slope_at(self, mx: float, my: float) -> float:
        """The least slope the fit takes where the sizes' mean is ``mx`` and the excess's ``my``: 0 while the excess
        is 0 or more; below 0, a line no steeper than the one through 0 and the mean (a negative excess as a share of
        the size: shapes measured dear), and never below ``least_slope``. Steeper, steps run cold at a small shape for
        a start (7 ms beyond where the later steps ran 3) turned the slope negative by a few steps' weight and priced
        the shallow depths out; a line through 0 prices a size by the share the steps measured."""
        if self.least_slope >= 0.0 or my >= 0.0 or mx <= 0.0:
            return max(self.least_slope, 0.0)
        return max(self.least_slope, my / mx)

    def least_size(self) -> float:
        """The low end of the sizes observed (their decayed mean less one deviation; the size itself where all were
        one)."""
        n, sx, _, sxx, _ = self._sums
        if n <= 0.0:
            return 0.0
        mean = sx / n
        return max(mean - math.sqrt(max(sxx / n - mean * mean, 0.0)), 0.0)

    def __call__(self, x: float) -> float:
        """The excess at size ``x``: the line, except that below the sizes observed (``least_size``) it stays no
        further below zero than the share of the size it was at the least of them (not below zero where it was 0 or more
        there). An excess below zero is a step
        cheaper than its shapes measured apart, and that comes from shapes measured on a busy machine (a server primed
        while another process ran measured its passes 1.3-2x dear), a share of each shape, not a constant: read on the
        line, steps run deep alone (one size) put the whole negative intercept on a plain step's small shape, and a
        server priced its plain 4-sequence steps at 0.75-1.11 ms where they took 1.96 and ran them at 0.8x the tokens
        of its deeper steps (session 76)."""
        a, c = self.coefficients()
        excess = a + c * x
        if excess < 0.0:
            least = self.least_size()
            if 0.0 < x < least:
                excess = max(excess, min(a + c * least, 0.0) * x / least)
        return excess


DRAFT_ROW_GROWTH = 0.05  # until measured: a lockstep draft forward costs 5% more per further sequence
# Until measured: a step's rest (all but its draft and pass: commits, detokenising, records, the server's messages)
# grows by this share of a lone request's per further sequence. Measured, a step of 16 sequences rests 1.2-1.6 ms
# through a server where a lone request's steps rest ~0.6 ms (0.06-0.1 ms a further sequence; in process 55-75 µs a
# sequence at 16 sequences). Proportional (the curves' default), a server's first batch of 16 after lone requests
# priced its rest at 16 x 0.62 = 10 ms, and every plain or shallow step as dear as that: its first plans went 5-7 deep
# (session 60).
REST_SEQUENCE_GROWTH = 0.1


def chained_plain_price(
    price: Callable[[int, int, int], float], rest: float, rows: int, chains: Sequence[int]
) -> float:
    """Seconds of a plain step whose sequences chain target passes (``chains``: each one's passes;
    ``Engine.chain_plain``): its first pass at ``rows`` with the step's rest (``price``, a ``BatchCosts.pricer``), then
    each later pass over the sequences still chaining, without the rest again (``rest``: what ``price`` puts in)."""
    seconds = price(rows, 0, 0)
    for s in range(1, max(chains, default=1)):
        seconds += max(price(sum(1 for k in chains if k > s), 0, 0) - rest, 0.0)
    return seconds


def steady_draft(record: StepRecord) -> bool:
    """Did the step's draft cost what its depth costs while drafting goes on? A draft model that sat out plain steps
    first takes in their tokens (``draft_fed`` beyond 2 per drafting sequence): that is the price of switching from
    plain decoding, paid once, and learnt as a depth's it priced drafting out for good (a batch that explored one
    token after 8 plain steps paid 16 sequences × 9 tokens of draft catch-up and concluded that drafting is dear).
    A step with prompt rows is not steady either: the draft model takes the joining prompts in within the step's draft
    time (pieces of up to the step's prompt budget, a rest with its first forward). Learnt as forwards, they made a
    lockstep forward of 4-6 sequences cost 3-5 ms instead of ~0.7 in a server with prompts of hundreds of tokens."""
    return not record.prompt_rows and record.draft_fed <= 2 * max(1, record.drafting)


class DepthCalibration:
    """How far a batch plan's predicted goodput was from what its steps measured, depth by depth.

    Every batch step run at a lockstep depth adds its tokens and seconds, measured and predicted, to that depth's sums,
    which first age by ``own_decay`` (a depth's own last ~30 steps weigh); all depths' sums decay by ``decay`` per step
    besides, slowly, so a depth not run for a long while drifts back to no correction (and is tried again). Until
    session 62 every depth's sums aged by 0.99 a step whoever ran it: a depth the plans only explore (one step in 16-64)
    kept the weight of its last few explorations, less than the ``prior`` toward the pool, and read what the depth the
    batch runs measured (a traced server at 8 clients held depth 4, 40 rows, 2.9 tokens/ms, where depth 3's steps made
    3.8: the 40-row pass begins a third group of the kernel's rows). A depth's factor is (measured ÷ predicted tokens) ×
    (predicted ÷ measured seconds), ratios of its sums (a mean of per-step ratios would lean against the deep depths,
    whose tokens per step spread the most), each shrunk by ``prior`` steps' worth toward the same ratios over every
    depth run (themselves shrunk toward 1). A depth never run (or run too long ago) shallower than the deepest run takes
    the pool's; one deeper takes the deepest run's. The curves and acceptance estimates price every depth from the same
    few: what they miss grows with the depth (a server's drafts cost 2-2.5x what they cost measured apart; rarely
    reached positions' acceptance), and only the steps see it. Shrunk toward 1 and borrowed from the nearest depth run,
    a depth run for a hundred steps kept its full ratio (1.10) while every shallower one borrowed a depth run a few
    times (0.95): a server at 4 clients held depth 6 (3.04 tokens/ms measured) where depth 3 served 3.20, and exploring
    only one deeper never measured the shallower depths to correct it."""

    def __init__(
        self, decay: float = 0.998, own_decay: float = 0.97, prior: float = 4.0, seen: float = 1.0, outlier: float = 2.0
    ) -> None:
        self.decay, self.own_decay, self.prior, self.seen, self.outlier = decay, own_decay, prior, seen, outlier
        # depth -> decayed [measured tokens, predicted tokens, measured seconds, predicted seconds, steps]
        self._sums: dict[int, list[float]] = {}
        self._pool: tuple[dict[int, list[float]], tuple[float, float]] | None = None

    def observe(self, depth: int, tokens: float, expected: float, seconds: float, predicted: float) -> None:
        if min(tokens, expected, seconds, predicted) <= 0.0:
            return
        self._pool = None
        # A step priced from a prior (pass sizes never measured: 1.75 s for a 7 ms step in the simulator's first step)
        # counts as at most ``outlier`` times off, so one such step does not hold a depth's ratio for hundreds of steps.
        predicted = min(max(predicted, seconds / self.outlier), seconds * self.outlier)
        for entry in self._sums.values():
            for i in range(5):
                entry[i] *= self.decay
        entry = self._sums.setdefault(depth, [0.0] * 5)
        for i, value in enumerate((tokens, expected, seconds, predicted, 1.0)):
            entry[i] = entry[i] * self.own_decay + value

    def factor(self, depth: int) -> float:
        """Measured ÷ predicted goodput to expect at ``depth`` (1.0 before any step is measured)."""
        if self._pool is None:  # the depths run and their pool, until the next step (a plan asks for every depth)
            run = {d: e for d, e in self._sums.items() if e[4] >= self.seen}
            pooled = [sum(e[i] for e in run.values()) for i in range(5)]
            self._pool = run, _shrunk(pooled, self.prior, (1.0, 1.0)) if run else (1.0, 1.0)
        run, base = self._pool
        if not run:
            return 1.0
        k = self.prior
        # The pool is shrunk toward 1, each depth toward the pool: a depth run often keeps its own ratio, one run a few
        # times moves toward what every depth measured, not toward 1.
        entry = run.get(depth)
        if entry is None:
            deepest = max(run)
            if depth < deepest:
                return base[0] * base[1]  # shallower than (or between) the depths run: the pool
            entry = run[deepest]  # deeper than any run: the deepest one's (what the estimates miss grows with depth)
        tokens, time = _shrunk(entry, k, base)
        return tokens * time


def _shrunk(entry: list[float], k: float, toward: tuple[float, float]) -> tuple[float, float]:
    """A depth's (measured ÷ predicted tokens, predicted ÷ measured seconds), each shrunk toward ``toward`` by ``k``
    steps' worth."""
    tokens, expected, seconds, predicted, steps = entry
    return (
        (steps * tokens / expected + k * toward[0]) / (steps + k),
        (steps * predicted / seconds + k * toward[1]) / (steps + k),
    )


def _read(table: dict[int, float], size: int) -> float:
    """``table`` (sizes measured, not empty) at ``size``: linear between the sizes around it (``_span``)."""
    lo, hi = _span(table, size)
    if lo == hi:
        return table[lo]
    return max(table[lo] + (size - lo) * (table[hi] - table[lo]) / (hi - lo), 1e-9)


def _span(table: dict[int, Any], size: int) -> tuple[int, int]:
    """The measured sizes of ``table`` (not empty) to read ``size`` from: itself twice where measured, the least twice
    below it (flat), the two around it between, the last two beyond (a line along them)."""
    if size in table:
        return size, size
    sizes = sorted(table)
    i = bisect.bisect_left(sizes, size)
    if i == 0 or len(sizes) == 1:
        return (sizes[0], sizes[0]) if i == 0 else (sizes[-1], sizes[-1])
    return (sizes[i - 1], sizes[i]) if i < len(sizes) else (sizes[-2], sizes[-1])


@dataclass
class BatchCosts:
    """What a step shared by many sequences costs: the target pass by its rows, a lockstep draft forward by
    the sequences drafting in it, and the rest of the step by the sequences in it. Fed once per pass (each
    of a step's records carries the step's times, so each counts 1/batch); one-sequence steps feed it too
    (the low end of the curves)."""

    verify: CurveEWMA = field(default_factory=CurveEWMA)  # rows -> seconds of the target pass
    draft_forward: CurveEWMA = field(default_factory=lambda: CurveEWMA(growth=DRAFT_ROW_GROWTH))  # drafting -> s
    # Each count of drafting sequences' draft seconds by depth (the cold first forward apart from the others).
    draft_lines: dict[int, DraftLine] = field(default_factory=dict)
    # sequences -> seconds of the rest of the step, each further sequence adding a share of one's until measured
    other: CurveEWMA = field(default_factory=lambda: CurveEWMA(growth=REST_SEQUENCE_GROWTH))
    # Measured apart from the steps (``prime``): by sequences drafting, a draft's first forward and each further one;
    # by rows, a target pass.
    measured_lines: dict[int, tuple[float, float]] = field(default_factory=dict)
    measured_passes: dict[int, float] = field(default_factory=dict)
    # What the steps measure beyond those shapes (``ExcessFit``): their drafts and passes by the shape's milliseconds,
    # their rest by sequences.
    excess: ExcessFit = field(default_factory=batch_excess_fit)
    rests: ExcessFit = field(default_factory=rest_fit)
    # decayed (seconds, weight) of the policy's own work in a batch step's rest (``steady_rest_seconds``)
    policy_time: list[float] = field(default_factory=lambda: [0.0, 0.0])

    def observe(self, record: StepRecord) -> None:
        """A record alone: a step of its own (a batched step's records come together, ``observe_step``)."""
        self.observe_step((record,))

    def observe_step(self, records: Sequence[StepRecord]) -> None:
        """A step's records (they carry the step's pass and draft times): the pass, the lockstep draft and the rest of
        the step learnt once. The rest is the least of the other times of its records whose request stepped before
        (``steady_rest``): a request that stepped in the step before has the step's own rest (from the step before to
        this one's plan, and its commits); one held while its prompt came in by pieces carries its wait (100-200 ms
        behind prompts of hundreds of tokens), which is no step's cost (learnt record by record, those waits priced
        every step of a server at 7 clients 2-7 ms too high, and a step's fixed cost amortised over more tokens made
        the batch plans go deeper than paid: docs/policy.md), and one admitted just before the step only the moment
        since (taken as the least, 0.4 ms where a 16-sequence server's steps had 1.2-2 ms). A step of first steps
        only leaves the rest unlearnt. Where the shapes were measured (``shaped``), a steady step (its rest known, no
        prompt rows, no draft catch-up) also teaches ``excess`` what its draft and pass cost beyond them and
        ``rests`` its rest (``steady_rest_seconds``)."""
        step = records[0]
        self.verify.observe(step.rows or step.tau + 1, step.verify_time)
        passes = step.draft_passes or step.tau
        if passes and step.draft_time > 0 and steady_draft(step):
            drafting = max(1, step.drafting or 1)
            self.draft_forward.observe(drafting, step.draft_time / passes)
            self.draft_lines.setdefault(drafting, DraftLine()).observe(passes, step.draft_time)
        steady = steady_rest(records)
        if steady is not None:
            self.other.observe(max(1, step.batch_size), steady.other_time)
        if steady is None:
            return
        if self.shaped and steady_draft(step):
            # one-sequence steps too: a server's first batch plans then price with what its lone requests measured
            shape = self.measured_shape(step.rows or step.tau + 1, passes, step.drafting)
            self.excess.observe(shape * EXCESS_SHAPE_UNIT, step.draft_time + step.verify_time - shape)
            self.rests.observe(max(1, step.batch_size), self.steady_rest_seconds(steady))
        if step.batch_size > 1:  # a lone request plans every step: its work is in its own rest
            p = self.policy_time
            p[0], p[1] = POLICY_TIME_DECAY * p[0] + steady.policy_time, POLICY_TIME_DECAY * p[1] + 1.0

    def steady_rest_seconds(self, steady: StepRecord) -> float:
        """A step's rest (``steady_rest``'s record's) as a plan prices it: a batch step's less the policy's own work in
        it, plus that work's mean a batch step (``policy_time``, learnt from the batch steps before); a lone request's
        as measured (it plans every step). A batch's policy replans once every few steps (a fresh plan and the learning
        of the steps replayed before it, ~0.5 ms at 4 sequences): taken whole, the steps planned afresh measured their
        depth ~10% slower than it ran (while explorations ran on those steps, a depth explored was not explored
        again)."""
        if steady.batch_size < 2:
            return steady.other_time
        p = self.policy_time
        return steady.other_time - steady.policy_time + p[0] / max(p[1], 1e-9)

    @property
    def granule(self) -> int:
        """The target's row groups (``MeasuredCosts.row_granule``; 0: none), kept by the steps' curve ``verify``."""
        return self.verify.granule

    def set_granule(self, granule: int) -> None:
        """A pass of more rows than one group of ``granule`` pays for the second about whole: no price is read across
        that edge, neither of the measured passes (``measured_pass``) nor of the steps' curve (``verify``)."""
        self.verify.set_granule(granule)

    @property
    def shaped_excess(self) -> bool:
        """Whether a step is priced as its measured shapes plus what the steps measured beyond them (``pricer``)."""
        return self.shaped and self.excess.weight >= EXCESS_WARM

    @property
    def shaped(self) -> bool:
        """Whether a pass's and a draft's shapes were measured apart from the steps (``prime``)."""
        return bool(self.measured_passes and self.measured_lines)

    def measured_pass(self, rows: int) -> float:
        """Seconds of a target pass of ``rows`` as measured apart from the steps (``measured_passes``, not empty):
        linear between the sizes measured, flat below the least, along the last two beyond. With row groups
        (``granule``: ``measure_batched_costs`` then measures the first row past the first group too), a pass of more
        rows than one group is never read on a line from one of a single group: a line from 16 to 32 rows priced 20
        rows a quarter of the way where they cost what 32 do. (Past the second group the groups are balanced, of fewer
        rows each, and a further group costs a share of one: measured, 48 rows + 1 1.11x, + 16 1.22x; the line from
        32 to 64 rows stands.)"""
        table = self.measured_passes
        g = self.granule
        if g and g < rows < 2 * g and g + 1 not in table:  # the second group's first row not measured: its last
            return _read(table, 2 * g)
        return _read(table, rows)

    def measured_shape(self, rows: int, depth: int, drafting: int) -> float:
        """Seconds of a step's pass of ``rows`` and its draft of ``depth`` forwards over ``drafting`` sequences as
        measured apart from the steps (``shaped``): what ``excess`` is measured beyond."""
        seconds = self.measured_pass(rows)
        if depth:
            first, further = self.measured_line(max(1, drafting)) or (0.0, 0.0)
            seconds += first + further * (depth - 1)
        return seconds

    def measured_line(self, n: int) -> tuple[float, float] | None:
        """(first forward, each further one) of a lockstep draft over ``n`` sequences as measured apart from the steps
        (``measured_lines``): linear between the counts measured, flat below the least, along the last two beyond."""
        lines = self.measured_lines
        if not lines:
            return None
        lo, hi = _span(lines, n)
        if lo == hi:
            return lines[lo]
        f = (n - lo) / (hi - lo)
        a, b = lines[lo], lines[hi]
        return max(a[0] + f * (b[0] - a[0]), 1e-9), max(a[1] + f * (b[1] - a[1]), 0.0)

    def step_time(self, rows: int, depth: int, drafting: int, sequences: int, solo: StepCosts) -> float:
        """Predicted seconds of a step with ``rows`` target rows over ``sequences`` sequences, ``depth`` lockstep
        draft forwards over ``drafting`` of them. What is not measured yet falls back on the solo costs, and
        where those are not measured either, on priors *relative to what is measured*: a pass's seconds
        from the solo line, a draft forward as ``prior_draft_frac`` of a one-row pass (the pass curve's
        floor once seen), 5% more per further sequence. (Mixing the solo priors' absolute seconds, a 1 s
        pass and a 0.1 s draft forward, with measured passes of milliseconds would price drafting out
        for good: a policy that never drafts never measures a draft forward.)"""
        return self.pricer(sequences, solo)(rows, depth, drafting)

    def rest(self, sequences: int, solo: StepCosts) -> float:
        """Predicted seconds of a step's rest (all but its draft and pass) over ``sequences`` sequences."""
        return self.other(sequences, (solo.other or 0.0) * sequences)

    def priced_rest(self, sequences: int, solo: StepCosts) -> float:
        """The rest ``pricer`` puts in each step of ``sequences`` sequences (a chained plain step pays it once:
        ``chained_plain_price``)."""
        if self.shaped_excess:
            return max(self.rests(sequences), 0.0)
        return self.rest(sequences, solo)

    def pricer(self, sequences: int, solo: StepCosts) -> Callable[[int, int, int], float]:
        """``step_time`` for one step's ``sequences``, as a function of (rows, depth, drafting): what does not
        depend on those is read once (a batch plan prices a dozen shapes of the same step).

        Where the shapes were measured apart from the steps (``prime``) and the steps have measured enough beyond
        them, a step is its pass's and its draft's measured shapes plus what the steps measure beyond those
        (``excess``, by the shape) and its rest (``rests``, by its sequences); otherwise its pass, draft and rest from
        the curves the steps taught, size by size."""
        if self.shaped_excess:
            excess, rest = self.excess, max(self.rests(sequences), 0.0)

            def shaped(rows: int, depth: int, drafting: int) -> float:
                shape = self.measured_shape(rows, depth, drafting)
                return max(shape + excess(shape * EXCESS_SHAPE_UNIT), 1e-9) + rest

            return shaped
        v0, v1 = solo.line()
        if solo.draft_per_token is not None:
            d1 = solo.draft_per_token
        else:  # a share of the pass curve's floor (flat below its smallest size)
            d1 = solo.prior_draft_frac * self.verify(1, v0)
        other = self.rest(sequences, solo)
        drafts: dict[int, tuple[float, float, float]] = {}  # drafting -> (per forward, first, further), as below

        def draft_line(n: int) -> tuple[float, float, float]:
            measured = self.measured_line(n)
            line = self.draft_lines.get(n)
            if measured is not None and (line is None or not line.seen):
                return measured[1], measured[0], measured[1]  # as measured apart from the steps, until steps run
            per_forward = self.draft_forward(n, d1 * (1 + DRAFT_ROW_GROWTH * (n - 1)))
            if line is None or not line.seen:
                return per_forward, per_forward, per_forward
            # The steps' line (its cold first forward; its slope ridged toward the measured one where there is one), at
            # the level of the smoothed curve by sequences.
            d0, slope = line.line(None if measured is None else measured[1])
            mean_depth = line.mean_depth()
            scale = per_forward * mean_depth / max(d0 + slope * (mean_depth - 1.0), 1e-12)
            return per_forward, scale * d0, scale * slope

        def price(rows: int, depth: int, drafting: int) -> float:
            step = self.verify(rows, v0 + v1 * (rows - 1)) + other
            if not depth:
                return step
            n = max(1, drafting)
            shape = drafts.get(n)
            if shape is None:
                shape = drafts[n] = draft_line(n)
            return step + shape[1] + shape[2] * (depth - 1)

        return price
