"""The Redis backend against the real Redis on 127.0.0.1:6379 (one namespace per test).

Each cache instance below stands for one encoder replica: its own memory tier
and in-process single-flight, Redis shared. Cross-process runs are in
test_encoder_cache_processes.py; outages in test_encoder_cache_outage.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from helpers_cache.fixtures import Encoder, must_not_compute, namespace, open_cache, raw, tensor  # noqa: F401
from prometheus_client import REGISTRY

from cache.redis_entry import entry_key


def sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def test_miss_then_hit_across_replicas(open_cache, raw, namespace) -> None:
    a, b = open_cache(), open_cache()
    assert a.backend == "redis" and a.shared
    hits_before = sample("epd:encoder_cache_hits_total")
    assert await b.get("k") is None
    first = await a.get_or_compute("k", Encoder(tensor(3)))
    assert not first.hit
    second = await b.get_or_compute("k", must_not_compute)  # replica B never ran the encoder
    assert second.hit and torch.equal(second.tensor, tensor(3))
    assert b.stats()["remote_hits"] == 1 and b.stats()["computes"] == 0
    assert (await b.get_or_compute("k", must_not_compute)).hit and b.stats()["local_hits"] == 1
    assert sample("epd:encoder_cache_hits_total") - hits_before == 2
    # the index fields are readable without moving the payload; the entry has a TTL
    dtype, shape = raw.hmget(entry_key(namespace, "k"), ["dtype", "shape"])
    assert (dtype, shape) == (b"float32", b"16,32") and 0 < raw.pttl(entry_key(namespace, "k")) <= 60_000


async def test_gateway_probe_contains_many(open_cache) -> None:
    encoder, gateway = open_cache(), open_cache()
    await encoder.put("a", tensor())
    assert await gateway.contains_many(["a", "b"]) == [True, False]
    assert await gateway.contains("a") and gateway.stats()["queries"] == 0  # probes are not lookups


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
async def test_payload_round_trips_dtypes(open_cache, dtype) -> None:
    a, b = open_cache(), open_cache()
    await a.put("k", tensor(dtype=dtype))
    got = await b.get("k")
    assert got is not None and got.dtype == dtype and torch.equal(got, tensor(dtype=dtype))


async def test_single_flight_in_process_and_across_replicas(open_cache) -> None:
    replicas = [open_cache(), open_cache(), open_cache()]
    encoder = Encoder(delay_s=0.2)
    calls = [r.get_or_compute("k", encoder) for r in replicas for _ in range(4)]
    results = await asyncio.gather(*calls)
    assert encoder.calls == 1
    assert sorted(r.hit for r in results) == [False] + [True] * 11
    assert all(torch.equal(r.tensor, encoder.value) for r in results)
    assert sum(r.stats()["merges"] for r in replicas) == 11
    assert sum(r.stats()["computes"] for r in replicas) == 1


async def test_waiters_are_woken_by_pubsub_not_polling(open_cache) -> None:
    holder, waiter = open_cache(), open_cache(poll_interval_s=5.0)
    started = asyncio.Event()

    async def slow_encode() -> torch.Tensor:
        started.set()
        await asyncio.sleep(0.4)
        return tensor(9)

    holding = asyncio.create_task(holder.get_or_compute("k", slow_encode))
    await started.wait()
    t0 = time.monotonic()
    fetched = await waiter.get_or_compute("k", must_not_compute)
    assert fetched.hit and torch.equal(fetched.tensor, tensor(9))
    assert time.monotonic() - t0 < 1.5  # woke on the publish, long before the 5 s poll
    assert waiter.stats()["merges"] == 1
    await holding


async def test_failed_holder_releases_and_a_waiter_encodes(open_cache, raw, namespace) -> None:
    holder, waiter = open_cache(), open_cache(poll_interval_s=5.0)
    failing = Encoder(delay_s=0.4, error=RuntimeError("encoder crashed"))
    good = Encoder(tensor(4))
    holding = asyncio.create_task(holder.get_or_compute("k", failing))
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    fetched = await waiter.get_or_compute("k", good)
    assert not fetched.hit and good.calls == 1 and time.monotonic() - t0 < 1.5
    with pytest.raises(RuntimeError, match="encoder crashed"):
        await holding
    assert not raw.exists(f"{namespace}:lock:k")


async def test_expired_lock_of_a_dead_holder_is_taken_over(open_cache, raw, namespace) -> None:
    raw.set(f"{namespace}:lock:k", "dead-host:1:token", px=300)  # a holder that died: no renewals
    cache = open_cache()
    encoder = Encoder()
    t0 = time.monotonic()
    fetched = await cache.get_or_compute("k", encoder)
    assert not fetched.hit and encoder.calls == 1
    assert 0.2 < time.monotonic() - t0 < 2.0


async def test_hung_holder_costs_at_most_the_wait_timeout(open_cache, raw, namespace) -> None:
    raw.set(f"{namespace}:lock:k", "hung-host:1:token", px=30_000)
    cache = open_cache()
    t0 = time.monotonic()
    fetched = await cache.get_or_compute("k", Encoder(), wait_timeout_s=0.3)
    assert not fetched.hit and 0.25 < time.monotonic() - t0 < 2.0
    assert cache.stats()["wait_timeouts"] == 1


async def test_lock_is_renewed_while_a_long_encode_runs(open_cache, raw, namespace) -> None:
    holder, other = open_cache(lock_ttl_s=0.45), open_cache()
    encoder = Encoder(delay_s=0.9)  # twice the lock's expiry
    holding = asyncio.create_task(holder.get_or_compute("k", encoder))
    await asyncio.sleep(0.6)
    assert raw.exists(f"{namespace}:lock:k")
    fetched = await other.get_or_compute("k", must_not_compute)
    assert fetched.hit and encoder.calls == 1
    await holding


async def test_entries_expire(open_cache) -> None:
    a, b = open_cache(ttl_s=0.3), open_cache(ttl_s=0.3)
    await a.put("k", tensor())
    assert await b.contains("k")
    await asyncio.sleep(0.45)
    assert not await a.contains("k") and await b.get("k") is None
    assert not (await b.get_or_compute("k", Encoder())).hit


async def test_missing_payload_means_transparent_re_encode(open_cache, raw, namespace) -> None:
    writer = open_cache()
    await writer.put("k", tensor(1))
    raw.hdel(entry_key(namespace, "k"), "data")  # index fields left, payload gone
    reader = open_cache()
    assert await reader.contains("k")  # the index still says yes...
    assert await reader.get("k") is None  # ...the read finds no payload: a miss, not an error
    assert reader.stats()["stale"] == 1 and not raw.exists(entry_key(namespace, "k"))
    encoder = Encoder(tensor(1))
    fetched = await reader.get_or_compute("k", encoder)
    assert not fetched.hit and encoder.calls == 1
    assert (await open_cache().get_or_compute("k", must_not_compute)).hit  # rewritten whole


async def test_corrupt_payload_and_vanished_entry_are_misses(open_cache, raw, namespace) -> None:
    writer = open_cache()
    await writer.put("k", tensor(1))
    raw.hset(entry_key(namespace, "k"), "data", b"\x00" * 10)  # length does not match 16x32 float32
    reader = open_cache()
    fetched = await reader.get_or_compute("k", Encoder(tensor(1)))
    assert not fetched.hit and reader.stats()["stale"] == 1
    gateway, late = open_cache(), open_cache()
    assert await gateway.contains("k")
    raw.delete(entry_key(namespace, "k"))  # evicted between the gateway's probe and the encode
    assert not (await late.get_or_compute("k", Encoder(tensor(1)))).hit


async def test_local_tier_evicts_by_bytes_and_redis_still_serves(open_cache) -> None:
    one = tensor().numel() * 4
    cache = open_cache(max_bytes=2 * one)
    for i in range(4):
        await cache.put(f"k{i}", tensor(i))
    stats = cache.stats()
    assert stats["entries"] == 2 and stats["bytes"] == 2 * one and stats["evictions"] == 2
    got = await cache.get_or_compute("k0", must_not_compute)
    assert got.hit and torch.equal(got.tensor, tensor(0)) and cache.stats()["remote_hits"] == 1


async def test_local_hit_restores_an_entry_redis_lost(open_cache, raw, namespace) -> None:
    encoder_replica = open_cache()
    await encoder_replica.get_or_compute("k", Encoder(tensor(5)))
    raw.delete(entry_key(namespace, "k"))  # e.g. evicted by Redis maxmemory
    assert (await encoder_replica.get_or_compute("k", must_not_compute)).hit  # local hit...
    prefill = open_cache()
    got = await prefill.get("k")  # ...and the key handed on is fetchable elsewhere again
    assert got is not None and torch.equal(got, tensor(5))


async def test_cancelled_encode_releases_the_lock(open_cache, raw, namespace) -> None:
    holder, other = open_cache(), open_cache(poll_interval_s=5.0)
    started = asyncio.Event()

    async def endless() -> torch.Tensor:
        started.set()
        await asyncio.sleep(60)
        return tensor()

    request = asyncio.create_task(holder.get_or_compute("k", endless))
    await started.wait()
    assert raw.exists(f"{namespace}:lock:k")
    request.cancel()  # the only caller went away (e.g. client disconnect): the encode stops
    with pytest.raises(asyncio.CancelledError):
        await request
    await asyncio.sleep(0.1)
    assert not raw.exists(f"{namespace}:lock:k")  # released, not left to expire
    t0 = time.monotonic()
    assert not (await other.get_or_compute("k", Encoder())).hit
    assert time.monotonic() - t0 < 1.0
