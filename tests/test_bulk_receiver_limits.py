"""The bulk KV receiver's limits: idle peers are closed, and nothing is allocated for a header
the reservation does not accept.

A real ``BulkKVServer`` on loopback in this process, over a real reservation table
and KV pool (a small layout: no model is needed to move bytes). Peers are plain
sockets speaking the frame format of ``decode_svc/bulk_receiver.py``.
"""

from __future__ import annotations

import asyncio
import struct
import time

import pytest
import torch

from decode_svc.bulk_receiver import BulkKVServer
from decode_svc.kv_receiver import KVReceiver
from decode_svc.reservations import ReservationTable
from proto.epd.v1 import epd_pb2 as pb
from runtime.worker.internal_auth import bulk_preamble
from runtime.worker.faults import FaultInjector
from runtime.model.kv_pool import KVBlockPool, KVLayout
from runtime.model.tensor_bytes import dtype_name
from runtime.worker.wire import payload_checksum

pytestmark = pytest.mark.timeout(60)

LAYOUT = KVLayout(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32)   # 64 bytes per token
PROMPT = 6
_LEN = struct.Struct("<I")


class OffHostPool(KVBlockPool):
    """Test seam: a pool that reports itself off the host, so the receiver takes the staged path."""

    @property
    def host_resident(self) -> bool:
        return False


class CountingServer(BulkKVServer):
    """Records every staging buffer asked for (the allocation the header check must precede)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.buffers_taken: list[int] = []

    def take_buffer(self, size: int) -> bytearray:
        self.buffers_taken.append(size)
        return super().take_buffer(size)


class Env:
    def __init__(self, pool: KVBlockPool, idle_timeout_s: float):
        self.pool = pool
        self.table = ReservationTable(pool, lease_margin_s=10)
        self.receiver = KVReceiver(self.table, pool)
        self.server = CountingServer(self.receiver, FaultInjector(""), idle_timeout_s=idle_timeout_s)

    async def connect(self):
        """A stream past its handshake (no token configured: any well-formed preamble)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.server.port)
        writer.write(bulk_preamble(None))
        return reader, writer

    def reserve(self):
        return self.table.reserve("r", PROMPT, 2, time.monotonic() + 30, "digest", "fp")


@pytest.fixture
async def make_env():
    envs: list[Env] = []

    async def make(*, idle_timeout_s: float = 30.0, off_host: bool = False) -> Env:
        cls = OffHostPool if off_host else KVBlockPool
        env = Env(cls(LAYOUT, num_blocks=8, block_size=4), idle_timeout_s)
        await env.server.start("127.0.0.1")
        envs.append(env)
        return env

    yield make
    for env in envs:
        await env.server.stop()


def frame(res, start: int, end: int, *, index: int = 0, last: bool = True, payload_bytes: int | None = None,
          seed: int = 0) -> tuple[bytes, bytes]:
    """One frame (length + header) and its payload: real bytes of the layout's shape."""
    kv = torch.randn(LAYOUT.layers, 2, end - start, LAYOUT.kv_heads, LAYOUT.head_dim,
                     generator=torch.Generator().manual_seed(seed))
    payload = kv.view(torch.uint8).numpy().tobytes()
    header = pb.KVChunk(reservation=pb.Reservation(reservation_id=res.reservation_id, generation=res.generation),
                        chunk_index=index, layer_start=0, layer_end=LAYOUT.layers, token_start=start, token_end=end,
                        dtype=dtype_name(LAYOUT.dtype), shape=list(kv.shape), checksum=payload_checksum(payload),
                        payload_bytes=len(payload) if payload_bytes is None else payload_bytes,
                        last=last, total_chunks=1 if last else 0, token_digest="digest", model_fingerprint="fp")
    head = header.SerializeToString()
    return _LEN.pack(len(head)) + head, payload


async def closed_by_server(reader, within_s: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), within_s) == b""
    except TimeoutError:
        return False


async def reply(reader, writer) -> pb.PushKVResponse:
    writer.write(_LEN.pack(0))
    await writer.drain()
    size = _LEN.unpack(await asyncio.wait_for(reader.readexactly(4), 5))[0]
    return pb.PushKVResponse.FromString(await reader.readexactly(size))


# -- idle peers ------------------------------------------------------------------------------
async def test_a_peer_that_sends_nothing_is_closed_after_the_idle_timeout(make_env):
    env = await make_env(idle_timeout_s=0.3)
    reader, writer = await env.connect()
    assert await closed_by_server(reader, 10), "a silent peer must not be held forever"
    writer.close()


