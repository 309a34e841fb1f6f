"""The bulk KV path: a plain TCP socket beside the gRPC control path.

The design chapter: bulk data should move on a path designed for it, while
control messages arrange the rendezvous. gRPC in Python parses each message into
fresh buffers and copies the payload several times. Here a chunk's header is
checked first (reservation, generation, duplicate, shape: ``KVReceiver.admit``),
then its payload is read from the socket **straight into the reservation's pool
blocks** and checksummed piece by piece while the bytes are still in cache. Only
a verified chunk is recorded (``KVReceiver.accept``); a sequence is inserted only
after every chunk is recorded, so unverified bytes in a reservation's own blocks
are never read. A pool that is not in host memory (``--device cuda``) is staged
through one host buffer and landed with ``KVReceiver.land``.

Nothing is allocated or written for a payload before its header passed ``admit``
(reservation, generation, shape, and a size equal to the shape's, so never more
than the reservation's own prompt KV), on every path. A refused payload is read
into a scratch buffer and forgotten, to keep the stream in step — unless it
declares more than any chunk of that reservation could hold (``payload_bound``):
then the stream is closed at once instead of reading it.

Idle peers: a connection that delivers no byte for ``idle_timeout_s``
(``EPD_BULK_IDLE_TIMEOUT_S``) is closed; a chunk it was landing is never counted
(its index leaves ``landing``; a resend overwrites its unverified bytes).

Ownership while a payload arrives: the event loop runs other callbacks between
two reads of one chunk, and a ``Release`` or ``Rearm`` may come in between.
Before every read the receiver checks that the reservation still holds the lease
(owner token) the chunk was admitted under; from the first read where it does not,
the rest of the payload is read into a scratch buffer and the chunk is rejected.
So a late chunk never writes into blocks that were freed or re-armed. The pool
hands out its views only under that owner token (``KVBlockPool.host_views``).

Wire format, one connection per transfer attempt::

    stream := preamble frame* end
    preamble := "EPDB" | u8 version | HMAC-SHA256(EPD_INTERNAL_TOKEN)  (runtime/worker/internal_auth.py)
    frame  := u32 header_len | header (KVChunk, payload empty, payload_bytes = N) | N payload bytes
    end    := u32 0
    reply  := u32 len | PushKVResponse           (sent after `end`, then the server closes)

The preamble is read, and checked in constant time, before any other byte: a stream
that does not start with it, or proves another token, is closed with nothing written
and counted in ``BulkKVServer.refused_streams``.
"""

from __future__ import annotations

import asyncio
import logging
import struct

from pydantic import SecretStr

from proto.epd.v1 import epd_pb2 as pb
from runtime.worker.faults import FaultInjector
from runtime.worker.internal_auth import BULK_MAGIC, BULK_PREAMBLE_BYTES, BULK_VERSION, bulk_preamble_ok
from runtime.worker.wire import checksum_digest, payload_hasher

from .kv_receiver import ChunkOutcome, ChunkResult, KVReceiver, StreamTally
from .reservations import Reservation

log = logging.getLogger("epd.decode.bulk")

_LEN = struct.Struct("<I")
MAX_HEADER_BYTES = 64 * 1024
_SCRATCH = bytearray(1 << 20)   # discarded payload bytes go here; its contents are never read


class HandshakeRefused(Exception):
    """The stream did not open with this worker's preamble."""


class _Handshake:
    """The preamble every stream opens with; a wrong byte is refused as soon as it arrives."""

    _HEAD = BULK_MAGIC + bytes([BULK_VERSION])

    def __init__(self, token: SecretStr | None):
        self.token = token
        self.buf = bytearray(BULK_PREAMBLE_BYTES)
        self.got = 0

    def buffer(self) -> memoryview:
        return memoryview(self.buf)[self.got:]

    def filled(self, n: int) -> bool:
        """True once the whole preamble is in and proves the token; raises ``HandshakeRefused``."""
        self.got += n
        head = min(self.got, len(self._HEAD))
        if self.buf[:head] != self._HEAD[:head]:
            raise HandshakeRefused("not an epd bulk KV stream (bad magic or version)")
        if self.got < len(self.buf):
            return False
        if not bulk_preamble_ok(bytes(self.buf), self.token):
            raise HandshakeRefused("wrong internal token")
        return True


class _Discard:
    """A payload nobody will use (refused, dropped, or its reservation went away): read and forget."""

    def __init__(self, remaining: int, result: ChunkResult | None):
        self.remaining = remaining
        self.result = result

    def buffer(self) -> memoryview:
        return memoryview(_SCRATCH)[: min(self.remaining, len(_SCRATCH))]

    def filled(self, n: int) -> bool:
        self.remaining -= n
        return self.remaining == 0

    def finish(self) -> ChunkResult | None:
        return self.result


