"""Decode leases across processes: a colocated request released during its embedding fetch, and
the decode settings that bound what a peer can hold (``EPD_MAX_LEASE_S``, ``EPD_BULK_IDLE_TIMEOUT_S``).

Real processes: one encoder whose every Encode call, a lookup by key included, first
waits ``STALL_MS`` (the built-in ``stall_encoder_ms`` fault: the window), one decode
worker. This process plays the gateway (it encodes the first prompt's image, bytes and
all, before the decode worker fetches it by key) and the prefill worker: it computes the
second prompt's KV with ``VLMAdapter.prefill`` and pushes it over ``Decode.PushKV``.
References are ``model.generate()`` of a model loaded here.
"""

from __future__ import annotations

import asyncio
import io
import random
import time
import uuid

import grpc
import pytest
import torch
from cluster import DEMO_MODEL, Cluster

from cache.keys import image_content_key
from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.demo_model.shapes import QUESTIONS, draw_shape
from runtime.model.model_adapter import FirstToken, VLMAdapter
from runtime.model.tensor_bytes import dtype_name
from runtime.worker.wire import GRPC_OPTIONS, payload_checksum, token_digest

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 10
STALL_MS = 2000
MAX_LEASE_S = 8.0
LEASE_MARGIN_S = 0.5
BULK_IDLE_S = 1.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("colocated-race"))
    try:
        encoder = cluster.start("encoder", "--faults", f"stall_encoder_ms={STALL_MS}")
        decode = cluster.start("decode", env={"EPD_MAX_LEASE_S": str(MAX_LEASE_S), "EPD_LEASE_MARGIN_S": str(LEASE_MARGIN_S),
                                              "EPD_BULK_IDLE_TIMEOUT_S": str(BULK_IDLE_S)})
        torch.set_grad_enabled(False)
        adapter = VLMAdapter.load(DEMO_MODEL)
        cluster.wait_healthy()
        yield cluster, encoder.address, decode.address, adapter
    finally:
        cluster.stop()


def prompt(adapter: VLMAdapter, seed: int, enc_stats: pb.WorkerStats):
    """(token ids, ImageRef, embedding, generate() output without EOS) for the seed's image."""
    processor = adapter.processor
    sample = draw_shape(random.Random(seed))
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[seed % len(QUESTIONS)]}]}],
        add_generation_prompt=True)
    enc = processor(images=[sample.image], text=text, return_tensors="pt")
    out = adapter.model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False)[0, enc["input_ids"].shape[1]:]
    expected = []
    for t in out.tolist():
        if t in adapter.eos_token_ids:
            break
        expected.append(t)
    buf = io.BytesIO()
    sample.image.save(buf, "PNG")
    key = image_content_key(sample.image, enc_stats.model_fingerprint, enc_stats.preprocess_digest)
    return enc["input_ids"][0].tolist(), key, buf.getvalue(), adapter.encode([sample.image])[0], expected


def kv_chunks(adapter: VLMAdapter, ids, embedding, res: pb.Reservation, digest: str) -> list[pb.KVChunk]:
    layout = adapter.kv_layout
    parts = list(adapter.prefill(ids, [embedding], 8))
    first = parts.pop()
    assert isinstance(first, FirstToken)
    msgs = []
    for c in parts:
        payload = c.kv.contiguous().view(torch.uint8).numpy().tobytes()
        msgs.append(pb.KVChunk(reservation=res, chunk_index=c.index, layer_start=0, layer_end=layout.layers,
                               token_start=c.start, token_end=c.end, dtype=dtype_name(layout.dtype),
                               shape=list(c.kv.shape), payload=payload, checksum=payload_checksum(payload)))
    msgs[-1].last, msgs[-1].total_chunks, msgs[-1].first_token = True, len(msgs), first.token_id
    msgs[-1].token_digest, msgs[-1].model_fingerprint = digest, adapter.model_fingerprint
    return msgs


def _deadline_ms(seconds: float) -> int:
    return int((time.time() + seconds) * 1000)


async def _reserve(stub, ids, digest, deadline_ms: int) -> pb.ReserveResponse:
    return await stub.Reserve(pb.ReserveRequest(request_id=f"req-{uuid.uuid4().hex[:6]}", prompt_tokens=len(ids),
                                                max_tokens=MAX_TOKENS, deadline_unix_ms=deadline_ms,
                                                token_digest=digest), timeout=5)


async def _held(stub) -> tuple[int, int, int, int]:
    end = time.monotonic() + 5
    while True:
        s = await stub.Stats(pb.StatsRequest(), timeout=5)
        held = (s.reservations_active, s.pending_chunks, s.running_seqs, s.total_blocks - s.free_blocks)
        if held == (0, 0, 0, 0) or time.monotonic() > end:
            return held
        await asyncio.sleep(0.05)


