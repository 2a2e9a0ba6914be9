"""Prometheus metrics of a server: the engine's speculative-decoding metrics plus queue and request gauges."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Histogram

from specdec.engine import Engine
from specdec.metrics import SpecMetrics
from specdec.runtime.heap import GcPauses
from specdec.server.scheduler import Scheduler


class ServerMetrics:
    """Registers a ``SpecMetrics`` observer on the engine, scheduler gauges and the garbage collector's pauses in the
    same registry."""

    def __init__(self, engine: Engine, scheduler: Scheduler) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.spec = SpecMetrics(self.registry)
        engine.observers.append(self.spec)
        r = self.registry
        gauges = {
            "active": ("specdec_server_requests_running", "Requests being generated (interleaved step by step)."),
            "queued": ("specdec_server_requests_waiting", "Requests waiting for a free slot."),
            "rejected": ("specdec_server_requests_rejected", "Requests refused with 429 since start."),
            "failed": ("specdec_server_requests_failed", "Admitted requests that failed (bad input, timeout)."),
            "cancelled": ("specdec_server_requests_cancelled", "Requests cancelled by a client disconnect."),
        }
        for key, (name, doc) in gauges.items():
            Gauge(name, doc, registry=r).set_function(lambda key=key: scheduler.snapshot()[key])  # type: ignore[misc]
        Gauge("specdec_server_max_batch", "Requests that may share one step's passes.", registry=r).set(
            scheduler.max_batch
        )
        r.register(GcPauses.installed())
        self._sequences = Histogram(
            "specdec_batch_sequences_per_pass",
            "Requests sharing each step's draft and target passes.",
            buckets=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64),
            registry=r,
        )
        self._rows = Histogram(
            "specdec_batch_rows_per_pass",
            "Rows (token positions) of each step's target pass over all its requests.",
            buckets=(1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512),
            registry=r,
        )

    def observe_pass(self, sequences: int, rows: int) -> None:
        """One batched step (called by the scheduler's worker)."""
        self._sequences.observe(sequences)
        self._rows.observe(rows)

    @property
    def content_type(self) -> str:
        return self.spec.content_type

    def render(self) -> bytes:
        return self.spec.render()
