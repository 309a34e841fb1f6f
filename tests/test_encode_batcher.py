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


def test_the_queue_and_each_batch_count_their_images_tokens(model):
    """An encode is priced by its images' placeholder tokens: the queue reports the tokens waiting,
    and each batch's timing sample is its tokens, not its image count."""
    adapter = model[0]
    images = [draw_shape(random.Random(k), size=48).image for k in range(3)]
    each = adapter.image_tokens(48, 48)

    async def run():
        batcher = EncodeBatcher(adapter, window_ms=2000.0)
        batcher.start()
        try:
            await batcher.encode(images[0])
            waiting = [asyncio.ensure_future(batcher.encode(im)) for im in images[1:]]
            await asyncio.sleep(0.05)   # in the window: both wait for the batch
            assert (batcher.queue_depth, batcher.queued_image_tokens) == (2, 2 * each)
            await asyncio.gather(*waiting)
            assert (batcher.queue_depth, batcher.queued_image_tokens) == (0, 0)
            return [(s.kind, s.size) for s in batcher.timings.since(0)]
        finally:
            await batcher.stop()

    assert each > 1 and asyncio.run(run()) == [("encode", each), ("encode", 2 * each)]


def test_tokens_the_caller_names_are_taken_as_they_are(model, monkeypatch):
    """The encoder passes each ref's placeholder count: the processor's rule is not run again for it."""
    adapter = model[0]
    image = draw_shape(random.Random(5), size=48).image
    monkeypatch.setattr(adapter, "image_tokens", lambda *a: (_ for _ in ()).throw(AssertionError("recounted")))

    async def run():
        batcher = EncodeBatcher(adapter)
        batcher.start()
        try:
            await batcher.encode(image, "", 16)
            return [(s.kind, s.size) for s in batcher.timings.since(0)]
        finally:
            await batcher.stop()

    assert asyncio.run(run()) == [("encode", 16)]
