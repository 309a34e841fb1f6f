"""The gRPC server of every worker: health, reflection, registration, graceful drain.

Every RPC but health needs the internal token when one is set (``runtime/worker/internal_auth.py``);
a worker that would listen beyond loopback without one refuses to start.

Lifecycle: start -> SERVING (health) -> registered in Redis with a heartbeat ->
on SIGTERM/SIGINT: NOT_SERVING first, deregister, drain in-flight work (bounded by
``drain_timeout_s``), then stop with a grace period. Nothing is cut mid-request
unless the drain times out. The process around it (flags, model, the role's parts,
close) is ``runtime/worker/runner.py``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto.epd.v1 import epd_pb2

from runtime.worker.discovery import WorkerRegistration
from runtime.worker.internal_auth import TOKEN_ENV, exposure_problem, server_interceptors
from runtime.worker.settings import WorkerSettings
from runtime.worker.wire import SERVER_OPTIONS

log = logging.getLogger("epd.worker")


class WorkerServer:
    def __init__(self, role: str, settings: WorkerSettings, service_name: str):
        self.role = role
        self.settings = settings
        self.service_name = service_name
        self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=server_interceptors(settings.internal_token))
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.address = ""
        self._registration: WorkerRegistration | None = None

    async def start(self) -> str:
        s = self.settings
        problem = exposure_problem(s.host, s.internal_token, s.allow_unauthenticated)
        if problem:
            raise RuntimeError(problem)
        if s.internal_token is None:
            log.warning("no %s: this %s worker accepts RPCs from anyone who can reach %s", TOKEN_ENV, self.role,
                        s.host)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (
            epd_pb2.DESCRIPTOR.services_by_name[self.service_name].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self.server)
        address = f"{self.settings.host}:{self.settings.resolved_port(self.role)}"
        try:
            port = self.server.add_insecure_port(address)
        except RuntimeError:   # grpcio raises where it cannot bind (older releases returned 0)
            port = 0
        if port == 0:
            raise RuntimeError(f"cannot bind {address}: another process may be listening on it")
        await self.server.start()
        self.address = self.settings.advertised_address(self.role, port)
        await self._set_serving(True)
        if self.settings.redis_url:
            self._registration = WorkerRegistration(self.settings.redis_url, self.role, self.address, self.settings.heartbeat_s)
            await self._registration.start()
        log.info("%s worker serving on %s", self.role, self.address)
        return self.address

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", epd_pb2.DESCRIPTOR.services_by_name[self.service_name].full_name):
            await self.health.set(name, status)

    async def drain_and_stop(self, drain: Callable[[float], Awaitable[None]] | None = None) -> None:
        await self._set_serving(False)
        if self._registration:
            await self._registration.stop()
        if drain:
            try:
                await asyncio.wait_for(drain(self.settings.drain_timeout_s), self.settings.drain_timeout_s)
            except TimeoutError:
                log.warning("%s drain timed out after %.0f s", self.role, self.settings.drain_timeout_s)
        await self.server.stop(grace=2.0)


async def run_until_signal(server: WorkerServer, drain: Callable[[float], Awaitable[None]] | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain and stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("%s worker draining", server.role)
    await server.drain_and_stop(drain)
