"""Open the encoder cache a process should use.

``redis_url`` None selects the embedded in-process cache (a single-host run);
a URL selects the Redis backend. The factory never connects: a Redis that is
down at start-up is one more outage the cache rides out, not a start-up error.
A malformed URL is a configuration error and raises ``ValueError`` here.
"""

from __future__ import annotations

from redis.asyncio import Redis

from cache.config import DEFAULT_MAX_BYTES, DEFAULT_NAMESPACE, DEFAULT_TTL_S, EncoderCacheConfig
from cache.encoder_cache import EncoderCache
from cache.memory_backend import MemoryEncoderCache
from cache.redis_backend import RedisEncoderCache


def open_encoder_cache(
    redis_url: str | None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    ttl_s: float = DEFAULT_TTL_S,
    namespace: str = DEFAULT_NAMESPACE,
    lock_ttl_s: float = 10.0,
    wait_timeout_s: float = 30.0,
    poll_interval_s: float = 0.1,
    retry_interval_s: float = 1.0,
    redis_timeout_s: float = 2.0,
    client: Redis | None = None,
) -> EncoderCache:
    """The cache for ``redis_url`` (see ``EncoderCacheConfig`` for the other settings).

    ``client``: an existing redis-py asyncio client whose pool the cache should
    share (the process's one pool); the cache does not close it, and its socket
    timeouts and retries, not ``redis_timeout_s``, then bound every Redis call
    (give it finite timeouts, or a hung Redis stalls the calls).
    """
    config = EncoderCacheConfig(
        redis_url=redis_url,
        max_bytes=max_bytes,
        ttl_s=ttl_s,
        namespace=namespace,
        lock_ttl_s=lock_ttl_s,
        wait_timeout_s=wait_timeout_s,
        poll_interval_s=poll_interval_s,
        retry_interval_s=retry_interval_s,
        redis_timeout_s=redis_timeout_s,
    )
    return open_encoder_cache_from_config(config, client=client)


def open_encoder_cache_from_config(config: EncoderCacheConfig, *, client: Redis | None = None) -> EncoderCache:
    if config.redis_url is None and client is None:
        return MemoryEncoderCache(max_bytes=config.max_bytes, ttl_s=config.ttl_s)
    try:
        return RedisEncoderCache(config, client=client)
    except ValueError as exc:  # redis-py rejects the URL's scheme or options
        raise ValueError(f"invalid EPD_REDIS_URL / redis_url: {exc}") from exc


def open_encoder_cache_for_settings(settings) -> EncoderCache:
    """A worker process's cache from its settings (``runtime.worker.settings.WorkerSettings``, the
    one source: ``EPD_REDIS_URL`` set selects Redis, ``EPD_CACHE_MAX_MB``, ``EPD_CACHE_TTL_S``)."""
    return open_encoder_cache(settings.redis_url, max_bytes=settings.cache_max_mb * 2**20, ttl_s=settings.cache_ttl_s)
