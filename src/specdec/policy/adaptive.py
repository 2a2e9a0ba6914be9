"""``adaptive``: pick τ each step to maximise expected emitted tokens per second,

    goodput(τ) = E[n̂ + 1 | τ] / (τ·t_draft + t_verify(τ + 1) + t_other),

from online estimates (``estimates.py``): per-position acceptance in three shrinkage levels
(all requests → prompt-length bucket → this request) and measured costs. When no τ beats plain
decoding (τ = 0) by ``margin``, it falls back to plain steps and probes again after a backoff that
doubles while probes fail. Under a pass budget it raises τ so the expected tokens fit the passes
left; with a latency SLO and a budget it spends latency slack on fewer passes.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.errors import InvalidRequestError
from specdec.policy.base import Decision, MeasuredCosts, Policy, ReachRule, StepContext
from specdec.policy.budget import FleetBudgetPolicy
from specdec.policy.estimates import (
    ArmComparison,
    BatchCosts,
    ConfidenceCalibration,
    DepthCalibration,
    PositionRates,
    StepCosts,
    batch_excess_fit,
    chained_plain_price,
    expected_emitted_all,
    reach_weighted_mean,
    steady_draft,
)
from specdec.records import GenerationStats, StepRecord, steady_rest, tokens_made

BUDGET_SAFETY = 1.3
REQUEST_DECAY = 0.95  # per observation of a position: a request remembers its last ~20 outcomes there
SHIFT = 2.0  # the CUSUMs test for a shift of this much in log-odds (0.9 -> 0.55, 0.4 -> 0.83)
_EXP_SHIFT_UP, _EXP_SHIFT_DOWN = math.expm1(SHIFT), math.expm1(-SHIFT)
CUSUM_H = 3.5  # evidence (nats) that declares a shift; the request then forgets what came before
# Pseudo-observations of the bucket's rates in a request's own: requests are shrunk hard toward their bucket
# (5-12 did alike in simulation), until a shift is detected in one, which is then no longer like the bucket.
REQUEST_PRIOR = 8.0
REQUEST_PRIOR_SHIFTED = 4.0
EXPLORE_EVERY = 8  # steps: one in 8 drafts one token further (until the stop rule runs) or takes the A/B's other arm
# A batch plan's explorations (``plan``) come EXPLORE_EVERY steps apart, twice as far apart after each whose next plan
# kept the depth, up to this; a plan that moves the depth brings them back to EXPLORE_EVERY.
EXPLORE_EVERY_SETTLED = 32
CALIBRATION_WARM = 30  # verified draft tokens before the draft's confidence is trusted to stop drafting
# The stop rule's break-even, scaled: the plan's goodput (no early stop) understates what the rule achieves,
# and so the value of time. 1.2-1.7 did alike on the simulator's workloads; 1.0-1.2 was best replaying the
# default pair's recorded drafts.
REACH_MARGIN = 1.2
REACH_DEPTH = 8  # the stop rule may draft this many tokens beyond the plan's τ
ARM_SETTLED_GAP = 0.04  # the stop rule this much ahead in goodput: settled
ARM_CHECK_EVERY_SETTLED = 32  # steps: then one in 32 goes without the rule
GAIN_PER_TOKEN = 0.02  # budget-limited: an extra draft token must add this many expected tokens
REPLAN_EVERY = 8  # batch steps a batch plan serves (see ``plan``)
EXPLORE_FROM_PLAIN_STEPS = 2  # steps an exploration from a plain batch plan runs (the first catches the draft up)
# Sequences from which a batch replays its plan (a single request plans every step, ``next_tau``). At 2-3 sequences a
# fresh plan every step cost ~0.4-0.6 ms of a 4-6 ms step (in process, an Emerald Rapids, session 48: the policy
# 0.74-0.91x the best fixed tau at 2-3 sequences with 4, 0.94-1.00x with 2).
REPLAN_MIN = 2
# A deeper batch depth must predict this much more goodput per position beyond the last plan's, a shallower one this
# much once (``_search_depth``): the predictions move from plan to plan and err more the deeper they reach (acceptance
# of rarely drafted positions, pass sizes never run, joins waiting on longer steps). In process, 4-32 sequences, the
# policy against the best fixed τ (then asked of each deeper depth against the best below it): 0.91-0.95x without it,
# 0.93-0.97x at 0.03, 0.86-0.97x at 0.06.
DEPTH_MARGIN = 0.03
# What a batch step measures beyond its price at the rows it ran (what the curves do not see yet: a pass size dearer
# than its neighbours, a draft line off; its rest less the policy's own work, that work at its mean; steps with prompt
# rows left out), decayed by this per record (~1,000 records, 60 steps of 16 sequences), and used once STEP_BIAS_WARM
# steps' worth is measured.
STEP_BIAS_DECAY = 0.999
STEP_BIAS_WARM = 4.0
DEPTH_PATIENCE = 3  # the batch planner prices depths up to this many beyond the last plan's


def _search_depth(rates: list[float], last: int | None, margin: float, depth_margin: float = DEPTH_MARGIN) -> int:
    """The batch's depth from its predicted goodput by depth (``rates[0]`` plain). Among the drafting depths, from
    the depth the last plan chose (``last``; depth 1 before any plan, or after a plain one): a deeper depth is asked
    ``depth_margin`` (DEPTH_MARGIN unless the policy sets it) more per position beyond it (deeper predictions err
    more), a shallower one that much once (the predictions move by a few percent from plan to plan); then drafting
    only if that depth beats plain by ``margin``.

    A search from depth 1 upward (each deeper depth asked to beat the best so far) flipped between depths on the
    predictions' noise where the goodput is flat across the depths a batch runs, and from a shallow depth it rarely
    reached back to a deep one: a server at 4 clients ran depth 1 on a sixth of its steps where depth 5, its usual
    depth, served 14% more. Asked per position both ways, a batch at 16 clients stayed at depth 7 where depth 3
    predicted 12% more."""
    if len(rates) < 2:
        return 0
    anchor = min(max(last or 1, 1), len(rates) - 1)
    best, score = anchor, rates[anchor]
    for cut in range(1, len(rates)):
        s = rates[cut] / (1.0 + depth_margin * (cut - anchor if cut > anchor else 1))
        if cut != anchor and s > score:
            best, score = cut, s
    return best if rates[best] > rates[0] * (1.0 + margin) else 0


def _look_down(rows: list[int], depth: int, granule: int) -> int:
    """Where an exploration below ``depth`` looks (``plan``): halfway down, and with row groups (``granule`` rows: a
    pass pays for a group it begins about whole) the deepest depth at or above 1 and at most halfway whose next depth
    would begin a further group (``rows``: the pass's rows by depth). A depth that leaves the last group part empty
    measures a pass of a whole group's price for fewer tokens: a server at 4 clients held depth 7 (32 rows, two groups
    of 16), looked down at depth 4 (20 rows, two groups) and never at 3 (16 rows, one), where τ = 3 served 1.18x its
    tokens/ms.

    Where ``depth``'s own pass begins a group it leaves part empty and the depth just below begins none, that depth is
    where it looks (the same group edge, however near): looking only halfway, a server at 8 clients held depth 4 (40
    rows: a third group begun for 8) and looked at depth 1, never at 3 (32 rows, two groups full), where τ = 3's steps
    made 1.3x its tokens/ms (session 62)."""
    half = (depth + 1) // 2
    if granule > 0:
        groups = [-(-r // granule) for r in rows]
        if depth >= 2 and rows[depth] % granule and groups[depth] > groups[depth - 1]:
            return depth - 1
        for d in range(half, 0, -1):
            if groups[d + 1] > groups[d]:
                return d
    return half


def reach_thresholds(times: list[float], rates: list[float], per_token: float, cap: int) -> tuple[float, ...]:
    """The stop rule's thresholds: after j drafted tokens, drafting token j+1 pays when
    reach · a_{j+1} ≥ Δt_j / per_token, the extra seconds of one more token (a draft forward and a verify
    slot) in emitted tokens at the current rate (renewal-reward: goodput is what a second is worth),
    times REACH_MARGIN. Δt_j is read from the measured step-time curve over the three block sizes
    around j: on a CPU some block sizes cost much more than others (the kernel verifies in groups of
    6), and a single step of a measured curve is noisy."""
    out = []
    for j in range(1, cap):
        lo, hi = max(j - 1, 0), min(j + 2, cap)
        extra = (times[hi] - times[lo]) / (hi - lo) / per_token
        out.append(min(0.95, REACH_MARGIN * extra / max(rates[j], 1e-3)))
    return tuple(out) or (0.0,)


def _want_left(ctx: StepContext) -> tuple[int, int | None]:
    """Tokens the request still wants (at least 1) and verification passes it has left (None: no cap)."""
    left = None if ctx.max_verify_passes is None else ctx.max_verify_passes - ctx.verify_passes
    return max(1, ctx.max_new_tokens - ctx.new_tokens), left


def _budget_binds(ctx: StepContext) -> bool:
    """Fewer passes left than tokens wanted: the request plans for its budget, not for speed."""
    if ctx.max_verify_passes is None:
        return False
    want, left = _want_left(ctx)
    return left is not None and left < want


def _predict_latency(req: _Request, plan: _Plan, ctx: StepContext) -> None:
    """At a request's first plan: its latency if every step ran at the plan's best τ (the SLO margin's yardstick)."""
    if req.predicted_latency is None:
        best = plan.best(list(range(len(plan.goodput))))
        req.predicted_latency = ctx.elapsed + _want_left(ctx)[0] / plan.emitted[best] * plan.times[best]


def _logit(p: float) -> float:
    p = min(max(p, 1e-3), 1 - 1e-3)
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@dataclass
class _Request:
    rates: PositionRates
    bucket: int
    arm: int | None = None  # the last decision drafted with the stop rule (1), without it (0), or neither
    probing: bool = False
    backoff: int = 4  # plain steps before the next probe while falling back
    since_probe: int = 0
    steps: int = 0
    predicted_latency: float | None = None
    cusum_up: float = 0.0  # log-likelihood-ratio CUSUMs: has this request's acceptance shifted up / down?
    cusum_down: float = 0.0
    changes: int = 0  # shifts detected so far
    plan: _Plan | None = None  # the last step's plan (its expected tokens by τ serve the batch planner)
    budget_bound: bool = False  # the last decision was made to fit a verification budget
    # steps since each CUSUM last stood at 0, i.e. since the shift it tests may have begun: (τ, n̂)
    recent_up: list[tuple[int, int]] = field(default_factory=list)
    recent_down: list[tuple[int, int]] = field(default_factory=list)


def _expected_tokens(req: _Request | None, tau: int) -> float:
    """The tokens a step of ``tau`` drafted was expected to make by the request's last plan (nan: none)."""
    if tau == 0:
        return 1.0
    if req is None or req.plan is None:
        return math.nan
    emitted = req.plan.emitted
    return emitted[min(tau, len(emitted) - 1)]


def _shift_terms(rates: list[float]) -> list[tuple[float, float]]:
    """Per position, the CUSUMs' L+ and L- (``_detect_shift``) at the rates a step was planned with."""
    out = []
    for rate in rates:
        p = min(max(rate, 0.02), 0.98)
        out.append((math.log1p(p * _EXP_SHIFT_UP), math.log1p(p * _EXP_SHIFT_DOWN)))
    return out


@dataclass
class _Plan:
    rates: list[float]  # conditional acceptance by draft position 1..K
    emitted: list[float]  # E[n̂+1 | τ], τ = 0..K
    times: list[float]  # predicted step seconds
    goodput: list[float] = field(init=False)
    # ``_shift_terms(rates)``, made at the first outcome observed against the plan (a batch plan serves several steps)
    _terms: list[tuple[float, float]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.goodput = [e / t for e, t in zip(self.emitted, self.times)]

    def shift_terms(self) -> list[tuple[float, float]]:
        if self._terms is None:
            self._terms = _shift_terms(self.rates)
        return self._terms

    def best(self, candidates: list[int]) -> int:
        return max(candidates, key=lambda tau: (self.goodput[tau], -tau))


class AdaptivePolicy(Policy):
    name = "adaptive"
    batch_aware = True

    def __init__(
        self,
        max_tau: int = 16,
        margin: float = 0.03,
        bucket_edges: tuple[int, ...] = (256, 1024, 4096),
        prior: float = 0.6,
        early_stop: bool = True,
        slo_p95_s: float | None = None,
        min_backoff: int = 4,
        max_backoff: int = 16,
        probe_tau: int = 1,
        row_granule: int | None = None,
        step_bias: bool = True,
        depth_margin: float = DEPTH_MARGIN,
    ) -> None:
        """``row_granule``: the rows of the target's row groups, for the price of a pass (a pass of more rows than
        one group pays for the second about whole); None: as the measured costs say (``prime``), 0: none (a pass's
        price smooth in its rows). ``step_bias``: a batch plan adds the step bias to every depth's price where its
        prices are not its measured shapes plus the steps' excess beyond them (``step_bias``); False: never.
        ``depth_margin``: how much more goodput a batch plan asks of each depth beyond its last (``_search_depth``)."""
        if not isinstance(max_tau, int) or max_tau < 1:
            raise InvalidRequestError(f"max_tau must be an integer >= 1, got {max_tau}", "max_tau")
        if not 0 <= margin < 1:
            raise InvalidRequestError(f"margin must be in [0, 1), got {margin}", "margin")
        if not 0 <= depth_margin < 1:
            raise InvalidRequestError(f"depth_margin must be in [0, 1), got {depth_margin}", "depth_margin")
        if slo_p95_s is not None and not slo_p95_s > 0:
            raise InvalidRequestError(f"slo_p95_s must be > 0 seconds, got {slo_p95_s}", "slo_p95_s")
        if not 0 < prior < 1:
            raise InvalidRequestError(f"prior acceptance must be in (0, 1), got {prior}", "prior")
        if row_granule is not None and (not isinstance(row_granule, int) or row_granule < 0):
            raise InvalidRequestError(f"row_granule must be an integer >= 0, got {row_granule!r}", "row_granule")
        self.row_granule = row_granule
        self.use_step_bias = bool(step_bias)
        self.max_tau, self.margin, self.prior, self.early_stop = max_tau, margin, prior, early_stop
        self.depth_margin = depth_margin
        self.bucket_edges = tuple(sorted(bucket_edges))
        self.slo_p95_s = slo_p95_s
        self.min_backoff, self.max_backoff, self.probe_tau = min_backoff, max_backoff, probe_tau
        pos = max_tau + 1
        self.global_rates = PositionRates(max_pos=pos, decay=0.99)
        self.bucket_rates = [PositionRates(max_pos=pos, decay=0.98) for _ in range(len(self.bucket_edges) + 1)]
        self.costs = StepCosts()
        self.batch_costs = BatchCosts()
        self.calibration = ConfidenceCalibration()
        self.arms = ArmComparison()
        self.latencies: deque[float] = deque(maxlen=200)
        self._latency_ratios: deque[float] = deque(maxlen=100)
        self._requests: dict[str, _Request] = {}
        # (bucket, positions) -> (versions of the global and bucket rates, their shrunk rates, those rates' logits)
        self._shared_rates: dict[tuple[int, int], tuple[tuple[int, int], list[float], list[float]]] = {}
        self._batch_depth = max_tau  # the depth the last batch step chose (bounds the next one's search)
        self._reuse: dict[str, Decision] = {}  # the last batch plan, by request
        self._joined: dict[str, Decision] = {}  # ... and the decisions of requests that joined its replays since
        self._reuse_until = 0  # ... replayed through this batch step
        # the plan's exploring depth, its requests' decisions there and the steps to explore, for the plan's next step
        self._explore_next: tuple[int, dict[str, Decision], int] | None = None
        self._explored = 0  # the batch step whose plan last explored (one deeper, or down: ``plan``)
        self._explore_down = False  # the next exploration looks down (they alternate)
        self._explore_gap = EXPLORE_EVERY  # batch steps from one exploration to the next (``plan``)
        self._explored_depth: int | None = None  # the depth planned at the last exploration, until the next plan
        self._batch_steps = 0  # steps planned for a batch (``plan``): its explorations come ``_explore_gap`` apart
        self._step_bias = [0.0, 0.0]  # decayed (measured - priced seconds, weight) of batch steps (``step_bias``)
        self._batch_planned = False  # a batch plan has been made: its steps teach the step bias
        # measured ÷ predicted goodput of the batch steps, by depth, one calibration per class of batch size
        # (``depth_calibration``): what the plans' prices miss the deeper they reach, and the more sequences drafting
        self._depth_calibrations: dict[int, DepthCalibration] = {}
        # Steps observed while a batch plan is replayed, learnt from at the next plan (``observe_step``): each with
        # its requests as they were when it was observed.
        self._unlearnt: list[tuple[list[_Request | None], Sequence[StepRecord]]] = []

    # -- estimates --------------------------------------------------------------------------

    def depth_calibration(self, sequences: int) -> DepthCalibration:
        """The depth calibration of steps of ``sequences`` sequences: one per class of batch size (2-3, 4-7, 8-15, 16-31,
        32 or more). What a plan's prices miss at a depth depends on the step's size too (a server's drafts and passes
        cost beyond their measured shapes by more with more sequences), and a server's load moves: learnt in one, a
        batch of 4 at depth 7 (where a shrinking batch ends its requests) read 1.16-1.18 and priced every depth past 6
        for 16 sequences by it."""
        key = min(max(sequences, 2), 32).bit_length()
        calibration = self._depth_calibrations.get(key)
        if calibration is None:
            calibration = self._depth_calibrations[key] = DepthCalibration()
        return calibration

    def _request(self, ctx: StepContext) -> _Request:
        req = self._requests.get(ctx.request_id)
        if req is None:
            bucket = bisect.bisect_right(self.bucket_edges, ctx.prompt_len)
            req = _Request(
                PositionRates(max_pos=self.max_tau + 1, decay=REQUEST_DECAY, prior_weight=REQUEST_PRIOR),
                bucket,
                backoff=self.min_backoff,
            )
            self._requests[ctx.request_id] = req
        return req

    def rates(self, req: _Request, n: int) -> list[float]:
        # The shared levels change only when some request's drafted step is observed: many requests of a
        # step (a batch) read the same ones, so they are derived once per change.
        bucket = self.bucket_rates[req.bucket]
        key = (req.bucket, n)
        versions = (self.global_rates.version, bucket.version)
        cached = self._shared_rates.get(key)
        if cached is None or cached[0] != versions:
            top = self.global_rates.rates(None, self.prior, n)
            mid = bucket.rates(top, self.prior, n)
            cached = self._shared_rates[key] = (versions, mid, [_logit(p) for p in mid])
        _, mid, logits = cached
        # A request that accepts more (or less) than its bucket at position 1, where evidence comes
        # fastest, is shifted by as much in log-odds at every position before its own data there.
        own = req.rates
        a1 = (own.wins[0] + own.prior_weight * mid[0]) / (own.trials[0] + own.prior_weight)
        shift = _logit(a1) - logits[0]
        if abs(shift) < 1e-6:
            return own.rates(mid, self.prior, n)
        return own.rates(mid[:1] + [_sigmoid(x + shift) for x in logits[1:]], self.prior, n)

    def _plan(self, req: _Request, k: int) -> _Plan:
        rates = self.rates(req, k)
        return _Plan(rates, expected_emitted_all(rates), self.costs.step_times(k))

    def slo_margin(self) -> float:
        """p95 of observed / predicted request latency (≥ 1): how far predictions can be trusted."""
        if len(self._latency_ratios) < 10:
            return 1.0
        ordered = sorted(self._latency_ratios)
        return min(3.0, max(1.0, ordered[int(0.95 * (len(ordered) - 1))]))

    # -- the decision -----------------------------------------------------------------------

    def begin(self, ctx: StepContext) -> None:
        self._request(ctx)

    def next_tau(self, ctx: StepContext) -> Decision:
        self.learn()
        req = self._request(ctx)
        req.steps += 1
        k = min(self.max_tau, ctx.max_tau)
        if k == 0:
            return self._decide(req, 0, "plain: no room to draft", None)
        plan = self._plan(req, k)
        req.plan, req.budget_bound = plan, False
        want, left = _want_left(ctx)
        _predict_latency(req, plan, ctx)
        if left is not None and left < want:
            req.budget_bound = True
            return self._under_budget(req, plan, want, left, ctx)
        return self._free(req, plan, ctx)

    def _free(self, req: _Request, plan: _Plan, ctx: StepContext) -> Decision:
        """No binding budget: best goodput, or fall back to plain steps (probing with backoff)."""
        tau = plan.best(list(range(1, len(plan.goodput))))
        ratio = plan.goodput[tau] / plan.goodput[0]
        if ratio >= 1.0 + self.margin:
            req.backoff = self.min_backoff
            k = len(plan.goodput) - 1
            if (
                not self._stop_rule_ready()
                and req.steps % EXPLORE_EVERY == 0
                and tau < k
                and plan.goodput[tau + 1] >= 0.9 * plan.goodput[tau]
            ):
                # Positions never drafted keep stale estimates; now and then look one further (the stop
                # rule, once calibrated, looks further by itself whenever the draft is confident).
                return self._decide(req, tau + 1, f"explore tau={tau + 1} (best {tau}, {ratio:.2f}x plain)", plan)
            return self._decide(req, tau, f"goodput {ratio:.2f}x plain at tau={tau}", plan)
        if ratio >= 1.0 - self.margin and tau == 1:
            # Near break-even a one-token draft costs next to nothing and keeps acceptance in view, so a
            # return of acceptance is seen at once rather than at the next probe.
            return self._decide(req, 1, f"hold tau=1: goodput {ratio:.2f}x plain, near break-even", None)
        req.since_probe += 1
        if req.since_probe >= req.backoff:
            req.since_probe = 0
            probe = min(max(self.probe_tau, tau), len(plan.goodput) - 1)
            req.probing = True
            return self._decide(req, probe, f"probe tau={probe} (fallback; best goodput {ratio:.2f}x plain)", None)
        return self._decide(req, 0, f"fallback: best goodput {ratio:.2f}x plain", None)

    def _under_budget(self, req: _Request, plan: _Plan, want: int, left: int, ctx: StepContext) -> Decision:
        """Fewer passes left than tokens wanted: raise τ so the expected tokens fit the passes."""
        k = len(plan.goodput) - 1
        # Acceptance varies step to step: plan for BUDGET_SAFETY times the tokens so the mean is not the edge.
        fits = [tau for tau in range(k + 1) if plan.emitted[tau] * left >= BUDGET_SAFETY * want]
        if fits and self.slo_p95_s is not None:
            margin = self.slo_margin()
            in_slo = [tau for tau in fits if self._predict(ctx, plan, tau, want, left) * margin <= self.slo_p95_s]
            if in_slo:
                # Latency slack buys fewer passes: the most tokens per pass that still meets the SLO.
                tau = max(in_slo, key=lambda t: plan.emitted[t] - GAIN_PER_TOKEN * t)
                return self._decide(
                    req, tau, f"budget+SLO: tau={tau}, {left} passes left for {want} tokens", plan, False
                )
        if fits:
            tau = plan.best(fits)
            return self._decide(req, tau, f"budget: tau={tau} fits {want} tokens in {left} passes", plan, False)
        tau = max(range(k + 1), key=lambda t: plan.emitted[t] - GAIN_PER_TOKEN * t)
        # Passes are what is scarce here, not time: no early stop, since a doubtful token may still pass.
        return self._decide(req, tau, f"budget-limited: tau={tau}, {left} passes left for {want} tokens", plan, False)

    def _predict(self, ctx: StepContext, plan: _Plan, tau: int, want: int, left: int) -> float:
        passes = min(want / plan.emitted[tau], left)
        return ctx.elapsed + passes * plan.times[tau]

    def _stop_rule_ready(self) -> bool:
        return self.early_stop and self.calibration.total >= CALIBRATION_WARM

    def _decide(self, req: _Request, tau: int, reason: str, plan: _Plan | None, early_stop: bool = True) -> Decision:
        req.arm = None
        if not (tau and plan is not None and early_stop and self._stop_rule_ready()):
            return Decision(tau, reason)
        # Some steps take the other arm, so both goodputs stay measured: every other step until both are,
        # then one in 8; one in 32 once the rule is clearly ahead (each minority step then costs the gap).
        # While the rule is off it keeps being checked one step in 8: an early verdict against it, from a
        # young calibration, must not stick.
        prefer = self.arms.prefer_rule()
        gap = self.arms.gap()
        if gap is None:
            every = 2
        else:
            settled = prefer and gap >= ARM_SETTLED_GAP
            every = ARM_CHECK_EVERY_SETTLED if settled else EXPLORE_EVERY
        req.arm = int(prefer) if req.steps % every else int(not prefer)
        if not req.arm:
            return Decision(
                tau, reason + (", stop rule off (measured slower)" if not prefer else ", no stop rule (A/B)")
            )
        # With a calibrated confidence signal the drafter decides the depth token by token: one more
        # draft token pays when the chance that it and all before it pass, reach · a, beats what its
        # forward and verify slot cost in output time, (t_draft + Δt_verify) · goodput (renewal-reward:
        # goodput is the value of time). a is this request's acceptance at the positions the plan drafts,
        # weighted by how often each is reached; each drafted token's own chance is a updated by its
        # draft probability (Bayes, the calibrated likelihoods), so reach falls fast on doubtful tokens.
        prior = reach_weighted_mean(plan.rates[:tau])
        cap = min(len(plan.goodput) - 1, tau + REACH_DEPTH)
        per_token = plan.times[tau] / plan.emitted[tau]
        rule = ReachRule(self.calibration.table(prior), reach_thresholds(plan.times, plan.rates, per_token, cap))
        shown = rule.min_reach[min(tau, len(rule.min_reach)) - 1]
        return Decision(cap, reason + f", up to {cap} while P(all pass) >= {shown:.2f} at {tau}", rule)

    def plan(self, ctxs: Sequence[StepContext], other_rows: int = 0, prompt_rows: int = 0) -> list[Decision]:
        """τ for every sequence of a step, for the goodput of the whole batch (tokens per second over all).

        The pass's cost depends on its rows, not on one request's τ: with many sequences the target pass
        is compute-bound and every drafted token costs a row for all. Each request may draft up to its room;
        a shared depth D caps every τ at D, and the D with the best predicted batch goodput is kept (by
        ``margin`` over plain steps). No request
        gives back tokens below the depth: trimming each request's τ by the expected gain of its last token
        against the pass's marginal cost of a row measured 5% slower in a server at 4-32 clients than the
        uniform depth (noisy curves trimmed tokens that paid; the lockstep draft costs by depth anyway), and the
        simulator's goals hold without it. Requests bound by a verification budget make their own
        decision and keep it (passes are what is scarce for them). A batch step costs a few microseconds
        per request: the batch's depth search replaces each request's own fallback, probes and
        exploration, the shared acceptance levels are derived once per change, and the stop rule is built
        only for the requests that draft.

        Prompt rows joining the pass (``prompt_rows``) are in it whatever the depth: they are priced into the pass
        (each drafted row costs its share of a bigger pass) but their own seconds are not in any depth's goodput.
        Counted as part of the step, a big prefill made every depth look cheap beside it (tokens ÷ a step of 200
        prompt rows) and the plan went 3-12 deep where one token paid best (a server at 7-16 clients with prompts of
        3-730 tokens served 0.85-0.89x the best fixed τ)."""
        if len(ctxs) == 1 and other_rows == 0:  # a request alone (its own prompt rows at its first step or not)
            return [self.next_tau(ctxs[0])]
        n = len(ctxs) + other_rows  # sequences in the step, at most (other rows: one per other sequence at least)
        self._batch_steps += 1
        if self._batch_steps <= self._reuse_until and abs(len(ctxs) - len(self._reuse)) * 4 <= len(self._reuse):
            return self._replay(ctxs, n)
        self._explore_next = None  # a plan's exploration not run (its next step was planned afresh): dropped
        self.learn()
        reqs: list[_Request] = []
        own: list[Decision | None] = []
        caps: list[int] = []
        floors: list[int] = []
        gains: list[list[float]] = []
        horizon = self._batch_horizon()
        for ctx in ctxs:
            req = self._request(ctx)
            k = min(horizon, ctx.max_tau)
            if k and _budget_binds(ctx):
                mine = self.next_tau(ctx)  # budget-bound: its own decision, kept
                cap = floor = min(mine.tau, k)
                own.append(mine)
            else:
                req.steps += 1
                self._plan_in_batch(req, ctx, k)
                req.budget_bound = False
                cap, floor = k, 0
                own.append(None)
            g = req.plan.emitted if req.plan is not None else [1.0]
            # Expected tokens of τ beyond the plan's horizon (a stop rule's cap): the plan's last increment, flat.
            gains.append(g + [g[-1]] * (cap + 1 - len(g)))
            reqs.append(req)
            caps.append(cap)
            floors.append(floor)

        price = self.batch_costs.pricer(n, self.costs)
        # A step where no sequence drafts chains its plain sequences' passes (``StepContext.chain``, the engine's
        # ``chain_plain``): k tokens each for k passes and one rest (``chained_plain_price``).
        chains = [ctx.chain for ctx in ctxs]
        chained = max(chains, default=1) > 1
        rest = self.batch_costs.priced_rest(n, self.costs) if chained else 0.0

        def rows_of(taus: list[int], prompt_rows: int = 0) -> int:  # the pass's rows (the other sequences' too)
            return other_rows + prompt_rows + sum(taus) + len(taus)

        def priced(taus: list[int], prompt_rows: int = prompt_rows) -> tuple[float, float]:  # expected tokens, seconds
            if chained and not any(taus):
                return float(sum(chains)), chained_plain_price(price, rest, rows_of(taus, prompt_rows), chains)
            got = sum(g[t] for g, t in zip(gains, taus))
            # the other sequences' rows make a token each at least
            return got, price(rows_of(taus, prompt_rows), max(taus, default=0), len(taus) - taus.count(0))

        # The prompt rows' own seconds (what they add to a plain pass of the others' rows): in every depth's step.
        sunk = 0.0
        if prompt_rows:
            plain_rows = other_rows + len(ctxs)
            sunk = max(0.0, price(plain_rows + prompt_rows, 0, 0) - price(plain_rows, 0, 0))

        # Every depth up to the caps priced, then the search (``_search_depth``) from the depth the last plan chose.
        # Each step's price is raised by the step bias, what the batch's steps' drafts and passes have measured beyond
        # their prices at the rows they ran (what the curves do not see yet): the ratio of tokens to the priced seconds
        # alone leans shallow wherever such a cost is real. Not where the prices are the measured shapes and the
        # steps' excess beyond them, which holds that cost already (``step_bias``).
        bias = self.step_bias()
        # Each depth's ratio is then scaled by what the steps run at that depth measured against their predictions
        # (``DepthCalibration``): the curves and the acceptance estimates err more the deeper they price.
        by_depth: list[list[int]] = []
        tokens: list[float] = []
        secs: list[float] = []
        rates: list[float] = []
        factors: list[float] = []
        calibration = self.depth_calibration(n)
        bound = any(floors)  # requests bound by a budget keep their own τ (their floor) at every depth
        for cut in range(max(caps, default=0) + 1):
            if bound:
                taus = [max(f, min(c, cut)) for f, c in zip(floors, caps)]
            else:
                taus = [c if c < cut else cut for c in caps]
            by_depth.append(taus)
            got, seconds = priced(taus)
            tokens.append(got)
            secs.append(seconds)
            factors.append(calibration.factor(max(taus, default=0)))
            rates.append(got / (max(seconds - sunk, 1e-9) + bias) * factors[-1])
        last = self._batch_depth if self._batch_planned else None
        depth = _search_depth(rates, last, self.margin, self.depth_margin)
        # The plan is replayed over the next steps (below), which come without this step's prompt rows: their depth is
        # searched among the same depths priced without them. Replayed as made, the plan of the step where 16 requests
        # joined at once (207 prompt rows, each drafted row dear in a pass that size) held 16 sequences plain for 8
        # steps, and again at the next such step: a server at 16 clients served 0.64-0.81x tau = 3 in the load test.
        steady, steady_rates = depth, rates
        if prompt_rows:
            steady_rates = []
            for taus, factor in zip(by_depth, factors):
                got, seconds = priced(taus, 0)
                steady_rates.append(got / (max(seconds, 1e-9) + bias) * factor)
            steady = _search_depth(steady_rates, last, self.margin, self.depth_margin)
        # Depths never run leave the cost curves unmeasured where they would be read (rows beyond any pass seen,
        # draft forwards never run) and acceptance unlearnt: now and then run one deeper when predicted nearly
        # as good, or whatever predicted while no draft forward has been measured (its cost is then a prior).
        # A plain batch looks one deeper whatever predicted: drafting costs learnt at a bad moment (a cold start, a
        # busy machine) would otherwise never be measured again, and a server at 4 clients stayed plain for good
        # at 0.55x the speed of drafting 3 tokens.
        # Every other exploration looks down instead, halfway or to a row group's edge (``_look_down``; a drafting
        # depth of 2 or more; whatever predicted): the excess a server's steps cost beyond their measured shapes
        # (``ExcessFit``) is fitted on the shapes the steps run, and from deep steps alone, one deeper now and then,
        # its slope was shrunk to a level that priced every shallow depth too dear. Through a server at 16 clients a
        # plan went from depth 3 to 7-8 within its first plans, priced depth 3 at 22 ms a step where τ = 3's steps took
        # 15, and stayed there (0.83-0.92x τ = 3 in four load tests); a step at half the depth spreads the shapes the
        # slope is learnt from.
        # The explorations space out while they keep confirming the depth: each costs a step at a depth predicted
        # worse, one in 8 steps ~1% of the goodput at 16 sequences in process (``engine_steps.py --interleave``: the
        # policy exploring every 8 steps and with this backoff, 0.930 / 0.938 / 0.928 against 0.969 / 0.931 / 0.930 of
        # the best fixed τ, 4 sequences 0.936 against 0.942).
        if self._explored_depth is not None:  # the first fresh plan since an exploration
            if steady == self._explored_depth:
                self._explore_gap = min(2 * self._explore_gap, EXPLORE_EVERY_SETTLED)
            else:
                self._explore_gap = EXPLORE_EVERY
            self._explored_depth = None
        # A batch that replays its plan (REPLAN_MIN sequences or more) explores on the step after the plan's, from the
        # depth it replays (``steady``): the plan's own step carries the policy's fresh plan and its learning of the
        # steps replayed before it (0.5-1.8 ms of the worker's Python at 4-16 sequences through a server, the event
        # loop's backlog then running beside the next pass), and in five traced servers such steps' drafts and passes
        # measured 0-15% slower than the replayed steps' at the same batch and depth: a bias against every depth
        # explored.
        reuse = len(ctxs) >= REPLAN_MIN
        base, base_rates = (steady, steady_rates) if reuse else (depth, rates)
        explore, target = False, base
        # From chained plain steps (each ``max(chains)`` passes), the explorations come as many times fewer steps apart:
        # about as often by passes as from plain steps of one pass. Each one from plain first feeds the draft model
        # every token made since the last (its catch-up, in the exploring step), and at the steps' gap in one-pass plain
        # a server at 16 clients spent ~30% of its time in exploring steps at under half plain's tokens a millisecond.
        gap = self._explore_gap * (max(chains, default=1) if base == 0 else 1)
        if self._batch_steps - self._explored >= gap:
            up = base + 1 < len(by_depth) and (
                base_rates[base + 1] >= 0.9 * base_rates[base] or base == 0 or not self.batch_costs.draft_forward.seen
            )
            down = base >= 2
            if down and (self._explore_down or not up):
                rows = [rows_of(taus) for taus in by_depth]
                target, explore, self._explore_down = _look_down(rows, base, self.batch_costs.granule), True, False
            elif up:
                target, explore, self._explore_down = base + 1, True, True
            if explore:
                self._explored = self._batch_steps  # (the plan's step: explorations come whole plans apart)
                self._explored_depth = steady
        self._batch_depth = steady
        self._batch_planned = True

        def decisions(depth: int, exploring: bool, replayed: bool = False) -> list[Decision]:
            # What the plan expects of the step, in each reason: a trace then holds the prediction against the step's
            # measured times and tokens (how far the cost curves are from what the steps cost).
            if replayed and prompt_rows:  # the steps after this one, without its prompt rows
                expect = (
                    f"replayed without the {prompt_rows} prompt rows of its plan's step; tokens/ms by depth "
                    + "/".join(f"{r * 1e-3:.2f}" for r in steady_rates)
                    + f" (steps' measured/predicted {'/'.join(f'{f:.2f}' for f in factors)})"
                )
            else:
                expect = (
                    f"{tokens[depth]:.1f} tokens in {(secs[depth] + bias) * 1e3:.2f} ms predicted "
                    f"(step bias {bias * 1e3:+.2f} ms"
                    + (f", {prompt_rows} prompt rows {sunk * 1e3:.2f} ms" if prompt_rows else "")
                    + f"); tokens/ms by depth {'/'.join(f'{r * 1e-3:.2f}' for r in rates)}"
                    + f" (steps' measured/predicted {'/'.join(f'{f:.2f}' for f in factors)})"
                )
            out: list[Decision] = []
            for req, kept, tau in zip(reqs, own, by_depth[depth]):
                if kept is not None and tau == kept.tau:
                    out.append(kept)
                    continue
                # No stop rule in a batch: its thresholds price a token at a lone step's costs (a draft forward of
                # its own and a verify slot), but here the lockstep forward runs for the others anyway and a row of
                # a big pass costs little, so it stopped drafts that would have paid.
                req.arm = None
                if tau == 0:
                    out.append(Decision(0, f"batch of {n}: plain (depth {depth} for the batch's goodput; {expect})"))
                else:
                    reason = (
                        f"batch of {n}: tau={tau} for the batch's goodput ("
                        + ("explore; " if exploring else "")
                        + f"{expect})"
                    )
                    out.append(Decision(tau, reason))
            return out

        # A batch of REPLAN_MIN or more keeps this plan for the next REPLAN_EVERY - 1 steps at its steady depth (without
        # this step's prompt rows), the first of them exploring where this plan explores: its inputs move slowly, and
        # re-deriving them costs tens of microseconds per request.
        now = explore and not reuse  # a batch that does not replay explores on the plan's own step
        out = decisions(target if now else depth, now)
        kept_plan = decisions(steady, False, replayed=True) if reuse and steady != depth else out
        self._reuse = {ctx.request_id: d for ctx, d in zip(ctxs, kept_plan)}
        self._joined = {}
        self._reuse_until = self._batch_steps + (REPLAN_EVERY - 1 if reuse else 0)
        if explore and reuse:
            explored = decisions(target, True, replayed=True)
            # From plain, two steps: the first's draft takes in the tokens of the plain steps before it (a catch-up that
            # no depth pays while drafting goes on, so no cost or calibration learns from it: ``steady_draft``), and
            # only the second measures what drafting costs. Explored one step at a time, a batch planned plain from
            # costs that priced drafting a few percent dear never measured a drafting step it could learn from: in
            # process at 16 sequences a policy held 384-420 of its 420-437 steps plain in three traced runs (plans at
            # 3.49 / 3.55 / 3.55 tokens/ms for depths 0-2 where τ = 2's steps made 3.84; its explorations at depth 1
            # measured 9-17 ms a step, catch-up included, where τ = 1's took 6.4), 0.83-0.93x τ = 2 (session 78).
            steps = EXPLORE_FROM_PLAIN_STEPS if base == 0 else 1
            self._explore_next = target, {ctx.request_id: d for ctx, d in zip(ctxs, explored)}, steps
        return out

    def _batch_horizon(self) -> int:
        """The deepest τ a batch plan prices. A plan moves the depth a few positions deeper at most: depths beyond the
        last plan's + DEPTH_PATIENCE + 1 are not priced (the search asks DEPTH_MARGIN more of each further position,
        and every depth priced costs a pass over the requests)."""
        return min(self.max_tau, self._batch_depth + DEPTH_PATIENCE + 1)

    def _plan_in_batch(self, req: _Request, ctx: StepContext, k: int) -> None:
        """A request's own plan in a batch (its expected tokens by τ up to ``k``; none at 0), which also predicts its
        latency at its first plan: made for each request a batch plan prices, and for each that joins it later."""
        req.plan = self._plan(req, k) if k > 0 else None
        if req.plan is not None:
            _predict_latency(req, req.plan, ctx)

    def _replay(self, ctxs: Sequence[StepContext], n: int) -> list[Decision]:
        """The last batch plan again: each request its decision (clamped to its room), a request that joined
        since the batch's depth without a stop rule, a budget-bound one its own decision afresh."""
        out = []
        reuse, joined = self._reuse, self._joined
        # The plan's exploration, on its first replayed step: its requests at the depth explored, and so a request that
        # joins there (with more requests than ``max_batch`` the steps rotate, and the plan's next step may hold none of
        # its requests: 32 clients at a batch of 16).
        pending, self._explore_next = self._explore_next, None
        exploring = None
        if pending is not None:
            exploring, explored, steps = pending
            reuse = {**reuse, **explored}
            if steps > 1:  # an exploration from plain: its next step too (``plan``), with the requests joining now
                explored = dict(explored)
                self._explore_next = exploring, explored, steps - 1
        for ctx in ctxs:
            req = self._request(ctx)
            d = reuse.get(ctx.request_id)
            if d is None:
                d = joined.get(ctx.request_id)
            if min(self.max_tau, ctx.max_tau) and _budget_binds(ctx):
                d = self.next_tau(ctx)
            elif d is None:
                # A request that joined since the plan: the batch's depth, and a plan of its own (its expected
                # tokens by τ) as the batch plan gives each of its requests. Its outcomes are then tested against
                # that plan's rates, derived once (without a plan each outcome derived them afresh: at 16 sequences a
                # third of the records), and its steps' tokens against the plan's (without one, a step holding such a
                # request was left out of the depth calibration). Kept until the next plan, as the plan's own
                # decisions are: a server with more requests than ``max_batch`` rotates its steps over them, and every
                # step of the half the plan had not seen derived each one's plan afresh (32 clients at a batch of 16:
                # the policy's work 0.60-0.71 ms a step against 0.47-0.56 at 16 clients, in process).
                req.steps += 1
                self._plan_in_batch(req, ctx, min(self._batch_horizon(), ctx.max_tau))
                d = Decision(min(self._batch_depth, self.max_tau, ctx.max_tau), f"batch of {n}: joined, at its depth")
                joined[ctx.request_id] = d
                if exploring is not None:
                    d = Decision(
                        min(exploring, self.max_tau, ctx.max_tau), f"batch of {n}: joined, explore; at {exploring}"
                    )
                    explored[ctx.request_id] = d
            else:
                req.steps += 1
                if d.tau > ctx.max_tau:
                    d = Decision(max(0, ctx.max_tau), d.reason, d.rule if ctx.max_tau > 0 else None)
            out.append(d)
        return out

    # -- learning ---------------------------------------------------------------------------

    def prime(self, costs: MeasuredCosts) -> None:
        """Start the batch cost curves from measured figures (each as one observation: steps soon outweigh
        them where they run; sizes never run keep them, which is their point: the cost of 64 rows is known
        before a pass of 64 rows is risked). The measured passes and draft lines also stay as the shapes a plan prices
        with once the steps have measured what they cost beyond them (``ExcessFit``), learnt afresh from new shapes."""
        self.learn()
        batch_costs = self.batch_costs
        batch_costs.set_granule(costs.row_granule if self.row_granule is None else self.row_granule)
        for rows, seconds in costs.passes.items():
            batch_costs.verify.observe(int(rows), float(seconds))
        for sequences, seconds in costs.draft_forwards.items():
            batch_costs.draft_forward.observe(int(sequences), float(seconds))
        lines = {int(n): (float(a), float(b)) for n, (a, b) in costs.draft_lines.items()}
        passes = {int(rows): float(seconds) for rows, seconds in costs.passes.items()}
        if lines != batch_costs.measured_lines or passes != batch_costs.measured_passes:
            batch_costs.measured_lines, batch_costs.measured_passes, batch_costs.excess = (
                lines,
                passes,
                batch_excess_fit(),
            )

    def step_bias(self) -> float:
        """Seconds the recent batch steps measured beyond what their plans priced (their rest less the policy's own work
        in it, that work at its mean a step: ``_learn_from``), 0 until STEP_BIAS_WARM steps' worth is measured.
        Never below 0: curves that price too high (priors, before their sizes are measured) correct themselves as the
        steps run, and a negative bias favours the shortest steps (a batch of 4 without a cost file served 0.64x the
        best fixed τ for a whole load level).

        0 where a step is priced as its measured shapes plus the excess the steps measured beyond them
        (``BatchCosts.shaped_excess``: a server that measured its passes at start, or read a cost file): that excess is
        the steps' cost beyond their prices already, and a constant on top counted it twice. Learnt from a server's
        transients besides (a 20 ms pass where 9 is usual, a round's 16 requests joining at once), it went to +2 ms at
        16 clients and priced every shallow depth as that much dearer: the plans went to depth 7 and their depth's
        calibration kept them there (0.75-0.91x τ = 3 in fresh servers' load tests). Left out there, the policy
        served 1.03-1.33x what it served with it at 4, 16 and 32 clients, all 12 levels of four pairs of fresh servers
        side by side (1 client 0.96-1.19x; docs/policy.md, session 58). Learnt all the same (``_learn_step``)."""
        if not self.use_step_bias or self.batch_costs.shaped_excess:
            return 0.0
        total, weight = self._step_bias
        return max(0.0, total / weight) if weight >= STEP_BIAS_WARM else 0.0

    def _learn_step(self, record: StepRecord, price: float, other: float, tokens: int, expected: float) -> None:
        """A batch step of the plan against its price: the step bias learns what it measured beyond it (decayed by
        STEP_BIAS_DECAY per record it had) and the depth calibration its goodput against the plans' prediction
        (``other``: its rest; ``tokens`` made before stop truncation, what a plan predicts; ``expected``: the plans'
        tokens at each record's τ, nan where a record had none)."""
        predicted = price + self.step_bias()  # as its plan priced it: the bias before this step is in it
        measured = record.draft_time + record.verify_time + other
        if expected > 0.0:  # nan (a record without a plan) compares false
            self.depth_calibration(record.batch_size).observe(
                record.draft_passes, tokens, expected, measured, predicted
            )
        decay = STEP_BIAS_DECAY**record.batch_size
        b = self._step_bias
        b[0] = decay * b[0] + (measured - price)
        b[1] = decay * b[1] + 1.0

    def observe(self, record: StepRecord) -> None:
        """A record alone: a step of its own (a batched step's records come together, ``observe_step``)."""
        self.observe_step((record,))

    def observe_step(self, records: Sequence[StepRecord]) -> None:
        """Learn from a step: what it cost, once (step bias and depth calibration, the batch cost curves, the solo
        costs), then each request's outcome (acceptance rates, shift test, probing, the draft's confidence).

        While a batch plan is being replayed (``plan``) nothing reads what its steps teach, so they are learnt from
        together, in order, when something next does (a plan made afresh, a request's own decision, ``learn``): the
        same updates in the same order, but the second step's on caches the first has warmed, where each step alone
        ran on caches the pass had just emptied (in the engine at 4 sequences, with plans replayed for 8 steps, 0.07 ms
        a step against 0.11 learnt record by record)."""
        if records:
            requests = self._requests
            self._unlearnt.append(([requests.get(r.request_id) for r in records], records))
        if self._batch_steps >= self._reuse_until:
            self.learn()

    def learn(self) -> None:
        """Learn from the steps observed and not learnt from yet (``observe_step``)."""
        if not self._unlearnt:
            return
        steps, self._unlearnt = self._unlearnt, []
        for reqs, records in steps:
            self._learn_from(reqs, records)

    def _learn_from(self, reqs: list[_Request | None], records: Sequence[StepRecord]) -> None:
        step = records[0]  # the step's pass, rows and times: every record carries them
        # Chained plain passes (``Engine.chain_plain``): the step's times are several passes'. A planned one is held
        # against its chained price, as ``plan`` priced it; no cost curve of one pass learns from it (below).
        chained = any(r.target_passes > 1 for r in records)
        steady = steady_rest(records) if step.batch_size > 1 else None  # the record with the step's own rest
        if step.batch_size > 1 and self._batch_planned and steady_draft(step):
            # A step of the batch plan being served, against its price at the rows it ran (a replayed plan's step
            # differs from the plan's), by the curves before its records teach them. Steps with prompt rows or a
            # draft's catch-up are left out: that work is a request's, once, not every step's (``plan`` keeps it out
            # of the goodput too). The step's rest is its own with the policy's work in it at its mean
            # (``BatchCosts.steady_rest_seconds``); taken as priced (2026-11-25 to 26), what the rest grows by with the
            # tokens a step makes (commits, detokenising, a server's messages: 0.15 ms a depth at 16 sequences through
            # the server) was in no depth's measure.
            batch_costs = self.batch_costs
            if steady is None:
                rest = batch_costs.rest(step.batch_size, self.costs)
            else:
                rest = batch_costs.steady_rest_seconds(steady)
            made = tokens_made(records)
            pricer = batch_costs.pricer(step.batch_size, self.costs)
            if chained:
                passes = [r.target_passes for r in records]
                price = chained_plain_price(
                    pricer, batch_costs.priced_rest(step.batch_size, self.costs), step.rows, passes
                )
                expected = float(sum(passes))
            else:
                price = pricer(step.rows, step.draft_passes, step.drafting)
                expected = sum(_expected_tokens(req, r.tau) for req, r in zip(reqs, records))
            self._learn_step(step, price, rest, made, expected)
        if chained:
            self._learn_outcomes(reqs, records)
            return
        self.batch_costs.observe_step(records)  # one-sequence steps too: the low end of the cost curves
        if step.batch_size == 1 and (step.rows or step.tau + 1) == step.tau + 1:  # not a prompt's first step
            # The stop rule keeps the token it stops at, so every forward the drafter ran made a verified token.
            forwards = step.tau if steady_draft(step) else 0  # a switch's catch-up is not a depth's cost
            self.costs.observe(step.tau, forwards, step.draft_time, step.verify_time, step.other_time)
        self._learn_outcomes(reqs, records)

    def _learn_outcomes(self, reqs: Sequence[_Request | None], records: Sequence[StepRecord]) -> None:
        """Each drafted record's outcome, in order: acceptance by position (shared and the request's own), the shift
        test against the rates the step was planned with, a probe's backoff, the A/B of the stop rule, the draft's
        confidence.

        One loop over a step's records: a batch step's learning is 16 records or more of a few positions each, and
        calls, slices and lookups per record were most of it (the policy's work is Python the step's thread runs
        between the kernel's calls, with the GIL held: docs/policy.md, session 60)."""
        glob, buckets, calibration = self.global_rates, self.bucket_rates, self.calibration
        for req, record in zip(reqs, records):
            tau = record.tau
            if not tau:
                continue
            n_accepted = record.n_accepted
            tested = n_accepted + 1 if n_accepted < tau else tau
            if req is not None:
                if req.arm is not None:
                    self.arms.observe(req.arm, len(record.emitted), record.total_time)
                # The rates the step was planned with (the plan's; else derived now, before this outcome is counted).
                plan = req.plan
                if plan is not None and len(plan.rates) >= tested:
                    terms = plan.shift_terms()
                else:
                    terms = _shift_terms(self.rates(req, tested))
            glob.update(tau, n_accepted)
            if req is not None:
                buckets[req.bucket].update(tau, n_accepted)
                req.rates.update(tau, n_accepted)
                self._detect_shift(req, record, terms, tested)
                if req.probing:
                    req.probing = False
                    # All accepted: probe again at once; some: soon; none: back off further.
                    if n_accepted == tau:
                        req.backoff = 1
                    else:
                        req.backoff = self.min_backoff if n_accepted else min(2 * req.backoff, self.max_backoff)
            if record.draft_token_probs:
                calibration.update(record.draft_token_probs, tau, n_accepted)

    def _detect_shift(self, req: _Request, record: StepRecord, terms: list[tuple[float, float]], tested: int) -> None:
        """Two-sided Bernoulli CUSUM on the ``tested`` positions this step tested, against the rates it was planned
        with (``terms``: ``_shift_terms`` of them, the first ``tested`` read; a plan's may hold more): a stretch where
        the draft does much better or worse (code <-> prose) is flagged within 2-3 outcomes, and the request's own
        statistics restart from the steps since the shift began."""
        # The alternative q = σ(logit p ± SHIFT) = p·e^±S / (1 − p + p·e^±S), so the log-likelihood ratios are
        # log(q/p) = ±S − L± for a pass and log((1 − q)/(1 − p)) = −L± for a failure, L± = log(1 + p·(e^±S − 1)).
        up, down = req.cusum_up, req.cusum_down
        passed = record.n_accepted
        for k in range(tested):
            l_up, l_down = terms[k]
            if k < passed:
                up, down = up + SHIFT - l_up, down - SHIFT - l_down
            else:
                up, down = up - l_up, down - l_down
            if up < 0.0:
                up = 0.0
            if down < 0.0:
                down = 0.0
        req.cusum_up, req.cusum_down = up, down
        step = (record.tau, passed)
        if up > 0:
            req.recent_up.append(step)
        elif req.recent_up:
            req.recent_up.clear()
        if down > 0:
            req.recent_down.append(step)
        elif req.recent_down:
            req.recent_down.clear()
        side = req.recent_up if up > CUSUM_H else req.recent_down if down > CUSUM_H else None
        if side is None:
            return
        req.changes += 1
        own = req.rates
        own.prior_weight = REQUEST_PRIOR_SHIFTED
        own.reset()
        for tau, n_acc in side:
            own.update(tau, n_acc)
        req.cusum_up = req.cusum_down = 0.0
        req.recent_up, req.recent_down = [], []

    def end(self, request_id: str, stats: GenerationStats) -> None:
        req = self._requests.pop(request_id, None)
        if stats.finish_reason == "cancelled":
            return
        self.latencies.append(stats.latency)
        # (a request that drafted from a predicted output ran faster than any plan of this policy's foresaw)
        if (
            req is not None
            and req.predicted_latency
            and stats.finish_reason == "length"
            and not stats.prediction_tokens
        ):
            self._latency_ratios.append(stats.latency / req.predicted_latency)

    def slo_attainment(self) -> float | None:
        """Share of recent requests that met the SLO (None without an SLO or requests)."""
        if self.slo_p95_s is None or not self.latencies:
            return None
        return sum(lat <= self.slo_p95_s for lat in self.latencies) / len(self.latencies)


def make_adaptive(
    fleet_budget: float | None = None, budget_window: int = 64, max_share: float = 4.0, **kwargs: Any
) -> Policy:
    """``adaptive``, optionally under a fleet-average budget of ``fleet_budget`` passes per request."""
    policy = AdaptivePolicy(**kwargs)
    if fleet_budget is None:
        return policy
    return FleetBudgetPolicy(policy, fleet_budget, budget_window, max_share)
