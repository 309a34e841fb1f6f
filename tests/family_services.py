"""What the per-family services tests share: a tiny random checkpoint served by real encoder, decode
and prefill processes, its ``generate()`` references, and requests sent through the gateway's own
``PromptBuilder`` and ``Orchestrator`` in the test's process.

``family_stack`` builds the checkpoint, starts the workers (prefill after decode: it pushes KV only to
discovered peers), computes the references while they start and yields a ``Stack``; everything is
stopped on exit. ``orchestrator`` is one placement's gateway side, counted by the test's leak check.
"""

from __future__ import annotations

import base64
import io
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from cluster import Cluster
from leaks import LONG_LEASES, LeakCheck, orchestrator_counters
from PIL import Image
from qwen_vl_cases import CASES, NEW_TOKENS, Case, hf_images

from gateway.chat_backend import ChatJob, PreparedImage
from gateway.openai_schema import ChatCompletionRequest
from gateway.orchestrator import Orchestrator
from gateway.prompt import PromptBuilder
from gateway.settings import GatewaySettings
from runtime.model.model_adapter import VLMAdapter
from runtime.model.sampling import SamplingParams

SERVED = "family-tiny"
MAX_TOKENS = NEW_TOKENS


@dataclass
class Request:
    messages: list[dict]            # OpenAI chat messages (images as data: URLs of PNGs)
    images: list[PreparedImage]     # as the gateway decodes them
    ids: list[int]                  # the processor's prompt (placeholders expanded)
    expected: list[int]             # generate(), cut at the first EOS
    finish: str


@dataclass
class Stack:
    cluster: Cluster
    adapter: VLMAdapter
    builder: PromptBuilder
    requests: dict[str, Request]

    def worker(self, role: str) -> str:
        return self.cluster.by_role(role)[0].address


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def openai_messages(case: Case) -> list[dict]:
    """The case's conversation as an OpenAI client sends it: each image part an ``image_url``, in order."""
    urls = iter("data:image/png;base64," + base64.b64encode(png(im)).decode() for im in case.images)
    out = []
    for message in case.messages:
        content = message["content"]
        if isinstance(content, list):
            content = [{"type": "image_url", "image_url": {"url": next(urls)}} if part["type"] == "image" else part
                       for part in content]
        out.append({"role": message["role"], "content": content})
    return out


def reference_request(adapter: VLMAdapter, case: Case) -> Request:
    """``case`` as a client sends it, with the checkpoint's greedy ``generate()`` (cut at the first EOS)."""
    text = adapter.processor.apply_chat_template(case.messages, add_generation_prompt=True)
    inputs = adapter.processor(images=hf_images(case.images), text=text, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    with torch.inference_mode():
        out = adapter.model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    new, finish = out[0, len(ids):].tolist(), "length"
    for i, token in enumerate(new):
        if token in adapter.eos_token_ids:
            new, finish = new[:i], "stop"
            break
    images = [PreparedImage(png(im), Image.open(io.BytesIO(png(im)))) for im in case.images]
    return Request(openai_messages(case), images, ids, new, finish)


@contextmanager
def family_stack(root: Path, family: str, build: Callable[[str, Path], Path]) -> Iterator[Stack]:
    checkpoint = build(family, root / family)
    cluster = Cluster(root, model=checkpoint)
    try:
        cluster.start("encoder")
        cluster.start("decode", env=LONG_LEASES)
        cluster.start("prefill")              # after decode: it pushes KV only to discovered peers
        torch.set_num_threads(1)
        adapter = VLMAdapter.load(checkpoint)    # the references, while the workers start
        requests = {case.name: reference_request(adapter, case) for case in CASES}
        cluster.wait_healthy()
        yield Stack(cluster, adapter, PromptBuilder.from_pretrained(checkpoint), requests)
    finally:
        cluster.stop()


@asynccontextmanager
async def orchestrator(stack: Stack, placement: str, chunk_tokens: int, check: LeakCheck):
    settings = GatewaySettings(encoder_addrs=[stack.worker("encoder")], prefill_addrs=[stack.worker("prefill")],
                               decode_addrs=[stack.worker("decode")], placement=placement,
                               prefill_chunk_tokens=chunk_tokens)
    o = Orchestrator(settings)
    await o.start()
    probe = orchestrator_counters(o)
    check.gateways.append(probe)
    try:
        yield o
    finally:
        await check.settled()
        check.gateways.remove(probe)
        await o.close()


async def run(o: Orchestrator, stack: Stack, r: Request) -> tuple[list[int], str]:
    """One request through ``o``: its tokens and finish reason (the gateway's prompt must be the processor's)."""
    (choice,) = await run_choices(o, stack, r, 1)
    return choice


async def run_choices(o: Orchestrator, stack: Stack, r: Request, n: int) -> list[tuple[list[int], str]]:
    """``run`` with ``n`` greedy choices: each choice's tokens and finish reason, by index."""
    chat = ChatCompletionRequest.model_validate({"model": SERVED, "messages": r.messages})
    prompt = stack.builder.build_prompt(chat.messages, [im.image for im in r.images])
    assert prompt.token_ids == r.ids, "the gateway's prompt is the processor's"
    now = time.monotonic()
    job = ChatJob(uuid.uuid4().hex, prompt.token_ids, r.images, MAX_TOKENS, SamplingParams(temperature=0.0, n=n),
                  now + 60.0, 1000.0, now, image_grids=prompt.image_grids, rope_delta=prompt.rope_delta,
                  image_variants=prompt.image_variants)
    tokens: list[list[int]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    async for ev in o.generate(job):
        tokens[ev.index] += ev.token_ids
        finish[ev.index] = ev.finish_reason or finish[ev.index]
    return list(zip(tokens, finish))
