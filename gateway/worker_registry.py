"""The gateway's live view of every worker: addresses, health, load and timings.

Discovery: static addresses from settings, plus (with Redis) every worker that
registered itself with a heartbeat. A poll loop calls each worker's ``Stats``
every ``poll_s``: success marks it healthy and refreshes its load; a failure marks
it unhealthy at once (routed around) and it is taken back as soon as a poll
succeeds again. A worker that died is marked within ``poll_s`` plus the slowest
poll of the previous round (each bounded by its 1 s timeout); a failed RPC marks
it at once (``gateway/worker_rpc.py``). A worker restarted on the same address is
reconnected to within about a second (``GRPC_OPTIONS``' reconnect backoff). Workers that vanish from Redis are dropped (their channel is closed once
this gateway's requests on them have ended: a draining worker leaves Redis first).

Timing samples in the stats feed the cost model (``on_sample``), so its
coefficients are calibrated online from what the workers measure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import redis.asyncio as aioredis
from pydantic import SecretStr

from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.worker.discovery import list_workers
from runtime.worker.internal_auth import open_channel

from .generate_mux import GenerateMux

log = logging.getLogger("epd.gateway.registry")

ROLES = ("encoder", "prefill", "decode")
_STUBS = {"encoder": pb_grpc.EncoderStub, "prefill": pb_grpc.PrefillStub, "decode": pb_grpc.DecodeStub}


@dataclass(slots=True)
class WorkerHandle:
    role: str
    address: str
    channel: grpc.aio.Channel
    stub: object
    static: bool = False
    healthy: bool = False
    stats: pb.WorkerStats | None = None
    last_sample: int = 0
    inflight: int = field(default=0)   # requests this gateway currently has on the worker (decode: one per choice)
    # prompts this gateway placed to prefill there (colocated on a decode worker, or on a prefill worker)
    # that have no first token yet, by request id: their tokens (admission.Ticket adds, moves with a
    # recovery and removes them: an estimate's input, never a count of capacity)
    placed_prompts: dict[str, int] = field(default_factory=dict)
    bulk_address: str = ""             # decode: its bulk KV path, learnt from Reserve replies
    # decode: its prefix-cache summary (ids of its cached block keys) and that summary's version;
    # emptied when a poll fails (a restarted worker lost its cache, and says so with a new version)
    prefix_summary: frozenset[int] = frozenset()
    prefix_summary_version: str = ""
    # decode: the GenerateMany stream its requests go on (generate_mux.py); None: one Generate call each
    generate_mux: GenerateMux | None = None

    def generate(self, request: pb.GenerateRequest, timeout_s: float):
        """Decode: the request's ``Generate``, read as a call (a message on ``generate_mux`` when there is one)."""
        if self.generate_mux is not None:
            return self.generate_mux.call(request, timeout_s)
        return self.stub.Generate(request, timeout=timeout_s)

    async def close(self) -> None:
        """Close the channel (and the GenerateMany stream on it: the requests still on it fail)."""
        if self.generate_mux is not None:
            await self.generate_mux.close()
        await self.channel.close()

    def describe(self) -> dict:
        s = self.stats
        out: dict = {"address": self.address, "healthy": self.healthy, "inflight_from_gateway": self.inflight}
        if s is not None:
            out.update(queue_depth=s.queue_depth, in_flight=s.in_flight, linear_kernel=s.linear_kernel,
                       cpus=list(s.cpus), cpus_busy=round(s.cpus_busy, 3))
            if self.role == "decode":
                out.update(reservations_active=s.reservations_active, pending_chunks=s.pending_chunks,
                           free_blocks=s.free_blocks, total_blocks=s.total_blocks, running_seqs=s.running_seqs,
                           max_batch_observed=s.max_batch, max_batch_configured=s.max_batch_configured,
                           lease_reaped_total=s.lease_reaped_total, attention_kernel=s.attention_kernel,
                           cached_blocks=s.cached_blocks, images_encoded_here=s.computes,
                           prefix_cache=s.prefix_cache, prefix_cache_queries_total=s.prefix_cache_queries_total,
                           prefix_cache_hits_total=s.prefix_cache_hits_total,
                           free_state_slots=s.free_state_slots, total_state_slots=s.total_state_slots)
            elif self.role == "encoder":
                out.update(computes=s.computes, cache_hits=s.cache_hits, single_flight_in_flight=s.single_flight_in_flight)
            elif self.role == "prefill":
                out.update(queued_prefill_tokens=s.queued_prefill_tokens, max_batch_observed=s.max_batch,
                           attention_kernel=s.attention_kernel,
                           free_blocks=s.free_blocks, total_blocks=s.total_blocks,
                           free_state_slots=s.free_state_slots, total_state_slots=s.total_state_slots)
        return out