async def test_colocated_request_released_during_its_fetch_never_writes_the_next_owners_blocks(stack):
    _, encoder, decode, adapter = stack
    async with grpc.aio.insecure_channel(encoder) as ech, grpc.aio.insecure_channel(decode, options=GRPC_OPTIONS) as dch:
        enc_stub, stub = pb_grpc.EncoderStub(ech), pb_grpc.DecodeStub(dch)
        enc_stats = await enc_stub.Stats(pb.StatsRequest(), timeout=5)
        ids_a, key_a, png_a, _, _ = prompt(adapter, 0, enc_stats)
        ids_b, key_b, _, emb_b, expected_b = prompt(adapter, 1, enc_stats)
        digest_a, digest_b = token_digest(ids_a, [key_a]), token_digest(ids_b, [key_b])
        reaped_before = (await stub.Stats(pb.StatsRequest(), timeout=5)).lease_reaped_total

        ref_a = pb.ImageRef(cache_key=key_a, encoder_address=encoder)
        await enc_stub.Encode(pb.EncodeRequest(request_id="a", images=[pb.EncodeImage(ref=ref_a, data=png_a)]),
                              timeout=20)   # as the gateway does: the bytes go to the encoder only
        res_a = (await _reserve(stub, ids_a, digest_a, _deadline_ms(15))).reservation
        call_a = stub.Generate(pb.GenerateRequest(
            request_id="a", reservation=res_a, max_tokens=MAX_TOKENS, deadline_unix_ms=_deadline_ms(15), colocated=True,
            token_ids=ids_a, images=[ref_a], chunk_tokens=8),
            timeout=20)
        task_a = asyncio.ensure_future(call_a.initial_metadata())
        end = time.monotonic() + 5
        while (await enc_stub.Stats(pb.StatsRequest(), timeout=5)).in_flight == 0:   # decode is fetching A's image
            assert time.monotonic() < end, "the decode worker never asked the encoder"
            await asyncio.sleep(0.02)

        assert (await stub.Release(pb.ReleaseRequest(reservation=res_a, reason="test"), timeout=5)).released
        res_b = (await _reserve(stub, ids_b, digest_b, _deadline_ms(30))).reservation   # LIFO: A's very blocks
        ack = await stub.PushKV(iter(kv_chunks(adapter, ids_b, emb_b, res_b, digest_b)), timeout=10)
        assert ack.state == "SUCCESS"
        assert (await enc_stub.Stats(pb.StatsRequest(), timeout=5)).in_flight == 1, "the window closed too early"

        await task_a
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call_a:
                pass
        assert info.value.code() == grpc.StatusCode.ABORTED
        assert info.value.details() == "reservation released while fetching embeddings"

        tokens = [t async for ev in stub.Generate(pb.GenerateRequest(
            request_id="b", reservation=res_b, max_tokens=MAX_TOKENS, deadline_unix_ms=_deadline_ms(30)), timeout=20)
            for t in ev.token_ids]
        assert tokens == expected_b, "the second request's KV was overwritten"
        assert await _held(stub) == (0, 0, 0, 0)
        assert (await stub.Stats(pb.StatsRequest(), timeout=5)).lease_reaped_total == reaped_before


async def test_idle_bulk_peer_is_closed_by_the_configured_timeout(stack):
    _, _, decode, adapter = stack
    async with grpc.aio.insecure_channel(decode, options=GRPC_OPTIONS) as ch:
        stub = pb_grpc.DecodeStub(ch)
        resp = await _reserve(stub, [1] * 20, "d", _deadline_ms(30))
        host, port = resp.bulk_address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            assert await asyncio.wait_for(reader.read(), BULK_IDLE_S + 10) == b""   # closed, not held
        finally:
            writer.close()
        assert (await stub.Release(pb.ReleaseRequest(reservation=resp.reservation), timeout=5)).released


async def test_a_far_future_deadline_is_capped_by_the_configured_max_lease(stack):
    _, _, decode, _ = stack
    async with grpc.aio.insecure_channel(decode, options=GRPC_OPTIONS) as ch:
        stub = pb_grpc.DecodeStub(ch)
        before = (await stub.Stats(pb.StatsRequest(), timeout=5)).lease_reaped_total
        started = time.monotonic()
        await _reserve(stub, [1] * 20, "d", _deadline_ms(10 * 365 * 86400))      # ten years
        end = started + MAX_LEASE_S + LEASE_MARGIN_S + 5
        while (stats := await stub.Stats(pb.StatsRequest(), timeout=5)).reservations_active and time.monotonic() < end:
            await asyncio.sleep(0.1)
        assert stats.reservations_active == 0 and stats.free_blocks == stats.total_blocks
        assert time.monotonic() - started >= MAX_LEASE_S + LEASE_MARGIN_S - 0.1   # the cap, not sooner
        assert stats.lease_reaped_total == before + 1
