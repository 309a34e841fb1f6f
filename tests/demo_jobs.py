"""A demo-model chat job for the gateway's Orchestrator, and running it to its answer (tests that
drive real workers through the orchestrator without HTTP)."""

from __future__ import annotations

import functools
import io
import random
import time
import uuid

from cluster import DEMO_MODEL
from transformers import AutoProcessor

from gateway.chat_backend import ChatJob, PreparedImage
from gateway.orchestrator import Orchestrator
from runtime.demo_model.shapes import draw_shape
from runtime.model.sampling import SamplingParams


QUESTION = "what is in the image ?"
MAX_TOKENS = 8


@functools.cache
def demo_processor():
    """The demo model's processor, loaded once per test process."""
    return AutoProcessor.from_pretrained(DEMO_MODEL)


def make_job(processor, seed: int, deadline_s: float = 30.0) -> tuple[ChatJob, str]:
    """A one-image question about the shape drawn from ``seed`` (8 tokens, greedy, ``deadline_s`` to the
    first token), and the answer the demo model gives."""
    sample = draw_shape(random.Random(seed))
    buf = io.BytesIO()
    sample.image.save(buf, "PNG")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    ids = processor(images=[sample.image], text=processor.apply_chat_template(msgs, add_generation_prompt=True))["input_ids"][0]
    now = time.monotonic()
    job = ChatJob(uuid.uuid4().hex, list(ids), [PreparedImage(buf.getvalue(), sample.image)], MAX_TOKENS, SamplingParams(),
                  now + deadline_s, 1000.0, now)
    return job, sample.answer


async def run(orch: Orchestrator, processor, job: ChatJob) -> str:
    """The job's reply text, generated through ``orch``."""
    tokens = [t async for ev in orch.generate(job) for t in ev.token_ids]
    return processor.tokenizer.decode(tokens, skip_special_tokens=True).strip()


def model_answer(adapter, seed: int) -> str:
    """What the demo model's own ``generate()`` answers to ``make_job(seed)``: the reference for an image
    drawn from a seed no test has fixed, since the model names the wrong shape for about 1 in 500 of them
    (6 of 3000 random seeds), where ``make_job``'s label would fail a correct pipeline."""
    _, _, expected = greedy_reference(adapter, seed, QUESTION, MAX_TOKENS)
    return adapter.processor.tokenizer.decode(expected, skip_special_tokens=True).strip()


def greedy_reference(adapter, seed: int, question: str, max_tokens: int):
    """A one-image question about the shape drawn from ``seed``, as the demo model's own ``generate()`` answers
    it: ``(prompt ids, image, greedy output without its EOS)``."""
    processor, eos = adapter.processor, set(adapter.eos_token_ids)
    image = draw_shape(random.Random(seed)).image
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}], add_generation_prompt=True)
    enc = processor(images=[image], text=text, return_tensors="pt")
    new = adapter.model.generate(**enc, max_new_tokens=max_tokens, do_sample=False)[0, enc["input_ids"].shape[1]:]
    expected = []
    for t in new.tolist():
        if t in eos:
            break
        expected.append(t)
    return enc["input_ids"][0].tolist(), image, expected
