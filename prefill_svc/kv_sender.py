"""Pushing one request's KV chunks to the decode worker that reserved blocks for them.

The scheduler decides what is ready (``ReadyChunk``: which tokens, their bytes, and
on the last one the first token); the sender builds each chunk's wire header
(``ChunkFraming``: reservation, layout, checksum, the final chunk's digest and
fingerprint) and moves the bytes. One stream per request: over the decode worker's
bulk TCP path when it has one (see ``decode_svc/bulk_receiver.py`` for the framing),
else a ``Decode.PushKV`` client stream. Chunks are queued as soon as prefill computes
them and sent eagerly (every ready chunk goes out now; the last one is marked final
and carries the first token), so the transfer of chunk k overlaps the compute of
chunk k+1. The stream's gRPC deadline is the request's. The stream succeeded only
when decode reports ``TransferState.SUCCESS`` for it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from dataclasses import dataclass

import grpc
from pydantic import SecretStr

from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.model.kv_pool import KVLayout
from runtime.model.tensor_bytes import dtype_name
from runtime.worker.faults import FaultInjector
from runtime.worker.internal_auth import bulk_preamble
from runtime.worker.timing_log import TimingLog
from runtime.worker.tracing import span
from runtime.worker.transfer_state import TransferState, from_wire
from runtime.model.sampling import SampledToken
from runtime.worker.wire import logprobs_to_pb, payload_checksum


class TransferBroken(RuntimeError):
    """The stream to decode broke off, or decode refused the transfer."""


_END = object()
_LEN = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class FinalChunk:
    """What only the last chunk of a prompt carries."""

    total_chunks: int
    first: SampledToken           # the first token, with its logprobs when the request asked for them
    prefill_ms: float             # the prompt's summed compute, for decode's first event
    rope_delta: int               # the prompt's (0 for 1-D families): decode checks it against the reservation
    state_parts: tuple = ()       # hybrid decoders: the linear layers' state at the prompt's end (pb.StatePart)
    others: tuple[SampledToken, ...] = ()   # n > 1: the first token of choices 1..n-1 (decode forks with them)


@dataclass(frozen=True, slots=True)
class ReadyChunk:
    """One computed chunk, as the prefill scheduler hands it over."""

    index: int
    token_start: int
    token_end: int
    payload: memoryview           # [layers, 2, tokens, kv_heads, head_dim] bytes: the pool's per-slot layout
    final: FinalChunk | None = None
    sliding_from: int = 0         # sliding layers carry positions from here only (KVLayout.window_from; 0: all)


@dataclass(frozen=True, slots=True)
class ChunkFraming:
    """What every ``KVChunk`` header of one request's stream says besides its own span."""

    request_id: str
    reservation: pb.Reservation
    layout: KVLayout
    token_digest: str             # of the prompt's ids, image keys and grids, rope delta: decode checks it on the last chunk
    model_fingerprint: str

    def header(self, chunk: ReadyChunk) -> pb.KVChunk:
        """The chunk's header: ``payload_bytes`` and checksum set, ``payload`` empty (it travels beside)."""
        layout, n = self.layout, chunk.token_end - chunk.token_start
        msg = pb.KVChunk(
            request_id=self.request_id, reservation=self.reservation, chunk_index=chunk.index,
            layer_start=0, layer_end=layout.layers, token_start=chunk.token_start, token_end=chunk.token_end,
            dtype=dtype_name(layout.dtype), shape=[layout.layers, 2, n, layout.kv_heads, layout.head_dim],
            payload_bytes=len(chunk.payload), checksum=payload_checksum(chunk.payload), last=chunk.final is not None,
            sliding_from=chunk.sliding_from,
        )
        if chunk.final is not None:
            msg.total_chunks, msg.first_token = chunk.final.total_chunks, chunk.final.first.token_id
            first_logprobs = logprobs_to_pb(chunk.final.first)
            if first_logprobs is not None:
                msg.first_logprobs.CopyFrom(first_logprobs)
            msg.token_digest, msg.model_fingerprint = self.token_digest, self.model_fingerprint
            msg.prefill_ms = chunk.final.prefill_ms
            msg.rope_delta = chunk.final.rope_delta
            msg.state_parts.extend(chunk.final.state_parts)
            for other in chunk.final.others:
                msg.choice_first_tokens.append(other.token_id)
                other_logprobs = logprobs_to_pb(other)
                if other_logprobs is not None:
                    msg.choice_first_logprobs.append(other_logprobs)
        return msg


