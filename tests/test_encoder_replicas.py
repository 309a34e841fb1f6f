"""Two encoder worker processes sharing the Redis-backed encoder cache.

An image encoded by encoder A is a hit for encoder B (B's vision tower never
runs), and concurrent misses for one image across both replicas cause one encode.
"""

from __future__ import annotations

import asyncio
import io

import grpc
import numpy as np
import pytest
from PIL import Image

from cluster import Cluster
from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc

REDIS_URL = "redis://127.0.0.1:6379/0"


def fresh_png(seed: int) -> bytes:
    """Noise never seen before (keys are content hashes), so each test starts with a miss."""
    rng = np.random.default_rng(seed + int.from_bytes(np.random.bytes(4), "little"))
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("encoders"))
    a = c.start("encoder", "--redis-url", REDIS_URL)
    b = c.start("encoder", "--redis-url", REDIS_URL)
    try:
        c.wait_healthy()
        yield a, b
    finally:
        c.stop()


async def encode(address: str, data: bytes) -> pb.EncodedImage:
    async with grpc.aio.insecure_channel(address) as ch:
        resp = await pb_grpc.EncoderStub(ch).Encode(
            pb.EncodeRequest(request_id="t", images=[pb.EncodeImage(data=data)], return_embeddings=True), timeout=30)
    return resp.images[0]


async def computes(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        return (await pb_grpc.EncoderStub(ch).Stats(pb.StatsRequest(), timeout=5)).computes


async def counters(address: str) -> tuple[int, int]:
    async with grpc.aio.insecure_channel(address) as ch:
        s = await pb_grpc.EncoderStub(ch).Stats(pb.StatsRequest(), timeout=5)
    return s.computes, s.cache_hits


async def encode_image(address: str, image: pb.EncodeImage) -> pb.EncodedImage:
    async with grpc.aio.insecure_channel(address) as ch:
        resp = await pb_grpc.EncoderStub(ch).Encode(
            pb.EncodeRequest(request_id="t", images=[image], return_embeddings=True), timeout=30)
    return resp.images[0]


async def test_image_encoded_by_a_is_a_hit_for_b(encoders):
    a, b = encoders
    data = fresh_png(1)
    before_a, before_b = await computes(a.address), await computes(b.address)
    first = await encode(a.address, data)
    second = await encode(b.address, data)
    assert not first.cache_hit and second.cache_hit
    assert first.cache_key == second.cache_key
    assert first.embedding.data == second.embedding.data  # the same tensor, bit for bit
    assert await computes(a.address) == before_a + 1
    assert await computes(b.address) == before_b  # B's vision tower never ran


async def test_concurrent_misses_across_replicas_encode_once(encoders):
    a, b = encoders
    data = fresh_png(2)
    before = await computes(a.address) + await computes(b.address)
    results = await asyncio.gather(*(encode((a, b)[i % 2].address, data) for i in range(8)))
    assert len({r.embedding.data for r in results}) == 1
    assert await computes(a.address) + await computes(b.address) == before + 1
    assert sum(not r.cache_hit for r in results) == 1


async def test_gateway_style_cached_probe(encoders):
    a, b = encoders
    data = fresh_png(3)
    key = (await encode(a.address, data)).cache_key
    async with grpc.aio.insecure_channel(b.address) as ch:
        resp = await pb_grpc.EncoderStub(ch).Cached(pb.CachedRequest(cache_keys=[key, "0" * 64]), timeout=5)
    assert list(resp.cached) == [True, False]


async def test_a_fetch_by_key_returns_the_embedding_and_is_no_cache_hit(encoders):
    """What a prefill or decode worker sends: the key alone. It reads the entry; it is no hit (a hit
    is a client image that did not need encoding), and a key no cache holds is NOT_FOUND."""
    a, b = encoders
    first = await encode(a.address, fresh_png(4))
    before = await counters(b.address)
    fetched = await encode_image(b.address, pb.EncodeImage(ref=pb.ImageRef(cache_key=first.cache_key)))
    assert fetched.embedding.data == first.embedding.data
    assert await counters(b.address) == before, "a fetch by key counted as a compute or a hit"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await encode_image(b.address, pb.EncodeImage(ref=pb.ImageRef(cache_key="0" * 64)))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_cached_key_is_served_without_decoding_the_bytes_again(encoders):
    """With bytes and a key, the encoder looks the key up first: a hit never decodes the bytes (here
    cut short, so decoding them would fail). The key is read on trust only: what gets written is
    still keyed by what the bytes decode to (next test)."""
    a, b = encoders
    data = fresh_png(5)
    first = await encode(a.address, data)
    computes_before, hits_before = await counters(b.address)
    again = await encode_image(b.address, pb.EncodeImage(ref=pb.ImageRef(cache_key=first.cache_key), data=data[:20]))
    assert again.cache_hit and again.embedding.data == first.embedding.data
    assert await counters(b.address) == (computes_before, hits_before + 1)


async def test_a_key_that_does_not_match_the_bytes_is_refused_on_a_miss_and_nothing_is_written(encoders):
    a, _ = encoders
    wrong = "f" * 64
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await encode_image(a.address, pb.EncodeImage(ref=pb.ImageRef(cache_key=wrong), data=fresh_png(6)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    async with grpc.aio.insecure_channel(a.address) as ch:
        assert list((await pb_grpc.EncoderStub(ch).Cached(pb.CachedRequest(cache_keys=[wrong]), timeout=5)).cached) \
            == [False]


async def test_the_gateways_encode_gets_back_only_embeddings_that_fit_inline(encoders):
    """``inline_up_to_bytes``: an embedding at most that large comes back with the reply (the gateway
    hands it on inline), a larger one does not (the worker fetches it by key)."""
    a, _ = encoders
    data = fresh_png(7)
    size = len((await encode(a.address, data)).embedding.data)
    assert size > 0

    async def inline(limit: int) -> pb.EncodedImage:
        async with grpc.aio.insecure_channel(a.address) as ch:
            resp = await pb_grpc.EncoderStub(ch).Encode(pb.EncodeRequest(
                request_id="t", images=[pb.EncodeImage(data=data)], inline_up_to_bytes=limit), timeout=30)
        return resp.images[0]

    assert len((await inline(size)).embedding.data) == size
    assert not (await inline(size - 1)).HasField("embedding")
    assert not (await inline(0)).HasField("embedding")
