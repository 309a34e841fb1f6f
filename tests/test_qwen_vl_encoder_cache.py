"""Dynamic resolution and the shared encoder cache (issue 17): other pixel limits, another entry.

Two ``epd encoder`` processes share the real Redis cache: one on a tiny Qwen2.5-VL
checkpoint, one on a copy whose image processor allows fewer pixels
(``size.longest_edge``, the processor's ``max_pixels``). The same image then has
another grid and another number of tokens, so the second encoder must not take the
first one's entry: its key differs (the preprocessing digest names the processor's
settings), it encodes the image itself, and each reports the grid its own processor made.
"""

from __future__ import annotations

import io
import json
import random
import shutil

import grpc
import pytest
from cluster import Cluster
from leaks import LeakCheck
from PIL import Image
from qwen_vl_cases import build_checkpoint

from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(240)

REDIS_URL = "redis://127.0.0.1:6379/0"


def fresh_png(width: int, height: int) -> bytes:
    """Noise never seen before (keys are content hashes), so the first encode is a miss."""
    rng = random.Random()
    image = Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-cache")
    full = build_checkpoint("qwen2_5_vl", root)
    smaller = root / "smaller"
    shutil.copytree(full, smaller)
    config = json.loads((smaller / "processor_config.json").read_text())
    assert config["image_processor"]["size"]["longest_edge"] == 128 * 128
    config["image_processor"]["size"]["longest_edge"] = 64 * 64
    (smaller / "processor_config.json").write_text(json.dumps(config, indent=2))
    cluster = Cluster(root, model=full)
    a = cluster.start("encoder", "--redis-url", REDIS_URL)
    cluster.model = smaller
    b = cluster.start("encoder", "--redis-url", REDIS_URL)
    try:
        cluster.wait_healthy()
        yield cluster, a.address, b.address
    finally:
        cluster.stop()


async def _call(address: str, method: str, request):
    async with grpc.aio.insecure_channel(address) as ch:
        return await getattr(pb_grpc.EncoderStub(ch), method)(request, timeout=30)


async def _encode(address: str, data: bytes) -> pb.EncodedImage:
    resp = await _call(address, "Encode", pb.EncodeRequest(request_id="t", images=[pb.EncodeImage(data=data)]))
    return resp.images[0]


async def test_other_pixel_limits_miss_the_cache(encoders):
    cluster, a, b = encoders
    check = LeakCheck.of_cluster(cluster, redis_url=REDIS_URL).begin()
    stats_a, stats_b = await _call(a, "Stats", pb.StatsRequest()), await _call(b, "Stats", pb.StatsRequest())
    assert stats_a.preprocess_digest != stats_b.preprocess_digest
    data = fresh_png(128, 128)
    first, again = await _encode(a, data), await _encode(a, data)
    assert (first.cache_hit, again.cache_hit, first.cache_key) == (False, True, again.cache_key)
    assert (list(first.grid_thw), first.tokens) == ([1, 16, 16], 64)
    before = (await _call(b, "Stats", pb.StatsRequest())).computes
    other = await _encode(b, data)
    assert not other.cache_hit and other.cache_key != first.cache_key
    assert (list(other.grid_thw), other.tokens) == ([1, 8, 8], 16)
    assert (await _call(b, "Stats", pb.StatsRequest())).computes == before + 1   # its own tower ran
    await check.settled()
