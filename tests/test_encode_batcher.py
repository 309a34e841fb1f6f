"""The encoder's micro-batching (``encoder_svc/batcher.py``): an idle encoder runs an image at
once; images that arrive while it is busy share a batch; each gets its own image's embedding."""

from __future__ import annotations

import asyncio
import random

import torch

from encoder_svc.batcher import EncodeBatcher
from runtime.demo_model.shapes import draw_shape


def test_an_idle_encoder_starts_at_once_and_a_busy_one_batches(model):
    adapter = model[0]
    images = [draw_shape(random.Random(k), size=48).image for k in range(3)]
    expected = adapter.encode(images)

    async def run():
        batcher = EncodeBatcher(adapter, window_ms=2000.0)   # a window no idle request may pay
        batcher.start()
        try:
            first = await asyncio.wait_for(batcher.encode(images[0]), timeout=1.5)   # idle: well inside the window
            assert (batcher.idle_starts, batcher.max_observed_batch) == (1, 1)
            rest = await asyncio.gather(batcher.encode(images[1]), batcher.encode(images[2]))  # busy: one batch
            assert (batcher.idle_starts, batcher.max_observed_batch, batcher.computes) == (1, 2, 3)
            return [first, *rest]
        finally:
            await batcher.stop()

    for got, want in zip(asyncio.run(run()), expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