async def test_a_half_sent_chunk_is_closed_and_never_counted(make_env):
    env = await make_env(idle_timeout_s=0.3)
    res = env.reserve()
    head, payload = frame(res, 0, PROMPT)
    reader, writer = await env.connect()
    writer.write(head + payload[: len(payload) // 2])          # half a chunk, then the peer hangs
    await writer.drain()
    assert await closed_by_server(reader, 10)
    writer.close()
    assert res.attempt.landing == set() and res.attempt.received == {}
    assert env.receiver.outcomes == {"accepted": 0, "duplicate": 0, "rejected": 0}
    # the chunk is not stuck "landing": a full resend on a new stream completes the transfer
    reader, writer = await env.connect()
    writer.write(head + payload)
    ack = await reply(reader, writer)
    writer.close()
    assert (ack.accepted, ack.state) == (1, "SUCCESS")


async def test_a_slow_but_live_peer_is_not_cut_off(make_env):
    """The timeout is for silence, not for a whole transfer: bytes every 0.1 s keep it open."""
    env = await make_env(idle_timeout_s=0.4)
    res = env.reserve()
    head, payload = frame(res, 0, PROMPT)
    data = head + payload
    reader, writer = await env.connect()
    step = len(data) // 8 + 1
    for i in range(0, len(data), step):                       # about 0.8 s in all, 0.1 s gaps
        writer.write(data[i: i + step])
        await writer.drain()
        await asyncio.sleep(0.1)
    ack = await reply(reader, writer)
    writer.close()
    assert (ack.accepted, ack.state) == (1, "SUCCESS")


# -- sizes are checked before anything is allocated -------------------------------------------
async def test_staged_path_refuses_an_oversized_header_without_allocating(make_env):
    env = await make_env(off_host=True)
    res = env.reserve()
    head, _ = frame(res, 0, PROMPT, payload_bytes=512 << 20)  # 512 MiB declared for 6 tokens of KV
    reader, writer = await env.connect()
    writer.write(head)
    await writer.drain()
    assert await closed_by_server(reader, 5), "a size no chunk of the reservation can have closes the stream"
    writer.close()
    assert env.server.buffers_taken == []
    assert env.receiver.outcomes["rejected"] == 1


async def test_staged_path_checks_the_reservation_before_taking_a_buffer(make_env):
    env = await make_env(off_host=True)
    res = env.reserve()
    stale_head, stale_payload = frame(pb.Reservation(reservation_id=res.reservation_id, generation=7), 0, PROMPT)
    unknown_head, unknown_payload = frame(pb.Reservation(reservation_id="nobody", generation=1), 0, PROMPT)
    head, payload = frame(res, 0, PROMPT, seed=3)
    reader, writer = await env.connect()
    writer.write(stale_head + stale_payload + unknown_head + unknown_payload)
    await writer.drain()
    await asyncio.sleep(0.2)
    assert env.server.buffers_taken == [], "refused headers must not allocate"
    writer.write(head + payload)
    ack = await reply(reader, writer)
    writer.close()
    assert (ack.accepted, ack.rejected, ack.state) == (1, 2, "SUCCESS")
    assert env.server.buffers_taken == [len(payload)]                # exactly the admitted chunk's size
    expected = torch.frombuffer(bytearray(payload), dtype=torch.float32).view(LAYOUT.layers, 2, PROMPT, 1, 4)
    assert torch.equal(env.pool.read(res.blocks, 0, PROMPT), expected)


async def test_in_place_path_closes_on_a_size_beyond_the_reservation(make_env):
    env = await make_env()
    res = env.reserve()
    head, _ = frame(res, 0, PROMPT, payload_bytes=PROMPT * LAYOUT.bytes_per_token + 1)
    reader, writer = await env.connect()
    writer.write(head)
    await writer.drain()
    assert await closed_by_server(reader, 5)
    writer.close()
    assert torch.count_nonzero(env.pool.kv) == 0
    assert res.attempt.state.name == "FAILED"                 # a sender that lies about sizes fails its attempt


def test_sink_selection_admits_before_it_allocates():
    """The selection itself, without a socket: an unknown reservation with a huge size is refused
    (raised, so the stream closes) and no staging buffer exists."""
    pool = OffHostPool(LAYOUT, num_blocks=8, block_size=4)
    table = ReservationTable(pool)
    server = CountingServer(KVReceiver(table, pool), FaultInjector(""))
    res = table.reserve("r", PROMPT, 2, time.monotonic() + 30, "digest", "fp")
    head = pb.KVChunk()
    _, payload = frame(res, 0, PROMPT)
    raw, _ = frame(res, 0, PROMPT, payload_bytes=1 << 30)
    head.ParseFromString(raw[4:])
    head.reservation.reservation_id = "nobody"
    with pytest.raises(ValueError, match="at most"):
        server.sink_for(head)
    assert server.buffers_taken == []
