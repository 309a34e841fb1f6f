"""A colocated request whose image is new is encoded on its decode worker, from the bytes on its
``Generate``, and the embedding reaches the encoder's cache, so a repeat is a hit there.

Real worker processes (one encoder, one decode worker, the demo model) and the gateway's
Orchestrator, placement ``colocated``. The answers are the demo model's (the shape drawn), so a
wrong embedding shows as a wrong answer; nothing stays held after any request
(``tests/leaks.py``). The last test plays the gateway by hand: bytes that are not the image the
ref's key names are refused before anything is encoded, and the reservation is freed.
"""

from __future__ import annotations

import asyncio
import io
import random
import time
import uuid

import grpc
import torch
import pytest
from cluster import encoder_and_decode
from demo_jobs import demo_processor, make_job

from cache.keys import image_content_key
from gateway.orchestrator import Orchestrator
from gateway.settings import GatewaySettings
from leaks import LONG_LEASES, LeakCheck, orchestrator_counters
from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.demo_model.shapes import draw_shape
from runtime.worker.wire import GRPC_OPTIONS, tensor_to_pb, token_digest

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def processor():
    return demo_processor()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with encoder_and_decode(tmp_path_factory.mktemp("colocated-encode"), LONG_LEASES) as cluster:
        yield cluster


async def start_gateway(stack, max_ms: float) -> tuple[Orchestrator, LeakCheck]:
    encoder, decode = stack.by_role("encoder")[0], stack.by_role("decode")[0]
    orch = Orchestrator(GatewaySettings(encoder_addrs=[encoder.address], decode_addrs=[decode.address],
                                        placement="colocated", colocated_encode_max_ms=max_ms))
    check = LeakCheck.of_cluster(stack, gateways=[orchestrator_counters(orch)]).begin()
    await orch.start()
    return orch, check


async def answer_and_breakdown(orch: Orchestrator, processor, job) -> tuple[str, dict[str, float]]:
    tokens, breakdown = [], None
    async for ev in orch.generate(job):
        breakdown = breakdown or ev.ttft_breakdown
        tokens.extend(ev.token_ids)
    return processor.tokenizer.decode(tokens, skip_special_tokens=True).strip(), breakdown


async def encoder_stats(stack) -> pb.WorkerStats:
    async with grpc.aio.insecure_channel(stack.by_role("encoder")[0].address) as ch:
        return await pb_grpc.EncoderStub(ch).Stats(pb.StatsRequest(), timeout=5)


def content_key(stats: pb.WorkerStats, job, cache_salt: str = "") -> str:
    """The salted key the gateway and the workers file ``job``'s image under (the encoder's ``stats``)."""
    return image_content_key(job.images[0].image, stats.model_fingerprint, stats.preprocess_digest, cache_salt)


async def cached_at_encoder(stack, key: str, wait_s: float = 10.0) -> bool:
    """Whether the encoder holds ``key`` within ``wait_s`` (the decode worker stores in the background)."""
    async with grpc.aio.insecure_channel(stack.by_role("encoder")[0].address) as ch:
        stub, end = pb_grpc.EncoderStub(ch), time.monotonic() + wait_s
        while True:
            if (await stub.Cached(pb.CachedRequest(cache_keys=[key]), timeout=5)).cached[0]:
                return True
            if time.monotonic() > end:
                return False
            await asyncio.sleep(0.05)


async def test_a_new_image_is_encoded_on_decode_and_its_repeat_is_an_encoder_cache_hit(stack, processor):
    orch, check = await start_gateway(stack, max_ms=1000.0)
    try:
        computes = (await encoder_stats(stack)).computes
        job, answer = make_job(processor, seed=61)
        text, breakdown = await answer_and_breakdown(orch, processor, job)
        assert text == answer
        assert breakdown["images_encoded_on_decode"] == 1
        assert (await encoder_stats(stack)).computes == computes, "the encoder encoded an image decode encoded"

        key = content_key(await encoder_stats(stack), job)
        assert await cached_at_encoder(stack, key), "decode's embedding never reached the encoder's cache"
        again, _ = make_job(processor, seed=61)   # the very same image
        text, breakdown = await answer_and_breakdown(orch, processor, again)
        assert text == answer
        assert breakdown["images_cache_hit"] == 1 and "images_encoded_on_decode" not in breakdown
        assert (await encoder_stats(stack)).computes == computes, "a repeat of a stored image was encoded again"
        await check.settled()
    finally:
        await orch.close()


async def test_an_image_encoded_on_decode_is_stored_in_its_requests_cache_namespace_only(stack, processor):
    orch, check = await start_gateway(stack, max_ms=1000.0)
    try:
        stats = await encoder_stats(stack)
        job, answer = make_job(processor, seed=65)
        job.cache_salt = "tenant-a"
        text, breakdown = await answer_and_breakdown(orch, processor, job)
        assert text == answer and breakdown["images_encoded_on_decode"] == 1
        assert await cached_at_encoder(stack, content_key(stats, job, "tenant-a"))
        assert not await cached_at_encoder(stack, content_key(stats, job), wait_s=0.2)

        other, _ = make_job(processor, seed=65)
        other.cache_salt = "tenant-b"   # the same image in another namespace: new there
        text, breakdown = await answer_and_breakdown(orch, processor, other)
        assert text == answer and breakdown["images_encoded_on_decode"] == 1 and breakdown["images_cache_hit"] == 0
        await check.settled()
    finally:
        await orch.close()


