"""E -> P -> D end to end: real worker processes on loopback, driven by the gateway's Orchestrator.

One encoder, one prefill and one decode worker (``epd encoder|prefill|decode``
on the demo model) serve the whole module. Every request goes through
``gateway.orchestrator.Orchestrator`` exactly as the HTTP gateway sends it, and
its greedy output must be token-identical to ``model.generate()`` run in this
process on a separately loaded copy of the model.

After every test each decode worker holds nothing: no active reservation, no
pending chunk, every KV block free (releases are asynchronous: polled briefly).
"""

from __future__ import annotations

import asyncio
import io
import random
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import pytest
import torch
from cluster import DEMO_MODEL, Cluster

from gateway.chat_backend import ChatJob, PreparedImage
from gateway.orchestrator import Orchestrator
from gateway.settings import GatewaySettings
from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.demo_model.shapes import QUESTIONS, draw_shape
from runtime.model.sampling import SEED_MAX, SEED_MIN, SamplingParams
from runtime.worker.wire import GRPC_OPTIONS

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 12
N_PROMPTS = 20
N_CONCURRENT = 16
DECODE_PREFILL_CHUNK = 8   # colocated prompts are prefilled on decode in chunks of 8, interleaved with steps


@dataclass
class Prompt:
    ids: list[int]
    png: bytes
    image: object
    expected: list[int]          # generate() output without the EOS
    finish: str                  # "stop" (EOS) or "length"


@dataclass
class Env:
    cluster: Cluster
    encoder: str
    prefill: str
    decode: list[str]
    prompts: list[Prompt]               # seeds 0..N_PROMPTS-1
    concurrent_prompts: list[Prompt]    # other images, for the concurrency test


