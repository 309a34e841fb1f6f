"""Redis failures at run time, against a private redis-server this test starts and kills.

Serving never stops: with Redis gone the cache encodes and keeps results in
process memory (counted as errors / bypasses, logged once), and it returns to
the shared tier by itself once Redis is back.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from helpers_cache.fixtures import (  # noqa: F401  (fixtures)
    Encoder,
    RedisServer,
    free_port,
    must_not_compute,
    namespace,
    open_cache,
    tensor,
)
from prometheus_client import REGISTRY

from cache.redis_entry import entry_key

@pytest.fixture
def server():
    srv = RedisServer()
    srv.start()
    yield srv
    srv.kill()


async def test_redis_down_then_back(open_cache, server, caplog, namespace) -> None:
    caplog.set_level(logging.INFO, logger="epd.cache")
    cache = open_cache(url=server.url, retry_interval_s=0.2, redis_timeout_s=0.5)
    other = open_cache(url=server.url, retry_interval_s=0.2, redis_timeout_s=0.5)
    assert not (await cache.get_or_compute("before", Encoder(tensor(1)))).hit
    assert (await other.get_or_compute("before", must_not_compute)).hit

    server.kill()
    errors_before = REGISTRY.get_sample_value("epd:encoder_cache_errors_total") or 0.0
    encoder = Encoder(tensor(2), delay_s=0.05)
    results = await asyncio.wait_for(
        asyncio.gather(*(cache.get_or_compute("during", encoder) for _ in range(5))), timeout=5
    )
    assert encoder.calls == 1 and sorted(r.hit for r in results) == [False] + [True] * 4  # still merged
    assert not cache.shared and cache.stats()["redis_up"] is False
    assert (await cache.get_or_compute("during", must_not_compute)).hit  # the degraded in-process cache
    assert await cache.contains_many(["during", "unknown"]) == [True, False]
    assert await cache.get("unknown") is None
    assert await cache.put("also-during", tensor(3)) is False
    assert (await other.get_or_compute("before", must_not_compute)).hit  # its memory tier still serves
    stats = cache.stats()
    assert stats["errors"] >= 1 and stats["bypassed"] >= 1
    assert (REGISTRY.get_sample_value("epd:encoder_cache_errors_total") or 0.0) > errors_before
    assert REGISTRY.get_sample_value("epd:encoder_cache_redis_up") == 0
    outage_logs = [r for r in caplog.records if r.levelno == logging.WARNING and "unreachable" in r.message]
    assert len(outage_logs) == 2  # once per cache instance (cache, other), not once per call

    server.start()  # same port, empty (no persistence)
    await asyncio.sleep(0.25)  # past retry_interval_s: the next call probes
    assert not (await cache.get_or_compute("after", Encoder(tensor(4)))).hit
    assert cache.shared and cache.stats()["redis_up"] is True
    raw = server.client()
    assert raw.exists(entry_key(namespace, "after"))
    assert (await other.get_or_compute("after", must_not_compute)).hit  # shared again, across replicas
    assert (await cache.get_or_compute("during", must_not_compute)).hit  # local hit re-uploads...
    assert raw.exists(entry_key(namespace, "during"))  # ...what was encoded during the outage
    raw.close()
    assert any("reachable again" in r.message for r in caplog.records)


async def test_redis_unreachable_from_the_start(open_cache) -> None:
    cache = open_cache(url=f"redis://127.0.0.1:{free_port()}/0", redis_timeout_s=0.5)
    encoder = Encoder()
    assert not (await cache.get_or_compute("k", encoder)).hit
    assert (await cache.get_or_compute("k", encoder)).hit and encoder.calls == 1
    assert await cache.contains("k") and not cache.shared


async def test_redis_maxmemory_eviction_means_re_encode(open_cache) -> None:
    server = RedisServer("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru")
    server.start()
    try:
        writer = open_cache(url=server.url)
        big = [tensor(i, rows=128, cols=512) for i in range(12)]  # 256 KiB each, 3 MiB in all
        for i, value in enumerate(big):
            await writer.put(f"k{i}", value)
        reader = open_cache(url=server.url)
        present = await reader.contains_many([f"k{i}" for i in range(12)])
        assert not all(present) and present[-1]  # Redis evicted some, the newest survived
        for i, value in enumerate(big):  # every key still answers: a hit, or a transparent re-encode
            encoder = Encoder(value)  # (re-encodes evict further entries, so a hit is not promised)
            fetched = await reader.get_or_compute(f"k{i}", encoder)
            assert torch.equal(fetched.tensor, value) and encoder.calls == (0 if fetched.hit else 1)
            assert present[i] or not fetched.hit
        assert reader.stats()["errors"] == 0
    finally:
        server.kill()
