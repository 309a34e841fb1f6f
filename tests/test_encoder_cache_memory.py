"""The embedded backend and its parts (LRU by bytes, single-flight), plus config and factory."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers_cache.fixtures import Encoder, must_not_compute, tensor
from prometheus_client import REGISTRY

from cache import EncoderCache, EncoderCacheConfig, MemoryEncoderCache, RedisEncoderCache, open_encoder_cache
from cache.factory import open_encoder_cache_for_settings
from runtime.worker.settings import WorkerSettings
from cache.lru import ByteLRU
from cache.single_flight import SingleFlight

KB = 1024


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


# --- ByteLRU ------------------------------------------------------------------------


def test_lru_evicts_least_recently_used_by_bytes() -> None:
    changes: list[tuple[int, int, int]] = []
    lru: ByteLRU[str] = ByteLRU(10 * KB, None, on_change=lambda *c: changes.append(c))
    for name in "abc":
        assert lru.put(name, name, 3 * KB)
    assert lru.get("a") == "a"  # a is now the youngest
    assert lru.put("d", "d", 3 * KB)  # 12 KB > 10 KB: evict b, the oldest
    assert [k for k in "abcd" if lru.contains(k)] == ["a", "c", "d"]
    assert lru.nbytes == 9 * KB and lru.evictions == 1
    assert changes[-1] == (0, 0, 1)  # +3 KB -3 KB, +1 -1 entry, one eviction
    assert sum(c[0] for c in changes) == lru.nbytes and sum(c[1] for c in changes) == len(lru)
    assert not lru.put("huge", "x", 11 * KB) and not lru.contains("huge")
    assert lru.put("e", "e", 10 * KB) and len(lru) == 1 and lru.nbytes == 10 * KB


def test_lru_ttl_slides_on_read_and_purges_on_put() -> None:
    clock = FakeClock()
    lru: ByteLRU[str] = ByteLRU(10 * KB, 5.0, clock=clock)
    lru.put("a", "a", KB)
    lru.put("b", "b", KB)
    clock.now += 4
    assert lru.get("a") == "a"  # a's deadline moves to now + 5
    clock.now += 2
    assert lru.contains("a") and not lru.contains("b") and lru.expirations == 1
    clock.now += 5
    lru.put("c", "c", KB)  # a expired: purged, not evicted
    assert len(lru) == 1 and lru.nbytes == KB and lru.evictions == 0


# --- SingleFlight -------------------------------------------------------------------


async def test_single_flight_merges_and_shares_errors() -> None:
    flights: SingleFlight[int] = SingleFlight()
    calls = 0

    async def work() -> int:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        return 7

    results = await asyncio.gather(*(flights.run("k", work) for _ in range(10)))
    assert calls == 1 and [v for v, _ in results] == [7] * 10
    assert sum(leader for _, leader in results) == 1 and len(flights) == 0

    async def boom() -> int:
        await asyncio.sleep(0.01)
        raise RuntimeError("encoder failed")

    outcomes = await asyncio.gather(*(flights.run("k", boom) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(o, RuntimeError) for o in outcomes) and len(flights) == 0


async def test_single_flight_cancellation() -> None:
    flights: SingleFlight[int] = SingleFlight()
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def work() -> int:
        started.set()
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 1

    first = asyncio.create_task(flights.run("k", work))
    second = asyncio.create_task(flights.run("k", work))
    await started.wait()
    first.cancel()  # one waiter leaves: the flight goes on for the other
    assert await second == (1, False)
    assert first.cancelled() and not cancelled.is_set()

    lone = asyncio.create_task(flights.run("j", work))
    await asyncio.sleep(0.01)
    lone.cancel()  # the last waiter leaves: the work is cancelled, the key is free
    with pytest.raises(asyncio.CancelledError):
        await lone
    await asyncio.wait_for(cancelled.wait(), 1)
    assert not flights.in_flight("j")


# --- MemoryEncoderCache -----------------------------------------------------------


async def test_memory_hit_miss_and_contains() -> None:
    cache = MemoryEncoderCache(max_bytes=1 << 20, ttl_s=60)
    assert isinstance(cache, EncoderCache) and cache.backend == "memory" and not cache.shared
    assert await cache.get("k") is None
    assert await cache.put("k", tensor(1)) is False  # not shared with other processes
    assert torch.equal(await cache.get("k"), tensor(1))
    assert await cache.contains("k") and not await cache.contains("other")
    assert await cache.contains_many(["other", "k"]) == [False, True]
    fetched = await cache.get_or_compute("k", must_not_compute)
    assert fetched.hit and torch.equal(fetched.tensor, tensor(1))
    stats = cache.stats()
    assert (stats["queries"], stats["hits"], stats["misses"], stats["entries"]) == (3, 2, 1, 1)
    assert stats["bytes"] == tensor().numel() * 4
    await cache.close()
    assert cache.stats()["bytes"] == 0


async def test_memory_single_flight_one_compute_for_concurrent_misses() -> None:
    cache = MemoryEncoderCache(max_bytes=1 << 20, ttl_s=60)
    encoder = Encoder(delay_s=0.02)
    names = ("epd:encoder_cache_queries_total", "epd:encoder_computes_total",
             "epd:encoder_cache_singleflight_merges_total")
    before = {n: sample(n) for n in names}
    results = await asyncio.gather(*(cache.get_or_compute("k", encoder) for _ in range(20)))
    assert encoder.calls == 1
    assert sorted(r.hit for r in results) == [False] + [True] * 19
    assert all(r.tensor is results[0].tensor for r in results)
    stats = cache.stats()
    assert (stats["queries"], stats["merges"], stats["computes"], stats["hits"]) == (20, 19, 1, 0)
    assert sample("epd:encoder_cache_queries_total") - before["epd:encoder_cache_queries_total"] == 20
    assert sample("epd:encoder_computes_total") - before["epd:encoder_computes_total"] == 1
    assert sample("epd:encoder_cache_singleflight_merges_total") - before[
        "epd:encoder_cache_singleflight_merges_total"] == 19
    assert (await cache.get_or_compute("k", must_not_compute)).hit


async def test_memory_failed_compute_is_shared_and_not_cached() -> None:
    cache = MemoryEncoderCache(max_bytes=1 << 20, ttl_s=60)
    failing = Encoder(delay_s=0.01, error=RuntimeError("bad image"))
    outcomes = await asyncio.gather(*(cache.get_or_compute("k", failing) for _ in range(4)), return_exceptions=True)
    assert failing.calls == 1 and all(isinstance(o, RuntimeError) for o in outcomes)
    assert not await cache.contains("k")
    assert not (await cache.get_or_compute("k", Encoder())).hit


async def test_memory_bounded_by_bytes_with_eviction_metrics() -> None:
    one = tensor().numel() * 4
    cache = MemoryEncoderCache(max_bytes=3 * one, ttl_s=60)
    bytes_before = sample("epd:encoder_cache_bytes")
    evictions_before = sample("epd:encoder_cache_evictions_total")
    for i in range(5):
        await cache.get_or_compute(f"k{i}", Encoder(tensor(i)))
    assert await cache.contains_many([f"k{i}" for i in range(5)]) == [False, False, True, True, True]
    stats = cache.stats()
    assert stats["bytes"] == 3 * one and stats["evictions"] == 2
    assert sample("epd:encoder_cache_bytes") - bytes_before == 3 * one
    assert sample("epd:encoder_cache_evictions_total") - evictions_before == 2
    await cache.put("huge", torch.zeros(4 * one // 4))  # larger than the whole cache: not stored
    assert not await cache.contains("huge") and cache.stats()["bytes"] == 3 * one
    await cache.close()
    assert sample("epd:encoder_cache_bytes") == bytes_before


async def test_memory_expiry() -> None:
    clock = FakeClock()
    cache = MemoryEncoderCache(max_bytes=1 << 20, ttl_s=10, clock=clock)
    await cache.put("k", tensor())
    clock.now += 11
    assert not await cache.contains("k")
    assert not (await cache.get_or_compute("k", Encoder())).hit


async def test_memory_stores_a_detached_cpu_copy_and_rejects_non_tensors() -> None:
    cache = MemoryEncoderCache(max_bytes=1 << 20, ttl_s=60)
    grad = torch.ones(2, 3, requires_grad=True) * 2
    await cache.put("g", grad)
    stored = await cache.get("g")
    assert stored is not None and not stored.requires_grad and stored.is_contiguous()

    async def not_a_tensor() -> torch.Tensor:
        return [1, 2]  # type: ignore[return-value]

    with pytest.raises(TypeError, match="torch.Tensor"):
        await cache.get_or_compute("n", not_a_tensor)
    with pytest.raises(ValueError, match="key"):
        await cache.get("")


# --- configuration and factory -------------------------------------------------------


async def test_factory_selects_backend_from_url_and_environment(monkeypatch) -> None:
    embedded = open_encoder_cache(None, max_bytes=1 << 20, ttl_s=5)
    assert isinstance(embedded, MemoryEncoderCache)
    monkeypatch.setenv("EPD_REDIS_URL", "")
    assert isinstance(open_encoder_cache_for_settings(WorkerSettings()), MemoryEncoderCache)
    monkeypatch.setenv("EPD_REDIS_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("EPD_CACHE_MAX_MB", "3")
    from_env = open_encoder_cache_for_settings(WorkerSettings())
    assert isinstance(from_env, RedisEncoderCache) and from_env.stats()["max_bytes"] == 3 << 20
    await from_env.close()
    with pytest.raises(ValueError, match="redis_url"):
        open_encoder_cache("http://not-redis:1", max_bytes=1, ttl_s=1)


def test_config_validation_is_explicit() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        EncoderCacheConfig(max_bytes=0)
    with pytest.raises(ValueError, match="ttl_s"):
        EncoderCacheConfig(ttl_s=-1)
    with pytest.raises(ValueError, match="cache_ttl_s"):
        WorkerSettings(cache_ttl_s="soon")
    assert EncoderCacheConfig(redis_url="  ").redis_url is None
