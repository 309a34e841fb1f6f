"""What one request's hop to a worker costs apart from the work at either end: a new gRPC call (how
the gateway sends every ``Generate``), the same call opened before the request is there, one
message on a gRPC stream already open, and a plain TCP socket, between two processes on this host.

    python -m bench.request_hop [--requests 1500] [--gap-ms 5] [--events 16] [--image-bytes 1500]
                                [--server-cores 0]

A child process (``--serve``) answers every kind: on a gRPC server built as a worker builds its own
(``SERVER_OPTIONS``, the internal-token interceptor), a unary-stream method (one ``GenerateRequest``
-> ``--events`` ``TokenEvent`` messages: ``grpc_call``), a stream-stream method that answers the one
request its call carries (``grpc_opened_call``: the client keeps one such call open ahead of the
next request and writes the request into it), and a stream-stream method answering each request
message on one stream that stays open (``grpc_stream``); on a socket, length-prefixed frames of the
same protobuf bytes, each event its own write (``socket``). The client dials as the gateway dials a
worker (``open_channel``: the options and the token), and both sides run on uvloop where it is
installed, as epd's processes do. The request is shaped like a demo chat's colocated ``Generate``
(a request id, 29 token ids, one image's bytes inline). The kinds take turns request by request,
``--gap-ms`` apart (a client one request at a time leaves such a gap between its requests), so the
host's load falls on each alike. ``--server-cores``: the child's cores (the demo model's decode
worker is bound to core 0; ``''``: unbound).

Measured per request: send -> first event back (what the hop adds to TTFT) and send -> last event.
Printed: medians and p90 of each kind, and each over the plain socket. Results:
``bench/results/request_hop.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import struct
import sys
import time
from pathlib import Path

from bench.harness.host import host_info
from bench.harness.paths import RESULTS
from bench.harness.report import finish_results, fmt, markdown_table, results_header, settings_json
from bench.harness.servers import bench_process, free_port
from launcher.processes import wait_serving
from runtime.worker.runner import run_event_loop

TOKEN_ENV = "EPD_BENCH_HOP_TOKEN"
SERVICE = "bench.Hop"
KINDS = ("grpc_call", "grpc_opened_call", "grpc_stream", "socket")
_FRAME = struct.Struct("<I")


def events_for(events: int) -> list[bytes]:
    from proto.epd.v1 import epd_pb2 as pb

    return [pb.TokenEvent(token_ids=[10 + i], finish_reason="length" if i == events - 1 else "").SerializeToString()
            for i in range(events)]


# -- the serving side ----------------------------------------------------------------------
def serve(grpc_port: int, socket_port: int, events: int) -> None:
    """Child process: the gRPC server (a worker's options and token check) and the socket server."""
    import grpc
    from pydantic import SecretStr

    from proto.epd.v1 import epd_pb2 as pb
    from runtime.worker.internal_auth import server_interceptors
    from runtime.worker.wire import SERVER_OPTIONS

    replies = events_for(events)

    async def call(request: bytes, context):
        pb.GenerateRequest.FromString(request)
        for reply in replies:
            yield reply

    async def stream(requests, context):
        async for request in requests:
            pb.GenerateRequest.FromString(request)
            for reply in replies:
                yield reply

    async def once(requests, context):   # one request a call, as a pre-opened Generate would carry
        pb.GenerateRequest.FromString(await anext(requests.__aiter__()))
        for reply in replies:
            yield reply

    async def frames(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (size,) = _FRAME.unpack(await reader.readexactly(_FRAME.size))
                pb.GenerateRequest.FromString(await reader.readexactly(size))
                for reply in replies:
                    writer.write(_FRAME.pack(len(reply)) + reply)
                    await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    async def main() -> None:
        server = grpc.aio.server(options=SERVER_OPTIONS,
                                 interceptors=server_interceptors(SecretStr(os.environ[TOKEN_ENV])))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Call": grpc.unary_stream_rpc_method_handler(call),
            "Stream": grpc.stream_stream_rpc_method_handler(stream),
            "Once": grpc.stream_stream_rpc_method_handler(once)}),))
        server.add_insecure_port(f"127.0.0.1:{grpc_port}")
        await server.start()
        sockets = await asyncio.start_server(frames, "127.0.0.1", socket_port)
        print("ready", flush=True)
        async with sockets:
            await server.wait_for_termination()

    run_event_loop(main())


# -- the client side -----------------------------------------------------------------------
def request_bytes(image_bytes: int) -> bytes:
    from proto.epd.v1 import epd_pb2 as pb

    request = pb.GenerateRequest(request_id="chatcmpl-" + secrets.token_hex(16), token_ids=list(range(1, 30)),
                                 colocated=True, max_tokens=16, deadline_unix_ms=int(time.time() * 1000) + 60_000)
    request.images.add(cache_key=secrets.token_hex(32), image_data=os.urandom(image_bytes))
    return request.SerializeToString()


