"""A ``ChatBackend`` test double: the real model, in-process, one model step at a time.

It runs encode -> chunked prefill (KV landed into a decode KV pool, as a decode
worker does) -> decode steps with ``runtime.model.model_adapter``; it is a stand-in
for the orchestrator so the HTTP layer is tested against real tokens, not a
product. Model steps run in a worker thread under one lock, so the event loop
stays free (disconnects and deadlines are noticed while a step runs).

Test hooks (set attributes, they apply to every later request):

* ``refuse``: an ``AdmissionRefused`` raised before the first event (``refusals``: that many times,
  then no more; ``None``: every time);
* ``deadline_exceeded``: raise ``DeadlineExceeded`` before the first event;
* ``hang_before_first``: never produce a first event (the gateway's own guard must fire);
* ``fail_after_tokens``: raise ``BackendFailure`` after that many tokens;
* ``token_delay_s``: sleep between decode steps (makes mid-stream disconnects deterministic);
* ``ignore_eos``: generate until ``max_tokens`` (long outputs from the demo model).

Observations: ``jobs`` (every job received), ``cancelled`` (request ids whose
generator was closed or cancelled before it ran to its end), ``finished`` (ran to
its end: resumed after the event with ``finish_reason``), ``active``
(requests holding KV blocks now) and ``pool.free_blocks``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import io
import random
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from PIL import Image

from gateway.chat_backend import AdmissionRefused, BackendFailure, ChatJob, DeadlineExceeded, TokenEvent
from runtime.demo_model.shapes import ShapeSample, draw_shape
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import DecodeInput, FirstToken, KVChunk, VLMAdapter
from runtime.model.sampling import SampledToken, for_choice

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "models" / "demo-vlm"
_random_model_dir: tempfile.TemporaryDirectory | None = None


def demo_model_path() -> tuple[Path, bool]:
    """``(path, trained)``: the shipped demo model, or a random-weight one built once per process."""
    global _random_model_dir
    if (DEMO_MODEL / "config.json").exists() and any(DEMO_MODEL.glob("*.safetensors")):
        return DEMO_MODEL, True
    if _random_model_dir is None:
        from transformers import LlavaForConditionalGeneration

        from runtime.demo_model.build import build_config, build_processor

        _random_model_dir = tempfile.TemporaryDirectory(prefix="epd-random-vlm-")
        torch.manual_seed(0)
        processor = build_processor()
        model = LlavaForConditionalGeneration(build_config(processor.tokenizer))
        model.save_pretrained(_random_model_dir.name)
        processor.save_pretrained(_random_model_dir.name)
    return Path(_random_model_dir.name), False


class InProcessBackend:
    def __init__(self, adapter: VLMAdapter, *, kv_blocks: int = 256, block_size: int = 16, prefill_chunk: int = 64):
        self.adapter = adapter
        self.pool = KVBlockPool(adapter.kv_layout, kv_blocks, block_size)
        self.prefill_chunk = prefill_chunk
        self._model_lock = threading.Lock()   # one model step at a time; also guards the pool
        # hooks
        self.refuse: AdmissionRefused | None = None
        self.refusals: int | None = None
        self.deadline_exceeded = False
        self.hang_before_first = False
        self.fail_after_tokens: int | None = None
        self.token_delay_s = 0.0
        self.ignore_eos = False
        self.is_healthy = True
        # observations
        self.started = False
        self.closed = False
        self.jobs: list[ChatJob] = []
        self.cancelled: list[str] = []
        self.finished: list[str] = []
        self.active = 0

    # -- ChatBackend ----------------------------------------------------------------
    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    def healthy(self) -> bool:
        return self.is_healthy

    def shed_estimate_ms(self) -> float:
        return 0.0

    def status(self) -> dict:
        return {"backend": "inprocess", "active": self.active, "free_blocks": self.pool.free_blocks,
                "requests": len(self.jobs)}

    async def generate(self, job: ChatJob) -> AsyncIterator[TokenEvent]:
        if job.sampling.n == 1:   # aclosing: closing this generator runs the inner one's cleanup now
            async with contextlib.aclosing(self._generate(job)) as events:
                async for event in events:
                    yield event
            return
        # n > 1: the choices one after another, each its own prefill (the real decode worker shares it)
        self.jobs.append(job)
        for i in range(job.sampling.n):
            one = dataclasses.replace(job, sampling=for_choice(dataclasses.replace(job.sampling, n=1), i))
            async with contextlib.aclosing(self._generate(one, record=False)) as events:
                async for event in events:
                    event.index = i
                    yield event

    async def _generate(self, job: ChatJob, record: bool = True) -> AsyncIterator[TokenEvent]:
        called_s = time.monotonic()
        if record:
            self.jobs.append(job)
        if self.refuse is not None:
            refusal = self.refuse
            if self.refusals is not None:
                self.refusals -= 1
                if self.refusals <= 0:
                    self.refuse, self.refusals = None, None
            raise refusal
        if self.deadline_exceeded or time.monotonic() > job.ttft_deadline_s:
            raise DeadlineExceeded("the first token cannot arrive before the deadline")
        with self._model_lock:
            owner = self.pool.new_token()
            blocks = self.pool.allocate(len(job.token_ids) + job.max_tokens, owner)
        if blocks is None:
            raise AdmissionRefused(503, "KV pool full", 1.0)
        self.active += 1
        done = False
        try:
            if self.hang_before_first:
                await asyncio.Event().wait()
            queued_s = time.monotonic()
            embeddings = await self._run(self.adapter.encode, [im.image for im in job.images]) if job.images else []
            encoded_s = time.monotonic()
            sampled, rope_delta = await self._run(self._prefill, job, embeddings, blocks, owner)
            prefilled_s = time.monotonic()
            breakdown = {
                "queue_ms": (queued_s - called_s) * 1e3,
                "encode_ms": (encoded_s - queued_s) * 1e3,
                "prefill_ms": (prefilled_s - encoded_s) * 1e3,
            }
            produced, position, output = 1, len(job.token_ids), []
            while True:
                token = sampled.token_id
                finish = self._finish(token, produced, job)
                output.append(token)
                yield TokenEvent([token], finish, breakdown, [sampled] if sampled.logprob is not None else None)
                breakdown = None
                if finish is not None:
                    done = True
                    return
                if self.fail_after_tokens is not None and produced >= self.fail_after_tokens:
                    raise BackendFailure("decode worker lost (injected)")
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                step = DecodeInput(token, position, blocks, job.sampling, rope_delta, job.token_ids, list(output))
                (sampled,) = await self._run(self.adapter.decode_sample, self.pool, [step])
                produced += 1
                position += 1
        finally:
            if not done:
                self.cancelled.append(job.request_id)
            else:
                self.finished.append(job.request_id)
            with self._model_lock:  # a cancelled step may still run in its thread: wait for it
                self.pool.free(blocks)
            self.active -= 1

    # -- model steps (worker thread) ------------------------------------------------
    async def _run(self, fn, *args):
        def locked():
            with self._model_lock:
                return fn(*args)

        return await asyncio.to_thread(locked)

    def _prefill(self, job: ChatJob, embeddings: list[torch.Tensor], blocks: list[int], owner: int) -> tuple[SampledToken, int]:
        """The first token and the sequence's rope delta (what decode steps need: 0 for 1-D families)."""
        first = None
        for item in self.adapter.prefill(job.token_ids, embeddings, self.prefill_chunk, job.sampling):
            if isinstance(item, KVChunk):
                self.pool.write(blocks, item.start, item.kv, owner=owner)
            elif isinstance(item, FirstToken):
                first = item
        if first is None:
            raise BackendFailure("prefill produced no token")
        if first.rope_delta != job.rope_delta:   # the gateway's position plan must be the model's
            raise BackendFailure(f"rope delta mismatch: the prompt's {first.rope_delta}, the job's {job.rope_delta}")
        return first.sampled, first.rope_delta

    def _finish(self, token: int, produced: int, job: ChatJob) -> str | None:
        ignore_eos = self.ignore_eos or job.sampling.ignore_eos
        if token in job.sampling.stop_token_ids or (token in self.adapter.eos_token_ids and not ignore_eos):
            return "stop"
        if produced >= job.max_tokens:
            return "length"
        return None


def load_adapter() -> tuple[VLMAdapter, bool]:
    """The demo model's adapter and whether it is the trained one (answers must then be right)."""
    path, trained = demo_model_path()
    return VLMAdapter.load(path), trained


# -- request helpers ------------------------------------------------------------------
def image_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def shape(seed: int) -> ShapeSample:
    return draw_shape(random.Random(seed))


def image_message(url: str, question: str = "what is in the image ?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]}]

