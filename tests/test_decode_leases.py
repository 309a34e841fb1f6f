"""Decode leases, in process: a request never writes into blocks it no longer owns.

A real ``DecodeServicer`` (demo model, real scheduler, real KV pool) is served by a
real gRPC server on loopback inside this process, so the test can look into the
pool. The one seam is the embedding fetcher: ``GatedFetcher`` serves embeddings
encoded here and holds each fetch until the test opens its gate — the window in
which a ``Release`` (or the lease reaper) frees a colocated request's blocks and
the next ``Reserve`` is handed the very same ones.

Success is judged against ``model.generate()`` of the same loaded model and
against a snapshot of the second request's landed KV.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import grpc
import pytest
import torch
from cluster import DEMO_MODEL
from demo_jobs import greedy_reference

from decode_svc.request_status import DecodeStatus
from decode_svc.scheduler import Sequence
from decode_svc.servicer import DecodeServicer
from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.demo_model.shapes import QUESTIONS
from cache.embedding_fetch import EmbeddingFetcher
from runtime.worker.peers import PeerDirectory
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import FirstToken, VLMAdapter
from runtime.model.sampling import SamplingParams
from runtime.model.tensor_bytes import dtype_name
from runtime.worker.wire import GRPC_OPTIONS, payload_checksum, token_digest

pytestmark = pytest.mark.timeout(120)

MAX_TOKENS = 10
KV_BLOCKS = 24
LEASE_MARGIN_S = 0.2


@dataclass
class Prompt:
    ids: list[int]
    key: str
    embedding: torch.Tensor
    expected: list[int]        # generate() output without the EOS

    @property
    def digest(self) -> str:
        return token_digest(self.ids, [self.key])


@pytest.fixture(scope="module")
def adapter() -> VLMAdapter:
    torch.set_grad_enabled(False)
    return VLMAdapter.load(DEMO_MODEL)


@pytest.fixture(scope="module")
def prompts(adapter) -> list[Prompt]:
    out = []
    for seed in range(3):
        with torch.inference_mode():
            ids, image, expected = greedy_reference(adapter, seed, QUESTIONS[seed % len(QUESTIONS)], MAX_TOKENS)
        out.append(Prompt(ids, f"image-{seed}", adapter.encode([image])[0], expected))
    assert out[0].ids != out[1].ids
    return out


class GatedFetcher(EmbeddingFetcher):
    """Test seam: embeddings computed in this process, each fetch held until ``gate`` is set."""

    def __init__(self, prompts: list[Prompt]):
        super().__init__(None, peers=PeerDirectory({}, None))
        self.by_key = {p.key: p.embedding for p in prompts}
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def fetch(self, request_id, images, timeout_s):
        self.entered.set()
        await self.gate.wait()
        return [self.by_key[im.cache_key] for im in images]


@dataclass
class Decode:
    servicer: DecodeServicer
    stub: pb_grpc.DecodeStub
    fetcher: GatedFetcher

    @property
    def pool(self) -> KVBlockPool:
        return self.servicer.pool


@pytest.fixture
async def decode(adapter, prompts):
    fetcher = GatedFetcher(prompts)
    pool = KVBlockPool(adapter.kv_layout, KV_BLOCKS, 16)
    servicer = DecodeServicer(adapter, pool, fetcher=fetcher, prefill_chunk_tokens=8,
                              lease_margin_s=LEASE_MARGIN_S, max_lease_s=30.0)
    server = grpc.aio.server()
    pb_grpc.add_DecodeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    servicer.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    try:
        yield Decode(servicer, pb_grpc.DecodeStub(channel), fetcher)
        # every path freed what it held
        end = time.monotonic() + 3
        while servicer.table.active and time.monotonic() < end:
            await asyncio.sleep(0.05)
        stats = servicer.local_stats()
        assert (stats["reservations_active"], stats["running_seqs"], stats["free_blocks"]) == (0, 0, KV_BLOCKS)
    finally:
        await channel.close()
        await servicer.close()
        await server.stop(0)


def _deadline_ms(seconds: float) -> int:
    return int((time.time() + seconds) * 1000)


async def reserve(d: Decode, p: Prompt, deadline_s: float = 30.0) -> pb.Reservation:
    resp = await d.stub.Reserve(pb.ReserveRequest(
        request_id=f"req-{uuid.uuid4().hex[:6]}", prompt_tokens=len(p.ids), max_tokens=MAX_TOKENS,
        deadline_unix_ms=_deadline_ms(deadline_s), token_digest=p.digest), timeout=5)
    return resp.reservation


def colocated(d: Decode, p: Prompt, res: pb.Reservation):
    return d.stub.Generate(pb.GenerateRequest(
        request_id="colocated", reservation=res, max_tokens=MAX_TOKENS, deadline_unix_ms=_deadline_ms(30),
        colocated=True, token_ids=p.ids, images=[pb.ImageRef(cache_key=p.key)], chunk_tokens=8), timeout=30)


async def collect(call) -> list[int]:
    return [t async for ev in call for t in ev.token_ids]


async def push_kv(d: Decode, adapter: VLMAdapter, p: Prompt, res: pb.Reservation) -> None:
    """Land ``p``'s real prompt KV in ``res`` over PushKV, as a prefill worker does."""
    layout = adapter.kv_layout
    parts = list(adapter.prefill(p.ids, [p.embedding], 8))
    first = parts.pop()
    assert isinstance(first, FirstToken)
    msgs = []
    for c in parts:
        payload = c.kv.contiguous().view(torch.uint8).numpy().tobytes()
        msgs.append(pb.KVChunk(reservation=res, chunk_index=c.index, layer_start=0, layer_end=layout.layers,
                               token_start=c.start, token_end=c.end, dtype=dtype_name(layout.dtype),
                               shape=list(c.kv.shape), payload=payload, checksum=payload_checksum(payload)))
    last = msgs[-1]
    last.last, last.total_chunks, last.first_token = True, len(msgs), first.token_id
    last.token_digest, last.model_fingerprint = p.digest, adapter.model_fingerprint
    ack = await d.stub.PushKV(iter(msgs), timeout=10)
    assert ack.state == "SUCCESS", ack


