"""Pushing one request's KV chunks to the decode worker that reserved blocks for them.

One client stream (``Decode.PushKV``) per request. Chunks are queued as soon as
prefill computes them and sent eagerly (every ready chunk goes out now; the last
one is marked final and carries the first token), so the transfer of chunk k
overlaps the compute of chunk k+1. The stream's gRPC deadline is the request's.
"""

from __future__ import annotations

import asyncio
import os
import time

import grpc

from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.faults import FaultInjector


class TransferBroken(RuntimeError):
    """The stream to decode broke off, or decode refused the transfer."""


_END = object()


class KVSender:
    def __init__(self, stub: pb_grpc.DecodeStub, timeout_s: float, faults: FaultInjector):
        self._stub = stub
        self._timeout_s = timeout_s
        self._faults = faults
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.bytes_sent = 0
        self.chunks_sent = 0
        self.first_send_at: float | None = None
        self.done_at: float | None = None
        self._broken: TransferBroken | None = None   # why our own chunk iterator stopped the stream

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def put(self, chunk: pb.KVChunk) -> None:
        self._queue.put_nowait(chunk)

    def finish(self) -> None:
        self._queue.put_nowait(_END)

    def abort(self) -> None:
        if self._task:
            self._task.cancel()

    async def _chunks(self):
        while True:
            chunk = await self._queue.get()
            if chunk is _END:
                return
            if self._faults.amount("delay_chunk_ms"):
                await asyncio.sleep(self._faults.amount("delay_chunk_ms") / 1000)
            if chunk.last and self._faults.coin("fail_transfer"):
                self._broken = TransferBroken("injected fault: transfer broken off before the last chunk")
                raise self._broken
            if self._faults.coin("crash_prefill"):
                os._exit(17)  # injected crash mid-transfer
            if self.first_send_at is None:
                self.first_send_at = time.monotonic()
            self.bytes_sent += len(chunk.payload)
            self.chunks_sent += 1
            yield chunk
            if self._faults.coin("dup_chunk"):
                yield chunk

    async def _run(self) -> pb.PushKVResponse:
        try:
            resp = await self._stub.PushKV(self._chunks(), timeout=max(0.05, self._timeout_s))
        except grpc.aio.AioRpcError as exc:
            raise TransferBroken(f"decode stream failed: {exc.code().name}: {exc.details()}") from exc
        except asyncio.CancelledError:
            # grpc cancels the call when the request iterator raises; surface our reason instead
            if self._broken is not None:
                raise self._broken from None
            raise
        finally:
            self.done_at = time.monotonic()
        if resp.state != "SUCCESS":
            raise TransferBroken(f"decode reports transfer {resp.state or 'incomplete'}: {resp.detail}")
        return resp

    async def wait(self) -> pb.PushKVResponse:
        return await self._task
