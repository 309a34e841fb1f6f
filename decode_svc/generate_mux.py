"""``Decode.GenerateMany``: many ``Generate`` calls as messages on one stream from a gateway.

A new gRPC call costs about as much again as one message on a stream already open (measured by
``bench/request_hop.py``), and a short chat pays that on its first token. So a gateway keeps one
stream open to each decode worker and sends each request on it as a ``GenerateOpen.start`` named
by its own call number (``gateway/generate_mux.py``).

Each started call runs the servicer's own ``Generate`` with a ``CallContext`` in place of its gRPC
context, so everything a call does and frees is exactly what a ``Generate`` call does. Lifecycle of
a call on this side: started -> its events -> one ``GenerateEnd``, then forgotten. It ends
normally (OK), by ``abort`` (its code, details and trailing metadata), by an error (UNKNOWN, as
gRPC reports a servicer's exception), by its deadline (``timeout_s``: DEADLINE_EXCEEDED), or it is
cancelled: by the gateway's ``cancel``, by the stream ending, or by the worker stopping, as gRPC
cancels a call whose client has gone (the generator's ``finally`` frees what it held). A cancelled
call sends no end: nobody waits for it. Each reply carries every entry ready when it is sent: a
decode step's events for all the requests on the stream go back as one message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from proto.epd.v1 import epd_pb2 as pb

log = logging.getLogger("epd.decode")

Generate = Callable[[pb.GenerateRequest, "CallContext"], AsyncIterator[pb.TokenEvent]]


class CallContext:
    """What ``Generate`` uses of a call's gRPC context: ``abort`` and ``set_trailing_metadata``."""

    def __init__(self) -> None:
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.trailing: tuple[tuple[str, str], ...] = ()

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        """End the call with ``code`` (raises, as gRPC's ``abort`` does)."""
        if trailing_metadata:
            self.trailing = tuple(trailing_metadata)
        self.code, self.details = code, details
        raise grpc.aio.AbortError(f"aborted: {code.name}")

    def end(self) -> pb.GenerateEnd:
        return pb.GenerateEnd(code=self.code.value[0], details=self.details,
                              trailing_metadata=[pb.StatusEntry(key=k, value=v) for k, v in self.trailing])


class GenerateMany:
    """One ``GenerateMany`` stream: its calls (one task each) and the events they send back."""

    def __init__(self, generate: Generate) -> None:
        self._generate = generate
        self._calls: dict[int, asyncio.Task] = {}
        self._out: asyncio.Queue[pb.GenerateEvent | None] = asyncio.Queue()

    async def serve(self, requests: AsyncIterator[pb.GenerateOpens]) -> AsyncIterator[pb.GenerateEvents]:
        """The stream's replies until the gateway closes its side; then every call still running is cancelled."""
        reader = asyncio.create_task(self._read(requests), name="generate-many-reader")
        try:
            while (event := await self._out.get()) is not None:
                batch = [event]
                while not self._out.empty() and (event := self._out.get_nowait()) is not None:
                    batch.append(event)
                yield pb.GenerateEvents(events=batch)
                if event is None:
                    break
        finally:
            reader.cancel()
            calls = list(self._calls.values())
            for task in calls:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(reader, *calls, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[pb.GenerateOpens]) -> None:
        try:
            async for batch in requests:
                for message in batch.opens:
                    kind = message.WhichOneof("body")
                    if kind == "start" and message.call not in self._calls:
                        self._calls[message.call] = asyncio.create_task(
                            self._run(message.call, message.start, message.timeout_s), name=f"generate-{message.call}")
                    elif kind == "cancel" and (task := self._calls.pop(message.call, None)) is not None:
                        task.cancel()
        except grpc.aio.AioRpcError as exc:     # the gateway went away mid-stream: as its calls being cancelled
            log.info("GenerateMany stream from the gateway ended: %s", exc.code().name)
        finally:
            self._out.put_nowait(None)

    async def _run(self, call: int, request: pb.GenerateRequest, timeout_s: float) -> None:
        context = CallContext()
        try:
            async with asyncio.timeout(timeout_s if timeout_s > 0 else None):
                async for event in self._generate(request, context):
                    self._out.put_nowait(pb.GenerateEvent(call=call, event=event))
        except grpc.aio.AbortError:
            pass
        except TimeoutError:
            context.code, context.details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        except asyncio.CancelledError:   # the gateway's cancel, or the stream is closing: no end is sent
            raise
        except Exception as exc:
            log.exception("request %s: Generate failed", request.request_id)
            context.code, context.details = grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)}: {exc}"
        finally:
            self._calls.pop(call, None)
        self._out.put_nowait(pb.GenerateEvent(call=call, end=context.end()))
