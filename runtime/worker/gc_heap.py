"""Garbage-collector pauses kept short: the start-up heap frozen, every pause measured.

CPython's oldest-generation collection walks every tracked object that is not frozen. A
serving process holds about half a million of them once it has started (torch,
transformers' tokenizer and processor, gRPC, FastAPI), and a full collection of that heap
stopped the process for 100-250 ms on the CPU hosts measured (bench/RESULTS.md): every
request in flight at that stage waited, for its first token or its next one. After
start-up the process allocates little that lives long, so those objects never become
garbage; scanning them is pure pause.

``freeze_startup_heap`` runs once, when the process is ready to serve but before it takes a
request (a worker just before its gRPC server starts and reports itself serving, the gateway at
the end of its lifespan's start-up, before uvicorn listens), so its own full collection stalls
nobody: one full collection, then ``gc.freeze()`` moves every survivor into the permanent
generation, which later collections skip. What requests allocate is collected as before; only
objects alive at start-up stay out of the collector's reach (dropping their last reference still
frees them). vLLM freezes its servers' start-up heap the same way.

``epd:gc_pause_seconds{generation}`` (process-wide ``REGISTRY``: the gateway's ``/metrics``
and a worker's metrics port) times every collection from ``gc.callbacks``, so a pause that
comes back is visible where latency is watched; ``epd:gc_frozen_objects`` is the frozen
heap's size as the freeze left it (0: nothing froze it; ``gc.get_freeze_count()`` walks the
whole frozen list, several ms, so a scrape does not ask it). ``install_pause_metric`` is idempotent.
"""

from __future__ import annotations

import gc
import time

from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import GaugeMetricFamily

PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

_pause: Histogram | None = None
_frozen: list[int] = [0]        # objects the last freeze left frozen
_started: list[float] = [0.0]   # gc.callbacks run on the collecting thread, one collection at a time


def freeze_startup_heap() -> int:
    """Collect once, then freeze what survived; returns the objects now frozen (``gc.get_freeze_count()``)."""
    gc.collect()
    gc.freeze()
    _frozen[0] = gc.get_freeze_count()
    return _frozen[0]


def install_pause_metric() -> Histogram:
    """``epd:gc_pause_seconds{generation}``, observed by a ``gc.callbacks`` hook (once per process)."""
    global _pause
    if _pause is None:
        _pause = Histogram("epd:gc_pause_seconds", "Time the garbage collector stopped this process, by generation.",
                           ["generation"], buckets=PAUSE_BUCKETS, registry=REGISTRY)
        REGISTRY.register(_FrozenObjects())
        gc.callbacks.append(_on_collection)
    return _pause


class _FrozenObjects:
    def collect(self):
        g = GaugeMetricFamily("epd:gc_frozen_objects", "Objects frozen out of garbage collection at start-up.")
        g.add_metric([], float(_frozen[0]))
        yield g


def _on_collection(phase: str, info: dict) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
    elif _pause is not None:
        _pause.labels(str(info["generation"])).observe(time.perf_counter() - _started[0])
