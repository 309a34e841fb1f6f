"""The bulk KV path: a plain TCP socket beside the gRPC control path.

The design chapter: bulk data should move on a path designed for it, while
control messages arrange the rendezvous. gRPC in Python parses each message into
fresh buffers and copies the payload several times; here the payload is read
from the socket straight into one preallocated buffer (``BufferedProtocol``),
checksummed there and copied once more, into the KV pool. Everything else — the
reservation, generation fencing, verification and the outcome table — is the
same ``KVReceiver`` the gRPC ``PushKV`` uses.

Wire format, one connection per transfer attempt::

    frame  := u32 header_len | header (KVChunk, payload empty, payload_bytes = N) | N payload bytes
    end    := u32 0
    reply  := u32 len | PushKVResponse           (sent after `end`, then the server closes)
"""

from __future__ import annotations

import asyncio
import logging
import struct

from proto.epd.v1 import epd_pb2 as pb
from runtime.faults import FaultInjector

from .kv_receiver import ChunkOutcome, KVReceiver

log = logging.getLogger("epd.decode.bulk")

_LEN = struct.Struct("<I")
MAX_HEADER_BYTES = 64 * 1024
MAX_PAYLOAD_BYTES = 1 << 30


class _BulkProtocol(asyncio.BufferedProtocol):
    def __init__(self, server: "BulkKVServer"):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self._len_buf = bytearray(4)
        self._header_buf = bytearray(MAX_HEADER_BYTES)
        self._state = "len"        # len -> header -> payload -> len ...
        self._filled = 0
        self._want = 4
        self._header: pb.KVChunk | None = None
        self._counts = {"accepted": 0, "duplicates": 0, "rejected": 0}
        self._detail = ""
        self._last_reservation = ""
        self._payload: bytearray | None = None   # this connection's payload buffer, from the server's free list

    def connection_made(self, transport):
        self.transport = transport

    def _target(self) -> memoryview:
        if self._state == "len":
            return memoryview(self._len_buf)
        if self._state == "header":
            return memoryview(self._header_buf)[: self._want]
        return memoryview(self._payload_buffer(self._want))[: self._want]

    def _payload_buffer(self, size: int) -> bytearray:
        if self._payload is None or len(self._payload) < size:
            if self._payload is not None:
                self.server.give_back(self._payload)
            self._payload = self.server.take_buffer(size)
        return self._payload

    def connection_lost(self, exc) -> None:
        if self._payload is not None:
            self.server.give_back(self._payload)
            self._payload = None

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._target()[self._filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        if self._filled < self._want:
            return
        self._filled = 0
        try:
            self._advance()
        except Exception as exc:  # malformed stream: close it; the attempt never completes
            log.warning("bulk KV stream closed: %s", exc)
            self.transport.close()

    def _advance(self) -> None:
        if self._state == "len":
            n = _LEN.unpack(self._len_buf)[0]
            if n == 0:
                self._reply()
                return
            if n > MAX_HEADER_BYTES:
                raise ValueError(f"header of {n} bytes")
            self._state, self._want = "header", n
        elif self._state == "header":
            self._header = pb.KVChunk.FromString(bytes(self._header_buf[: self._want]))
            size = self._header.payload_bytes
            if not 0 < size <= MAX_PAYLOAD_BYTES:
                raise ValueError(f"payload of {size} bytes")
            self._state, self._want = "payload", size
        else:
            payload = memoryview(self._payload)[: self._want]
            self._land(self._header, payload)
            self._state, self._want = "len", 4

    def _land(self, header: pb.KVChunk, payload: memoryview) -> None:
        self._last_reservation = header.reservation.reservation_id
        if not self.server.faults.mangle_payload(payload):
            return
        result = self.server.receiver.land(header, payload)
        key = {ChunkOutcome.ACCEPTED: "accepted", ChunkOutcome.DUPLICATE: "duplicates"}.get(result.outcome, "rejected")
        self._counts[key] += 1
        if result.outcome == ChunkOutcome.REJECTED:
            self._detail = result.detail

    def _reply(self) -> None:
        res = self.server.receiver.table.get(self._last_reservation)
        state = res.attempt.state.name if res is not None else ""
        if res is not None:
            self.server.on_stream_end(res)
        body = pb.PushKVResponse(state=state, detail=self._detail, **self._counts).SerializeToString()
        self.transport.write(_LEN.pack(len(body)) + body)
        self.transport.close()


class BulkKVServer:
    """Accepts bulk KV streams; one event-loop thread, like the gRPC servicer, so no locking.

    Each connection reads payloads into its own buffer taken from a small free list, so
    concurrent transfers never share bytes and steady state allocates nothing.
    """

    def __init__(self, receiver: KVReceiver, faults: FaultInjector, on_stream_end=lambda res: None):
        self.receiver = receiver
        self.faults = faults
        self.on_stream_end = on_stream_end
        self._free_buffers: list[bytearray] = []
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    def take_buffer(self, size: int) -> bytearray:
        """A payload buffer for one connection; buffers are reused across connections, never shared."""
        for i, buf in enumerate(self._free_buffers):
            if len(buf) >= size:
                return self._free_buffers.pop(i)
        return bytearray(size)

    def give_back(self, buf: bytearray) -> None:
        if len(self._free_buffers) < 8:
            self._free_buffers.append(buf)

    async def start(self, host: str, port: int = 0) -> int:
        self._server = await asyncio.get_running_loop().create_server(lambda: _BulkProtocol(self), host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