async def generate(d: Decode, res: pb.Reservation) -> list[int]:
    return await collect(d.stub.Generate(pb.GenerateRequest(
        request_id="disaggregated", reservation=res, max_tokens=MAX_TOKENS, deadline_unix_ms=_deadline_ms(30)),
        timeout=30))


# -- defect 1: a colocated request whose reservation went away while it fetched ---------------------
@pytest.mark.parametrize("how", ["release", "lease_expiry"])
async def test_colocated_request_never_writes_into_blocks_it_lost_while_fetching(decode, adapter, prompts, how):
    a, b = prompts[0], prompts[1]
    res_a = await reserve(decode, a, deadline_s=0.3 if how == "lease_expiry" else 30.0)
    blocks_a = list(decode.servicer.table.get(res_a.reservation_id).blocks)
    task_a = asyncio.ensure_future(collect(colocated(decode, a, res_a)))
    await asyncio.wait_for(decode.fetcher.entered.wait(), 5)        # A is inside its embedding fetch

    if how == "release":
        released = await decode.stub.Release(pb.ReleaseRequest(reservation=res_a, reason="test"), timeout=5)
        assert released.released
    else:
        end = time.monotonic() + 5
        while decode.servicer.table.get(res_a.reservation_id) is not None and time.monotonic() < end:
            await asyncio.sleep(0.05)
        assert decode.servicer.table.reaped_total == 1                # the reaper freed it, and counted it

    res_b = await reserve(decode, b)                                  # LIFO free list: A's very blocks
    blocks_b = decode.servicer.table.get(res_b.reservation_id).blocks
    assert set(blocks_b) & set(blocks_a), "the second request must get the first one's blocks"
    await push_kv(decode, adapter, b, res_b)
    landed = decode.pool.read(blocks_b, 0, len(blocks_b) * 16)

    decode.fetcher.gate.set()                                         # A's fetch returns now
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(task_a, 20)
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "reservation released while" in info.value.details()
    for _ in range(3):                                                # a few scheduler turns for a stray step
        await asyncio.sleep(0.05)
    assert torch.equal(decode.pool.read(blocks_b, 0, len(blocks_b) * 16), landed), "A wrote into B's blocks"

    assert await generate(decode, res_b) == b.expected
    assert decode.servicer.table.reaped_total == (1 if how == "lease_expiry" else 0)