async def measure(grpc_port: int, socket_port: int, token: str,
                  args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """Per kind, each request's (first event, last event) seconds after its send."""
    from pydantic import SecretStr

    from runtime.worker.internal_auth import open_channel

    payload = request_bytes(args.image_bytes)
    channel = open_channel(f"127.0.0.1:{grpc_port}", SecretStr(token))
    call = channel.unary_stream(f"/{SERVICE}/Call")
    stream = channel.stream_stream(f"/{SERVICE}/Stream")()
    reader, writer = await asyncio.open_connection("127.0.0.1", socket_port)

    async def by_call() -> tuple[float, float]:
        t0 = time.perf_counter()
        replies = call(payload, timeout=10).__aiter__()
        await replies.__anext__()
        first = time.perf_counter() - t0
        got = 1 + len([r async for r in replies])
        assert got == args.events, got
        return first, time.perf_counter() - t0

    once_call = channel.stream_stream(f"/{SERVICE}/Once")
    spare = [once_call()]

    async def by_opened_call() -> tuple[float, float]:
        opened, spare[0] = spare[0], once_call()   # the next one opens before it is needed
        t0 = time.perf_counter()
        await opened.write(payload)   # the server answers one request a call: no half-close needed
        replies = opened.__aiter__()
        await replies.__anext__()
        first = time.perf_counter() - t0
        got = 1 + len([r async for r in replies])
        assert got == args.events, got
        return first, time.perf_counter() - t0

    async def by_stream() -> tuple[float, float]:
        t0 = time.perf_counter()
        await stream.write(payload)
        await stream.read()
        first = time.perf_counter() - t0
        for _ in range(args.events - 1):
            await stream.read()
        return first, time.perf_counter() - t0

    async def by_socket() -> tuple[float, float]:
        t0 = time.perf_counter()
        writer.write(_FRAME.pack(len(payload)) + payload)
        await writer.drain()
        first = 0.0
        for i in range(args.events):
            (size,) = _FRAME.unpack(await reader.readexactly(_FRAME.size))
            await reader.readexactly(size)
            if i == 0:
                first = time.perf_counter() - t0
        return first, time.perf_counter() - t0

    kinds = {"grpc_call": by_call, "grpc_opened_call": by_opened_call, "grpc_stream": by_stream, "socket": by_socket}
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
    for i in range(args.warmup + args.requests):
        for kind in KINDS:
            await asyncio.sleep(args.gap_ms / 1000)
            got = await kinds[kind]()
            if i >= args.warmup:
                samples[kind].append(got)
    await stream.done_writing()
    spare[0].cancel()
    writer.close()
    await channel.close()
    return samples


def summarise(samples: dict[str, list[tuple[float, float]]]) -> dict[str, dict[str, float]]:
    out = {}
    for kind, pairs in samples.items():
        first = sorted(p[0] * 1e3 for p in pairs)
        last = sorted(p[1] * 1e3 for p in pairs)
        out[kind] = {"first_ms_p50": statistics.median(first), "first_ms_p90": first[int(0.9 * (len(first) - 1))],
                     "last_ms_p50": statistics.median(last), "last_ms_p90": last[int(0.9 * (len(last) - 1))]}
    base = out["socket"]
    for row in out.values():
        row["first_over_socket"] = row["first_ms_p50"] / base["first_ms_p50"]
        row["last_over_socket"] = row["last_ms_p50"] / base["last_ms_p50"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1500, help="measured requests of each kind")
    ap.add_argument("--warmup", type=int, default=100, help="unmeasured requests of each kind first")
    ap.add_argument("--gap-ms", type=float, default=5.0, help="pause before each send")
    ap.add_argument("--events", type=int, default=16, help="TokenEvent messages back per request")
    ap.add_argument("--image-bytes", type=int, default=1500, help="image bytes inline in the request")
    ap.add_argument("--server-cores", default="0", help="the serving child's cores (comma list; '' = unbound)")
    ap.add_argument("--logs", type=Path, default=Path("/tmp/epd-bench-logs"))
    ap.add_argument("--json", type=Path, default=RESULTS / "request_hop.json")
    ap.add_argument("--serve", nargs=3, type=int, metavar=("GRPC_PORT", "SOCKET_PORT", "EVENTS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(*args.serve)
        return 0
    if args.events < 1:
        ap.error("--events must be at least 1")
    token = secrets.token_urlsafe(24)
    grpc_port, socket_port = free_port(), free_port()
    pin = ["taskset", "-c", args.server_cores] if args.server_cores else []
    child = bench_process("hop server", [*pin, sys.executable, "-m", "bench.request_hop",
                                         "--serve", str(grpc_port), str(socket_port), str(args.events)],
                          args.logs / "request-hop-server.log", {TOKEN_ENV: token})
    child.start()
    try:
        wait_serving(lambda: "ready" in child.log(), [child], 60, child.name, poll_s=0.1)
        started = time.perf_counter()
        samples = {}

        async def run() -> None:
            samples.update(await measure(grpc_port, socket_port, token, args))

        run_event_loop(run())
        elapsed = time.perf_counter() - started
    finally:
        child.stop()
    table = summarise(samples)
    rows = [[kind, fmt(r["first_ms_p50"], 3), fmt(r["first_ms_p90"], 3), fmt(r["first_over_socket"]),
             fmt(r["last_ms_p50"], 3), fmt(r["last_ms_p90"], 3), fmt(r["last_over_socket"])] for kind, r in table.items()]
    print(f"\n## one request's hop, {args.requests} requests of each kind, {args.events} events back, "
          f"{args.image_bytes} image bytes, {args.gap_ms} ms apart ({elapsed:.0f} s)\n")
    print(markdown_table(["kind", "first event p50 ms", "p90", "/ socket", "last event p50 ms", "p90", "/ socket"], rows))
    saved = table["grpc_call"]["first_ms_p50"] - table["grpc_stream"]["first_ms_p50"]
    print(f"\na new call over a message on the open stream, to the first event: {saved:+.3f} ms")
    payload = {**results_header("request_hop", argv), "settings": settings_json(
        {k: v for k, v in vars(args).items() if k not in ("serve", "logs", "json")}), "host": host_info(),
        "kinds": table, "call_minus_stream_first_ms": saved}
    finish_results(args.json, payload)
    print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
