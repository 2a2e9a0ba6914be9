"""Shipped workloads: an acceptance process, request lengths, and optional budget / SLO."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from specdec.errors import InvalidRequestError
from specdec.simulate.processes import (
    IID,
    AcceptanceProcess,
    Decaying,
    PerRequest,
    Phases,
    PromptRegime,
    Replay,
    SimRequest,
)

Lengths = Callable[[random.Random, int], tuple[int, int, int]]  # (rng, index) -> (prompt_len, max_new, length)


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # stationary | switching | useless | scenario | replay
    description: str
    process: Callable[[int], AcceptanceProcess]  # seed -> a fresh process
    lengths: Lengths
    requests: int = 60
    fleet_budget: float | None = None  # average target passes per request, over a window of budget_window
    budget_window: int = 32
    max_verify_passes: int | None = None
    slo_s: float | None = None  # p95 end-to-end latency target
    cost: str | None = None  # the cost model this workload is about (default: the command's)

    def make_requests(self, seed: int) -> list[SimRequest]:
        rng = random.Random(f"{self.name}/{seed}/requests")
        out, offset = [], 0
        for i in range(self.requests):
            prompt_len, max_new, length = self.lengths(rng, i)
            out.append(SimRequest(i, prompt_len, max_new, length, offset))
            offset += min(max_new, length)
        return out


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, median * math.exp(rng.gauss(0.0, sigma)))))


def chat_lengths(rng: random.Random, i: int) -> tuple[int, int, int]:
    """Prompts around 300 tokens; 96 new tokens asked, a quarter of requests stop earlier by EOS."""
    prompt = _lognormal(rng, 300, 0.8, 8, 3000)
    length = rng.randint(24, 96) if rng.random() < 0.25 else 10**9
    return prompt, 96, length


def mixed_prompt_lengths(rng: random.Random, i: int) -> tuple[int, int, int]:
    """Half short prompts (~300 tokens), half long ones (~2,000)."""
    prompt = _lognormal(rng, 300, 0.5, 8, 1000) if rng.random() < 0.5 else _lognormal(rng, 2000, 0.4, 1024, 8000)
    return prompt, 96, 10**9


def assistant_lengths(rng: random.Random, i: int) -> tuple[int, int, int]:
    """Writing-assistant suggestions: at most 8 tokens (often fewer); 30% of prompts are long documents."""
    prompt = _lognormal(rng, 400, 0.5, 16, 1000) if rng.random() < 0.7 else _lognormal(rng, 2500, 0.4, 1024, 8000)
    return prompt, 8, rng.randint(3, 8)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload("iid-0.6", "stationary", "i.i.d. acceptance α = 0.6", lambda s: IID(0.6), chat_lengths),
        Workload("iid-0.8", "stationary", "i.i.d. acceptance α = 0.8", lambda s: IID(0.8), chat_lengths),
        Workload("iid-0.9", "stationary", "i.i.d. acceptance α = 0.9", lambda s: IID(0.9), chat_lengths),
        Workload(
            "decaying",
            "stationary",
            "per-position decay α_k = 0.95·0.92^(k-1)",
            lambda s: Decaying(0.95, 0.92),
            chat_lengths,
        ),
        Workload(
            "long-prompts",
            "switching",
            "α 0.8 on prompts < 1024 tokens, 0.4 on longer ones (half each)",
            lambda s: PromptRegime(IID(0.8), IID(0.4)),
            mixed_prompt_lengths,
        ),
        Workload(
            "phases",
            "switching",
            "α switches 0.9 ↔ 0.2 in phases of ~48 tokens (code ↔ prose)",
            lambda s: Phases((0.9, 0.2), 48.0, seed=s),
            chat_lengths,
        ),
        Workload(
            "mixed-requests",
            "switching",
            "each request draws α ~ U(0.05, 0.95) (the default pair measured 0.02-0.94 by prompt)",
            lambda s: PerRequest(0.05, 0.95),
            chat_lengths,
        ),
        Workload("useless", "useless", "a useless draft: α = 0.02", lambda s: IID(0.02), chat_lengths),
        Workload(
            "writing-assistant",
            "scenario",
            "≤ 8-token suggestions, 30% long prompts (first rejection at token 2-3), B = 2, p95 < 250 ms",
            lambda s: PromptRegime(Decaying(0.9, 0.97), Decaying(0.6, 0.85)),
            assistant_lengths,
            requests=200,
            fleet_budget=2.0,
            budget_window=32,
            slo_s=0.25,
            cost="gpu-70b",
        ),
    ]
}


def load_test_lengths(rng: random.Random, i: int) -> tuple[int, int, int]:
    """The load test's requests: short prompts (~60 tokens), 64 new tokens asked, a tenth stop earlier by EOS."""
    prompt = _lognormal(rng, 60, 0.6, 8, 512)
    length = rng.randint(16, 63) if rng.random() < 0.1 else 10**9
    return prompt, 64, length


# Workloads about serving load (``simulate --arrivals``, the batched goals): kept apart from WORKLOADS, whose
# goals and default table are about one request at a time.
LOAD_WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload(
            "load-mixed",
            "load",
            "the load test's shape: 64-token requests, ~60-token prompts, α per request ~ U(0.05, 0.95)",
            lambda s: PerRequest(0.05, 0.95),
            load_test_lengths,
            requests=64,
        ),
        Workload(
            "load-0.8",
            "load",
            "the load test's shape with i.i.d. acceptance α = 0.8 (a draft that pays more)",
            lambda s: IID(0.8),
            load_test_lengths,
            requests=64,
        ),
    ]
}


def replay_workload(trace: str) -> Workload:
    """A workload replaying a recorded JSONL trace: its prompts, lengths and acceptance, in order."""
    proc = Replay.from_trace(trace)
    recs = proc.requests

    def lengths(rng: random.Random, i: int) -> tuple[int, int, int]:
        rec = recs[i % len(recs)]
        return rec["prompt_len"], max(1, rec["new_tokens"]), 10**9

    return Workload(
        f"replay:{trace}",
        "replay",
        f"replay of {len(recs)} recorded requests",
        lambda s: proc,
        lengths,
        requests=len(recs),
    )


def get_workload(name: str) -> Workload:
    if name in WORKLOADS:
        return WORKLOADS[name]
    if name in LOAD_WORKLOADS:
        return LOAD_WORKLOADS[name]
    if name.startswith("replay:"):
        return replay_workload(name[len("replay:") :])
    raise InvalidRequestError(
        f"unknown workload {name!r}: use one of {', '.join([*WORKLOADS, *LOAD_WORKLOADS])} or replay:TRACE.jsonl",
        "workload",
    )