class _Staged:
    """Pool off the host: the payload goes into one host buffer, then ``KVReceiver.land`` copies it
    (and checks the header again: the reservation may have gone while the bytes arrived).
    Built only for an admitted header, so the buffer is at most the reservation's prompt KV."""

    def __init__(self, server: "BulkKVServer", header: pb.KVChunk, corrupt: bool):
        self.server, self.header, self.corrupt = server, header, corrupt
        self.size = header.payload_bytes
        self.buf = server.take_buffer(self.size)
        self.got = 0

    def buffer(self) -> memoryview:
        return memoryview(self.buf)[self.got: self.size]

    def filled(self, n: int) -> bool:
        self.got += n
        return self.got == self.size

    def finish(self) -> ChunkResult:
        payload = memoryview(self.buf)[: self.size]
        if self.corrupt:
            payload[self.size // 2] ^= 0xFF
        try:
            return self.server.receiver.land(self.header, payload)
        finally:
            self.server.give_back(self.buf)


class _InPlace:
    """Payload read straight into ``res``'s pool blocks, hashed piece by piece as it arrives."""

    def __init__(self, receiver: KVReceiver, res: Reservation, header: pb.KVChunk, views: list[memoryview],
                 corrupt: bool):
        self.receiver, self.res, self.header, self.corrupt = receiver, res, header, corrupt
        self.attempt = res.attempt                 # the attempt these bytes belong to
        self.lease = res.lease                     # ...and the owner token its blocks carry
        self.views = [v for v in views if len(v)]
        self.view_index = 0
        self.offset = 0
        self.remaining = header.payload_bytes
        self.hasher = payload_hasher()
        self.lost: _Discard | None = None          # set once the blocks are no longer ours to write
        self.attempt.landing.add(header.chunk_index)

    def _still_owned(self) -> bool:
        return self.res.holds(self.lease)

    def buffer(self) -> memoryview:
        if self.lost is None and not self._still_owned():
            self.lost = _Discard(self.remaining, ChunkResult(
                ChunkOutcome.REJECTED, "reservation released or re-armed while the chunk was arriving"))
        if self.lost is not None:
            return self.lost.buffer()
        return self.views[self.view_index][self.offset:]

    def filled(self, n: int) -> bool:
        if self.lost is not None:
            self.remaining -= n
            return self.lost.filled(n)
        piece = self.views[self.view_index][self.offset: self.offset + n]
        if self.corrupt:                           # injected wire damage, before the checksum sees it
            piece[n // 2] ^= 0xFF
            self.corrupt = False
        self.hasher.update(piece)
        self.offset += n
        self.remaining -= n
        if self.offset == len(self.views[self.view_index]):
            self.view_index, self.offset = self.view_index + 1, 0
        return self.remaining == 0

    def finish(self) -> ChunkResult:
        self.attempt.landing.discard(self.header.chunk_index)
        if self.lost is not None:   # ownership is checked before every read, so this is the only way to lose it
            return self.lost.result
        if self.attempt.state.terminal:            # another stream failed this attempt meanwhile
            return ChunkResult(ChunkOutcome.REJECTED, f"transfer failed: {self.attempt.detail}")
        if checksum_digest(self.hasher) != self.header.checksum:
            return self.receiver.fail(self.res, f"checksum mismatch on chunk {self.header.chunk_index}")
        return self.receiver.accept(self.res, self.header, self.header.payload_bytes)


class _BulkProtocol(asyncio.BufferedProtocol):
    def __init__(self, server: "BulkKVServer"):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._last_bytes_at = self._loop.time()
        self._idle_timer: asyncio.TimerHandle | None = None
        self._len_buf = bytearray(4)
        self._header_limit = MAX_HEADER_BYTES + server.receiver.state_header_bytes   # hybrid: the final chunk's state parts
        self._header_buf = bytearray(self._header_limit)
        self._handshake = _Handshake(server.token)
        self._state = "preamble"   # preamble -> len -> header -> payload -> len ...
        self._filled = 0
        self._want = 4
        self._sink: _Discard | _Staged | _InPlace | None = None
        self._tally = StreamTally(server.receiver)

    def connection_made(self, transport):
        self.transport = transport
        self._last_bytes_at = self._loop.time()
        self._idle_timer = self._loop.call_later(self.server.idle_timeout_s, self._check_idle)

    def _check_idle(self) -> None:
        """Close a peer that sent nothing for ``idle_timeout_s`` (half-open, hung or idle)."""
        idle = self._loop.time() - self._last_bytes_at
        if idle < self.server.idle_timeout_s:
            self._idle_timer = self._loop.call_later(self.server.idle_timeout_s - idle, self._check_idle)
            return
        self._idle_timer = None
        log.warning("bulk KV stream idle for %.1f s (state %s); closing it", idle, self._state)
        self.transport.abort()        # connection_lost discards the chunk that was landing

    def connection_lost(self, exc) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if isinstance(self._sink, _InPlace):       # stream broke mid-chunk: the chunk never counts
            self._sink.attempt.landing.discard(self._sink.header.chunk_index)
        elif isinstance(self._sink, _Staged):
            self.server.give_back(self._sink.buf)
        self._sink = None

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._state == "preamble":
            return self._handshake.buffer()
        if self._state == "payload":
            return self._sink.buffer()
        target = self._len_buf if self._state == "len" else self._header_buf
        return memoryview(target)[self._filled: self._want]

    def buffer_updated(self, nbytes: int) -> None:
        self._last_bytes_at = self._loop.time()
        if self._state == "preamble":
            self._check_handshake(nbytes)
            return
        try:
            if self._state == "payload":
                if self._sink.filled(nbytes):
                    sink, self._sink = self._sink, None
                    self._count(sink.finish())
                    self._state, self._want = "len", 4
                return
            self._filled += nbytes
            if self._filled == self._want:
                self._filled = 0
                self._advance()
        except Exception as exc:  # malformed stream: close it; the attempt never completes
            log.warning("bulk KV stream closed: %s", exc)
            self.transport.close()

    def _check_handshake(self, nbytes: int) -> None:
        try:
            if self._handshake.filled(nbytes):
                self._state, self._want = "len", 4
        except HandshakeRefused as exc:
            self._state = "refused"
            self.server.refuse_stream(exc)
            self.transport.abort()      # nothing was, or will be, written to this peer

    def _advance(self) -> None:
        if self._state == "len":
            n = _LEN.unpack(self._len_buf)[0]
            if n == 0:
                self._reply()
                return
            if n > self._header_limit:
                raise ValueError(f"header of {n} bytes")
            self._state, self._want = "header", n
        else:
            header = pb.KVChunk.FromString(bytes(self._header_buf[: self._want]))
            if header.payload_bytes <= 0:
                raise ValueError(f"payload of {header.payload_bytes} bytes")
            self._tally.saw(header)
            self._sink = self.server.sink_for(header)
            self._state = "payload"

    def _count(self, result: ChunkResult | None) -> None:
        if result is not None:          # None: a chunk the fault injector dropped
            self._tally.record(result)

    def _reply(self) -> None:
        body = self._tally.reply().SerializeToString()
        self.transport.write(_LEN.pack(len(body)) + body)
        self.transport.close()


class BulkKVServer:
    """Accepts bulk KV streams; one event-loop thread, like the gRPC servicer, so no locking.

    Payloads land in place in the pool. Only a pool off the host stages them, each
    connection in its own buffer from a small free list, so concurrent transfers
    never share bytes and steady state allocates nothing.
    """

    def __init__(self, receiver: KVReceiver, faults: FaultInjector, idle_timeout_s: float = 30.0,
                 token: SecretStr | None = None):
        if idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
        self.receiver = receiver
        self.faults = faults
        self.idle_timeout_s = idle_timeout_s
        self.token = token           # what every stream's preamble must prove (None: any preamble)
        self.refused_streams = 0
        self._free_buffers: list[bytearray] = []
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    def sink_for(self, header: pb.KVChunk) -> _Discard | _Staged | _InPlace:
        """Where one payload goes, decided from its header alone; ``admit`` runs first on every
        path, so nothing is allocated or written for a header the reservation does not accept.
        Raises ``ValueError`` (the stream is closed) for a size no chunk of it could have."""
        receiver = self.receiver
        size = header.payload_bytes
        res, refused = receiver.admit(header, size)
        if refused is not None:
            bound = receiver.payload_bound(header)
            if size > bound:
                receiver.count(refused)
                raise ValueError(f"payload of {size} bytes declared, at most {bound} possible: {refused.detail}")
            return _Discard(size, refused)
        fate = self.faults.bulk_chunk_fate()
        if fate == "drop":
            return _Discard(size, None)
        if not receiver.pool.host_resident:
            return _Staged(self, header, corrupt=fate == "corrupt")
        views = receiver.pool.host_views(res.blocks, header.token_start, header.token_end, owner=res.attempt.owner,
                                         layer_from=receiver.layer_from(header), rings=res.choice_rings(0))   # sliding layers trimmed: fewer bytes
        return _InPlace(receiver, res, header, views, corrupt=fate == "corrupt")

    def refuse_stream(self, why: Exception) -> None:
        self.refused_streams += 1
        if self.refused_streams & (self.refused_streams - 1) == 0:   # 1st, 2nd, 4th...: a flood cannot flood the log
            log.warning("bulk KV stream refused: %s (%d refused so far)", why, self.refused_streams)

    def take_buffer(self, size: int) -> bytearray:
        """A staging buffer for one chunk; buffers are reused across connections, never shared."""
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
