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
            pb.EncodeRequest(request_id="t", images=[pb.ImageRef(data=data)], return_embeddings=True), timeout=30)
    return resp.images[0]


async def computes(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        return (await pb_grpc.EncoderStub(ch).Stats(pb.StatsRequest(), timeout=5)).computes


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
