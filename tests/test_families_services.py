"""LLaVA-OneVision, LLaVA-NeXT, Idefics3, SmolVLM and Gemma 3 through the services (issue 18): real processes, real gRPC.

Per family (a module-scoped stack, torn down before the next family's): the tiny
random checkpoint (``epd demo-model --family``'s builder), one encoder, one decode
and one prefill worker (``epd <role> --model DIR``). Requests go through the
gateway's own ``PromptBuilder`` (the chat template, the processor's any-resolution
placeholder expansion) and ``Orchestrator`` in this process, over gRPC, both
placements, with chunk sizes that cut image spans and with the whole prompt. The
reference is ``generate()`` of the same checkpoint loaded here (greedy, cut at the
first EOS, which ends the services' stream). After every test nothing is held
(``tests/leaks.py``).

On the code before issue 18 no worker starts: these architectures were refused at
start-up ("multi-crop (anyres) image features", "multi-crop image splitting").
"""

from __future__ import annotations

import base64
import io
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from cluster import Cluster
from leaks import LONG_LEASES, LeakCheck, orchestrator_counters
from PIL import Image
from qwen_vl_cases import CASES, NEW_TOKENS, Case, image_runs

from gateway.chat_backend import ChatJob, PreparedImage
from gateway.openai_schema import ChatCompletionRequest
from gateway.orchestrator import Orchestrator
from gateway.prompt import PromptBuilder
from gateway.settings import GatewaySettings
from runtime.demo_model.gemma3 import build_gemma3
from runtime.demo_model.idefics3 import SplitFamily, build_idefics3
from runtime.demo_model.llava_anyres import AnyResFamily, build_llava_anyres
from runtime.model.model_adapter import VLMAdapter
from runtime.model.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

SERVED = "family-tiny"
BUILDERS = {**{f.value: build_llava_anyres for f in AnyResFamily}, **{f.value: build_idefics3 for f in SplitFamily},
            "gemma3": build_gemma3}
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


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def _openai_messages(case: Case) -> list[dict]:
    urls = iter("data:image/png;base64," + base64.b64encode(_png(im)).decode() for im in case.images)
    out = []
    for message in case.messages:
        content = message["content"]
        if isinstance(content, list):
            content = [{"type": "image_url", "image_url": {"url": next(urls)}} if part["type"] == "image" else part
                       for part in content]
        out.append({"role": message["role"], "content": content})
    return out


def _request(adapter: VLMAdapter, case: Case) -> Request:
    text = adapter.processor.apply_chat_template(case.messages, add_generation_prompt=True)
    inputs = adapter.processor(images=case.images or None, text=text, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    with torch.inference_mode():
        out = adapter.model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    new, finish = out[0, len(ids):].tolist(), "length"
    for i, token in enumerate(new):
        if token in adapter.eos_token_ids:
            new, finish = new[:i], "stop"
            break
    images = [PreparedImage(_png(im), Image.open(io.BytesIO(_png(im)))) for im in case.images]
    return Request(_openai_messages(case), images, ids, new, finish)


@pytest.fixture(scope="module", params=list(BUILDERS))
def stack(request, tmp_path_factory) -> Stack:
    root = tmp_path_factory.mktemp(f"family-services-{request.param}")
    checkpoint = BUILDERS[request.param](request.param, root / request.param)
    cluster = Cluster(root, model=checkpoint)
    try:
        cluster.start("encoder")
        cluster.start("decode", env=LONG_LEASES)
        cluster.start("prefill")              # after decode: it pushes KV only to discovered peers
        torch.set_num_threads(1)
        adapter = VLMAdapter.load(checkpoint)    # the references, while the workers start
        requests = {case.name: _request(adapter, case) for case in CASES}
        cluster.wait_healthy()
        yield Stack(cluster, adapter, PromptBuilder.from_pretrained(checkpoint), requests)
    finally:
        cluster.stop()


@pytest.fixture
async def leaks(stack):
    check = LeakCheck.of_cluster(stack.cluster).begin()
    yield check
    await check.settled()


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
    chat = ChatCompletionRequest.model_validate({"model": SERVED, "messages": r.messages})
    prompt = stack.builder.build_prompt(chat.messages, [im.image for im in r.images])
    assert prompt.token_ids == r.ids, "the gateway's prompt is the processor's"
    now = time.monotonic()
    job = ChatJob(uuid.uuid4().hex, prompt.token_ids, r.images, MAX_TOKENS, SamplingParams(temperature=0.0),
                  now + 60.0, 1000.0, now, image_grids=prompt.image_grids, rope_delta=prompt.rope_delta)
    tokens, finish = [], None
    async for ev in o.generate(job):
        tokens += ev.token_ids
        finish = ev.finish_reason or finish
    return tokens, finish


@pytest.mark.parametrize("placement, chunk_tokens", [("disaggregated", 7), ("disaggregated", 4096),
                                                     ("colocated", 5), ("colocated", 4096)],
                         ids=["disagg-chunk-7", "disagg-whole", "coloc-chunk-5", "coloc-whole"])
async def test_output_is_token_identical_to_generate(stack, leaks, placement, chunk_tokens):
    async with orchestrator(stack, placement, chunk_tokens, leaks) as o:
        got = {name: await run(o, stack, r) for name, r in stack.requests.items()}
    assert got == {name: (r.expected, r.finish) for name, r in stack.requests.items()}
    if chunk_tokens < 4096:    # the plain boundaries really cut image spans
        three = stack.requests["three-images"].ids
        runs = image_runs(three, stack.adapter.image_token_id)
        assert any(s < b < e for s, e in runs for b in range(chunk_tokens, len(three), chunk_tokens))
