"""The garbage collector in a long-running engine: the loaded heap frozen out of its scans, its pauses measured."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from specdec.runtime.heap import PAUSE_BUCKETS, GcPauses, freeze_heap, unfreeze_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    unfreeze_heap()  # this test process goes on collecting as before


def test_freeze_keeps_what_is_loaded_out_of_every_later_scan(unfrozen: None) -> None:
    loaded = [[i] for i in range(1000)]  # containers alive at load time, as a model's modules and the engine's state
    tracked = {id(o) for o in gc.get_objects()}
    assert id(loaded) in tracked
    frozen = freeze_heap()
    assert frozen == gc.get_freeze_count() and frozen >= 1000
    after = {id(o) for o in gc.get_objects()}  # what collections walk now
    assert id(loaded) not in after and not any(id(x) in after for x in loaded)
    served = [[1]]  # made while serving: collected as ever
    assert id(served) in {id(o) for o in gc.get_objects()}
    assert loaded[999] == [999]  # frozen objects are kept (and still freed by reference counting)


def test_every_collection_pause_is_counted_by_generation() -> None:
    pauses = GcPauses.installed()
    assert GcPauses.installed() is pauses and gc.callbacks.count(pauses._callback) == 1  # once per process
    before = (sum(pauses.counts[2]), pauses.sums[2])
    gc.collect()
    gc.collect(0)
    assert sum(pauses.counts[2]) == before[0] + 1 and pauses.sums[2] > before[1]
    assert sum(pauses.counts[0]) >= 1 and pauses.longest > 0
    families = {f.name: f for f in pauses.collect()}
    hist = families["specdec_gc_pause_seconds"]
    buckets = [s for s in hist.samples if s.name.endswith("_bucket") and s.labels["generation"] == "2"]
    assert [s.labels["le"] for s in buckets] == [*map(str, PAUSE_BUCKETS), "+Inf"]
    counts = [s.value for s in buckets]
    assert counts == sorted(counts) and counts[-1] == sum(pauses.counts[2])  # cumulative, +Inf holds all
    assert families["specdec_gc_frozen_objects"].samples[0].value == gc.get_freeze_count()


def test_a_scrape_reports_the_frozen_count_without_walking_the_frozen_objects(
    unfrozen: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counting the frozen objects walks every one (~20 ms for a server's heap, the GIL held): ``/metrics`` reports
    the count taken at the freeze instead."""
    frozen = freeze_heap()
    assert frozen == gc.get_freeze_count() > 0

    def walk() -> int:
        raise AssertionError("a scrape walked the frozen objects")

    monkeypatch.setattr(gc, "get_freeze_count", walk)
    families = {f.name: f for f in GcPauses.installed().collect()}
    assert families["specdec_gc_frozen_objects"].samples[0].value == frozen
    monkeypatch.undo()
    unfreeze_heap()
    families = {f.name: f for f in GcPauses.installed().collect()}
    assert families["specdec_gc_frozen_objects"].samples[0].value == 0 == gc.get_freeze_count()


def test_a_command_leaves_the_collector_as_it_found_it() -> None:
    """``frozen_heap`` (bench, tune, serve): frozen for the command's body, unfrozen after it, error or not."""
    from specdec.runtime.heap import frozen_heap

    assert gc.get_freeze_count() == 0
    with frozen_heap() as frozen:
        assert frozen > 0 and gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("the command failed")
    assert gc.get_freeze_count() == 0