class WorkerRegistry:
    def __init__(self, static: dict[str, list[str]], redis_url: str | None, *, poll_s: float = 0.5,
                 on_sample: Callable[[str, pb.TimingSample], None] | None = None,
                 on_refresh: Callable[[], None] | None = None, token: SecretStr | None = None,
                 generate_stream: bool = True):
        self.workers: dict[str, dict[str, WorkerHandle]] = {role: {} for role in ROLES}
        self._static = static
        self._token = token   # EPD_INTERNAL_TOKEN: every channel sends it on every call
        self._generate_stream = generate_stream   # decode handles send Generate on a GenerateMany stream
        self._redis = aioredis.from_url(redis_url, socket_timeout=1, socket_connect_timeout=1) if redis_url else None
        self.poll_s = poll_s
        self.on_sample = on_sample or (lambda role, s: None)
        self.on_refresh = on_refresh or (lambda: None)
        self._task: asyncio.Task | None = None
        self._closing = False
        # handles that left discovery while this gateway still had requests on them: their
        # channel stays open until those requests end (a draining worker deregisters first)
        self._leaving: list[WorkerHandle] = []

    def _add(self, role: str, address: str, static: bool = False) -> WorkerHandle:
        if address not in self.workers[role]:
            channel = open_channel(address, self._token)
            stub = _STUBS[role](channel)
            mux = GenerateMux(stub) if role == "decode" and self._generate_stream else None
            self.workers[role][address] = WorkerHandle(role, address, channel, stub, static=static, generate_mux=mux)
        return self.workers[role][address]

    async def start(self) -> None:
        """Channels are opened here, inside the serving event loop (gRPC aio binds them to it)."""
        for role, addresses in self._static.items():
            for address in addresses:
                self._add(role, address, static=True)
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="worker-registry")

    async def close(self) -> None:
        self._closing = True
        if self._task:
            self._task.cancel()
            # bounded: a cancel that lands inside a redis-py call can be swallowed; the flag ends the loop
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._task, 5.0)
        for h in self.handles():
            await h.close()
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._redis.aclose(), 2.0)

    async def _loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.poll_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("worker refresh failed")

    async def refresh(self) -> None:
        if self._redis is not None:
            try:
                for role in ROLES:
                    live = set(await list_workers(self._redis, role))
                    for address in live:
                        self._add(role, address)
                    for address, h in list(self.workers[role].items()):
                        if not h.static and address not in live:
                            del self.workers[role][address]
                            h.healthy = False
                            self._leaving.append(h)   # a draining worker finishes what it accepted
            except Exception as exc:
                log.warning("discovery through Redis failed: %s", exc)
        for h in [h for h in self._leaving if h.inflight <= 0]:
            self._leaving.remove(h)
            await h.close()
        await asyncio.gather(*(self._poll(h) for handles in self.workers.values() for h in list(handles.values())))
        self.on_refresh()

    async def _poll(self, h: WorkerHandle) -> None:
        try:
            stats = await h.stub.Stats(pb.StatsRequest(since_sample=h.last_sample,
                                                       prefix_summary_version=h.prefix_summary_version),
                                       timeout=max(1.0, self.poll_s * 2))
        except grpc.aio.AioRpcError:
            h.healthy = False
            h.prefix_summary, h.prefix_summary_version = frozenset(), ""
            return
        if stats.prefix_summary_sent or not stats.prefix_cache:
            h.prefix_summary = frozenset(stats.prefix_summary)
            h.prefix_summary_version = stats.prefix_summary_version
        del stats.prefix_summary[:]        # kept once, as the set
        if stats.last_sample < h.last_sample:  # the worker restarted: its sample numbering began again
            h.last_sample = 0
        for sample in stats.samples:
            self.on_sample(h.role, sample)
        h.last_sample = stats.last_sample
        h.stats = stats
        h.healthy = stats.serving

    def mark_unhealthy(self, role: str, address: str) -> None:
        h = self.workers[role].get(address)
        if h is not None:
            h.healthy = False
            h.prefix_summary, h.prefix_summary_version = frozenset(), ""

    def healthy(self, role: str) -> list[WorkerHandle]:
        return [h for h in self.workers[role].values() if h.healthy]

    def handles(self) -> list[WorkerHandle]:
        """Every handle with an open channel: the listed ones and those still leaving."""
        return [*(h for handles in self.workers.values() for h in handles.values()), *self._leaving]

    def get(self, role: str, address: str) -> WorkerHandle | None:
        return self.workers[role].get(address)

    def status(self) -> dict:
        return {role: [h.describe() for h in handles.values()] for role, handles in self.workers.items()}
