"""The decode side of the KV handoff, driven directly over gRPC with handcrafted chunks.

One real decode worker process (``epd decode`` on loopback, 1 MiB KV pool, lease
margin 0.5 s) serves the whole module. This process plays the prefill worker: it
computes real prompt KV with ``VLMAdapter.prefill`` on the demo model and pushes
it as ``KVChunk`` messages through ``Decode.PushKV``, exactly as
``prefill_svc`` does, then mangles the stream for each case of the per-chunk
outcome table in ``decode_svc/kv_receiver.py``. Success is judged against
``model.generate()`` run here on a separately loaded copy of the model.

Every test ends with the worker holding nothing: no active reservation, no
pending chunk, every KV block free (checked through ``Decode.Stats``).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from cluster import DEMO_MODEL, Cluster, free_port

from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.demo_model.shapes import QUESTIONS, draw_shape
from runtime.worker.internal_auth import bulk_preamble
from runtime.model.model_adapter import FirstToken, VLMAdapter
from runtime.model.tensor_bytes import dtype_name
from runtime.worker.wire import GRPC_OPTIONS, payload_checksum, token_digest

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 12
LEASE_MARGIN_S = 0.5
KV_MEMORY_MB = 1          # 42 blocks of 16 tokens for the demo model: small enough to exhaust


@dataclass
class Prompt:
    seed: int
    ids: list[int]
    keys: list[str]
    embeddings: list[torch.Tensor]
    expected: list[int]          # generate() output without the EOS
    finish: str                  # "stop" (EOS) or "length"

    @property
    def digest(self) -> str:
        return token_digest(self.ids, self.keys)


@dataclass
class Env:
    address: str
    adapter: VLMAdapter
    prompts: list[Prompt]
    total_blocks: int
    metrics_url: str

    def prompt(self, i: int = 0) -> Prompt:
        return self.prompts[i % len(self.prompts)]


def _reference(model, processor, eos: int, seed: int) -> tuple[list[int], list[int], object, str]:
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
    return enc["input_ids"][0].tolist(), new, sample.image, finish


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
    cluster = Cluster(tmp_path_factory.mktemp("kv-handoff"))
    metrics_port = free_port()
    worker = cluster.start("decode", "--kv-memory-mb", str(KV_MEMORY_MB),
                           env={"EPD_LEASE_MARGIN_S": str(LEASE_MARGIN_S), "EPD_METRICS_PORT": str(metrics_port)})
    try:
        # load here while the worker process starts up
        from transformers import AutoModelForImageTextToText, AutoProcessor

        torch.set_grad_enabled(False)
        processor = AutoProcessor.from_pretrained(DEMO_MODEL)
        model = AutoModelForImageTextToText.from_pretrained(DEMO_MODEL).eval()
        adapter = VLMAdapter.load(DEMO_MODEL)
        eos = int(model.generation_config.eos_token_id)
        prompts = []
        for seed in range(4):
            ids, expected, image, finish = _reference(model, processor, eos, seed)
            prompts.append(Prompt(seed, ids, [f"test-image-{seed}"], adapter.encode([image]), expected, finish))
        cluster.wait_healthy()
        with grpc.insecure_channel(worker.address) as ch:
            stats = pb_grpc.DecodeStub(ch).Stats(pb.StatsRequest(), timeout=5)
        assert stats.model_fingerprint == adapter.model_fingerprint
        assert stats.free_blocks == stats.total_blocks > 0
        yield Env(worker.address, adapter, prompts, stats.total_blocks, f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        cluster.stop()


def test_worker_heap_frozen_at_start(env):
    """A started worker froze its start-up heap (model, torch, gRPC) out of later full collections,
    and reports the collector's pauses on its metrics port (``runtime/worker/gc_heap.py``)."""
    import httpx

    text = httpx.get(env.metrics_url, timeout=5, trust_env=False).text
    frozen = [float(l.split()[-1]) for l in text.splitlines() if l.startswith("epd:gc_frozen_objects ")]
    assert frozen and frozen[0] > 100_000
    assert "# TYPE epd:gc_pause_seconds histogram" in text


def chunk_outcomes(env: Env) -> dict[str, float]:
    """The worker's ``epd:worker_kv_chunks_total`` counter by outcome, scraped from its metrics port."""
    import httpx

    out = {}
    for line in httpx.get(env.metrics_url, timeout=5, trust_env=False).text.splitlines():
        if line.startswith("epd:worker_kv_chunks_total{"):
            name, value = line.rsplit(" ", 1)
            out[name.split('outcome="')[1].split('"')[0]] = float(value)
    return out


