"""Prometheus metrics of a worker process, served on ``EPD_METRICS_PORT`` when set.

Gauges and counters are read from the live servicer at scrape time (a custom
collector), so they can never drift from the state they describe. Counters:
``epd:worker_kv_chunks_total{outcome}`` and, on decode, ``epd:lease_reaped_total`` and the
prefix cache's ``epd:prefix_cache_queries_total`` / ``epd:prefix_cache_hits_total`` (prompt
tokens looked up / served from cached blocks; ``epd:worker_cached_blocks`` is its gauge).
"""

from __future__ import annotations

from collections.abc import Callable

from typing import Protocol

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

class HasLocalStats(Protocol):
    def local_stats(self) -> dict[str, int]: ...


_GAUGES = {
    "reservations_active": "Decode reservations holding KV blocks",
    "pending_chunks": "KV chunks landed but not yet inserted",
    "free_blocks": "KV blocks a reservation can take (free, or cached and unreferenced)",
    "total_blocks": "KV blocks in the pool",
    "cached_blocks": "KV blocks holding prefix-cache KV",
    "running_seqs": "Sequences in the running batch",
    "queue_depth": "Requests queued at this worker",
    "in_flight": "Requests in flight at this worker",
    "single_flight_in_flight": "Encoder-cache single-flight computations in progress",
}

_COUNTERS = {   # local_stats key ``<name>_total`` -> ``epd:worker_<name>_total``
    "encoder_computes": "Images the encoder computed (cache misses)",
    "encoder_cache_hits": "Images sent to the encoder that were already cached",
    "encoder_stored": "Embeddings decode workers computed themselves and handed to the encoder's cache",
    "images_encoded_here": "Images a decode worker encoded itself for a colocated request",
    "embedding_store_failures": "Embeddings a decode worker computed that did not reach the encoder's cache",
    "embedding_store_calls": "Store calls a decode worker made to encoders (each carries every embedding then waiting for it)",
    "refill_waits": "Refill steps a decode worker held for colocated prompts on their way",
}


class _WorkerCollector:
    def __init__(self, servicer_fn: Callable[[], "HasLocalStats"]):
        self._servicer_fn = servicer_fn

    def collect(self):
        stats = self._servicer_fn().local_stats()
        for name, help_ in _GAUGES.items():
            if name in stats:
                g = GaugeMetricFamily(f"epd:worker_{name}", help_)
                g.add_metric([], float(stats[name]))
                yield g
        for name, help_ in _COUNTERS.items():
            if f"{name}_total" in stats:
                c = CounterMetricFamily(f"epd:worker_{name}", help_)
                c.add_metric([], float(stats[f"{name}_total"]))
                yield c
        if "lease_reaped_total" in stats:
            c = CounterMetricFamily("epd:lease_reaped", "Reservations the lease reaper released (nobody freed them in time)")
            c.add_metric([], float(stats["lease_reaped_total"]))
            yield c
        for name, help_ in (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
                            ("prefix_cache_hits", "Prompt tokens served from the prefix cache")):
            if f"{name}_total" in stats:
                c = CounterMetricFamily(f"epd:{name}", help_)
                c.add_metric([], float(stats[f"{name}_total"]))
                yield c
        chunks = {k.removeprefix("kv_chunks_"): v for k, v in stats.items() if k.startswith("kv_chunks_")}
        if chunks:
            c = CounterMetricFamily("epd:worker_kv_chunks", "KV chunks received, by outcome", labels=["outcome"])
            for outcome, n in chunks.items():
                c.add_metric([outcome], float(n))
            yield c


def serve_worker_metrics(port: int | None, servicer_fn: Callable[[], "HasLocalStats"]) -> None:
    if port is None:
        return
    REGISTRY.register(_WorkerCollector(servicer_fn))
    start_http_server(port)
