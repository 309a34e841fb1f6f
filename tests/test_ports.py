"""Every worker listens on a port of its own.

``free_port`` hands a port to a child that binds it seconds later, so the kernel may offer the
same port again meanwhile; a stack planned in one go (``epd serve``, the test clusters) would
then give two workers one address. And a worker's gRPC server must not share a port another
server listens on (gRPC's default SO_REUSEPORT would let it, and the kernel would split the
connections between the two): the second one fails to start instead.
"""

from __future__ import annotations

import pytest

from launcher.processes import free_port
from runtime.worker.grpc_server import WorkerServer
from runtime.worker.settings import WorkerSettings


def test_a_port_is_never_handed_out_twice():
    ports = [free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports)


async def test_a_worker_refuses_a_port_another_server_listens_on():
    port = free_port()
    settings = WorkerSettings(host="127.0.0.1", port=port)
    first = WorkerServer("encoder", settings, "Encoder")
    assert await first.start() == f"127.0.0.1:{port}"
    second = WorkerServer("decode", settings, "Decode")
    try:
        with pytest.raises(RuntimeError, match=f"cannot bind 127.0.0.1:{port}"):
            await second.start()
    finally:
        await second.server.stop(None)
        await first.server.stop(None)
