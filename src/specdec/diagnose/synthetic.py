"""Synthetic traces with one planted fault each, for tests and for trying ``specdec diagnose`` out.

Every trace is made of real ``StepRecord``/``RequestSummary`` objects written through ``JsonlTrace``,
so it follows the current schema. Faults (``FAULTS``): a healthy run and one run per cause diagnose
must recognise.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

from specdec.records import GenerationStats, RequestSummary, StepRecord, correction_kind
from specdec.trace import JsonlTrace


@dataclass(frozen=True)
class Scenario:
    alpha_short: float = 0.72  # per-position acceptance probability on short prompts
    alpha_long: float = 0.72  # ... on prompts of LONG_PROMPT tokens or more
    t1: float = 0.005  # seconds per one-token target pass
    serial: float = 0.03  # extra verify cost per extra block token, in passes
    c: float = 0.05  # draft cost per token, in passes
    other: float = 0.0002  # seconds of host work per step
    temperature: float = 0.8
    emit_rejected: bool = False  # plant: append the rejected draft token after a rejection
    accept_all: bool = False  # plant: accept every draft token whatever p/q says


LONG_PROMPT = 512
FAULTS: dict[str, Scenario] = {
    "healthy": Scenario(),
    "long_prompt": Scenario(alpha_short=0.78, alpha_long=0.08),
    "serial_verify": Scenario(serial=1.0),
    "slow_draft": Scenario(alpha_short=0.6, alpha_long=0.6, c=0.9),
    "weak_draft": Scenario(alpha_short=0.03, alpha_long=0.03),
    "host_overhead": Scenario(other=0.012),
    "inconsistent": Scenario(emit_rejected=True),
    "accept_all": Scenario(accept_all=True),
}
PROMPT_LENS = (24, 40, 90, 130, 200, 600, 700, 900, 1200, 1500)


def write_synthetic_trace(
    path: str | Path,
    fault: str = "healthy",
    seed: int = 0,
    requests: int = 10,
    steps_per_request: int = 40,
    greedy: bool = False,
) -> Path:
    """Write a trace with ``fault`` planted (a key of ``FAULTS``) and return its path."""
    sc = FAULTS[fault]
    if greedy:
        sc = replace(sc, temperature=0.0)
    rng = random.Random(seed)
    path = Path(path)
    with JsonlTrace(path, meta={"synthetic": fault, "seed": seed}) as trace:
        for r in range(requests):
            _request(trace, sc, rng, f"req{r}", PROMPT_LENS[r % len(PROMPT_LENS)], steps_per_request)
    return path


def _request(trace: JsonlTrace, sc: Scenario, rng: random.Random, rid: str, prompt_len: int, n_steps: int) -> None:
    alpha = sc.alpha_long if prompt_len >= LONG_PROMPT else sc.alpha_short
    stats = GenerationStats(prompt_tokens=prompt_len)
    context = prompt_len
    for step in range(n_steps):
        tau = 4 if rng.random() < 0.7 else rng.randrange(0, 4)  # some shorter blocks, as at request ends
        rec = _step(sc, rng, rid, step, prompt_len, context, tau, alpha)
        context += len(rec.emitted)
        stats.add(rec)
        trace.on_step(rec)
    stats.latency = stats.draft_time + stats.verify_time + stats.other_time + 0.01
    stats.prefill_time = 0.01
    trace.on_request(
        RequestSummary(
            request_id=rid,
            policy="fixed",
            prompt_len=prompt_len,
            stats=stats,
            settings={"temperature": sc.temperature},
            prompt_ids=[1] * prompt_len,
        )
    )


def _step(
    sc: Scenario, rng: random.Random, rid: str, step: int, prompt_len: int, context: int, tau: int, alpha: float
) -> StepRecord:
    drafts = [rng.randrange(10, 300) for _ in range(tau)]
    q = [rng.uniform(0.2, 0.9) for _ in range(tau)]
    ratio = [min(1.5, max(0.0, rng.gauss(alpha, 0.15))) for _ in range(tau)]  # p/q per position
    p = [qi * m for qi, m in zip(q, ratio)]
    flags = [rng.random() < min(1.0, m) for m in ratio]
    if sc.accept_all:
        flags = [True] * tau
        p = [qi * 0.3 for qi in q]  # the target disagrees: a correct rule would accept ~30%
    n = next((i for i, f in enumerate(flags) if not f), tau)
    correction = rng.randrange(300, 320)  # never equal to a draft token
    emitted = drafts[:n] + [correction]
    if sc.emit_rejected and n < tau:
        emitted = drafts[: n + 1] + [correction]
    noise = rng.uniform(0.95, 1.05)
    greedy = sc.temperature == 0
    return StepRecord(
        request_id=rid,
        step=step,
        prompt_len=prompt_len,
        context_len=context,
        policy="fixed",
        reason="fixed τ",
        tau=tau,
        draft_tokens=drafts,
        accept_flags=flags,
        n_accepted=n,
        correction=correction_kind(tau, n),
        emitted=emitted,
        draft_time=tau * sc.c * sc.t1 * rng.uniform(0.9, 1.1),
        verify_time=sc.t1 * (1 + sc.serial * tau) * noise,
        other_time=sc.other * rng.uniform(0.8, 1.2),
        draft_token_probs=[] if greedy else q,
        target_token_probs=[] if greedy else p,
    )
