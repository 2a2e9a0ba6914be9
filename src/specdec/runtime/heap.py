"""Python's cyclic garbage collector in a long-running engine: the loaded heap kept out of its scans, and its pauses
measured.

A full (generation-2) collection walks every container object the process holds. After importing torch and
loading the models that is ~300,000 objects, ~100 ms on the CPUs we serve from and up to ~200 ms with the cores
busy; and a server promotes enough short-lived objects (records, token lists) to trigger one every second or
so. Each stops the engine's worker mid-step (a traced server at 16 clients showed a draft phase of 207 ms in a
step of 15 ms), and which mode or load level of a benchmark happens to take them decided comparisons between
them by up to ±0.2. ``freeze_heap`` moves the objects alive once everything is loaded into the collector's
permanent generation (``gc.freeze``), which no collection walks: later full collections scan only what the
serving allocated since, in well under a millisecond. Objects frozen are still freed by reference counting;
only cycles among them are never collected (there are none to speak of once loading is done).

``GcPauses`` times every collection (``gc.callbacks``) so a server's ``/metrics`` shows what the collector costs.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

# Histogram buckets (seconds) of one collection's pause.
PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)


# Objects frozen by ``freeze_heap`` (0 once ``unfreeze_heap`` let them go), counted once at the freeze: the count
# (``gc.get_freeze_count``) walks every frozen object, ~20 ms for a server's ~300,000 with the GIL held, and a
# ``/metrics`` scrape that asked for it stalled the event loop and the engine's worker that long (session 67).
_frozen = 0


def freeze_heap() -> int:
    """Collect once, then keep every object alive now out of all later collections' scans; returns their count.

    Call it when a long-running process has loaded what it serves from (models, engine) and before it serves."""
    global _frozen
    gc.collect()
    gc.freeze()
    _frozen = gc.get_freeze_count()
    return _frozen


def unfreeze_heap() -> None:
    """Let the frozen objects back into the collector's scans (``gc.unfreeze``)."""
    global _frozen
    gc.unfreeze()
    _frozen = 0


def frozen_count() -> int:
    """The objects ``freeze_heap`` froze (as counted then), without walking them."""
    return _frozen


@contextlib.contextmanager
def frozen_heap() -> Iterator[int]:
    """``freeze_heap`` for the body of a command, undone after it (``gc.unfreeze``): a command run inside another
    process (a test, a notebook calling ``specdec.cli.main``) leaves that process's collector as it found it, frozen
    objects that became cyclic garbage meanwhile then collected as usual."""
    try:
        yield freeze_heap()
    finally:
        unfreeze_heap()


class GcPauses:
    """The pause of every garbage collection in this process, by generation (one instance, installed once:
    ``gc.callbacks`` is process-wide). A collection runs on whichever thread allocated when it was due, and
    holds the GIL throughout, so ``time.perf_counter`` around it is its pause."""

    _instance: GcPauses | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._started: float | None = None
        self.counts = [[0] * (len(PAUSE_BUCKETS) + 1) for _ in range(3)]  # per generation: per bucket, +Inf last
        self.sums = [0.0, 0.0, 0.0]
        self.longest = 0.0

    @classmethod
    def installed(cls) -> GcPauses:
        """The process's recorder, its callback registered at the first call."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
                gc.callbacks.append(cls._instance._callback)
            return cls._instance

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        pause = time.perf_counter() - self._started
        self._started = None
        gen = min(max(int(info.get("generation", 2)), 0), 2)
        self.counts[gen][bisect.bisect_left(PAUSE_BUCKETS, pause)] += 1
        self.sums[gen] += pause
        self.longest = max(self.longest, pause)

    def collect(self) -> Iterator[Any]:
        """Prometheus metric families (a custom collector's ``collect``)."""
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

        hist = HistogramMetricFamily(
            "specdec_gc_pause_seconds",
            "Pauses of Python's garbage collector (the engine's worker stops while one runs), by generation.",
            labels=["generation"],
        )
        for gen in range(3):
            cumulative, buckets = 0, []
            for edge, count in zip((*map(str, PAUSE_BUCKETS), "+Inf"), self.counts[gen]):
                cumulative += count
                buckets.append((edge, cumulative))
            hist.add_metric([str(gen)], buckets, self.sums[gen])
        yield hist
        yield GaugeMetricFamily(
            "specdec_gc_frozen_objects",
            "Objects kept out of the collector's scans (frozen once the models were loaded; 0: not frozen).",
            value=frozen_count(),  # as counted at the freeze: counting them again walks every one (~20 ms)
        )