def outcome_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


async def _stats(stub) -> pb.WorkerStats:
    return await stub.Stats(pb.StatsRequest(), timeout=5)


async def _wait_stats(stub, pred, timeout_s: float = 5.0) -> pb.WorkerStats:
    end = time.monotonic() + timeout_s
    while True:
        stats = await _stats(stub)
        if pred(stats) or time.monotonic() > end:
            return stats
        await asyncio.sleep(0.05)


@pytest.fixture
async def stub(env):
    """A Decode stub; afterwards the worker must hold nothing (releases are async: poll briefly)."""
    channel = grpc.aio.insecure_channel(env.address, options=GRPC_OPTIONS)
    s = pb_grpc.DecodeStub(channel)
    try:
        yield s
        stats = await _wait_stats(s, lambda st: st.reservations_active == 0 and st.pending_chunks == 0
                                  and st.free_blocks == st.total_blocks)
        assert (stats.reservations_active, stats.pending_chunks, stats.running_seqs) == (0, 0, 0)
        assert stats.free_blocks == stats.total_blocks == env.total_blocks
    finally:
        await channel.close()


# -- helpers: the prefill side, by hand ------------------------------------------------
def _deadline_ms(seconds: float) -> int:
    return int((time.time() + seconds) * 1000)


async def reserve(stub, env: Env, p: Prompt, *, deadline_s: float = 30.0, **overrides) -> pb.Reservation:
    req = dict(request_id=f"req-{uuid.uuid4().hex[:8]}", prompt_tokens=len(p.ids), max_tokens=MAX_TOKENS,
               deadline_unix_ms=_deadline_ms(deadline_s), token_digest=p.digest,
               model_fingerprint=env.adapter.model_fingerprint)
    req.update(overrides)
    resp = await stub.Reserve(pb.ReserveRequest(**req), timeout=5)
    assert resp.reservation.generation == 1 and resp.blocks > 0
    return resp.reservation


def kv_chunks(env: Env, p: Prompt, reservation: pb.Reservation, chunk_tokens: int, *,
              digest: str | None = None, fingerprint: str | None = None) -> list[pb.KVChunk]:
    """Real prompt KV, chunked and framed as prefill_svc frames it (checksum, final-chunk fields)."""
    layout = env.adapter.kv_layout
    parts = list(env.adapter.prefill(p.ids, p.embeddings, chunk_tokens))
    first = parts.pop()
    assert isinstance(first, FirstToken) and first.token_id == p.expected[0]
    msgs = []
    for c in parts:
        payload = c.kv.contiguous().view(torch.uint8).numpy().tobytes()
        msg = pb.KVChunk(request_id="prefill-by-hand", reservation=reservation, chunk_index=c.index,
                         layer_start=0, layer_end=layout.layers, token_start=c.start, token_end=c.end,
                         dtype=dtype_name(layout.dtype), shape=list(c.kv.shape), payload=payload,
                         checksum=payload_checksum(payload))
        msgs.append(msg)
    last = msgs[-1]
    last.last, last.total_chunks, last.first_token = True, len(msgs), first.token_id
    last.token_digest = p.digest if digest is None else digest
    last.model_fingerprint = env.adapter.model_fingerprint if fingerprint is None else fingerprint
    last.prefill_ms = 1.0
    return msgs


def garbage_like(chunk: pb.KVChunk, reservation: pb.Reservation | None = None) -> pb.KVChunk:
    """Same framing (valid checksum), payload of large random values: poison if it ever landed."""
    g = pb.KVChunk()
    g.CopyFrom(chunk)
    if reservation is not None:
        g.reservation.CopyFrom(reservation)
    kv = torch.randn(tuple(chunk.shape), generator=torch.Generator().manual_seed(7)) * 1e3
    g.payload = kv.to(torch.float32).view(torch.uint8).numpy().tobytes()
    g.checksum = payload_checksum(g.payload)
    return g


async def push(stub, chunks) -> pb.PushKVResponse:
    return await stub.PushKV(iter(list(chunks)), timeout=10)


