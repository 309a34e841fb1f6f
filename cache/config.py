"""Encoder-cache settings, validated on construction.

``redis_url`` None (or empty) selects the in-process backend; anything else selects Redis.
A worker process builds them from its ``WorkerSettings`` (``open_encoder_cache_for_settings``),
the one place its ``EPD_*`` variables are read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_MAX_BYTES = 2 << 30
DEFAULT_TTL_S = 3600.0
DEFAULT_NAMESPACE = "epd:enc"


@dataclass(frozen=True, slots=True)
class EncoderCacheConfig:
    """All durations in seconds.

    max_bytes:        bound on this process's in-memory tier (LRU by bytes).
    ttl_s:            entry lifetime since last use, in memory and in Redis.
    namespace:        prefix of every Redis key and channel of this cache.
    lock_ttl_s:       expiry of the single-flight lock; a live holder renews it
                      every ``lock_ttl_s / 3``, a dead one frees it after this.
    wait_timeout_s:   longest wait on another process's encode before
                      encoding here anyway (default of ``get_or_compute``).
    poll_interval_s:  a waiter re-checks Redis at least this often (pub/sub
                      wakes it sooner; polling covers lost messages and
                      expired locks).
    retry_interval_s: after a Redis failure, calls skip Redis for this long,
                      then one call probes it again.
    redis_timeout_s:  socket connect/read timeout of Redis calls.
    """

    redis_url: str | None = None
    max_bytes: int = DEFAULT_MAX_BYTES
    ttl_s: float = DEFAULT_TTL_S
    namespace: str = DEFAULT_NAMESPACE
    lock_ttl_s: float = 10.0
    wait_timeout_s: float = 30.0
    poll_interval_s: float = 0.1
    retry_interval_s: float = 1.0
    redis_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.redis_url is not None and not self.redis_url.strip():
            object.__setattr__(self, "redis_url", None)
        if not isinstance(self.max_bytes, int) or self.max_bytes <= 0:
            raise ValueError(f"encoder cache max_bytes must be a positive int, got {self.max_bytes!r}")
        for name in ("ttl_s", "lock_ttl_s", "wait_timeout_s", "poll_interval_s", "retry_interval_s", "redis_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"encoder cache {name} must be a positive number of seconds, got {value!r}")
        if not self.namespace or any(c.isspace() for c in self.namespace):
            raise ValueError(f"encoder cache namespace must be non-empty without spaces, got {self.namespace!r}")
