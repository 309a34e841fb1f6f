"""Micro-batching of concurrent encode requests.

Images submitted within ``window_ms`` of each other (up to ``max_batch``) run
through the vision tower as one batch in a worker thread. The window is waited only while
the encoder is busy (a batch ended less than ``window_ms`` before the image came, so more are
likely on the way); an image reaching an idle encoder runs at once, so a lone request's TTFT
does not pay the window. Images that arrive during a batch go together in the next. Each submitter awaits
its own future; a failed batch fails exactly its members. Each image goes with its layout
variant (``families.base``; ``""`` for most families), and one batch may mix variants: the family
encodes each image in its own. Each image is counted in its placeholder tokens (as the request's ref names them, else the
processor's rule, ``VLMAdapter.image_tokens``, ~0.2 ms an image on the event loop for LLaVA): a
batch's timing sample is its tokens, and the queue reports the tokens waiting (an encode is priced
per token, ``runtime.policy.cost_model``).
"""

from __future__ import annotations

import asyncio
import time

import torch
from PIL import Image

from runtime.model.model_adapter import VLMAdapter
from runtime.worker import torch_thread
from runtime.worker.timing_log import TimingLog


class EncodeBatcher:
    def __init__(self, adapter: VLMAdapter, *, max_batch: int = 16, window_ms: float = 3.0, timings: TimingLog | None = None):
        self.adapter = adapter
        self.max_batch = max_batch
        self.window_s = window_ms / 1000
        self.timings = timings or TimingLog()
        self.computes = 0
        self.max_observed_batch = 0
        self.idle_starts = 0               # batches started at once: the encoder was idle
        self._last_end = float("-inf")     # time.monotonic() when the last batch ended
        self._pending: list[tuple[Image.Image, str, asyncio.Future, int]] = []   # image, variant, its future, tokens
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def queue_depth(self) -> int:
        """Images waiting for a batch whose submitter still waits (a cancelled one is dropped unencoded)."""
        return sum(1 for _, _, fut, _ in self._pending if not fut.cancelled())

    @property
    def queued_image_tokens(self) -> int:
        """The placeholder tokens of the images ``queue_depth`` counts."""
        return sum(tokens for _, _, fut, tokens in self._pending if not fut.cancelled())

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="encode-batcher")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        for _, _, fut, _ in self._pending:
            if not fut.done():
                fut.set_exception(RuntimeError("encoder stopping"))
        self._pending.clear()

    async def encode(self, image: Image.Image, layout_variant: str = "", tokens: int = 0) -> torch.Tensor:
        """``image``'s embedding; ``tokens``: its placeholder tokens when the caller knows them (0: computed)."""
        tokens = tokens if tokens > 0 else self.adapter.image_tokens(*image.size, layout_variant)
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((image, layout_variant, fut, tokens))
        self._wake.set()
        return await fut

    async def _loop(self) -> None:
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
            busy = time.monotonic() - self._last_end < self.window_s
            if busy and len(self._pending) < self.max_batch:
                await asyncio.sleep(self.window_s)
            elif not busy:
                self.idle_starts += 1
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
            batch = [entry for entry in batch if not entry[2].cancelled()]
            if not batch:
                continue
            started = time.perf_counter()
            try:
                outputs = await torch_thread.run(self.adapter.encode, [im for im, _, _, _ in batch],
                                                  [v for _, v, _, _ in batch])
            except Exception as exc:
                self._last_end = time.monotonic()
                for _, _, fut, _ in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self._last_end = time.monotonic()
            self.timings.record("encode", sum(tokens for _, _, _, tokens in batch), (time.perf_counter() - started) * 1000)
            self.computes += len(batch)
            self.max_observed_batch = max(self.max_observed_batch, len(batch))
            for (_, _, fut, _), out in zip(batch, outputs):
                if not fut.done():
                    fut.set_result(out)
