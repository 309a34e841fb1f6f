"""The prefill side of the bulk KV path: what goes on the socket, and when.

A decode worker closes a bulk stream that sends nothing for ``bulk_idle_timeout_s``. A
request may wait in the prefill queue behind others for longer than that, so the sender
must not open its stream before it has a chunk to send. Real sockets on loopback.
"""

from __future__ import annotations

import asyncio
import struct

from proto.epd.v1 import epd_pb2 as pb
from prefill_svc.kv_sender import KVSender
from runtime.worker.faults import FaultInjector
from runtime.worker.internal_auth import BULK_PREAMBLE_BYTES, bulk_preamble

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