async def generate(stub, reservation: pb.Reservation, deadline_s: float = 20.0) -> tuple[list[int], str, list[pb.TokenEvent]]:
    call = stub.Generate(pb.GenerateRequest(request_id="gen", reservation=reservation, max_tokens=MAX_TOKENS,
                                            deadline_unix_ms=_deadline_ms(deadline_s)), timeout=deadline_s + 10)
    events = [ev async for ev in call]
    tokens = [t for ev in events for t in ev.token_ids]
    return tokens, events[-1].finish_reason, events


async def generate_error(stub, reservation: pb.Reservation) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(stub, reservation)
    return info.value


# -- success ---------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_tokens", [64, 16, 3], ids=["1-chunk", "2-chunks", "many-chunks"])
async def test_full_handoff_decodes_exactly_what_generate_does(env, stub, chunk_tokens) -> None:
    p = env.prompt(chunk_tokens)
    res = await reserve(stub, env, p)
    chunks = kv_chunks(env, p, res, chunk_tokens)
    assert len(chunks) == -(-len(p.ids) // chunk_tokens)
    ack = await push(stub, chunks)
    assert (ack.accepted, ack.duplicates, ack.rejected, ack.state) == (len(chunks), 0, 0, "SUCCESS")
    stats = await _stats(stub)
    assert (stats.reservations_active, stats.pending_chunks) == (1, len(chunks))  # landed, not yet inserted

    tokens, finish, events = await generate(stub, res)
    assert tokens == p.expected and finish == p.finish
    metric = events[0].transfer
    assert metric.chunks == len(chunks)
    assert metric.transfer_total_bytes == len(p.ids) * env.adapter.kv_layout.bytes_per_token
    assert metric.HasField("transfer_latency_s") and metric.transfer_latency_s >= 0


async def test_a_reservation_of_three_choices_reports_the_blocks_the_pool_lost(env, stub) -> None:
    p = env.prompt(0)
    before = (await _stats(stub)).free_blocks
    resp = await stub.Reserve(pb.ReserveRequest(
        request_id="choices", prompt_tokens=len(p.ids), max_tokens=MAX_TOKENS, deadline_unix_ms=_deadline_ms(30),
        token_digest=p.digest, model_fingerprint=env.adapter.model_fingerprint, choices=3), timeout=5)
    after = (await _stats(stub)).free_blocks
    assert resp.blocks == before - after > 0
    released = await stub.Release(pb.ReleaseRequest(request_id="choices", reservation=resp.reservation, reason="test"),
                                  timeout=5)
    assert released.released and (await _stats(stub)).free_blocks == before


async def test_duplicate_chunks_are_counted_and_the_transfer_succeeds(env, stub) -> None:
    p = env.prompt(1)
    res = await reserve(stub, env, p)
    c = kv_chunks(env, p, res, 8)
    assert len(c) == 4
    ack = await push(stub, [c[0], c[0], c[1], c[1]])            # the same index twice in one stream
    assert (ack.accepted, ack.duplicates, ack.rejected, ack.state) == (2, 2, 0, "TRANSFERRING")
    ack = await push(stub, [c[1], c[2], c[3], c[3], c[0]])      # a resend across streams, and after SUCCESS
    assert (ack.accepted, ack.duplicates, ack.rejected, ack.state) == (2, 3, 0, "SUCCESS")
    assert (await _stats(stub)).pending_chunks == 4            # duplicates never counted twice

    tokens, finish, events = await generate(stub, res)
    assert tokens == p.expected and finish == p.finish
    assert events[0].transfer.chunks == 4


async def test_out_of_order_arrival_succeeds(env, stub) -> None:
    p = env.prompt(2)
    res = await reserve(stub, env, p)
    chunks = kv_chunks(env, p, res, 3)
    order = list(range(len(chunks)))
    random.Random(3).shuffle(order)
    order.remove(len(chunks) - 1)
    order.insert(0, len(chunks) - 1)                            # the final chunk (total, digest) first
    ack = await push(stub, [chunks[i] for i in order[:4]])
    assert (ack.accepted, ack.state) == (4, "TRANSFERRING")     # not SUCCESS while any index is missing
    ack = await push(stub, [chunks[i] for i in order[4:]])
    assert (ack.accepted, ack.duplicates, ack.rejected, ack.state) == (len(chunks) - 4, 0, 0, "SUCCESS")

    tokens, finish, _ = await generate(stub, res)
    assert tokens == p.expected and finish == p.finish


# -- failures --------------------------------------------------------------------------
async def test_corrupted_chunk_fails_the_transfer_and_the_reservation_is_kept_until_release(env, stub) -> None:
    p = env.prompt(0)
    res = await reserve(stub, env, p)
    c = kv_chunks(env, p, res, 8)
    bad = pb.KVChunk()
    bad.CopyFrom(c[1])
    data = bytearray(bad.payload)
    data[len(data) // 2] ^= 0xFF
    bad.payload = bytes(data)                                   # checksum left as sent: mismatch
    ack = await push(stub, [c[0], bad, c[2], c[3]])
    assert (ack.accepted, ack.rejected, ack.state) == (1, 3, "FAILED")
    assert "checksum mismatch on chunk 1" in ack.detail

    err = await generate_error(stub, res)
    assert err.code() == grpc.StatusCode.ABORTED
    assert err.details().startswith("KV transfer failed") and "checksum mismatch" in err.details()
    await asyncio.sleep(0.3)
    stats = await _stats(stub)
    assert stats.reservations_active == 1                       # kept for a retry into it (Rearm)
    assert stats.free_blocks == env.total_blocks - 3
    late = await push(stub, [c[1]])                             # a FAILED attempt accepts nothing more
    assert (late.accepted, late.rejected, late.state) == (0, 1, "FAILED")

    released = await stub.Release(pb.ReleaseRequest(request_id="r", reservation=res, reason="test"), timeout=5)
    assert released.released
    again = await stub.Release(pb.ReleaseRequest(request_id="r", reservation=res, reason="test"), timeout=5)
    assert not again.released                                   # idempotent: freed exactly once


async def test_stale_generation_after_rearm_is_rejected_and_never_written(env, stub) -> None:
    p = env.prompt(3)
    res1 = await reserve(stub, env, p)
    c1 = kv_chunks(env, p, res1, 8)
    bad = pb.KVChunk()
    bad.CopyFrom(c1[0])
    bad.checksum = "0" * 32
    ack = await push(stub, [bad])
    assert ack.state == "FAILED"
    assert (await generate_error(stub, res1)).code() == grpc.StatusCode.ABORTED

    rearmed = await stub.Rearm(pb.RearmRequest(request_id="r", reservation=res1), timeout=5)
    res2 = rearmed.reservation
    assert res2.reservation_id == res1.reservation_id and res2.generation == 2
    c2 = kv_chunks(env, p, res2, 8)
    ack = await push(stub, [c1[2], *c2, garbage_like(c2[0], res1), garbage_like(c2[1], res1)])
    assert (ack.accepted, ack.rejected, ack.state) == (len(c2), 3, "SUCCESS")
    assert "stale generation 1 != 2" in ack.detail

    err = await generate_error(stub, res1)                     # the old generation cannot start decode
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    tokens, finish, _ = await generate(stub, res2)             # poison from generation 1 never landed
    assert tokens == p.expected and finish == p.finish


async def test_chunk_after_release_is_rejected_and_never_written(env, stub) -> None:
    p = env.prompt(1)
    # control: poison that does land changes the output, so "output unchanged" below means "not written"
    res0 = await reserve(stub, env, p)
    c0 = kv_chunks(env, p, res0, 16)
    ack = await push(stub, [garbage_like(c0[0]), c0[1]])
    assert ack.state == "SUCCESS"
    tokens, _, _ = await generate(stub, res0)
    assert tokens != p.expected

    gone = await reserve(stub, env, p)
    assert (await stub.Release(pb.ReleaseRequest(request_id="r", reservation=gone, reason="test"), timeout=5)).released
    res = await reserve(stub, env, p)                           # LIFO free list: the very blocks `gone` had
    ack = await push(stub, kv_chunks(env, p, res, 16))
    assert ack.state == "SUCCESS"
    poison = [garbage_like(c) for c in kv_chunks(env, p, gone, 16)]
    before = chunk_outcomes(env)
    late = await push(stub, poison)
    assert (late.accepted, late.duplicates, late.rejected, late.state) == (0, 0, len(poison), "")
    assert outcome_delta(before, chunk_outcomes(env)) == {"rejected": len(poison)}   # operators see it too
    assert "unknown or released reservation" in late.detail
    tokens, finish, _ = await generate(stub, res)
    assert tokens == p.expected and finish == p.finish

    err = await generate_error(stub, gone)
    assert err.code() == grpc.StatusCode.NOT_FOUND


async def test_reservation_that_does_not_fit_takes_nothing(env, stub) -> None:
    before = await _stats(stub)
    block = before.block_size
    with pytest.raises(grpc.aio.AioRpcError) as never:
        await stub.Reserve(pb.ReserveRequest(request_id="huge", prompt_tokens=env.total_blocks * block,
                                             max_tokens=1, deadline_unix_ms=_deadline_ms(30)), timeout=5)
    assert never.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "never fit" in never.value.details()
    assert (await _stats(stub)).free_blocks == before.free_blocks

    # fill the pool to 2 free blocks, then ask for 3
    big = await stub.Reserve(pb.ReserveRequest(request_id="big", prompt_tokens=(env.total_blocks - 2) * block - 1,
                                               max_tokens=1, deadline_unix_ms=_deadline_ms(30)), timeout=5)
    assert (await _stats(stub)).free_blocks == 2
    with pytest.raises(grpc.aio.AioRpcError) as no_room:
        await stub.Reserve(pb.ReserveRequest(request_id="more", prompt_tokens=2 * block, max_tokens=1,
                                             deadline_unix_ms=_deadline_ms(30)), timeout=5)
    assert no_room.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "no room" in no_room.value.details()
    stats = await _stats(stub)
    assert (stats.free_blocks, stats.reservations_active) == (2, 1)
    assert (await stub.Release(pb.ReleaseRequest(request_id="big", reservation=big.reservation), timeout=5)).released


async def test_peer_that_disappears_mid_transfer_leaves_a_lease_that_expires(env, stub) -> None:
    p = env.prompt(2)
    deadline_s = 3.0
    started = time.monotonic()
    res = await reserve(stub, env, p, deadline_s=deadline_s)
    expires_at = started + deadline_s + LEASE_MARGIN_S - 0.01     # lease = deadline + margin, no earlier
    chunks = kv_chunks(env, p, res, 4)
    vanish = asyncio.Event()

    async def sender():
        yield chunks[0]
        yield chunks[1]
        await vanish.wait()                                   # the peer dies here: never sends the rest
        for c in chunks[2:]:
            yield c

    call = stub.PushKV(sender(), timeout=30)
    stats = await _wait_stats(stub, lambda st: st.pending_chunks == 2)
    assert (stats.pending_chunks, stats.reservations_active) == (2, 1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call

    probe = await push(stub, [chunks[0]])                     # a harmless resend reads the state back
    assert (probe.duplicates, probe.state) == (1, "TRANSFERRING")
    assert time.monotonic() < expires_at
    assert (await _stats(stub)).reservations_active == 1      # held while the lease lasts

    stats = await _wait_stats(stub, lambda st: st.reservations_active == 0, timeout_s=deadline_s + 5)
    assert stats.reservations_active == 0 and stats.pending_chunks == 0
    assert time.monotonic() >= expires_at                     # not before deadline + margin
    assert stats.free_blocks == env.total_blocks
    late = await push(stub, chunks[2:])                       # the rest, too late: rejected, not written
    assert (late.accepted, late.rejected) == (0, len(chunks) - 2)


@pytest.mark.parametrize("field", ["token_digest", "model_fingerprint"])
async def test_digest_or_fingerprint_mismatch_fails_the_transfer(env, stub, field) -> None:
    p = env.prompt(0)
    res = await reserve(stub, env, p)
    wrong = {"digest": token_digest(p.ids, ["another-image"])} if field == "token_digest" else {"fingerprint": "f" * 24}
    chunks = kv_chunks(env, p, res, 16, **wrong)
    ack = await push(stub, chunks)
    assert (ack.accepted, ack.rejected, ack.state) == (len(chunks), 0, "FAILED")

    err = await generate_error(stub, res)
    assert err.code() == grpc.StatusCode.ABORTED
    expected = "token digest mismatch" if field == "token_digest" else "fingerprint mismatch"
    assert err.details().startswith("KV transfer failed") and expected in err.details()
    assert (await stub.Release(pb.ReleaseRequest(request_id="r", reservation=res), timeout=5)).released


# -- the bulk TCP path (decode_svc/bulk_receiver.py) -------------------------------------------
async def bulk_reserve(stub, env: Env, p: Prompt) -> tuple[pb.Reservation, str]:
    resp = await stub.Reserve(pb.ReserveRequest(
        request_id=f"req-{uuid.uuid4().hex[:8]}", prompt_tokens=len(p.ids), max_tokens=MAX_TOKENS,
        deadline_unix_ms=_deadline_ms(30), token_digest=p.digest, model_fingerprint=env.adapter.model_fingerprint),
        timeout=5)
    assert resp.bulk_address, "decode workers offer the bulk KV path by default"
    return resp.reservation, resp.bulk_address


def as_bulk(msgs: list[pb.KVChunk]) -> list[tuple[pb.KVChunk, bytes]]:
    out = []
    for m in msgs:
        header = pb.KVChunk()
        header.CopyFrom(m)
        payload = header.payload
        header.ClearField("payload")
        header.payload_bytes = len(payload)
        out.append((header, payload))
    return out


async def test_bulk_path_handoff_with_duplicates_decodes_exactly(env, stub) -> None:
    from prefill_svc.kv_sender import KVSender
    from runtime.worker.faults import FaultInjector

    p = env.prompt(3)
    reservation, bulk = await bulk_reserve(stub, env, p)
    frames = as_bulk(kv_chunks(env, p, reservation, 5))
    sender = KVSender(stub, 10, FaultInjector(""), bulk_address=bulk)
    for header, payload in [frames[0], *frames]:  # chunk 0 twice
        sender.put(header, payload)
    sender.finish()
    sender.start()
    ack = await sender.wait()
    assert (ack.state, ack.accepted, ack.duplicates) == ("SUCCESS", len(frames), 1)
    tokens, finish, _ = await generate(stub, reservation)
    assert tokens == p.expected and finish == p.finish


async def test_bulk_path_malformed_stream_is_closed_and_nothing_lands(env, stub) -> None:
    import struct

    p = env.prompt(4)
    reservation, bulk = await bulk_reserve(stub, env, p)
    host, port = bulk.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(bulk_preamble(None) + struct.pack("<I", 10_000_000))  # a header length no sender would use
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # the worker closed the stream
    writer.close()
    stats = await _stats(stub)
    assert stats.pending_chunks == 0
    # the reservation is still usable by a well-formed transfer
    await push(stub, kv_chunks(env, p, reservation, 16))
    tokens, _, _ = await generate(stub, reservation)
    assert tokens == p.expected


async def test_bulk_chunk_cut_off_by_release_never_writes_into_the_next_owners_blocks(env, stub) -> None:
    """The bulk path reads payloads straight into pool blocks: a release in the middle of a
    chunk must stop the writes, even when the same blocks already belong to someone else."""
    import struct

    p = env.prompt(5)
    gone, bulk = await bulk_reserve(stub, env, p)
    header, _ = as_bulk([garbage_like(m) for m in kv_chunks(env, p, gone, 10_000)])[0]   # one chunk, poison
    payload = garbage_like(kv_chunks(env, p, gone, 10_000)[0]).payload
    head = header.SerializeToString()
    host, port = bulk.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    half = len(payload) // 2
    writer.write(bulk_preamble(None) + struct.pack("<I", len(head)) + head + payload[:half])
    await writer.drain()
    await _wait_stats(stub, lambda s: True)   # a round trip: the worker has had time to read the first half
    await asyncio.sleep(0.2)

    assert (await stub.Release(pb.ReleaseRequest(request_id="r", reservation=gone, reason="test"), timeout=5)).released
    res = await reserve(stub, env, p)                           # the very blocks `gone` had
    assert (await push(stub, kv_chunks(env, p, res, 16))).state == "SUCCESS"

    before = chunk_outcomes(env)
    writer.write(payload[half:] + struct.pack("<I", 0))        # the rest of the stale chunk, after the new KV
    await writer.drain()
    size = struct.unpack("<I", await asyncio.wait_for(reader.readexactly(4), 5))[0]
    reply = pb.PushKVResponse.FromString(await reader.readexactly(size))
    writer.close()
    assert (reply.accepted, reply.rejected) == (0, 1)
    assert "released or re-armed while the chunk was arriving" in reply.detail
    assert outcome_delta(before, chunk_outcomes(env)) == {"rejected": 1}   # the bulk path counts alike

    tokens, finish, _ = await generate(stub, res)
    assert tokens == p.expected and finish == p.finish
    assert (await _stats(stub)).pending_chunks == 0
