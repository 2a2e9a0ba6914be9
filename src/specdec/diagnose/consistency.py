"""Evidence that a trace's output is not what the acceptance rule allows ("fast but wrong").

Two kinds: invariants every correct step satisfies (records.py states them), and a statistical
test of the accept flags against the probabilities recorded with them: in sampling mode each
flag is an independent Bernoulli(min(1, p/q)) (verify.py), so the number of True flags has a
known mean and variance; a count far above it means tokens were accepted that the rule rejects.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.records import RequestSummary, StepRecord, correction_kind
from specdec.trace import Trace

Z_IMPLAUSIBLE = 6.0  # |z| beyond this: a correct engine produces it with probability < 1e-8 (normal tail)


@dataclass
class Violations:
    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)  # kind -> first occurrence, "request r step s: ..."
    checked_steps: int = 0

    def add(self, kind: str, where: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.examples.setdefault(kind, where)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _leading_true(flags: list[bool]) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def _expected_correction(s: StepRecord) -> str:
    return correction_kind(s.tau, s.n_accepted)


# Each invariant: (kind, test returning a description of the breach or None).
STEP_INVARIANTS: dict[str, Callable[[StepRecord], str | None]] = {
    "tau_mismatch": lambda s: (
        f"τ={s.tau} but {len(s.draft_tokens)} draft tokens and {len(s.accept_flags)} accept flags"
        if not len(s.draft_tokens) == len(s.accept_flags) == s.tau
        else None
    ),
    "n_accepted_vs_flags": lambda s: (
        f"n̂={s.n_accepted} but the flags {s.accept_flags} have {_leading_true(s.accept_flags)} leading True"
        if s.n_accepted != _leading_true(s.accept_flags)
        else None
    ),
    "emitted_not_draft_prefix": lambda s: (
        f"emitted {s.emitted[: s.n_accepted]} but accepted drafts were {s.draft_tokens[: s.n_accepted]}"
        if s.emitted[: s.n_accepted] != s.draft_tokens[: min(s.n_accepted, len(s.emitted))]
        else None
    ),
    "too_many_emitted": lambda s: (
        f"{len(s.emitted)} tokens emitted after n̂={s.n_accepted} in {s.target_passes} target pass(es) (at most "
        f"n̂ + passes allowed)"
        if len(s.emitted) > s.n_accepted + s.target_passes
        else None
    ),
    "chained_step_with_drafts": lambda s: (
        f"a step of {s.target_passes} chained target passes drafted τ={s.tau} (only plain steps chain)"
        if s.target_passes > 1 and s.tau
        else None
    ),
    "rejected_token_emitted": lambda s: (
        f"the rejected draft token {s.draft_tokens[s.n_accepted]} was emitted as the correction token"
        if s.n_accepted < s.tau == len(s.draft_tokens)
        and len(s.emitted) > s.n_accepted
        and s.emitted[s.n_accepted] == s.draft_tokens[s.n_accepted]
        else None
    ),
    "wrong_correction_kind": lambda s: (
        f"correction {s.correction!r} but τ={s.tau}, n̂={s.n_accepted} implies {_expected_correction(s)!r}"
        if s.correction != _expected_correction(s)
        else None
    ),
    "flag_vs_probs": lambda s: _flag_vs_probs(s),
}


def _flag_vs_probs(s: StepRecord) -> str | None:
    """With p ≥ q the rule always accepts; with p = 0 it never does."""
    p, q = s.target_token_probs, s.draft_token_probs
    if len(p) != s.tau or len(q) != s.tau:
        return None
    for t, (flag, pt, qt) in enumerate(zip(s.accept_flags, p, q)):
        if flag and pt <= 0:
            return f"position {t + 1} accepted although the target gives the token probability 0"
        if not flag and pt >= qt > 0 and pt > 0:
            return f"position {t + 1} rejected although p={pt:.3g} ≥ q={qt:.3g} (always accepted)"
    return None


def check_steps(trace: Trace) -> Violations:
    out = Violations()
    for req in trace.requests:
        context = None
        for s in req.steps:
            out.checked_steps += 1
            where = f"request {req.request_id} step {s.step}"
            for kind, test in STEP_INVARIANTS.items():
                why = test(s)
                if why:
                    out.add(kind, f"{where}: {why}")
            if context is not None and s.context_len != context:
                out.add("context_gap", f"{where}: context_len {s.context_len} but the previous steps imply {context}")
            context = s.context_len + len(s.emitted)
        _check_summary(req.summary, req.steps, req.request_id, out)
    return out


def _check_summary(summary: RequestSummary | None, steps: list[StepRecord], rid: str, out: Violations) -> None:
    if summary is None or not steps or summary.stats.finish_reason == "cancelled":
        return
    emitted = sum(len(s.emitted) for s in steps)
    if summary.stats.new_tokens != emitted:
        out.add(
            "summary_mismatch",
            f"request {rid}: summary says {summary.stats.new_tokens} new tokens, the steps emitted {emitted}",
        )


@dataclass
class AcceptanceTest:
    """Observed True flags vs the number min(1, p/q) predicts, over positions with recorded probabilities."""

    positions: int
    observed: int
    expected: float
    variance: float

    @property
    def z(self) -> float:
        return (self.observed - self.expected) / math.sqrt(self.variance) if self.variance > 0 else 0.0


def acceptance_test(trace: Trace) -> AcceptanceTest | None:
    observed, expected, variance, n = 0, 0.0, 0.0, 0
    for s in trace.steps:
        p, q = s.target_token_probs, s.draft_token_probs
        if len(p) != s.tau or len(q) != s.tau or s.tau == 0:
            continue
        for flag, pt, qt in zip(s.accept_flags, p, q):
            m = 0.0 if pt <= 0 else (1.0 if qt <= 0 else min(1.0, pt / qt))
            observed += int(bool(flag))
            expected += m
            variance += m * (1 - m)
            n += 1
    if n == 0:
        return None
    return AcceptanceTest(positions=n, observed=observed, expected=expected, variance=variance)
