"""Prometheus metrics fed from StepRecords, following vLLM's spec-decode conventions.

Names mirror vLLM's ``vllm:spec_decode_*`` counters with the ``specdec_`` prefix, so a vLLM
dashboard ports by renaming:

- ``specdec_spec_decode_num_drafts_total``: steps that proposed at least one draft token.
- ``specdec_spec_decode_num_draft_tokens_total``: draft tokens proposed (Σ τ).
- ``specdec_spec_decode_num_accepted_tokens_total``: draft tokens the acceptance rule accepted (Σ n̂).
- ``specdec_spec_decode_num_accepted_tokens_per_pos_total{position="i"}``: drafts whose token at
  0-based position i was accepted (it and every token before it).

Steps that drafted from a request's predicted output (``prediction``; record ``reason`` "prediction") are counted
apart, in ``specdec_prediction_draft_tokens_total`` and ``specdec_prediction_accepted_tokens_total``, so the
spec-decode counters stay the drafter's.

Derived (PromQL): α = accepted / draft_tokens; mean acceptance length *including the correction
token* = 1 + accepted / drafts; per-position acceptance = per_pos{position=i} / drafts.
Accepted counts are the acceptance rule's outcome (n̂); a stop condition may cut the last step of
a request, so ``specdec_generation_tokens_total`` is the count of tokens actually emitted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specdec.records import RequestSummary, StepRecord

ACCEPTED_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 24, 32)
FLUSH_EVERY = 256  # step records summed before they reach the metrics, at most (a scrape or a request's end sooner)
VERIFY_PASSES_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class SpecMetrics:
    """Engine observer updating metrics in its own ``CollectorRegistry`` (never the global one)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()  # one record's updates land together relative to render()
        self._accepted_at: list[Any] = []  # per-position children exported so far (zeros included, so ratios exist)
        r = self.registry
        self.num_drafts = Counter("specdec_spec_decode_num_drafts", "Steps that proposed draft tokens.", registry=r)
        self.num_draft_tokens = Counter("specdec_spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r)
        self.num_accepted_tokens = Counter(
            "specdec_spec_decode_num_accepted_tokens", "Draft tokens accepted by the acceptance rule.", registry=r
        )
        self.accepted_per_pos = Counter(
            "specdec_spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this 0-based position was accepted (with every token before it).",
            ["position"],
            registry=r,
        )
        self.prediction_draft_tokens = Counter(
            "specdec_prediction_draft_tokens",
            "Tokens drafted from requests' predicted outputs (prediction), not in the spec_decode counters.",
            registry=r,
        )
        self.prediction_accepted_tokens = Counter(
            "specdec_prediction_accepted_tokens",
            "Of the tokens drafted from predicted outputs, those the acceptance rule accepted.",
            registry=r,
        )
        self.verify_passes = Counter("specdec_verify_passes", "Target verify passes (prefill not counted).", registry=r)
        self.generation_tokens = Counter("specdec_generation_tokens", "Tokens emitted to outputs.", registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.prompt_cached_tokens = Counter(
            "specdec_prompt_cached_tokens",
            "Of specdec_prompt_tokens, those whose keys and values the target's prefix cache held (not computed).",
            registry=r,
        )
        self.step_seconds = Counter(
            "specdec_step_seconds", "Step time by phase: draft, verify, other.", ["phase"], registry=r
        )
        self.policy_seconds = Counter(
            "specdec_policy_seconds",
            "Of the 'other' phase of specdec_step_seconds, the policies' own work (their plans and learning).",
            registry=r,
        )
        self.requests = Counter(
            "specdec_request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        self.accepted_length = Histogram(
            "specdec_accepted_length",
            "Tokens emitted per verify pass, the correction token included.",
            buckets=ACCEPTED_LENGTH_BUCKETS,
            registry=r,
        )
        self.request_verify_passes = Histogram(
            "specdec_request_verify_passes", "Verify passes per request.", buckets=VERIFY_PASSES_BUCKETS, registry=r
        )
        self.time_per_output_token = Histogram(
            "specdec_time_per_output_token_seconds",
            "Decode time per output token of a request (prefill excluded).",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.request_latency = Histogram(
            "specdec_e2e_request_latency_seconds",
            "Request latency, prefill included.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        for reason in ("stop", "length", "verify_budget", "cancelled"):
            self.requests.labels(finished_reason=reason)  # export zeros so rates exist before the first finish
        self._phase_seconds = tuple(self.step_seconds.labels(phase=p) for p in ("draft", "verify", "other"))
        self._sums = _StepSums()

    def on_step(self, record: StepRecord) -> None:
        # Summed here and handed to the metrics in bulk (``_flush``: at a scrape, at a request's end, every FLUSH_EVERY
        # records): each metric's update takes its own lock, ~10 a record, ~5 µs a record of the stepping thread, 16
        # records a batched step.
        emitted = len(record.emitted)
        with self._lock:
            sums = self._sums
            sums.records += 1
            passes = record.target_passes
            sums.passes += passes
            sums.tokens += emitted
            if passes == 1:
                sums.lengths[emitted] = sums.lengths.get(emitted, 0) + 1
            else:  # a chained plain step: a token a pass (none for the passes after a stop cut the chain)
                sums.lengths[1] = sums.lengths.get(1, 0) + emitted
                sums.lengths[0] = sums.lengths.get(0, 0) + passes - emitted
            sums.draft += record.draft_time
            sums.verify += record.verify_time
            sums.other += record.other_time
            sums.policy += record.policy_time
            if record.predicted:
                sums.predicted += record.tau
                sums.predicted_accepted += record.n_accepted
            elif record.tau > 0:
                sums.drafts += 1
                sums.draft_tokens += record.tau
                sums.accepted += record.n_accepted
                at = sums.accepted_at
                while len(at) < record.tau:  # every position drafted is exported, zero until accepted
                    at.append(0)
                for pos in range(record.n_accepted):
                    at[pos] += 1
            if sums.records >= FLUSH_EVERY:
                self._flush()

    def _flush(self) -> None:
        """The summed step records into the metrics (the lock held)."""
        sums, self._sums = self._sums, _StepSums()
        if not sums.records:
            return
        self.verify_passes.inc(sums.passes)
        self.generation_tokens.inc(sums.tokens)
        for length, count in sums.lengths.items():
            for _ in range(count):
                self.accepted_length.observe(length)
        for child, seconds in zip(self._phase_seconds, (sums.draft, sums.verify, sums.other)):
            child.inc(seconds)
        self.policy_seconds.inc(sums.policy)
        if sums.predicted:
            self.prediction_draft_tokens.inc(sums.predicted)
            self.prediction_accepted_tokens.inc(sums.predicted_accepted)
        if sums.drafts:
            self.num_drafts.inc(sums.drafts)
            self.num_draft_tokens.inc(sums.draft_tokens)
            self.num_accepted_tokens.inc(sums.accepted)
        by_pos = self._accepted_at
        while len(by_pos) < len(sums.accepted_at):
            by_pos.append(self.accepted_per_pos.labels(position=str(len(by_pos))))
        for child, count in zip(by_pos, sums.accepted_at):
            if count:
                child.inc(count)

    def on_request(self, summary: RequestSummary) -> None:
        s = summary.stats
        with self._lock:
            self._flush()
            self.requests.labels(finished_reason=s.finish_reason).inc()
            self.prompt_tokens.inc(s.prompt_tokens)
            self.prompt_cached_tokens.inc(s.cached_tokens)
            self.request_verify_passes.observe(s.target_passes)
            self.request_latency.observe(s.latency)
            decode = s.latency - s.prefill_time
            if s.new_tokens > 0 and decode > 0:
                self.time_per_output_token.observe(decode / s.new_tokens)

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        with self._lock:
            self._flush()
            return generate_latest(self.registry)


@dataclass
class _StepSums:
    """Step records summed since the last flush (``SpecMetrics.on_step``)."""

    records: int = 0
    passes: int = 0  # target passes: a record's own, several for a chained plain step
    tokens: int = 0
    lengths: dict[int, int] = field(default_factory=dict)  # emitted tokens per target pass -> passes
    draft: float = 0.0
    verify: float = 0.0
    other: float = 0.0
    policy: float = 0.0  # of other
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # by 0-based position: drafts accepted through it
    predicted: int = 0  # tokens drafted from predicted outputs (kept out of the drafter's counts)
    predicted_accepted: int = 0
