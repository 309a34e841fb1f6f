"""Many ``Generate`` calls on one ``GenerateMany`` stream: the decode side (``decode_svc/generate_mux.py``)
runs each as its own ``Generate``, and the gateway side (``gateway/generate_mux.py``) reads each as a
call. Over a real gRPC server and channel (a worker's options and token), with a ``Generate`` that
records what it was asked and whether its ``finally`` ran: the end-to-end paths through the real
decode worker are every other gateway test's, which send their requests this way by default."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from pydantic import SecretStr

from decode_svc.generate_mux import GenerateMany
from gateway.generate_mux import GenerateMux
from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.worker.internal_auth import open_channel, server_interceptors
from runtime.worker.rpc_failure import FailureKind, abort_with, failure_kind
from runtime.worker.wire import GRPC_OPTIONS, SERVER_OPTIONS

TOKEN = SecretStr("mux-test-token")


class Recorder:
    """A ``Generate``: request ``r-N-tokens`` yields N events; ``abort``, ``boom`` and ``hang`` do what they say."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.finished: list[str] = []   # each request whose generator ran its finally
        self.gate = asyncio.Event()

    async def generate(self, request: pb.GenerateRequest, context):
        rid = request.request_id
        self.started.append(rid)
        try:
            if rid.startswith("abort"):
                await abort_with(context, FailureKind.EMBEDDING_FETCH, grpc.StatusCode.FAILED_PRECONDITION, "no embedding")
            if rid.startswith("boom"):
                raise RuntimeError("a bug")
            if rid.startswith("hang"):
                await asyncio.Event().wait()
            if rid.startswith("gated"):
                await self.gate.wait()
            for i in range(int(rid.split("-")[1])):
                await asyncio.sleep(0)
                yield pb.TokenEvent(token_ids=[i], finish_reason="length" if i == int(rid.split("-")[1]) - 1 else "")
        finally:
            self.finished.append(rid)


class Servicer(pb_grpc.DecodeServicer):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.streams = 0

    async def GenerateMany(self, request_iterator, context):
        self.streams += 1
        async for event in GenerateMany(self.recorder.generate).serve(request_iterator):
            yield event


@contextlib.asynccontextmanager
async def worker(recorder: Recorder, port: int = 0):
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=server_interceptors(TOKEN))
    servicer = Servicer(recorder)
    pb_grpc.add_DecodeServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        yield server, servicer, port
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def gateway_side(port: int):
    """The gateway's side: a channel dialled as the registry dials a worker, and its ``GenerateMux``."""
    channel = open_channel(f"127.0.0.1:{port}", TOKEN)
    mux = GenerateMux(pb_grpc.DecodeStub(channel))
    try:
        yield mux
    finally:
        await mux.close()
        await channel.close()


async def read_all(call) -> list[int]:
    return [ev.token_ids[0] async for ev in call]


