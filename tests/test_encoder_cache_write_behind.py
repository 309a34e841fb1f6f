"""The encoder's miss path without waiting on Redis: ``missed`` and ``write_behind`` (real Redis).

``write_behind``: ``get_or_compute`` returns once the embedding is computed, while its Redis write
is held up (the Redis server pauses writes from inside ``compute``); the single-flight lock stays
held until the entry is written, so another replica waiting on the key reads it instead of encoding
it again. ``missed``: the caller has just missed the entry; the lock is taken only while the entry is
still absent, so an entry another replica stored in between is read, never encoded twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch
from helpers_cache.fixtures import Encoder, RedisServer, must_not_compute, namespace, open_cache, raw, tensor  # noqa: F401

from cache.redis_entry import entry_key


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A private Redis: the test pauses its writes, which must not stall anyone else's."""
    srv = RedisServer()
    srv.start()
    yield srv
    srv.kill()


async def settle(cache, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while cache.in_flight:
        assert asyncio.get_running_loop().time() < deadline, "write-behind never finished"
        await asyncio.sleep(0.01)


async def test_write_behind_returns_before_the_write_and_holds_the_lock_until_it_lands(
        open_cache, server, namespace) -> None:
    admin = server.client()
    encoder, replica = open_cache(server.url), open_cache(server.url, poll_interval_s=5.0)
    lock, entry = f"{namespace}:lock:k", entry_key(namespace, "k")

    async def encode_then_pause_writes() -> torch.Tensor:
        admin.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")   # the store below waits for the unpause
        return tensor(5)

    try:
        fetched = await asyncio.wait_for(
            encoder.get_or_compute("k", encode_then_pause_writes, write_behind=True), 5.0)
        assert not fetched.hit and torch.equal(fetched.tensor, tensor(5))
        # returned with the write still pending: nothing in Redis yet, the lock still held, counted in flight
        assert not admin.exists(entry) and admin.exists(lock)
        assert encoder.in_flight == 1
        assert torch.equal(await encoder.get("k"), tensor(5))   # this replica answers from its LRU meanwhile
        waiting = asyncio.create_task(replica.get_or_compute("k", must_not_compute))
        await asyncio.sleep(0.2)
        assert not waiting.done()   # the other replica waits on the lock, it does not encode
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    await settle(encoder)
    assert admin.exists(entry) and not admin.exists(lock)
    woken = await asyncio.wait_for(waiting, 3.0)   # woken by the release's publish, long before its 5 s poll
    assert woken.hit and torch.equal(woken.tensor, tensor(5)) and replica.stats()["computes"] == 0
    admin.close()


async def test_close_waits_for_pending_writes(open_cache, server, namespace) -> None:
    admin = server.client()
    cache = open_cache(server.url)

    async def encode_then_pause_writes() -> torch.Tensor:
        admin.execute_command("CLIENT", "PAUSE", 300, "WRITE")   # lifts by itself
        return tensor(2)

    await cache.get_or_compute("k", encode_then_pause_writes, write_behind=True)
    assert cache.in_flight == 1
    await cache.close()
    assert cache.in_flight == 0
    assert admin.exists(entry_key(namespace, "k")) and not admin.exists(f"{namespace}:lock:k")
    admin.close()


async def test_missed_reads_an_entry_stored_since_the_callers_miss(open_cache) -> None:
    a, b = open_cache(), open_cache()
    assert await a.get("k") is None                     # a's read misses ...
    await b.get_or_compute("k", Encoder(tensor(7)))     # ... b stores it and releases ...
    fetched = await a.get_or_compute("k", must_not_compute, missed=True)   # ... a reads it, no second encode
    assert fetched.hit and torch.equal(fetched.tensor, tensor(7))
    assert a.stats()["computes"] == 0 and a.stats()["remote_hits"] == 1


async def test_missed_computes_once_and_stores(open_cache, raw, namespace) -> None:
    a, b = open_cache(), open_cache()
    encoder = Encoder(tensor(8), delay_s=0.1)
    assert await a.get("k") is None and await b.get("k") is None
    results = await asyncio.gather(a.get_or_compute("k", encoder, missed=True),
                                   b.get_or_compute("k", encoder, missed=True))
    assert encoder.calls == 1 and sorted(r.hit for r in results) == [False, True]
    assert raw.exists(entry_key(namespace, "k")) and not raw.exists(f"{namespace}:lock:k")


async def test_write_behind_after_a_hung_holder_still_stores(open_cache, raw, namespace) -> None:
    raw.set(f"{namespace}:lock:k", "hung-host:1:token", px=30_000)   # never released: encode without the lock
    cache = open_cache()
    fetched = await cache.get_or_compute("k", Encoder(tensor(6)), wait_timeout_s=0.3, write_behind=True)
    assert not fetched.hit and cache.stats()["wait_timeouts"] == 1
    await settle(cache)
    assert raw.exists(entry_key(namespace, "k"))
    assert raw.get(f"{namespace}:lock:k") == b"hung-host:1:token"   # the hung holder's lock is not ours to free