async def test_with_colocated_encode_off_the_encoder_encodes(stack, processor):
    orch, check = await start_gateway(stack, max_ms=0.0)
    try:
        computes = (await encoder_stats(stack)).computes
        job, answer = make_job(processor, seed=62)
        text, breakdown = await answer_and_breakdown(orch, processor, job)
        assert text == answer
        assert "images_encoded_on_decode" not in breakdown
        assert (await encoder_stats(stack)).computes == computes + 1
        await check.settled()
    finally:
        await orch.close()


async def test_bytes_that_are_not_the_refs_image_are_refused_and_nothing_is_held(stack, processor):
    encoder, decode = stack.by_role("encoder")[0], stack.by_role("decode")[0]
    check = LeakCheck.of_cluster(stack).begin()
    stats = await encoder_stats(stack)
    job, _ = make_job(processor, seed=63)
    other = draw_shape(random.Random(64)).image
    buf = io.BytesIO()
    other.save(buf, "PNG")
    key = content_key(stats, job)
    ref = pb.ImageRef(cache_key=key, encoder_address=encoder.address, image_data=buf.getvalue())
    digest = token_digest(job.token_ids, [key])
    deadline_ms = int((time.time() + 20) * 1000)
    async with grpc.aio.insecure_channel(decode.address, options=GRPC_OPTIONS) as ch:
        stub = pb_grpc.DecodeStub(ch)
        res = (await stub.Reserve(pb.ReserveRequest(request_id=uuid.uuid4().hex, prompt_tokens=len(job.token_ids),
                                                    max_tokens=8, deadline_unix_ms=deadline_ms, token_digest=digest),
                                  timeout=5)).reservation
        call = stub.Generate(pb.GenerateRequest(request_id="mismatch", reservation=res, max_tokens=8, colocated=True,
                                                deadline_unix_ms=deadline_ms, token_ids=job.token_ids, images=[ref],
                                                chunk_tokens=8), timeout=20)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache key does not match the image content" in info.value.details()
    assert not await cached_at_encoder(stack, key, wait_s=0.5), "a mismatched embedding reached the encoder's cache"
    await check.settled()


async def test_the_encoder_keeps_no_embedding_that_is_not_this_models(stack):
    async with grpc.aio.insecure_channel(stack.by_role("encoder")[0].address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pb_grpc.EncoderStub(ch).Store(pb.StoreRequest(embeddings=[pb.StoredEmbedding(
                cache_key="not-this-models", embedding=tensor_to_pb(torch.zeros(3, 5)))]), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not await cached_at_encoder(stack, "not-this-models", wait_s=0.2)


async def test_the_store_waits_for_the_requests_first_token(tmp_path_factory, processor):
    """The store of an image encoded on decode starts once the request's first token is out: on a small
    host its serialization and call would run on the cores that token's step needs. A decode worker
    whose every step waits 1.5 s first shows the order: encoded at once, not at the encoder until the
    first event, then stored."""
    env = {**LONG_LEASES, "EPD_FAULTS": "delay_step_ms=1500"}
    with encoder_and_decode(tmp_path_factory.mktemp("store-after-first-token"), env) as slow:
        encoder, decode = slow.by_role("encoder")[0], slow.by_role("decode")[0]
        stats = await encoder_stats(slow)
        job, _ = make_job(processor, seed=66)
        key = content_key(stats, job)
        buf = io.BytesIO()
        job.images[0].image.save(buf, "PNG")
        ref = pb.ImageRef(cache_key=key, encoder_address=encoder.address, image_data=buf.getvalue())
        deadline_ms = int((time.time() + 30) * 1000)
        async with grpc.aio.insecure_channel(decode.address, options=GRPC_OPTIONS) as ch:
            stub = pb_grpc.DecodeStub(ch)
            res = (await stub.Reserve(pb.ReserveRequest(
                request_id=uuid.uuid4().hex, prompt_tokens=len(job.token_ids), max_tokens=1,
                deadline_unix_ms=deadline_ms, token_digest=token_digest(job.token_ids, [key])), timeout=5)).reservation
            call = stub.Generate(pb.GenerateRequest(request_id="store-order", reservation=res, max_tokens=1,
                                                    colocated=True, deadline_unix_ms=deadline_ms,
                                                    token_ids=job.token_ids, images=[ref]), timeout=30)
            first = asyncio.ensure_future(call.read())
            await asyncio.sleep(0.8)   # encoded by now; the first step is still waiting out its 1.5 s
            assert not first.done()
            assert not await cached_at_encoder(slow, key, wait_s=0.0), "the store did not wait for the first token"
            assert (await first).token_ids
            while await call.read() is not grpc.aio.EOF:
                pass
        assert await cached_at_encoder(slow, key), "the embedding never reached the encoder after the first token"
