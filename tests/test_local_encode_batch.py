"""Images encoded on a decode worker that wait for its model thread together go through the tower as one
batch (``LocalEncoder._drain``), and a member whose bytes are bad fails alone.

In process: the demo model's adapter, a real ``LocalEncoder`` and the real torch thread, held busy
first (as a decode step would hold it) so that the encodes queue. The one seam is the encoder
directory (``require_encoders``: every ref names a known encoder). The end-to-end path is
``tests/test_colocated_encode.py``.
"""

from __future__ import annotations

import asyncio
import io
import random
import time

import pytest
import torch
from cluster import DEMO_MODEL

from cache.keys import decode_with_key
from decode_svc.local_encode import LocalEncoder, LocalImageError
from proto.epd.v1 import epd_pb2 as pb
from runtime.demo_model.shapes import draw_shape
from runtime.model.model_adapter import VLMAdapter
from runtime.worker import torch_thread

pytestmark = pytest.mark.timeout(60)


class KnownEncoders:
    """Every ref's encoder is known (the directory check passes); nothing is stored in these tests."""

    async def require_encoders(self, refs) -> None:
        return None


@pytest.fixture(scope="module")
def adapter() -> VLMAdapter:
    torch.set_grad_enabled(False)
    return VLMAdapter.load(DEMO_MODEL)


def ref_of(local: LocalEncoder, seed: int) -> tuple[pb.ImageRef, object]:
    image = draw_shape(random.Random(seed)).image
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    data = buf.getvalue()
    _, key = decode_with_key(data, local.adapter.model_fingerprint, local.digest, "", "")
    return pb.ImageRef(cache_key=key, image_data=data), image


async def test_waiting_encodes_run_as_one_batch_and_a_bad_member_fails_alone(adapter, monkeypatch):
    local = LocalEncoder(adapter, KnownEncoders())
    calls: list[int] = []
    encode_images = adapter.encode_images
    monkeypatch.setattr(adapter, "encode_images", lambda images, variants=None: (
        calls.append(len(images)), encode_images(images, variants))[1])
    good = [ref_of(local, seed) for seed in range(3)]
    bad, _ = ref_of(local, 9)
    bad.image_data = good[0][0].image_data      # another image's bytes under this key

    busy = asyncio.ensure_future(torch_thread.run(time.sleep, 0.3))   # a step holds the model thread
    await asyncio.sleep(0.05)
    tasks = [asyncio.ensure_future(local.encode_then(f"r{i}", [ref], lambda records: len(records)))
             for i, (ref, _) in enumerate(good)]
    tasks.insert(1, asyncio.ensure_future(local.encode_then("bad", [bad], lambda records: len(records))))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await busy

    assert isinstance(results[1], LocalImageError)
    for (records, after), (_, image) in zip([results[0], *results[2:]], good):
        assert after == 1                                           # ``then`` ran on the member's own records
        alone = adapter.encode_images([image])[0]
        assert records[0].grid == alone.grid
        torch.testing.assert_close(records[0].features, alone.features, rtol=1e-4, atol=1e-5)
    assert calls[0] == 3, f"the three good images waiting together are one tower call, not {calls}"
    assert local.encoded == 3
    await local.close()


async def test_a_lone_encode_runs_at_once_and_nothing_is_left_waiting(adapter):
    local = LocalEncoder(adapter, KnownEncoders())
    ref, _ = ref_of(local, 4)
    records, after = await asyncio.wait_for(local.encode_then("one", [ref], None), 10)
    assert len(records) == 1 and after is None
    assert local._drainer is None and not local._waiting
    await local.close()
