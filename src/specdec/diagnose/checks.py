"""The checks: each reads the trace's aggregates and returns findings with evidence and an action.

Ranking: correctness findings first; performance findings by ``impact``, the estimated fraction
of decode time that fixing the cause would save.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from specdec.diagnose.analysis import BatchDepths, Bucket, TraceStats
from specdec.diagnose.consistency import Z_IMPLAUSIBLE, acceptance_test, check_steps
from specdec.trace import Trace

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
MIN_DRAFTED = 40  # drafted tokens before acceptance figures are trusted
SERIAL_CRITICAL, SERIAL_WARNING = 0.5, 0.3  # extra verify cost per extra block token, in one-token passes
HOST_CRITICAL, HOST_WARNING = 0.4, 0.25  # share of step time outside the two models
WEAK_LENGTH = 1.3  # a free draft would save < 1 - 1/1.3 of the passes: the draft is the problem, not its cost
MIN_DEPTH_STEPS = 20  # batched steps of one batch size and depth before their goodput is compared
DEPTH_GAP = 0.10  # another depth of the same batch size served this much more: worth a warning
SAME_DEPTH_GAP = 0.05  # a policy's batched steps served this much less than a fixed τ's at the same depths: a warning


@dataclass
class Finding:
    code: str
    severity: str  # critical | warning | info
    title: str
    evidence: list[str]
    action: str
    impact: float = 0.0  # estimated fraction of decode time lost to this cause (0..1); correctness: 1
    correctness: bool = False

    def rank_key(self) -> tuple[int, int, float]:
        return (0 if self.correctness else 1, SEVERITY_ORDER[self.severity], -self.impact)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Context:
    trace: Trace
    stats: TraceStats
    found: dict[str, Finding] = field(default_factory=dict)  # earlier checks' findings, by code


def _sev(impact: float, critical: float = 0.2, warning: float = 0.08) -> str:
    return "critical" if impact >= critical else ("warning" if impact >= warning else "info")


def check_consistency(ctx: Context) -> list[Finding]:
    v = check_steps(ctx.trace)
    if not v.total:
        return []
    evidence = [f"{n} step(s): {kind.replace('_', ' ')}; first: {v.examples[kind]}" for kind, n in v.counts.items()]
    return [
        Finding(
            code="inconsistent_trace",
            severity="critical",
            correctness=True,
            impact=1.0,
            title="Output inconsistent with the acceptance rule: tokens were emitted that verification did not accept",
            evidence=[f"{v.total} violation(s) in {v.checked_steps} steps", *evidence],
            action="Do not trust this configuration's output: run `specdec audit` with the same model options to "
            "compare against target-only decoding, and fix the verify/commit path before measuring speed.",
        )
    ]


def check_acceptance_plausibility(ctx: Context) -> list[Finding]:
    test = acceptance_test(ctx.trace)
    st = ctx.stats
    if test is not None and test.positions >= MIN_DRAFTED and abs(test.z) >= Z_IMPLAUSIBLE:
        high = test.z > 0
        return [
            Finding(
                code="implausible_acceptance" if high else "implausibly_low_acceptance",
                severity="critical" if high else "warning",
                correctness=high,
                impact=1.0 if high else 0.1,
                title=(
                    "Acceptance implausibly high for the recorded probabilities (accepted what the rule rejects)"
                    if high
                    else "Acceptance far below what the recorded probabilities imply"
                ),
                evidence=[
                    f"{test.observed} of {test.positions} draft positions accepted; the recorded p and q "
                    f"predict {test.expected:.1f} ± {test.variance**0.5:.1f} (z = {test.z:+.1f}, a correct "
                    "engine exceeds |z| = 6 with probability < 1e-8)",
                    f"mean q(ŷ) = {_mean_prob(ctx, 'draft_token_probs'):.2f}, "
                    f"mean p(ŷ) = {_mean_prob(ctx, 'target_token_probs'):.2f}",
                ],
                action=(
                    "Run `specdec audit --temperature T` with this configuration: the acceptance test is not "
                    "r ≤ p/q, so the output is not distributed as the target's."
                    if high
                    else "Check that the draft distribution used to sample the draft is the one passed to the "
                    "acceptance test (same temperature/top-k/top-p); run `specdec audit`."
                ),
            )
        ]
    greedy_only = st.temperatures == {0.0} or (test is None and not st.temperatures)
    if greedy_only and st.drafted >= 100 and st.alpha >= 0.98:
        return [
            Finding(
                code="implausible_acceptance",
                severity="warning",
                impact=0.05,
                title="Acceptance implausibly high: nearly every draft token accepted",
                evidence=[
                    f"α = {st.alpha:.3f} over {st.drafted} drafted tokens ({st.draft_steps} steps)",
                    "plausible only when the draft is (nearly) the target itself or the output repeats text the "
                    "drafter copies; an acceptance test that accepts everything looks the same",
                ],
                action="Run `specdec audit` with this configuration to confirm the output equals target-only decoding.",
            )
        ]
    return []


def _mean_prob(ctx: Context, key: str) -> float:
    vals = [x for s in ctx.trace.steps for x in getattr(s, key)]
    return statistics.fmean(vals) if vals else 0.0


def check_serial_verify(ctx: Context) -> list[Finding]:
    if not ctx.stats.costs_readable:
        return []
    fit = ctx.stats.fit
    sigma = fit.serial_fraction()
    if sigma is None or sigma < SERIAL_WARNING:
        return []
    st = ctx.stats
    excess = sum(max(0.0, s.verify_time - st.t1) for s in st.timed_steps)
    impact = excess / st.total_time if st.total_time else 0.0
    ks = sorted(k for k in fit.medians if fit.counts[k] >= 3)
    table = ", ".join(f"k={k}: {fit.medians[k] * 1e3:.2f} ms" for k in ks)
    return [
        Finding(
            code="serial_verify",
            severity="critical" if sigma >= SERIAL_CRITICAL else "warning",
            impact=impact,
            title="Verification is not parallel: verify time grows roughly linearly with the block size",
            evidence=[
                f"median verify time by block size k = τ+1: {table}",
                f"each extra block token costs {sigma:.2f}× a one-token pass (parallel verify: ≈0.0–0.04 in "
                "bf16, ≤0.15 in fp32; token-by-token: ≈1.0)",
                f"{impact:.0%} of decode time is verify time beyond one pass",
            ],
            action="The target is evaluated token by token or the KV-cache path re-runs the context: check that the "
            "runtime feeds the whole block [last, ŷ1..ŷτ] in one forward and appends to (not rebuilds) the cache; "
            "use bf16 or a runtime with batched attention over the block.",
        )
    ]


def long_prompt_split(ctx: Context) -> tuple[Bucket, Bucket] | None:
    """Shorter | longer prompts split where acceptance drops most (both sides merged: more data per side,
    and the threshold found is where the collapse starts)."""
    buckets = [b for b in ctx.stats.prompt_buckets if b.drafted >= MIN_DRAFTED / 2]
    if len(buckets) < 2:
        return None
    splits = [(_merge(buckets[:i]), _merge(buckets[i:])) for i in range(1, len(buckets))]
    return max(splits, key=lambda lr: lr[0].alpha - lr[1].alpha)


def check_long_prompts(ctx: Context) -> list[Finding]:
    split = long_prompt_split(ctx)
    if split is None:
        return []
    short, long_ = split
    drop = short.alpha - long_.alpha
    if not (short.alpha >= 0.3 and drop >= 0.2 and long_.alpha <= 0.6 * short.alpha):
        return []
    lost = 1 - long_.mean_accepted_length / short.mean_accepted_length if short.mean_accepted_length else 0.0
    total = sum(b.time for b in ctx.stats.prompt_buckets)
    impact = lost * (long_.time / total) if total else 0.0
    per = "; ".join(f"{b.label} tokens: α={b.alpha:.2f} ({len(b.requests)} req)" for b in ctx.stats.prompt_buckets)
    return [
        Finding(
            code="long_prompt_collapse",
            severity=_sev(max(impact, 0.2 if drop >= 0.4 else 0.1)),
            impact=impact,
            title="Acceptance collapses on long prompts while short prompts are fine",
            evidence=[
                f"prompts {short.label} tokens: α = {short.alpha:.2f} ({short.drafted} drafted); prompts "
                f"{long_.label} tokens: α = {long_.alpha:.2f} ({long_.drafted} drafted)",
                f"acceptance by prompt length: {per}",
                f"tokens per pass {short.mean_accepted_length:.2f} → {long_.mean_accepted_length:.2f}: "
                f"≈{impact:.0%} of decode time lost on the long prompts",
            ],
            action=f"Use a prompt-length-aware τ: draft less (or fall back to τ=0) above ≈{long_.lo} prompt tokens; "
            "longer-term, train/distil the draft on contexts as long as the workload's.",
        )
    ]


def _merge(buckets: list[Bucket]) -> Bucket:
    out = Bucket(
        label=f"{buckets[0].lo}-{buckets[-1].hi - 1}" if buckets[-1].hi < 1 << 62 else f"{buckets[0].lo}+",
        lo=buckets[0].lo,
        hi=buckets[-1].hi,
    )
    for b in buckets:
        out.drafting += b.drafting
        out.time += b.time
        out.requests |= b.requests
    return out


def check_host_overhead(ctx: Context) -> list[Finding]:
    if not ctx.stats.costs_readable:
        return []
    st = ctx.stats
    share = st.other_time / st.total_time if st.total_time else 0.0
    if share < HOST_WARNING:
        return []
    evidence = [
        f"{share:.0%} of step time is outside the draft and target forwards (draft "
        f"{st.draft_time / st.total_time:.0%}, verify {st.verify_time / st.total_time:.0%})",
        f"median other time per step {st.other_per_step * 1e3:.2f} ms vs one target pass {st.t1 * 1e3:.2f} ms",
    ]
    if st.policy_time > 0:  # traces written before policy_time carry 0
        evidence.append(
            f"of it, the policy's own work (its plans and learning) {st.policy_time / st.total_time:.0%} of step time"
        )
    if st.concurrent:
        evidence.append(
            "requests were interleaved: a step's other time includes time spent on other requests "
            "between its steps, so part of this is scheduling, not per-step overhead"
        )
    return [
        Finding(
            code="host_overhead",
            severity="critical" if share >= HOST_CRITICAL else "warning",
            impact=share - 0.05,
            title="Host overhead dominates: time outside the two models' forwards",
            evidence=evidence,
            action="Profile the step outside the forwards (policy, detokenising, stop-string checks, Python "
            "bookkeeping, device syncs); stream text less often, move work off the decode loop, or use a "
            "runtime with fewer per-step host operations.",
        )
    ]


def check_economics(ctx: Context) -> list[Finding]:
    if not ctx.stats.costs_readable:
        return []
    st = ctx.stats
    c = st.c
    if st.drafted < MIN_DRAFTED or c is None:
        return []
    tau = max(1, round(st.mean_tau))
    L = st.mean_accepted_length
    draft_cost, verify_excess = tau * c, st.fit.v(tau + 1) - 1
    model = L / (1 + draft_cost + verify_excess)
    achieved = st.achieved_speedup()
    loses = model < 1.0 or (achieved is not None and achieved < 0.95)
    barely = model < 1.1 or (achieved is not None and achieved < 1.05)
    if not (loses or barely):
        return []
    severity = "critical" if loses else "warning"
    if "serial_verify" in ctx.found and verify_excess > draft_cost:
        return []  # the verify path, not the draft, is what makes speculation lose
    split = long_prompt_split(ctx) if "long_prompt_collapse" in ctx.found else None
    if split is not None and split[0].mean_accepted_length / (1 + draft_cost + verify_excess) >= 1.0:
        return []  # short prompts pay: the long prompts are the cause, reported above
    breakeven_c = max(0.0, (L - 1 - verify_excess) / tau)
    speed = f"achieved ≈{achieved:.2f}× plain decoding" if achieved is not None else "achieved speedup unknown"
    evidence = [
        f"α = {st.alpha:.2f} at mean τ = {st.mean_tau:.1f}: {L:.2f} tokens per target pass (incl. the "
        "correction token)",
        f"draft cost c = {c:.2f} target passes per draft token (median of per-step ratios; typical "
        f"{(st.draft_cost_per_token or 0) * 1e3:.2f} ms per draft token, {st.t1 * 1e3:.2f} ms per target pass); "
        f"one step costs {1 + draft_cost + verify_excess:.2f} passes",
        f"estimated speedup {model:.2f}× from α and c ({speed}); break-even needs c < {breakeven_c:.2f} "
        "at this acceptance",
    ]
    prompts = [r.prompt_len for r in ctx.trace.requests]
    if prompts and statistics.median(prompts) >= 256:
        evidence.append(
            f"prompts are long (median {statistics.median(prompts):.0f} tokens): if short prompts "
            "accept more, the draft degrades with context length"
        )
    impact = max(0.0, 1 - (achieved if achieved is not None else model))
    floor = 0.2 if loses else 0.08
    if L < WEAK_LENGTH:
        return [
            Finding(
                code="draft_too_weak",
                severity=severity,
                impact=max(impact, floor),
                evidence=evidence,
                title="Draft too weak for its cost: it rarely predicts the target, so speculation cannot pay",
                action="Fall back to plain decoding (τ=0 / --no-draft) or an adaptive policy that stops drafting; use a "
                "draft trained or distilled on the target's outputs and data (or prompt lookup for repetitive "
                "text).",
            )
        ]
    return [
        Finding(
            code="draft_too_slow",
            severity=severity,
            impact=max(impact, floor),
            evidence=evidence,
            title="Draft too slow for its acceptance: draft cost per token exceeds what acceptance pays back",
            action=f"Use a smaller/faster draft (c below ≈{breakeven_c:.2f}), a smaller τ, or fall back to plain "
            "decoding (τ=0); run the draft in a cheaper dtype/runtime.",
        )
    ]


def check_tau_choice(ctx: Context) -> list[Finding]:
    if not ctx.stats.costs_readable:
        return []
    st = ctx.stats
    skip = {"draft_too_weak", "draft_too_slow", "implausible_acceptance", "inconsistent_trace"}
    if st.drafted < MIN_DRAFTED or st.c is None or skip & set(ctx.found):
        return []
    tau = max(1, round(st.mean_tau))
    options = {t: st.model_speedup(t, with_overhead=True) for t in range(0, max(9, tau + 1))}
    best = max(options, key=lambda t: options[t])
    gain = options[best] / options[tau] - 1
    if best == tau or gain < 0.05:
        return []
    return [
        Finding(
            code="tau_suboptimal",
            severity="warning" if gain >= 0.15 else "info",
            impact=gain / (1 + gain),
            title=f"τ={tau} is not the best draft length for this acceptance and cost (τ≈{best} is)",
            evidence=[
                f"per-position acceptance: {', '.join(f'{a:.2f}' for a in st.conditional_acceptance()[:8])}",
                f"modelled speedup τ={tau}: {options[tau]:.2f}×, τ={best}: {options[best]:.2f}× (c = {st.c:.2f})",
            ],
            action=f"Use --tau {best} or an adaptive policy.",
        )
    ]


def check_batch_depths(ctx: Context) -> list[Finding]:
    """A batching server's trace: the goodput each lockstep depth served at the batch size most steps ran, from the
    steps themselves, policy by policy. The depths a policy chose are run in the conditions it chose them in (harder
    stretches, other loads), so a gap is a lead to compare with a fixed τ, not a verdict. Where the trace holds a
    fixed τ's steps beside a policy's (a load test's modes), the two are also compared at the depths both ran."""
    batch = ctx.stats.batch
    if batch is None:
        return []
    several = len(batch.policies) > 1
    # The depths a policy chose (a fixed τ's steps are only read for their depths when nothing else chose any).
    choosing = [p for p in batch.policies if p != "fixed"] or batch.policies
    depths = [f for p in choosing for f in _depths_of(batch, p, several)]
    beside = [f for p in choosing if "fixed" in batch.policies and p != "fixed" for f in _beside_fixed(batch, p)]
    # One finding of each kind (a diagnosis keeps one per code): the policy's that weighs most.
    return [max(found, key=lambda f: (f.severity != "info", f.impact)) for found in (depths, beside) if found]


def _depths_of(batch: BatchDepths, policy: str, several: bool) -> list[Finding]:
    """One policy's steps by depth: did it run mostly at the depth that served best?"""
    n, rows = batch.sequences, batch.of(policy)
    enough = [g for g in rows if g.steps >= MIN_DEPTH_STEPS]
    if not enough:
        return []
    who = f"{policy}'s " if several else ""
    evidence = [
        f"{who}batches of {n} ({sum(g.steps for g in rows)} steps without prompt rows; {batch.all_steps} at every "
        "size, every policy): "
        + ", ".join(f"depth {g.depth} {g.tokens_per_ms:.2f} tokens/ms over {g.steps} steps" for g in rows)
    ]
    most = max(rows, key=lambda g: g.steps)
    best = max(enough, key=lambda g: g.tokens_per_ms)
    gap = best.tokens_per_ms / most.tokens_per_ms - 1 if most.tokens_per_ms > 0 else 0.0
    if gap < DEPTH_GAP:  # the most run depth is among ``enough`` (some depth is): gap 0 where it is the best
        return [
            Finding(
                code="batch_depths",
                severity="info",
                title=f"Batched steps by depth{f' ({policy})' if several else ''}: the most run (depth {most.depth}) "
                f"served within {DEPTH_GAP:.0%} of the best",
                evidence=evidence,
                action="No action needed for this line.",
            )
        ]
    impact = 1 - most.tokens_per_ms / best.tokens_per_ms
    return [
        Finding(
            code="batch_depths",
            severity=_sev(impact, critical=0.25, warning=DEPTH_GAP * 0.9),
            impact=impact,
            title=(
                f"{f'{policy} batches' if several else 'Batches'} of {n} ran mostly at depth {most.depth}, which "
                f"served {impact:.0%} less than depth {best.depth} in the same trace"
            ),
            evidence=evidence,
            action=(
                f'Compare with a fixed τ ("speculative": {{"tau": {best.depth}}}, or specdec serve --tau); if it serves '
                "more, re-measure the policy's batch costs (specdec tune --threads auto --save-costs) and read the "
                "batch plans' reasons (each depth's predicted tokens/ms and its steps' measured/predicted factor)."
            ),
        )
    ]


def _beside_fixed(batch: BatchDepths, policy: str) -> list[Finding]:
    """A policy's steps against a fixed τ's at the same depths (each depth's steps weighed by the policy's count): what
    the policy makes of a step, the time its passes take and the rest of its steps (where its own work is)."""
    fixed = {g.depth: g for g in batch.of("fixed") if g.steps >= MIN_DEPTH_STEPS}
    pairs = [(g, fixed[g.depth]) for g in batch.of(policy) if g.steps >= MIN_DEPTH_STEPS and g.depth in fixed]
    if not pairs:
        return []
    weight = sum(g.steps for g, _ in pairs)
    ratio = sum(g.steps * g.tokens_per_ms / f.tokens_per_ms for g, f in pairs if f.tokens_per_ms > 0) / weight
    rest = sum(g.steps * (g.rest_ms_per_step - f.rest_ms_per_step) for g, f in pairs) / weight
    tokens = sum(g.steps * (g.tokens_per_step / f.tokens_per_step - 1) for g, f in pairs if f.tokens_per_step) / weight
    passes = (
        sum(g.steps * (g.pass_ms_per_step / f.pass_ms_per_step - 1) for g, f in pairs if f.pass_ms_per_step) / weight
    )
    evidence = [
        f"batches of {batch.sequences}, depth {g.depth}: {policy} {g.tokens_per_ms:.2f} tokens/ms over {g.steps} steps "
        f"({g.tokens_per_step:.2f} tokens, {g.pass_ms_per_step:.3f} ms of draft and pass, "
        f"{g.rest_ms_per_step:.3f} ms of rest a step), fixed τ {f.tokens_per_ms:.2f} over {f.steps} "
        f"({f.tokens_per_step:.2f}, {f.pass_ms_per_step:.3f} ms, {f.rest_ms_per_step:.3f} ms)"
        for g, f in pairs
    ]
    gap = 1 - ratio
    if gap < SAME_DEPTH_GAP:
        return [
            Finding(
                code="batch_beside_fixed",
                severity="info",
                title=f"At the depths both ran, {policy}'s batched steps served {ratio:.2f}x a fixed τ's",
                evidence=evidence,
                action="No action needed for this line.",
            )
        ]
    # Which of the step's parts the gap is in: tokens a step (its drafts), the draft and pass (its rows), or the rest.
    parts = {
        "its steps made fewer tokens": -tokens,
        "its drafts and passes took longer": passes,
        f"the rest of its steps took {rest:.3f} ms longer (the policy's own work is there)": rest
        / max(f.ms_per_step for _, f in pairs),
    }
    cause = max(parts, key=lambda k: parts[k])
    return [
        Finding(
            code="batch_beside_fixed",
            severity=_sev(gap, critical=0.25, warning=SAME_DEPTH_GAP * 0.9),
            impact=gap,
            title=f"At the same depths {policy}'s batched steps served {gap:.0%} less than a fixed τ's: {cause}",
            evidence=evidence,
            action=(
                "Where the rest is longer, the policy's per-step work (its plan and learning) costs more than its "
                'choices gain at this load: a fixed τ at the depth it runs most saves it ("speculative": {"tau": '
                f"{max(pairs, key=lambda p: p[0].steps)[0].depth}}}); benchmarks/engine_steps.py --by-depth measures "
                "the same split in process, without HTTP."
            ),
        )
    ]


def summary_finding(ctx: Context) -> list[Finding]:
    """An info line with the headline figures, always present."""
    st = ctx.stats
    achieved = st.achieved_speedup()
    c = f"{st.c:.2f}" if st.c is not None else "n/a"
    return [
        Finding(
            code="summary",
            severity="info",
            impact=0.0,
            title="Headline figures",
            evidence=[
                f"{st.n_requests} request(s), {len(st.steps)} steps, {st.emitted} tokens; α = {st.alpha:.2f}, "
                f"{st.mean_accepted_length:.2f} tokens per pass (incl. correction), c = {c}",
                (
                    f"costs from the {len(st.timed_steps)} steps of one sequence (batched steps share their passes: "
                    "batch_depths reads them); "
                    if len(st.timed_steps) < len(st.steps)
                    else ""
                )
                + f"time split: draft {_pct(st.draft_time, st.total_time)}, verify {_pct(st.verify_time, st.total_time)}"
                f", other {_pct(st.other_time, st.total_time)}"
                + (f"; estimated speedup vs plain decoding ≈{achieved:.2f}×" if achieved is not None else ""),
            ],
            action="No action needed for this line.",
        )
    ]


def _pct(a: float, b: float) -> str:
    return f"{a / b:.0%}" if b else "n/a"


# Order matters: later checks read earlier findings (economics defers to a specific cause).
CHECKS: dict[str, Callable[[Context], list[Finding]]] = {
    "consistency": check_consistency,
    "acceptance_plausibility": check_acceptance_plausibility,
    "serial_verify": check_serial_verify,
    "long_prompts": check_long_prompts,
    "host_overhead": check_host_overhead,
    "economics": check_economics,
    "tau_choice": check_tau_choice,
    "batch_depths": check_batch_depths,
    "summary": summary_finding,
}