def _prompt(model, processor, eos: int, seed: int) -> Prompt:
    sample = draw_shape(random.Random(seed))
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[seed % len(QUESTIONS)]}]}],
        add_generation_prompt=True)
    enc = processor(images=[sample.image], text=text, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    finish = "length"
    if eos in new:
        new, finish = new[: new.index(eos)], "stop"
    buf = io.BytesIO()
    sample.image.save(buf, "PNG")
    return Prompt(enc["input_ids"][0].tolist(), buf.getvalue(), sample.image, new, finish)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
    cluster = Cluster(tmp_path_factory.mktemp("e2e"))
    try:
        encoder = cluster.start("encoder")
        decode = cluster.start("decode", "--prefill-chunk-tokens", str(DECODE_PREFILL_CHUNK))
        prefill = cluster.start("prefill")      # after decode: it pushes KV only to discovered peers
        # references while the workers start up
        from transformers import AutoModelForImageTextToText, AutoProcessor

        processor = AutoProcessor.from_pretrained(DEMO_MODEL)
        model = AutoModelForImageTextToText.from_pretrained(DEMO_MODEL).eval()
        eos = int(model.generation_config.eos_token_id)
        prompts = [_prompt(model, processor, eos, seed) for seed in range(N_PROMPTS)]
        concurrent = [_prompt(model, processor, eos, 1000 + seed) for seed in range(N_CONCURRENT)]
        cluster.wait_healthy()
        yield Env(cluster, encoder.address, prefill.address, [decode.address], prompts, concurrent)
    finally:
        cluster.stop()


async def _decode_stats(env: Env) -> list[pb.WorkerStats]:
    out = []
    for address in env.decode:
        async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as ch:
            out.append(await pb_grpc.DecodeStub(ch).Stats(pb.StatsRequest(), timeout=5))
    return out


@pytest.fixture(autouse=True)
async def decode_workers_hold_nothing_after(env):
    yield
    end = time.monotonic() + 5.0
    while True:
        stats = await _decode_stats(env)
        clean = all(s.reservations_active == 0 and s.pending_chunks == 0 and s.running_seqs == 0
                    and s.free_blocks == s.total_blocks for s in stats)
        if clean or time.monotonic() > end:
            break
        await asyncio.sleep(0.05)
    for s in stats:
        assert (s.address, s.reservations_active, s.pending_chunks, s.running_seqs) == (s.address, 0, 0, 0)
        assert s.free_blocks == s.total_blocks


@asynccontextmanager
async def orchestrator(env: Env, placement: str, chunk_tokens: int = 256):
    settings = GatewaySettings(encoder_addrs=[env.encoder], prefill_addrs=[env.prefill], decode_addrs=env.decode,
                               placement=placement, prefill_chunk_tokens=chunk_tokens)
    o = Orchestrator(settings)
    await o.start()
    try:
        yield o
    finally:
        await o.close()


async def run(o: Orchestrator, p: Prompt, deadline_s: float = 60.0,
              sampling: SamplingParams = SamplingParams()) -> tuple[list[int], str, dict]:
    now = time.monotonic()
    job = ChatJob(uuid.uuid4().hex, list(p.ids), [PreparedImage(p.png, p.image)], MAX_TOKENS, sampling,
                  now + deadline_s, 1000.0, now)
    tokens: list[int] = []
    finish, breakdown = None, {}
    async for ev in o.generate(job):
        tokens += ev.token_ids
        finish = ev.finish_reason or finish
        breakdown = ev.ttft_breakdown or breakdown
    return tokens, finish, breakdown


def test_prompts_split_as_intended(env) -> None:
    """The chunk sizes below mean 1, 2 and many chunks only for prompts of 17..32 tokens."""
    lengths = {len(p.ids) for p in env.prompts + env.concurrent_prompts}
    assert all(16 < n <= 32 for n in lengths), lengths
    assert all(p.expected for p in env.prompts)


@pytest.mark.parametrize("chunk_tokens", [64, 16, 3], ids=["1-chunk", "2-chunks", "many-chunks"])
async def test_disaggregated_output_equals_generate(env, chunk_tokens) -> None:
    async with orchestrator(env, "disaggregated", chunk_tokens) as o:
        for i, p in enumerate(env.prompts):
            tokens, finish, breakdown = await run(o, p)
            assert (tokens, finish) == (p.expected, p.finish), f"prompt {i}"
            assert breakdown["transfer_bytes"] == len(p.ids) * 1536        # L3 x 2 x KV2 x D32 x fp32 per token
            assert "colocated_prefill_ms" not in breakdown


@pytest.mark.parametrize("chunk_tokens", [256, 5], ids=["1-chunk", "many-chunks"])
async def test_colocated_output_equals_generate(env, chunk_tokens) -> None:
    before = [len(s.samples) for s in await _decode_stats(env)]
    async with orchestrator(env, "colocated", chunk_tokens) as o:
        for i, p in enumerate(env.prompts[:5]):
            tokens, finish, breakdown = await run(o, p)
            assert (tokens, finish) == (p.expected, p.finish), f"prompt {i}"
            assert "colocated_prefill_ms" in breakdown and "transfer_bytes" not in breakdown
    # the decode worker prefilled in the request's chunk size, one chunk per step
    prefill_steps = [smp.size for s, n in zip(await _decode_stats(env), before) for smp in s.samples[n:]
                     if smp.kind == "prefill"]
    assert prefill_steps and max(prefill_steps) <= chunk_tokens
    assert len(prefill_steps) >= sum(-(-len(p.ids) // chunk_tokens) for p in env.prompts[:5])


async def test_concurrent_requests_share_decode_batches_and_match_single_requests(env) -> None:
    prompts = env.concurrent_prompts
    async with orchestrator(env, "disaggregated", 16) as o:
        single = [await run(o, p) for p in prompts]
        for (tokens, finish, _), p in zip(single, prompts):
            assert (tokens, finish) == (p.expected, p.finish)
        before = max(s.max_batch for s in await _decode_stats(env))
        together = await asyncio.gather(*(run(o, p) for p in prompts))
    after = max(s.max_batch for s in await _decode_stats(env))
    for i, ((tokens, finish, _), (one_tokens, one_finish, _)) in enumerate(zip(together, single)):
        assert (tokens, finish) == (one_tokens, one_finish), f"request {i}"
    assert after > 1, f"decode never ran two sequences in one step (max batch before {before}, after {after})"


async def test_sampling_edges_reach_the_workers_exactly(env) -> None:
    """Issue 15, defect 4: a top_p below float32's reach was 1.0 or a 503 on the wire; now every value works."""
    p = env.prompts[0]
    sampled = {}
    for placement in ("disaggregated", "colocated"):
        async with orchestrator(env, placement) as o:
            for top_p in (1e-300, 5e-324, 4e-7):   # only the top token is left: the greedy answer at any temperature
                tokens, finish, _ = await run(o, p, sampling=SamplingParams(temperature=2.0, top_p=top_p, seed=SEED_MAX))
                assert (tokens, finish) == (p.expected, p.finish), (placement, top_p)
            sampled[placement] = await run(o, p, sampling=SamplingParams(temperature=1.3, top_p=0.999, seed=SEED_MIN))
    # the same seed samples the same tokens whichever worker draws them
    assert sampled["disaggregated"][:2] == sampled["colocated"][:2]
