"""The start-up heap frozen out of full collections, and the collector's pauses measured
(``runtime/worker/gc_heap.py``)."""

from __future__ import annotations

import gc

from prometheus_client import REGISTRY

from runtime.worker.gc_heap import freeze_startup_heap, install_pause_metric


def _pause_count(generation: str) -> float:
    return REGISTRY.get_sample_value("epd:gc_pause_seconds_count", {"generation": generation}) or 0.0


def test_frozen_objects_are_not_walked_by_a_full_collection():
    startup = [[i] for i in range(20_000)]   # tracked containers alive when start-up ends
    try:
        frozen = freeze_startup_heap()
        assert frozen >= len(startup)
        install_pause_metric()
        assert REGISTRY.get_sample_value("epd:gc_frozen_objects") == float(frozen)
        oldest = {id(o) for o in gc.get_objects(generation=2)}
        assert not any(id(o) in oldest for o in startup)   # a full collection no longer walks them
        later = [[i] for i in range(100)]
        gc.collect()
        oldest = {id(o) for o in gc.get_objects(generation=2)}
        assert all(id(o) in oldest for o in later)           # what comes after is collected as before
    finally:
        gc.unfreeze()   # this test process builds and drops many servers


def test_every_collection_is_timed_by_generation():
    install_pause_metric()
    install_pause_metric()   # idempotent: one hook, one histogram
    before = _pause_count("2"), _pause_count("0")
    gc.collect()
    gc.collect(0)
    assert _pause_count("2") == before[0] + 1
    assert _pause_count("0") == before[1] + 1
