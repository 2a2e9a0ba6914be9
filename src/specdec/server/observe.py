"""Prometheus metrics of a server: the engine's speculative-decoding metrics plus queue and request gauges, and the
process's and its threads' CPU."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, ProcessCollector

from specdec.engine import Engine
from specdec.metrics import SpecMetrics
from specdec.runtime.heap import GcPauses
from specdec.server.scheduler import Scheduler


class ThreadCpu:
    """CPU time of the server's own threads by role (a custom collector: ``specdec_server_thread_cpu_seconds_total``),
    read from ``/proc/self/task/TID/stat`` (Linux; elsewhere the family has no samples), each from when its thread took
    the role: the event loop's (HTTP, request parsing, streaming every event) since the server began serving, the
    scheduler worker's (the engine's Python between passes, and its share of the passes: the kernel's other compute
    threads are in ``process_cpu_seconds_total`` only). The loop's CPU a request says what the HTTP side takes from the
    cores the passes use: on two cores a second of it cost the batched steps ~2.4 seconds of a core
    (``benchmarks/contention.py``, docs/server.md)."""

    _TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") and "SC_CLK_TCK" in os.sysconf_names else 100

    def __init__(self) -> None:
        self._threads: dict[str, Callable[[], int | None]] = {}  # role -> the thread's native id now (None: none)
        self._since: dict[str, float] = {}  # role -> the thread's CPU seconds when it took the role (not counted)

    def watch(self, role: str, native_id: Callable[[], int | None]) -> None:
        self._threads[role] = native_id

    def watch_current(self, role: str) -> None:
        """Watch the calling thread as ``role``, from now (the event loop runs on the thread that loaded the models:
        that work is not the role's)."""
        tid = threading.get_native_id()
        self.watch(role, lambda: tid)
        start = self.thread_seconds(tid)
        if start is not None:
            self._since[role] = start

    def thread_seconds(self, tid: int) -> float | None:
        """A thread's CPU seconds (user + system) from ``/proc``; None where there is none (not Linux, or ended)."""
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / self._TICK  # utime + stime (fields 14, 15)
        except (OSError, IndexError, ValueError):
            return None

    def seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for role, native_id in self._threads.items():
            tid = native_id()
            seconds = None if tid is None else self.thread_seconds(tid)
            if seconds is not None:
                out[role] = round(max(0.0, seconds - self._since.get(role, 0.0)), 6)
        return out

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(
            "specdec_server_thread_cpu_seconds",
            "CPU time of the server's threads since it began serving: the event loop (HTTP, streaming) and the "
            "scheduler's worker (the engine's steps; the passes' other compute threads are in process_cpu_seconds_total).",
            labels=["thread"],
        )
        for role, seconds in sorted(self.seconds().items()):
            family.add_metric([role], seconds)
        yield family


class ServerMetrics:
    """Registers a ``SpecMetrics`` observer on the engine, scheduler gauges, the garbage collector's pauses, the
    process's CPU and memory and its threads' CPU (``ThreadCpu``) in the same registry."""

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
        ProcessCollector(registry=r)  # process_cpu_seconds_total, resident memory, ... (Linux)
        self.threads = ThreadCpu()
        self.threads.watch("scheduler", lambda: scheduler.thread_native_id)
        r.register(self.threads)  # type: ignore[arg-type]
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