# -- the scheduler's fence, without the servicer's checks --------------------------------------------
async def test_scheduler_retires_a_sequence_whose_lease_is_gone_without_writing(decode, adapter, prompts):
    """A future code path that inserts, or keeps running, a sequence whose reservation was freed
    must not write: the scheduler checks the pool's owner token at insertion and before each step."""
    servicer, pool = decode.servicer, decode.pool
    table, scheduler = servicer.table, servicer.scheduler
    a, b = prompts[0], prompts[2]
    embeds_a = adapter.prepare(a.ids, [a.embedding])   # the PreparedPrompt insert_colocated takes

    def sequence(res) -> Sequence:
        return Sequence("a", res.lease, res.blocks, res.prompt_tokens, MAX_TOKENS, SamplingParams())

    # 1. inserted after its reservation was released (the servicer check "forgotten")
    res = table.reserve("a", len(a.ids), MAX_TOKENS, time.monotonic() + 30, a.digest, "fp")
    seq = sequence(res)
    table.release(res.reservation_id, "test")
    other = table.reserve("b", len(b.ids), MAX_TOKENS, time.monotonic() + 30, b.digest, "fp")
    assert set(other.blocks) & set(seq.blocks)
    pool.write(other.blocks, 0, torch.ones(adapter.kv_layout.layers, 2, 16, adapter.kv_layout.kv_heads,
                                           adapter.kv_layout.head_dim), owner=other.lease.owner)
    snapshot = pool.kv.clone()
    scheduler.insert_colocated(seq, embeds_a)
    ev = await asyncio.wait_for(seq.events.get(), 5)
    assert (ev.finish_reason, ev.token_ids) == ("aborted", [])
    assert seq.status is DecodeStatus.FINISHED_ABORTED and not scheduler.holds(seq)
    assert not scheduler.busy
    assert torch.equal(pool.kv, snapshot)
    table.release(other.reservation_id, "test")

    # 2. inserted while valid, then its blocks freed behind the scheduler's back before the first step
    res = table.reserve("a", len(a.ids), MAX_TOKENS, time.monotonic() + 30, a.digest, "fp")
    seq = sequence(res)
    scheduler.insert_colocated(seq, embeds_a)                 # no await: the scheduler has not stepped yet
    table.release(res.reservation_id, "a buggy path")          # not via cancel: the blocks just go
    other = table.reserve("b", len(b.ids), MAX_TOKENS, time.monotonic() + 30, b.digest, "fp")
    pool.write(other.blocks, 0, torch.ones(adapter.kv_layout.layers, 2, 16, adapter.kv_layout.kv_heads,
                                           adapter.kv_layout.head_dim), owner=other.lease.owner)
    snapshot = pool.kv.clone()
    ev = await asyncio.wait_for(seq.events.get(), 5)
    assert ev.finish_reason == "aborted" and "nothing was written" in ev.detail
    assert seq.status is DecodeStatus.FINISHED_ABORTED
    assert torch.equal(pool.kv, snapshot), "a step ran for a sequence whose lease was gone"
    assert table.get(other.reservation_id) is not None, "retiring the stale sequence must not free B"
    table.release(other.reservation_id, "test")


# -- the lease cap and the reaper counter ---------------------------------------------------------
def scrape(servicer) -> str:
    """The worker metrics endpoint's text for ``servicer`` (its collector, rendered as Prometheus serves it)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from runtime.worker.worker_metrics import _WorkerCollector

    registry = CollectorRegistry()
    registry.register(_WorkerCollector(lambda: servicer))
    return generate_latest(registry).decode()


async def test_a_far_future_deadline_gets_a_lease_capped_at_max_lease(adapter, prompts):
    pool = KVBlockPool(adapter.kv_layout, KV_BLOCKS, 16)
    servicer = DecodeServicer(adapter, pool, fetcher=GatedFetcher(prompts), lease_margin_s=LEASE_MARGIN_S,
                              max_lease_s=0.5)
    server = grpc.aio.server()
    pb_grpc.add_DecodeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    servicer.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.DecodeStub(ch)
            p = prompts[0]
            before = time.monotonic()
            years = int((time.time() + 10 * 365 * 86400) * 1000)
            resp = await stub.Reserve(pb.ReserveRequest(request_id="greedy", prompt_tokens=len(p.ids),
                                                        max_tokens=MAX_TOKENS, deadline_unix_ms=years), timeout=5)
            res = servicer.table.get(resp.reservation.reservation_id)
            assert res.lease_expires_at <= time.monotonic() + 0.5 + LEASE_MARGIN_S
            assert res.lease_expires_at >= before + 0.5 + LEASE_MARGIN_S - 0.01
            assert (await stub.Stats(pb.StatsRequest(), timeout=5)).lease_reaped_total == 0
            end = time.monotonic() + 5
            while servicer.table.active and time.monotonic() < end:
                await asyncio.sleep(0.05)
            stats = await stub.Stats(pb.StatsRequest(), timeout=5)
            assert (stats.reservations_active, stats.free_blocks) == (0, KV_BLOCKS), "the cap did not end the lease"
            assert stats.lease_reaped_total == 1 and servicer.local_stats()["lease_reaped_total"] == 1
            assert "epd:lease_reaped_total 1.0" in scrape(servicer).splitlines()   # the worker metrics endpoint
            # a reservation released by its owner is not counted
            resp = await stub.Reserve(pb.ReserveRequest(request_id="ok", prompt_tokens=len(p.ids),
                                                        max_tokens=MAX_TOKENS, deadline_unix_ms=years), timeout=5)
            assert (await stub.Release(pb.ReleaseRequest(reservation=resp.reservation), timeout=5)).released
            await asyncio.sleep(1.0)
            assert (await stub.Stats(pb.StatsRequest(), timeout=5)).lease_reaped_total == 1
    finally:
        await servicer.close()
        await server.stop(0)


async def test_a_second_generate_on_the_same_generation_is_refused(decode, prompts):
    """Two colocated Generates for one reservation would both write its blocks: the second is refused."""
    p = prompts[0]
    res = await reserve(decode, p)
    first = asyncio.ensure_future(collect(colocated(decode, p, res)))
    await asyncio.wait_for(decode.fetcher.entered.wait(), 5)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(colocated(decode, p, res))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    decode.fetcher.gate.set()
    assert await asyncio.wait_for(first, 20) == p.expected
