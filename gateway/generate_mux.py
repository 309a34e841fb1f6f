"""Many ``Generate`` calls on one stream to a decode worker (``Decode.GenerateMany``).

A new gRPC call costs about as much again as one message on a stream already open
(``bench/request_hop.py``), and a short chat pays it on its first token. So the gateway keeps one
``GenerateMany`` stream open to each decode worker (opened by the first call, again by the first
call after it ended) and sends each request on it as a ``GenerateOpen.start`` with a number of its
own; the worker runs its ``Generate`` for it (``decode_svc/generate_mux.py``).

``GenerateMux.call(request, timeout)`` gives a ``MuxCall``, read as a ``Generate`` call is read:
iterate its ``TokenEvent``s (every ``__aiter__`` continues the one iterator), ``cancel()`` it (the
worker cancels its ``Generate``, which frees what it held; reading on raises
``asyncio.CancelledError``). A call that ends with a status other than OK raises
``grpc.aio.AioRpcError`` with that code, details and trailing metadata, so ``failure_kind`` and the
failure policy read it as they read a call's. Its deadline (``timeout``) holds on both sides: the
worker ends it DEADLINE_EXCEEDED, and so does the gateway if that end does not come. When the stream
itself fails (the worker went away), every call on it fails with the stream's error, as each call
of its own would have.

Ownership: each ``_Stream`` owns its gRPC call, its writer and reader tasks and the table of its live
calls; a call leaves the table once, when its end arrives, when it is cancelled or times out, or
when the stream fails. With tracing on, each request opens a ``Generate`` call of its own instead
(its metadata carries that request's trace context).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from proto.epd.v1 import epd_pb2 as pb
from runtime.worker.tracing import tracing_on

log = logging.getLogger("epd.gateway")

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _error(code: grpc.StatusCode, details: str, trailing: tuple = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


class MuxCall:
    """One request's ``Generate`` on a ``GenerateMany`` stream (reads as a ``Generate`` call)."""

    def __init__(self, stream: _Stream, number: int, timeout_s: float | None) -> None:
        self._stream, self.number = stream, number
        self._inbox: asyncio.Queue[Any] = asyncio.Queue()   # TokenEvents, then None (OK) or the exception to raise
        self._over = False
        self._aiter: AsyncIterator[pb.TokenEvent] | None = None
        self._timer = (asyncio.get_running_loop().call_later(timeout_s, self._expire)
                       if timeout_s is not None else None)

    def __aiter__(self) -> AsyncIterator[pb.TokenEvent]:
        if self._aiter is None:
            self._aiter = self._events()
        return self._aiter

    async def _events(self) -> AsyncIterator[pb.TokenEvent]:
        while True:
            item = await self._inbox.get()
            if isinstance(item, pb.TokenEvent):
                yield item
            elif item is None:
                return
            else:
                raise item

    def done(self) -> bool:
        return self._over

    def cancel(self) -> bool:
        """As a call's ``cancel``: the worker cancels this request's ``Generate``; ``False`` when already over.
        A read after it raises ``asyncio.CancelledError`` at once, as on a call (events not yet read are dropped)."""
        if self._over:
            return False
        while not self._inbox.empty():
            self._inbox.get_nowait()
        self._finish(asyncio.CancelledError())
        self._stream.send_cancel(self.number)
        return True

    def _expire(self) -> None:
        if self._finish(_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")):
            self._stream.send_cancel(self.number)

    # -- the stream's side ---------------------------------------------------------------------------
    def deliver(self, event: pb.TokenEvent) -> None:
        if not self._over:
            self._inbox.put_nowait(event)

    def _finish(self, outcome: BaseException | None) -> bool:
        """End the call once: ``None`` (OK) or the exception its reader raises. Whether this ended it."""
        if self._over:
            return False
        self._over = True
        if self._timer is not None:
            self._timer.cancel()
        self._stream.forget(self.number)
        self._inbox.put_nowait(outcome)
        return True

    def end(self, end: pb.GenerateEnd) -> None:
        code = _CODES.get(end.code, grpc.StatusCode.UNKNOWN)
        trailing = tuple((e.key, e.value) for e in end.trailing_metadata)
        self._finish(None if code is grpc.StatusCode.OK else _error(code, end.details, trailing))

    def fail(self, error: BaseException) -> None:
        self._finish(error)


class _Stream:
    """One open ``GenerateMany`` call and the requests on it."""

    def __init__(self, stub: Any) -> None:
        self.calls: dict[int, MuxCall] = {}
        self.failed = False
        self._outbox: asyncio.Queue[pb.GenerateOpen] = asyncio.Queue()
        self._call = stub.GenerateMany()
        self._writer = asyncio.create_task(self._write(), name="generate-many-writer")
        self._reader = asyncio.create_task(self._read(), name="generate-many-reader")

    def send(self, message: pb.GenerateOpen) -> None:
        self._outbox.put_nowait(message)

    def send_cancel(self, number: int) -> None:
        if not self.failed:
            self.send(pb.GenerateOpen(call=number, cancel=True))

    def forget(self, number: int) -> None:
        self.calls.pop(number, None)

    async def _write(self) -> None:
        try:
            while True:
                batch = [await self._outbox.get()]
                while not self._outbox.empty():
                    batch.append(self._outbox.get_nowait())
                await self._call.write(pb.GenerateOpens(opens=batch))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            log.debug("GenerateMany stream stopped taking requests: %r", exc)   # the reader tells every call

    async def _read(self) -> None:
        error = _error(grpc.StatusCode.UNAVAILABLE, "GenerateMany stream closed by the worker")
        try:
            async for batch in self._call:
                for message in batch.events:
                    call = self.calls.get(message.call)
                    if call is None:
                        continue   # cancelled or timed out here already
                    if message.WhichOneof("body") == "event":
                        call.deliver(message.event)
                    else:
                        call.end(message.end)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = _error(grpc.StatusCode.CANCELLED, "GenerateMany stream closed by the gateway")
            raise
        finally:
            self.failed = True
            self._writer.cancel()
            for call in list(self.calls.values()):   # each its own exception object, as each call's would be
                call.fail(_error(error.code(), error.details(), tuple(error.trailing_metadata() or ())))

    async def close(self) -> None:
        self.failed = True
        self._call.cancel()
        for task in (self._writer, self._reader):
            task.cancel()
        await asyncio.gather(self._writer, self._reader, return_exceptions=True)


class GenerateMux:
    """A decode worker's ``GenerateMany`` stream, opened when needed; ``call`` sends one request on it."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub
        self._stream: _Stream | None = None
        self._numbers = itertools.count(1)

    def call(self, request: pb.GenerateRequest, timeout_s: float | None) -> MuxCall | Any:
        """The request's ``Generate``: a ``MuxCall`` on the stream (a ``Generate`` call of its own with tracing on)."""
        if tracing_on():
            return self._stub.Generate(request, timeout=timeout_s)
        if self._stream is None or self._stream.failed:
            self._stream = _Stream(self._stub)
        number = next(self._numbers)
        call = MuxCall(self._stream, number, timeout_s)
        self._stream.calls[number] = call
        self._stream.send(pb.GenerateOpen(call=number, start=request, timeout_s=timeout_s or 0.0))
        return call

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()
            self._stream = None
