"""Encoder-cache metrics: Prometheus (default registry) plus per-instance counts.

Every ``get`` / ``get_or_compute`` call is one query, and a query that
returns a tensor ends as exactly one of:

* hit:   served from a stored entry (this process's memory or Redis);
* merge: served by joining another caller's in-flight lookup or encode
         (single-flight, in this process or, through the Redis lock, another);
* miss:  everything else (this caller ran the encoder, or ``get`` found nothing,
         or the compute failed).

So ``misses = queries - hits - merges``, and ``computes`` counts encoder runs
(images actually encoded): with N concurrent callers for one new image,
queries = N, merges = N - 1, computes = 1.

Process-wide gauges (``bytes``, ``entries``) are moved by deltas, so several
cache instances in one process add up. Per-instance numbers live in
``CacheCounters`` (what ``stats()`` reports), so tests and the gateway can read
one instance without the global registry.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge

QUERIES = Counter("epd:encoder_cache_queries", "Encoder-cache lookups (get and get_or_compute calls)")
HITS = Counter("epd:encoder_cache_hits", "Lookups served from a stored entry (local memory or Redis)")
COMPUTES = Counter("epd:encoder_computes", "Images actually encoded through the cache (compute() invocations)")
MERGES = Counter(
    "epd:encoder_cache_singleflight_merges",
    "Lookups served by joining another caller's in-flight lookup or encode (in-process or cross-process)",
)
EVICTIONS = Counter("epd:encoder_cache_evictions", "Local entries evicted to stay under the byte bound")
ERRORS = Counter("epd:encoder_cache_errors", "Failed Redis operations (the call went on without Redis)")
BYPASSED = Counter(
    "epd:encoder_cache_bypassed", "Operations that skipped Redis because it was marked unreachable"
)
STALE = Counter(
    "epd:encoder_cache_stale_entries", "Redis entries found partial or corrupt (dropped, then re-encoded)"
)
WAIT_TIMEOUTS = Counter(
    "epd:encoder_cache_wait_timeouts", "Waits on another process's encode that ran out and computed locally"
)
BYTES = Gauge("epd:encoder_cache_bytes", "Embedding bytes held in this process's cache memory")
ENTRIES = Gauge("epd:encoder_cache_entries", "Embeddings held in this process's cache memory")
REDIS_UP = Gauge("epd:encoder_cache_redis_up", "1 while the Redis tier answers, 0 while the cache runs without it")


@dataclass(slots=True)
class CacheCounters:
    """Per-instance counts; each method also moves the matching Prometheus metric."""

    queries: int = 0
    local_hits: int = 0
    remote_hits: int = 0
    merges: int = 0
    computes: int = 0
    evictions: int = 0
    errors: int = 0
    bypassed: int = 0
    stale: int = 0
    wait_timeouts: int = 0

    @property
    def hits(self) -> int:
        return self.local_hits + self.remote_hits

    def query(self) -> None:
        self.queries += 1
        QUERIES.inc()

    def hit(self, *, remote: bool) -> None:
        if remote:
            self.remote_hits += 1
        else:
            self.local_hits += 1
        HITS.inc()

    def merge(self) -> None:
        self.merges += 1
        MERGES.inc()

    def compute(self) -> None:
        self.computes += 1
        COMPUTES.inc()

    def error(self) -> None:
        self.errors += 1
        ERRORS.inc()

    def bypass(self) -> None:
        self.bypassed += 1
        BYPASSED.inc()

    def stale_entry(self) -> None:
        self.stale += 1
        STALE.inc()

    def wait_timeout(self) -> None:
        self.wait_timeouts += 1
        WAIT_TIMEOUTS.inc()

    def memory_changed(self, bytes_delta: int, entries_delta: int, evictions: int) -> None:
        """The ``ByteLRU.on_change`` callback."""
        if bytes_delta:
            BYTES.inc(bytes_delta)
        if entries_delta:
            ENTRIES.inc(entries_delta)
        if evictions:
            self.evictions += evictions
            EVICTIONS.inc(evictions)

    def as_dict(self) -> dict[str, int]:
        return {
            "queries": self.queries,
            "hits": self.hits,
            "local_hits": self.local_hits,
            "remote_hits": self.remote_hits,
            "merges": self.merges,
            "misses": self.queries - self.hits - self.merges,
            "computes": self.computes,
            "evictions": self.evictions,
            "errors": self.errors,
            "bypassed": self.bypassed,
            "stale": self.stale,
            "wait_timeouts": self.wait_timeouts,
        }
