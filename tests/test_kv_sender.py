"""The prefill side of the KV stream: what goes on the socket, and when, and the headers it frames.

A decode worker closes a bulk stream that sends nothing for ``bulk_idle_timeout_s``. A
request may wait in the prefill queue behind others for longer than that, so the sender
must not open its stream before it has a chunk to send. Real sockets on loopback.

The sender, not the prefill scheduler, builds each chunk's header (``ChunkFraming``):
what it frames must be what decode's ``KVReceiver`` accepts (a real receiver, table and pool).
"""

from __future__ import annotations

import asyncio
import struct
import time

import torch

from decode_svc.kv_receiver import ChunkOutcome, KVReceiver
from decode_svc.reservations import ReservationTable
from proto.epd.v1 import epd_pb2 as pb
from prefill_svc.kv_sender import ChunkFraming, FinalChunk, KVSender, ReadyChunk
from runtime.model.kv_pool import KVBlockPool, KVLayout
from runtime.model.sampling import SampledToken
from runtime.worker.faults import FaultInjector
from runtime.worker.internal_auth import BULK_PREAMBLE_BYTES, bulk_preamble
from runtime.worker.transfer_state import TransferState
from runtime.worker.wire import token_digest

_LEN = struct.Struct("<I")


async def test_the_bulk_stream_opens_with_the_first_chunk_not_before():
    connections: asyncio.Queue = asyncio.Queue()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await connections.put((reader, writer))

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sender = KVSender(None, 30.0, FaultInjector(""), bulk_address=f"127.0.0.1:{port}")
    sender.start()
    try:
        await asyncio.sleep(0.5)                     # prefill is still queued: nothing may be connected
        assert connections.empty(), "the bulk stream was opened before there was a chunk to send"

        payload = bytes(range(64))
        sender.put(pb.KVChunk(chunk_index=0, payload_bytes=len(payload), last=True, total_chunks=1), payload)
        sender.finish()
        reader, writer = await asyncio.wait_for(connections.get(), 5)
        assert await reader.readexactly(BULK_PREAMBLE_BYTES) == bulk_preamble(None)
        header = pb.KVChunk.FromString(await reader.readexactly(_LEN.unpack(await reader.readexactly(4))[0]))
        assert header.chunk_index == 0 and await reader.readexactly(len(payload)) == payload
        assert _LEN.unpack(await reader.readexactly(4))[0] == 0          # end of stream
        reply = pb.PushKVResponse(accepted=1, state="SUCCESS").SerializeToString()
        writer.write(_LEN.pack(len(reply)) + reply)
        await writer.drain()
        assert (await asyncio.wait_for(sender.wait(), 5)).state == "SUCCESS"
        writer.close()
    finally:
        sender.abort()
        server.close()
        await server.wait_closed()


def test_framed_chunks_are_what_the_decode_receiver_accepts():
    layout = KVLayout(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32)
    pool = KVBlockPool(layout, num_blocks=4, block_size=4)
    table = ReservationTable(pool)
    digest = token_digest(list(range(7)), ["image"])
    res = table.reserve("r", 7, 2, time.monotonic() + 30, digest, "fp")
    framing = ChunkFraming("r", pb.Reservation(reservation_id=res.reservation_id, generation=res.generation),
                           layout, digest, "fp")
    kv = torch.randn(layout.layers, 2, 7, layout.kv_heads, layout.head_dim)
    spans = [(0, 4), (4, 7)]
    receiver = KVReceiver(table, pool)
    for i, (start, end) in enumerate(spans):
        payload = memoryview(kv[:, :, start:end].contiguous().view(torch.uint8).numpy()).cast("B")
        final = FinalChunk(total_chunks=len(spans), first=SampledToken(42), prefill_ms=3.5, rope_delta=0) if end == 7 else None
        header = framing.header(ReadyChunk(i, start, end, payload, final))
        assert header.payload == b"" and header.payload_bytes == len(payload)   # the bytes travel beside it
        assert header.last == (final is not None)
        assert receiver.land(header, payload).outcome == ChunkOutcome.ACCEPTED
    assert res.attempt.state is TransferState.SUCCESS                  # digest, fingerprint, coverage all agreed
    assert (res.attempt.first_token, res.attempt.prefill_ms) == (42, 3.5)
    assert torch.equal(pool.read(res.blocks, 0, 7), kv)

