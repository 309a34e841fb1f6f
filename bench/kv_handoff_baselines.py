"""``kv_handoff``'s baselines: the same bytes over a plain TCP socket, and over bare gRPC (no
protobuf, checksum or pool), each received by a child process that prints ``ready`` once it
listens (``python -m bench.kv_handoff --socket-server`` / ``--grpc-raw-server``)."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from pathlib import Path

from bench.harness.servers import Process, bench_process
from launcher.processes import wait_serving

MiB = 1 << 20


# -- the raw socket side --------------------------------------------------------------
def socket_server(port: int, total: int) -> None:
    """Child process: accept connections; for each, receive ``total`` bytes, answer one byte."""
    buf = bytearray(total)
    view = memoryview(buf)
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", port))
        srv.listen(1)
        print("ready", flush=True)
        while True:
            conn, _ = srv.accept()
            with conn:
                got = 0
                while got < total:
                    n = conn.recv_into(view[got:], min(total - got, 16 * MiB))
                    if n == 0:
                        break
                    got += n
                if got < total:
                    return
                conn.sendall(b"k")


def socket_send(port: int, payload: memoryview, piece: int) -> float:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        for off in range(0, len(payload), piece):
            s.sendall(payload[off: off + piece])
        ack = s.recv(1)
        elapsed = time.perf_counter() - t0
    assert ack == b"k"
    return elapsed


# -- gRPC transport alone: the same stream of bytes, no protobuf, no checksum, no pool -----
def grpc_raw_server(port: int) -> None:
    """Child process: a grpc.aio server (same options as the workers) whose one method counts raw bytes."""
    import grpc

    from runtime.worker.wire import GRPC_OPTIONS

    async def push(request_iterator, context) -> bytes:
        n = 0
        async for message in request_iterator:
            n += len(message)
        return n.to_bytes(8, "little")

    async def serve() -> None:
        server = grpc.aio.server(options=GRPC_OPTIONS)
        handler = grpc.method_handlers_generic_handler("bench.Raw", {"Push": grpc.stream_unary_rpc_method_handler(push)})
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())


async def grpc_raw_push(channel, pieces: list[bytes]) -> float:
    push = channel.stream_unary("/bench.Raw/Push")
    t0 = time.perf_counter()
    got = int.from_bytes(await push(iter(pieces), timeout=600), "little")
    elapsed = time.perf_counter() - t0
    assert got == sum(len(p) for p in pieces)
    return elapsed


def baseline_processes(socket_port: int, total: int, raw_port: int, logs: Path) -> list[Process]:
    """The socket server (receiving ``total`` bytes a connection) and the raw gRPC server, not started."""
    me = [sys.executable, "-m", "bench.kv_handoff"]
    return [bench_process("socket server", [*me, "--socket-server", str(socket_port), "--socket-total", str(total)],
                          logs / "socket.log"),
            bench_process("raw gRPC server", [*me, "--grpc-raw-server", str(raw_port)], logs / "grpc-raw.log")]


def start_until_ready(helper: Process) -> None:
    """Start a baseline server and wait for its ``ready`` line."""
    helper.start()
    wait_serving(lambda: "ready" in helper.log(), [helper], 60, helper.name, poll_s=0.1)