class KVSender:
    def __init__(self, stub: pb_grpc.DecodeStub, timeout_s: float, faults: FaultInjector, bulk_address: str = "",
                 timings: TimingLog | None = None, bulk_token: SecretStr | None = None,
                 framing: ChunkFraming | None = None):
        self._stub = stub
        self._framing = framing   # builds headers for ``send``; ``put`` takes headers already built
        self._timings = timings   # link-time samples (bytes, ms) per chunk, bulk path only
        self._bulk_address = bulk_address
        self._bulk_token = bulk_token   # proves this stream to the receiver (the handshake preamble)
        self._timeout_s = timeout_s
        self._faults = faults
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.bytes_sent = 0
        self.chunks_sent = 0
        self._broken: TransferBroken | None = None   # why our own chunk iterator stopped the stream

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def send(self, chunk: ReadyChunk) -> None:
        """Frame one computed chunk (header and checksum, ``ChunkFraming``) and queue it."""
        if self._framing is None:
            raise RuntimeError("this KVSender was built without a ChunkFraming; queue built headers with put()")
        self.put(self._framing.header(chunk), chunk.payload)

    def put(self, header: pb.KVChunk, payload: bytes | memoryview) -> None:
        """Queue one chunk whose header is built (``payload_bytes`` set, ``payload`` empty) with its bytes."""
        self._queue.put_nowait((header, payload))

    def finish(self) -> None:
        self._queue.put_nowait(_END)

    def abort(self) -> None:
        if self._task:
            self._task.cancel()

    async def _chunks(self):
        """Yield ``(header, payload)`` in order, applying the injected sender-side faults."""
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            chunk, payload = item
            if self._faults.amount("delay_chunk_ms"):
                await asyncio.sleep(self._faults.amount("delay_chunk_ms") / 1000)
            if chunk.last and self._faults.coin("fail_transfer"):
                self._broken = TransferBroken("injected fault: transfer broken off before the last chunk")
                raise self._broken
            if self._faults.coin("crash_prefill"):
                os._exit(17)  # injected crash mid-transfer
            self.bytes_sent += len(payload)
            self.chunks_sent += 1
            yield chunk, payload
            if self._faults.coin("dup_chunk"):
                yield chunk, payload

    async def _grpc_messages(self):
        async for chunk, payload in self._chunks():
            with span("prefill.send", **{"epd.request_id": chunk.request_id, "epd.chunk": chunk.chunk_index,
                                         "epd.bytes": len(payload), "epd.transport": "grpc"}):
                msg = pb.KVChunk()
                msg.CopyFrom(chunk)
                msg.payload = bytes(payload)  # protobuf needs bytes: the gRPC path's extra copy
            yield msg

    async def _run(self) -> pb.PushKVResponse:
        if self._bulk_address:
            try:
                async with asyncio.timeout(max(0.05, self._timeout_s)):
                    resp = await self._run_bulk()
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                raise TransferBroken(f"bulk KV stream to {self._bulk_address} failed: {exc!r}") from exc
            return self._check(resp)
        try:
            resp = await self._stub.PushKV(self._grpc_messages(), timeout=max(0.05, self._timeout_s))
        except grpc.aio.AioRpcError as exc:
            raise TransferBroken(f"decode stream failed: {exc.code().name}: {exc.details()}") from exc
        except asyncio.CancelledError:
            # grpc cancels the call when the request iterator raises; surface our reason instead
            if self._broken is not None:
                raise self._broken from None
            raise
        return self._check(resp)

    @staticmethod
    def _check(resp: pb.PushKVResponse) -> pb.PushKVResponse:
        if from_wire(resp.state) is not TransferState.SUCCESS:
            raise TransferBroken(f"decode reports transfer {resp.state or 'incomplete'}: {resp.detail}")
        return resp

    async def _run_bulk(self) -> pb.PushKVResponse:
        """Plain socket, no transport buffer: ``sock_sendall`` sends the payload bytes in place."""
        loop = asyncio.get_running_loop()
        host, port = self._bulk_address.rsplit(":", 1)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            connected = False
            async for chunk, payload in self._chunks():
                if not connected:   # only once there is a chunk: a request queued behind others holds no idle stream
                    await loop.sock_connect(sock, (host, int(port)))
                    await loop.sock_sendall(sock, bulk_preamble(self._bulk_token))
                    connected = True
                header = chunk.SerializeToString()
                started = time.perf_counter()
                with span("prefill.send", **{"epd.request_id": chunk.request_id, "epd.chunk": chunk.chunk_index,
                                             "epd.bytes": len(payload), "epd.transport": "bulk"}):
                    await loop.sock_sendall(sock, _LEN.pack(len(header)) + header)
                    await loop.sock_sendall(sock, payload)
                if self._timings is not None:  # the link's own time for this chunk, no compute waits in it
                    self._timings.record("transfer", len(payload), (time.perf_counter() - started) * 1000)
            if not connected:       # no chunk at all: the stream ended before prefill produced one
                raise TransferBroken("no KV chunk was produced")
            await loop.sock_sendall(sock, _LEN.pack(0))
            size = _LEN.unpack(await self._recv_exactly(loop, sock, 4))[0]
            return pb.PushKVResponse.FromString(await self._recv_exactly(loop, sock, size))
        finally:
            sock.close()

    @staticmethod
    async def _recv_exactly(loop, sock: socket.socket, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = await loop.sock_recv_into(sock, view[got:])
            if k == 0:
                raise asyncio.IncompleteReadError(bytes(buf[:got]), n)
            got += k
        return bytes(buf)

    async def wait(self) -> pb.PushKVResponse:
        return await self._task