async def until(predicate, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


def test_requests_share_one_stream_and_each_gets_its_own_events() -> None:
    async def main() -> None:
        recorder = Recorder()
        async with worker(recorder) as (_, servicer, port):
            async with gateway_side(port) as mux:
                calls = [mux.call(pb.GenerateRequest(request_id=f"r-{n}-{k}"), 10.0) for k, n in enumerate((3, 7, 1, 5))]
                results = await asyncio.gather(*(read_all(c) for c in calls))
                assert results == [list(range(3)), list(range(7)), [0], list(range(5))]
                first = calls[0].__aiter__()
                assert calls[0].__aiter__() is first   # a second read continues the one iterator, as a call's does
                assert (await read_all(mux.call(pb.GenerateRequest(request_id="r-2-x"), 10.0))) == [0, 1]
                assert servicer.streams == 1   # five requests, one stream
                await until(lambda: len(recorder.finished) == 5)

    asyncio.run(main())


def test_a_failed_call_raises_its_status_and_failure_kind_and_the_others_go_on() -> None:
    async def main() -> None:
        recorder = Recorder()
        async with worker(recorder) as (_, _, port):
            async with gateway_side(port) as mux:
                aborted = mux.call(pb.GenerateRequest(request_id="abort-1"), 10.0)
                broken = mux.call(pb.GenerateRequest(request_id="boom-1"), 10.0)
                fine = mux.call(pb.GenerateRequest(request_id="r-4"), 10.0)
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await read_all(aborted)
                assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and exc.value.details() == "no embedding"
                assert failure_kind(exc.value) is FailureKind.EMBEDDING_FETCH
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await read_all(broken)
                assert exc.value.code() == grpc.StatusCode.UNKNOWN and "a bug" in exc.value.details()
                assert await read_all(fine) == [0, 1, 2, 3]
                assert aborted.done() and broken.done() and fine.done()

    asyncio.run(main())


def test_cancel_reaches_the_worker_and_frees_what_its_generate_held() -> None:
    async def main() -> None:
        recorder = Recorder()
        async with worker(recorder) as (_, _, port):
            async with gateway_side(port) as mux:
                call = mux.call(pb.GenerateRequest(request_id="hang-1"), 10.0)
                await until(lambda: recorder.started == ["hang-1"])
                reading = asyncio.ensure_future(read_all(call))
                await asyncio.sleep(0.05)
                assert call.cancel() and not call.cancel()   # once
                with pytest.raises(asyncio.CancelledError):
                    await reading
                await until(lambda: recorder.finished == ["hang-1"])   # the worker's Generate ran its finally
                assert await read_all(mux.call(pb.GenerateRequest(request_id="r-2"), 10.0)) == [0, 1]   # the stream lives on

    asyncio.run(main())


def test_the_deadline_ends_the_call_on_both_sides() -> None:
    async def main() -> None:
        recorder = Recorder()
        async with worker(recorder) as (_, _, port):
            async with gateway_side(port) as mux:
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await read_all(mux.call(pb.GenerateRequest(request_id="hang-1"), 0.2))
                assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                await until(lambda: recorder.finished == ["hang-1"])

    asyncio.run(main())


def test_a_worker_that_goes_away_fails_its_calls_as_unavailable_and_a_new_stream_serves_it_back() -> None:
    async def main() -> None:
        recorder = Recorder()
        async with worker(recorder) as (server, _, port):
            await server.stop(0)   # only its port is wanted: the worker below comes back on it
        async with gateway_side(port) as mux:
            async with worker(recorder, port) as (server, _, _):
                calls = [mux.call(pb.GenerateRequest(request_id=f"gated-{n}"), 10.0) for n in (2, 3)]
                await until(lambda: len(recorder.started) == 2)
                await server.stop(0)
                for call in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as exc:
                        await read_all(call)
                    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and failure_kind(exc.value) is None
                await until(lambda: sorted(recorder.finished) == ["gated-2", "gated-3"])   # cancelled there, freed
            async with worker(recorder, port) as (_, servicer, _):   # the worker is back on its address
                recorder.gate.set()
                async with asyncio.timeout(10):
                    while True:   # the channel reconnects within about a second
                        try:
                            assert await read_all(mux.call(pb.GenerateRequest(request_id="gated-2-again"), 10.0)) == [0, 1]
                            break
                        except grpc.aio.AioRpcError as exc:
                            assert exc.code() == grpc.StatusCode.UNAVAILABLE
                            await asyncio.sleep(0.1)
                assert servicer.streams == 1


def test_closing_the_stream_cancels_every_call_on_the_worker() -> None:
    async def main() -> None:
        recorder = Recorder()
        async with worker(recorder) as (_, _, port):
            async with gateway_side(port) as mux:
                calls = [mux.call(pb.GenerateRequest(request_id=f"hang-{n}"), 10.0) for n in range(3)]
                await until(lambda: len(recorder.started) == 3)
                await mux.close()   # the gateway stops (or drops the worker): as each call being cancelled
                for call in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as exc:
                        await read_all(call)
                    assert exc.value.code() == grpc.StatusCode.CANCELLED
                await until(lambda: len(recorder.finished) == 3)

    asyncio.run(main())


def test_a_stream_without_the_internal_token_is_refused() -> None:
    async def main() -> None:
        async with worker(Recorder()) as (_, servicer, port):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
                mux = GenerateMux(pb_grpc.DecodeStub(channel))
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await read_all(mux.call(pb.GenerateRequest(request_id="r-1"), 10.0))
                assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert servicer.streams == 0
                await mux.close()

    asyncio.run(main())


def test_workers_accept_the_keepalive_pings_of_an_idle_open_stream() -> None:
    """A GenerateMany stream stays open while no request is on it, and the gateway's channel pings it
    every ``keepalive_time_ms``; a server that allows fewer pings without data answers GOAWAY
    ``too_many_pings`` and every request on the stream fails (gRPC's default allows one per 5 minutes)."""
    client, server = dict(GRPC_OPTIONS), dict(SERVER_OPTIONS)
    assert server["grpc.http2.min_ping_interval_without_data_ms"] <= client["grpc.keepalive_time_ms"]
