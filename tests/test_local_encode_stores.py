"""The embeddings a decode worker encoded go to their encoder's cache in as few ``Store`` calls as the
timing allows: one call in flight per encoder, and every store that starts meanwhile rides the next one
(``LocalEncoder``'s outbox and sender, ``decode_svc/local_encode.py``).

In process: the demo model's adapter and a real ``LocalEncoder``. The seam is the fetcher (the
encoder directory, and the ``Store`` call itself, which records each call's keys and can be held or
failed); the real call to a real encoder is ``tests/test_colocated_encode.py``.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from cluster import DEMO_MODEL

from decode_svc import local_encode
from decode_svc.local_encode import LocalEncoder
from proto.epd.v1 import epd_pb2 as pb
from runtime.model.families import ImageEmbedding
from runtime.model.model_adapter import VLMAdapter

pytestmark = pytest.mark.timeout(60)

ENCODER = "127.0.0.1:1"
OTHER_ENCODER = "127.0.0.1:2"


class RecordingStores:
    """Every ref's encoder is known; each ``Store`` call's keys are recorded, and a call waits for
    ``release`` (set: calls return at once) and fails while ``failing``."""

    def __init__(self):
        self.calls: list[tuple[str, list[str]]] = []
        self.release = asyncio.Event()
        self.release.set()
        self.failing = False

    async def require_encoders(self, refs) -> None:
        return None

    async def store(self, address, embeddings, timeout_s) -> int:
        self.calls.append((address, [e.cache_key for e in embeddings]))
        await self.release.wait()
        if self.failing:
            raise ConnectionError("encoder unreachable")
        return len(embeddings)


@pytest.fixture(scope="module")
def adapter() -> VLMAdapter:
    torch.set_grad_enabled(False)
    return VLMAdapter.load(DEMO_MODEL)


def encoded(local: LocalEncoder, request_id: str, address: str = ENCODER, images: int = 1) -> list[str]:
    """``request_id``'s images as its encode leaves them (held for ``start_stores``); their keys."""
    hidden = local.adapter.model.config.text_config.hidden_size
    keys = [f"{request_id}-image{i}" for i in range(images)]
    local._hold_stores(request_id, [pb.ImageRef(cache_key=k, encoder_address=address) for k in keys],
                       [ImageEmbedding(torch.zeros(16, hidden)) for _ in keys])
    return keys


async def until(condition, timeout_s: float = 5.0) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.005)
    await asyncio.wait_for(poll(), timeout_s)


async def settled(local: LocalEncoder) -> None:
    while local._senders:
        await asyncio.gather(*local._senders.values())


async def test_stores_that_start_while_a_call_is_in_flight_ride_the_next_call(adapter):
    stores = RecordingStores()
    local = LocalEncoder(adapter, stores)
    first = encoded(local, "r0")
    local.start_stores("r0")                 # alone: it goes at once
    await until(lambda: stores.calls)
    assert stores.calls == [(ENCODER, first)]
    await settled(local)
    stores.release.clear()                   # the next call is held in flight
    second = encoded(local, "r1")
    local.start_stores("r1")
    await until(lambda: len(stores.calls) == 2)
    burst = [k for i in range(2, 8) for k in encoded(local, f"r{i}", images=2)]
    for i in range(2, 8):                    # a step's first tokens: their stores start together
        local.start_stores(f"r{i}")
    await asyncio.sleep(0.05)
    assert stores.calls[1:] == [(ENCODER, second)], "a store waits while its encoder's call is in flight"
    stores.release.set()
    await settled(local)
    assert stores.calls[2:] == [(ENCODER, burst)], "the six requests' twelve embeddings are one call"
    assert local.store_calls == 3 and local.store_failures == 0
    assert not local._outbox and not local._pending
    await local.close()


async def test_each_encoder_has_its_own_call_and_a_second_start_finds_nothing(adapter):
    stores = RecordingStores()
    local = LocalEncoder(adapter, stores)
    mine = encoded(local, "r0")
    theirs = encoded(local, "r1", address=OTHER_ENCODER)
    local.start_stores("r0")
    local.start_stores("r1")
    local.start_stores("r0")                 # Generate's end calls it again: nothing left to send
    await settled(local)
    assert sorted(stores.calls) == [(ENCODER, mine), (OTHER_ENCODER, theirs)]
    await local.close()


async def test_a_call_carries_at_most_the_batch_bytes_and_a_failed_call_counts_each_embedding(adapter, monkeypatch):
    hidden = adapter.model.config.text_config.hidden_size
    monkeypatch.setattr(local_encode, "STORE_BATCH_BYTES", 2 * 16 * hidden * 4)   # two demo embeddings
    stores = RecordingStores()
    local = LocalEncoder(adapter, stores)
    stores.failing = True
    stores.release.clear()
    keys = [k for i in range(5) for k in encoded(local, f"r{i}")]
    local.start_stores("r0")
    await until(lambda: stores.calls)
    for i in range(1, 5):
        local.start_stores(f"r{i}")
    stores.release.set()
    await settled(local)
    assert [len(k) for _, k in stores.calls] == [1, 2, 2], "the first alone, then two by two in order"
    assert [k for _, ks in stores.calls for k in ks] == keys
    assert local.store_failures == 5 and local.store_calls == 3
    await local.close()


async def test_close_waits_for_the_call_in_flight_then_drops_what_still_waits(adapter, monkeypatch):
    monkeypatch.setattr(local_encode, "STORE_CLOSE_WAIT_S", 0.1)
    stores = RecordingStores()
    local = LocalEncoder(adapter, stores)
    stores.release.clear()                   # the encoder never answers
    encoded(local, "r0")
    local.start_stores("r0")
    await until(lambda: stores.calls)
    encoded(local, "r1")
    local.start_stores("r1")
    encoded(local, "r2")                     # encoded, its first token not out yet
    await asyncio.wait_for(local.close(), 5)
    assert not local._senders and not local._outbox and not local._pending
    assert len(stores.calls) == 1
