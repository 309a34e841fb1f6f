"""``bench.request_hop``: the hop-cost benchmark runs end to end against a real child process that
serves as a worker does (its gRPC options and internal-token check). Nothing here is a timing
claim: the test checks that every kind is measured and reported, not how fast."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import grpc

from bench import request_hop
from bench.harness.servers import bench_process, free_port
from launcher.processes import wait_serving


def test_every_kind_is_measured_and_reported(tmp_path: Path) -> None:
    out = tmp_path / "hop.json"
    assert request_hop.main(["--requests", "4", "--warmup", "1", "--gap-ms", "0", "--events", "3",
                             "--server-cores", "", "--logs", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["kinds"]) == list(request_hop.KINDS)
    for row in result["kinds"].values():
        assert 0 < row["first_ms_p50"] <= row["last_ms_p50"]
    assert result["kinds"]["socket"]["first_over_socket"] == 1.0
    assert result["command"].startswith("python -m bench.request_hop --requests 4")
    assert result["settings"]["events"] == 3


async def _status_without_token(port: int) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(f"/{request_hop.SERVICE}/Call")(request_hop.request_bytes(10), timeout=10)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def test_the_server_checks_the_internal_token_as_a_worker_does(tmp_path: Path) -> None:
    grpc_port, socket_port = free_port(), free_port()
    child = bench_process("hop server", [sys.executable, "-m", "bench.request_hop", "--serve",
                                         str(grpc_port), str(socket_port), "2"], tmp_path / "server.log",
                          {request_hop.TOKEN_ENV: "a-token"})
    child.start()
    try:
        wait_serving(lambda: "ready" in child.log(), [child], 60, child.name, poll_s=0.1)
        assert asyncio.run(_status_without_token(grpc_port)) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        child.stop()
