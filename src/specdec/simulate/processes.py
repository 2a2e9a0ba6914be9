"""Acceptance processes: the chance that draft position k is accepted, given what came before.

A process answers ``rate(state, start, k)``: the conditional acceptance of the k-th draft token
(1-based) of a step that starts at output position ``start`` of a request. Draft confidence (the
draft's probability of its token, which early-stopping policies read) is an assumed model:
accepted tokens have confidence ~ Beta(4, 1.5) (mean 0.73), rejected ones ~ Beta(1.5, 3) (mean 0.33).
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.analysis import StepAggregate
from specdec.errors import InvalidRequestError
from specdec.trace import read_trace


@dataclass
class SimRequest:
    index: int
    prompt_len: int
    max_new_tokens: int
    length: int  # tokens until the request would stop by itself (EOS); ≥ max_new_tokens: runs to length
    offset: int = 0  # tokens emitted by earlier requests (for processes that drift in time)
    data: Any = None  # per-request draw of the process (e.g. its own α)


REPLAY_DEPTH = 64  # draft positions whose acceptance a replayed trace estimates
CONFIDENCE_IF_ACCEPTED = (4.0, 1.5)  # Beta parameters of the draft's top probability for a token that passes
CONFIDENCE_IF_REJECTED = (1.5, 3.0)  # ... and for one that fails


def draft_confidence(accepted: bool, rng: random.Random) -> float:
    return rng.betavariate(*(CONFIDENCE_IF_ACCEPTED if accepted else CONFIDENCE_IF_REJECTED))


def confidence_tenths(accepted: bool, steps: int = 200) -> list[float]:
    """P(the draft's top probability falls in each tenth | accepted or not), by midpoint integration."""
    a, b = CONFIDENCE_IF_ACCEPTED if accepted else CONFIDENCE_IF_REJECTED
    log_beta = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    h = 0.1 / steps
    out = []
    for tenth in range(10):
        xs = (tenth / 10 + (i + 0.5) * h for i in range(steps))
        out.append(sum(math.exp((a - 1) * math.log(x) + (b - 1) * math.log(1 - x) - log_beta) for x in xs) * h)
    return out


class AcceptanceProcess(ABC):
    name: str

    def prepare(self, req: SimRequest, rng: random.Random) -> None:  # noqa: B027 - optional hook
        """Draw whatever is per request (stored in ``req.data``)."""

    @abstractmethod
    def rate(self, req: SimRequest, start: int, k: int) -> float: ...


@dataclass
class IID(AcceptanceProcess):
    alpha: float
    name: str = "iid"

    def rate(self, req: SimRequest, start: int, k: int) -> float:
        return self.alpha


@dataclass
class Decaying(AcceptanceProcess):
    """α_k = α_1 · γ^(k-1): later draft positions drift further from the target."""

    alpha: float
    gamma: float
    name: str = "decaying"

    def rate(self, req: SimRequest, start: int, k: int) -> float:
        return self.alpha * self.gamma ** (k - 1)


@dataclass
class PromptRegime(AcceptanceProcess):
    """Long prompts get their own (lower) acceptance, e.g. 0.8 below ``threshold`` tokens, 0.4 above."""

    short: AcceptanceProcess
    long: AcceptanceProcess
    threshold: int = 1024
    name: str = "prompt-regime"

    def rate(self, req: SimRequest, start: int, k: int) -> float:
        return (self.long if req.prompt_len >= self.threshold else self.short).rate(req, start, k)


@dataclass
class Phases(AcceptanceProcess):
    """Acceptance switches between regimes over the output stream (e.g. code ↔ prose), each phase
    lasting a geometric number of tokens with mean ``mean_len``; phases run across requests."""

    alphas: tuple[float, ...]
    mean_len: float
    seed: int = 0
    name: str = "phases"
    _phase: list[int] = field(default_factory=list)

    def _at(self, pos: int) -> int:
        # Extended in fixed chunks from per-chunk seeds: the same phases whatever order positions are read in.
        while len(self._phase) <= pos:
            rng = random.Random(f"phases/{self.seed}/{len(self._phase) // 4096}")
            current = self._phase[-1] if self._phase else 0
            for _ in range(4096):
                if rng.random() < 1.0 / self.mean_len:
                    current = (current + 1) % len(self.alphas)
                self._phase.append(current)
        return self._phase[pos]

    def rate(self, req: SimRequest, start: int, k: int) -> float:
        return self.alphas[self._at(req.offset + start + k - 1)]


@dataclass
class PerRequest(AcceptanceProcess):
    """Each request draws its own α uniformly from [lo, hi] (prompts differ: some easy, some hard)."""

    lo: float
    hi: float
    name: str = "per-request"

    def prepare(self, req: SimRequest, rng: random.Random) -> None:
        req.data = rng.uniform(self.lo, self.hi)

    def rate(self, req: SimRequest, start: int, k: int) -> float:
        return float(req.data)


@dataclass
class Replay(AcceptanceProcess):
    """Acceptance recorded in a JSONL trace, replayed position by position.

    For greedy decoding the draft's token at output position p (given the verified text) is
    accepted or not whatever step drafts it, so a trace fixes ``ok[p]`` for every position it
    tested: within a step, positions up to n̂ passed and position n̂+1 failed. Positions a trace
    never tested (after a fully accepted draft, or during plain steps) are drawn at the trace's
    own conditional rate for that draft depth.
    """

    requests: list[dict[str, Any]]  # {"prompt_len", "new_tokens", "ok": [True/False/None per position]}
    depth_rates: list[float]
    name: str = "replay"

    @classmethod
    def from_trace(cls, path: str | Path) -> Replay:
        trace = read_trace(path)
        recorded = sorted((r for r in trace.requests if r.steps), key=lambda r: r.first_line)  # in file order
        if not recorded:
            raise InvalidRequestError(f"trace {path} has no step records", "trace")
        requests = []
        for req in recorded:
            ok: list[bool | None] = []
            for s in sorted(req.steps, key=lambda s: s.step):
                ok.extend([True] * s.n_accepted)
                if s.n_accepted < s.tau:
                    ok.append(False)
                elif len(s.emitted) > s.n_accepted:
                    ok.append(None)  # the bonus / plain token's position: the draft was not tested there
            requests.append({"prompt_len": req.steps[0].prompt_len, "new_tokens": len(ok), "ok": ok})
        rates = StepAggregate.of(s for req in recorded for s in req.steps).shrunk_rates(REPLAY_DEPTH)
        return cls(requests, rates)

    def prepare(self, req: SimRequest, rng: random.Random) -> None:
        rec = self.requests[req.index % len(self.requests)]
        req.data = [rng.random() < self.depth_rates[0] if v is None else v for v in rec["ok"]]

    def rate(self, req: SimRequest, start: int, k: int) -> float:
        ok = req.data
        p = start + k - 1
        if p < len(ok):
            return 1.0 if ok[p] else 0.0
        return self.depth_rates[min(k - 1, len(self.depth_rates) - 1)]
