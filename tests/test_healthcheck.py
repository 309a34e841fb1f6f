"""`epd healthcheck` against a real grpc.aio health server and a small HTTP server."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from launcher import cli
from launcher.healthcheck import Target, main, parse_target

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _run(argv: list[str]) -> int:
    # main() blocks; run it off the loop that serves the aio gRPC server.
    return await asyncio.to_thread(main, argv)


@pytest.fixture
async def health_server() -> AsyncIterator[tuple[str, health.aio.HealthServicer]]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"grpc://127.0.0.1:{port}", servicer
    finally:
        await server.stop(grace=None)


async def test_grpc_serving_is_healthy(health_server, capsys) -> None:
    target, servicer = health_server
    await servicer.set("", SERVING)
    assert await _run([target]) == 0
    assert "healthy" in capsys.readouterr().out


async def test_grpc_not_serving_is_unhealthy(health_server, capsys) -> None:
    target, servicer = health_server
    await servicer.set("", NOT_SERVING)
    assert await _run([target]) == 1
    assert "NOT_SERVING" in capsys.readouterr().err


async def test_grpc_flip_to_not_serving_before_shutdown(health_server) -> None:
    # What a worker does on SIGTERM before draining: checks start failing at once.
    target, servicer = health_server
    await servicer.set("", SERVING)
    assert await _run([target]) == 0
    await servicer.enter_graceful_shutdown()
    assert await _run([target]) == 1


async def test_grpc_named_service(health_server, capsys) -> None:
    target, servicer = health_server
    await servicer.set("epd.v1.Decode", SERVING)
    await servicer.set("epd.v1.Prefill", NOT_SERVING)
    assert await _run([f"{target}/epd.v1.Decode"]) == 0
    assert await _run([f"{target}/epd.v1.Prefill"]) == 1
    assert await _run([f"{target}/epd.v1.Unknown"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_grpc_unreachable_fails_fast(capsys) -> None:
    assert main([f"grpc://127.0.0.1:{_free_port()}", "--timeout", "2"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err  # refused at once, not after the timeout


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        status = {"/health": 200, "/draining": 503, "/redirect": 302}.get(self.path, 404)
        self.send_response(status)
        if status == 302:
            self.send_header("Location", "/health")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_http_200_is_healthy(http_server) -> None:
    assert main([f"{http_server}/health"]) == 0


@pytest.mark.parametrize("path", ["/draining", "/missing", "/redirect"])
def test_http_other_status_is_unhealthy(http_server, path, capsys) -> None:
    assert main([f"{http_server}{path}"]) == 1
    assert "HTTP" in capsys.readouterr().err


def test_http_unreachable(capsys) -> None:
    assert main([f"http://127.0.0.1:{_free_port()}/health", "--timeout", "2"]) == 1
    assert "unhealthy" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, expected",
    [
        ("grpc://127.0.0.1:50053", Target("grpc", "127.0.0.1:50053")),
        ("grpc://decode:50053/epd.v1.Decode", Target("grpc", "decode:50053", "epd.v1.Decode")),
        ("grpc://[::1]:50051", Target("grpc", "[::1]:50051")),
        ("http://gateway:8000/health", Target("http", "http://gateway:8000/health")),
    ],
)
def test_parse_target(text: str, expected: Target) -> None:
    assert parse_target(text) == expected


@pytest.mark.parametrize("bad", ["127.0.0.1:50053", "grpc://127.0.0.1", "grpc://:50053", "tcp://x:1", "http:///health"])
def test_bad_target_is_usage_error(bad: str, capsys) -> None:
    assert main([bad]) == 2
    assert "epd healthcheck:" in capsys.readouterr().err


def test_usage_errors() -> None:
    assert main([]) == 2
    assert main(["grpc://127.0.0.1:1", "--timeout", "0"]) == 2


def test_dispatched_by_epd_cli(http_server) -> None:
    assert cli.SUBCOMMANDS["healthcheck"][0] == "launcher.healthcheck"
    assert cli.main(["healthcheck", f"{http_server}/health"]) == 0
    assert cli.main(["healthcheck", f"{http_server}/draining"]) == 1
