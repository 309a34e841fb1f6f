"""Qwen3.5 (hybrid: Gated DeltaNet + full attention) through the services: real processes, real gRPC.

The tiny random checkpoint (``epd demo-model --family qwen3_5``), one encoder, one
decode and one prefill worker. Requests go through the gateway's ``PromptBuilder``
and ``Orchestrator`` in this process, both placements, chunks of 1 token, a few
tokens (cutting image spans) and the whole prompt: the prefill worker carries the
linear-attention state chunk to chunk and hands it over on the last chunk
(disaggregated), or the decode worker carries it across its steps (colocated).
The reference is ``generate()`` of the same checkpoint. After every test nothing
is held (``tests/leaks.py``) and every state slot is free on both workers.
"""

from __future__ import annotations

import base64
import io
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
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
from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.demo_model.qwen3_5 import build_qwen3_5
from runtime.worker.wire import GRPC_OPTIONS
from runtime.model.model_adapter import VLMAdapter
from runtime.model.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

SERVED = "family-tiny"
BUILDERS = {"qwen3_5": build_qwen3_5}
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


async def _slots(address: str) -> tuple[int, int]:

    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stub = pb_grpc.DecodeStub(channel)
        s = await stub.Stats(pb.StatsRequest(), timeout=5)
    return s.free_state_slots, s.total_state_slots


@pytest.fixture
async def leaks(stack):
    check = LeakCheck.of_cluster(stack.cluster).begin()
    yield check
    await check.settled()
    free, total = await _slots(stack.worker("decode"))
    assert total > 0 and free == total, f"decode state slots held after the test: {free} of {total} free"


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


@pytest.mark.parametrize("placement, chunk_tokens", [("disaggregated", 1), ("disaggregated", 7), ("disaggregated", 4096),
                                                     ("colocated", 1), ("colocated", 5), ("colocated", 4096)],
                         ids=["disagg-chunk-1", "disagg-chunk-7", "disagg-whole", "coloc-chunk-1", "coloc-chunk-5",
                              "coloc-whole"])
async def test_output_is_token_identical_to_generate(stack, leaks, placement, chunk_tokens):
    async with orchestrator(stack, placement, chunk_tokens, leaks) as o:
        got = {name: await run(o, stack, r) for name, r in stack.requests.items()}
    assert got == {name: (r.expected, r.finish) for name, r in stack.requests.items()}
    if 1 < chunk_tokens < 4096:    # the chunks really cut image spans
        three = stack.requests["three-images"].ids
        runs = image_runs(three, stack.adapter.image_token_id)
        assert any(s < b < e for s, e in runs for b in range(chunk_tokens, len(three), chunk_tokens))


async def test_status_shows_state_slots_and_no_prefix_cache(stack, leaks):

    for role in ("decode", "prefill"):
        async with grpc.aio.insecure_channel(stack.worker(role), options=GRPC_OPTIONS) as channel:
            stub = pb_grpc.DecodeStub(channel) if role == "decode" else pb_grpc.PrefillStub(channel)
            s = await stub.Stats(pb.StatsRequest(), timeout=5)
        assert s.total_state_slots > 0 and s.free_state_slots == s.total_state_slots, role
        if role == "decode":
            assert not s.prefix_cache, "a hybrid model's decode worker keeps no prefix cache"
