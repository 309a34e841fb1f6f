"""The one leak check of the fault, resilience, serve and stream-ending tests: nothing is left held.

After a test, for every worker the test names (a worker it killed is left out by the test,
by process or address: ``exclude``; a named worker that does not answer is reported, never
skipped):

- decode: every KV block free (``free_blocks == total_blocks``) and every state slot of a hybrid
  model (``free_state_slots == total_state_slots``), no running sequence, no
  reservation, no landed chunk, and ``lease_reaped_total`` where it was when the test began:
  the lease reaper did not free what a path forgot. Start decode workers with
  ``LONG_LEASES`` so that no lease can end inside a test and the reaper cannot do it;
- prefill: its scratch pool (and state slots) free, nothing queued or in flight;
- encoder: nothing queued or in flight, no encoder-cache single-flight entry;
- every gateway (an in-process ``Orchestrator``, or a gateway process through ``/status``):
  each worker handle's in-flight count 0, no admitted request still waiting for a first token;
- the encoder cache's Redis, when the cache is Redis: no ``{namespace}:lock:*`` key;
- the named workers' logs: no KV block freed twice since the test began.

Stats are asynchronous (a Release may still be on its way when a request returns), so
``settled`` / ``assert_settled`` poll for at most ``SETTLE_S``, shorter than any lease and
than the cache's lock expiry (10 s), and fail listing everything still held.

Usage::

    check = LeakCheck.of_cluster(cluster, gateways=[orchestrator_counters(orch)]).begin()   # before the work
    ...                                       # a cluster check names the workers started meanwhile too
    check.exclude(killed)                     # the Worker the test killed (a restart on its address counts)
    await check.settled()
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
import redis

from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc

# a lease ends at its TTFT deadline plus this margin: longer than any test, so only the path
# that owns a reservation can have freed it
LONG_LEASES = {"EPD_LEASE_MARGIN_S": "300"}
SETTLE_S = 8.0
ROLES = ("encoder", "prefill", "decode")
_STUBS = {"encoder": pb_grpc.EncoderStub, "prefill": pb_grpc.PrefillStub, "decode": pb_grpc.DecodeStub}
_NO_SAMPLES = 2**63   # Stats(since_sample): newer than anything, so no timing samples ride along
DOUBLE_FREE = "freed twice"   # runtime/kv_pool.py's error

GatewayProbe = Callable[[], dict[str, int]]   # what a gateway still counts, by name (all 0 when clean)


def orchestrator_counters(orch) -> GatewayProbe:
    """An in-process ``gateway.orchestrator.Orchestrator``: handle in-flight counts and admissions waiting."""
    def probe() -> dict[str, int]:
        out: dict[str, int] = {}
        for h in orch.registry.handles():     # a handle leaving discovery and its successor: summed
            name = f"gateway inflight on {h.role} {h.address}"
            out[name] = out.get(name, 0) + h.inflight
        out["gateway: admitted, waiting for a first token"] = orch.admission.pressure.waiting
        return out
    return probe


def http_gateway_counters(base: str, headers: dict[str, str] | None = None) -> GatewayProbe:
    """A gateway process: the same counters from its ``/status``."""
    def probe() -> dict[str, int]:
        try:
            status = httpx.get(f"{base}/status", headers=headers, timeout=5, trust_env=False).json()
        except (httpx.HTTPError, ValueError) as exc:
            return {f"gateway {base}: /status failed ({exc!r})": 1}
        out = {f"gateway {base} inflight on {role} {w['address']}": w["inflight_from_gateway"]
               for role in ROLES for w in status[role]}
        out[f"gateway {base}: admitted, waiting for a first token"] = status["waiting_first_token"]
        return out
    return probe


@dataclass
class LeakCheck:
    workers: dict[str, list[str]] = field(default_factory=dict)   # role -> addresses that must be clean ...
    cluster: object | None = None      # ... or every worker of this tests/cluster.py cluster, as it is at each look,
    excluded: list = field(default_factory=list)  # but these Workers (or addresses): the ones the test killed
    gateways: list[GatewayProbe] = field(default_factory=list)
    token: str | None = None           # EPD_INTERNAL_TOKEN of the workers
    redis_url: str | None = None       # the encoder cache's Redis, when it is Redis
    namespace: str = "epd:enc"
    reaped_before: dict[str, int] = field(default_factory=dict)
    _log_offsets: dict[int, int] = field(default_factory=dict)    # id(Worker) -> log length at begin

    @classmethod
    def of_cluster(cls, cluster, *, exclude: Iterable = (), redis_url: str | None = None,
                   gateways: Iterable[GatewayProbe] = ()) -> LeakCheck:
        return cls(cluster=cluster, excluded=list(exclude), gateways=list(gateways), token=cluster.token,
                   redis_url=redis_url)

    def exclude(self, *gone) -> None:
        """Leave out Workers (or addresses) the test killed or stopped on purpose."""
        self.excluded.extend(gone)

    def _named(self) -> list[tuple[str, str, object | None]]:
        """(role, address, Worker or None) of every worker to check."""
        if self.cluster is None:
            return [(role, a, None) for role in ROLES for a in self.workers.get(role, [])]
        gone = [x for x in self.excluded if isinstance(x, str)]
        return [(w.role, w.address, w) for w in self.cluster.workers
                if w.address not in gone and not any(w is x for x in self.excluded)]

    def begin(self) -> LeakCheck:
        """Record where the reaper counters and the logs stand now (call before the test's work)."""
        for role, address, worker in self._named():
            if worker is not None:
                self._log_offsets[id(worker)] = len(worker.log())
            if role == "decode":
                try:
                    self.reaped_before[address] = self._stats("decode", address).lease_reaped_total
                except grpc.RpcError:
                    pass    # not up yet (e.g. a replacement that is starting): it counts from 0
        return self

    # -- one look ---------------------------------------------------------------------------
    def _stats(self, role: str, address: str) -> pb.WorkerStats:
        metadata = (("authorization", f"Bearer {self.token}"),) if self.token else None
        with grpc.insecure_channel(address) as ch:
            return _STUBS[role](ch).Stats(pb.StatsRequest(since_sample=_NO_SAMPLES), timeout=2.0, metadata=metadata)

    def _worker_held(self, role: str, address: str) -> list[str]:
        try:
            s = self._stats(role, address)
        except grpc.RpcError as exc:
            return [f"{role} {address}: Stats failed ({exc.code().name}); a worker the test killed must be excluded"]
        held = []
        if role == "decode":
            before = self.reaped_before.get(address, 0)
            if s.lease_reaped_total < before:   # restarted on this address: a new process counts from 0
                before = 0
            for name, value in (("used blocks", s.total_blocks - s.free_blocks), ("running_seqs", s.running_seqs),
                                ("held state slots", s.total_state_slots - s.free_state_slots),
                                ("reservations_active", s.reservations_active), ("pending_chunks", s.pending_chunks),
                                ("reservations the lease reaper freed during the test", s.lease_reaped_total - before)):
                if value:
                    held.append(f"decode {address}: {name} = {value}")
        elif role == "prefill":
            for name, value in (("scratch blocks in use", s.total_blocks - s.free_blocks),
                                ("held state slots", s.total_state_slots - s.free_state_slots),
                                ("queue_depth", s.queue_depth), ("in_flight", s.in_flight)):
                if value:
                    held.append(f"prefill {address}: {name} = {value}")
        else:
            for name, value in (("queue_depth", s.queue_depth), ("in_flight", s.in_flight),
                                ("single_flight_in_flight", s.single_flight_in_flight)):
                if value:
                    held.append(f"encoder {address}: {name} = {value}")
        return held

    def _redis_locks(self) -> list[str]:
        client = redis.Redis.from_url(self.redis_url, socket_timeout=2, socket_connect_timeout=2)
        try:
            return [k.decode() for k in client.scan_iter(match=f"{self.namespace}:lock:*")]
        finally:
            client.close()

    def held(self) -> list[str]:
        """Everything still held right now (empty when clean)."""
        named = self._named()
        held = [h for role, address, _ in named for h in self._worker_held(role, address)]
        for probe in self.gateways:
            held += [f"{name} = {n}" for name, n in probe().items() if n]
        if self.redis_url is not None:
            held += [f"encoder-cache lock left in Redis: {key}" for key in self._redis_locks()]
        for role, address, worker in named:
            text = worker.log()[self._log_offsets.get(id(worker), 0):] if worker is not None else ""
            held += [f"{role} {address} log: {line.strip()}" for line in text.splitlines() if DOUBLE_FREE in line]
        return held

    # -- until clean ------------------------------------------------------------------------
    def _failed(self, held: list[str], timeout_s: float) -> None:
        pytest.fail(f"still held {timeout_s:.0f} s after the test's requests ended:\n  " + "\n  ".join(held))

    async def settled(self, timeout_s: float = SETTLE_S) -> None:
        """Poll (without blocking the event loop) until nothing is held; fail listing it otherwise."""
        end = time.monotonic() + timeout_s
        while held := await asyncio.to_thread(self.held):
            if time.monotonic() > end:
                self._failed(held, timeout_s)
            await asyncio.sleep(0.2)

    def assert_settled(self, timeout_s: float = SETTLE_S) -> None:
        """``settled`` for synchronous code (no event loop of the caller must be needed meanwhile)."""
        end = time.monotonic() + timeout_s
        while held := self.held():
            if time.monotonic() > end:
                self._failed(held, timeout_s)
            time.sleep(0.2)


@contextmanager
def settled_after(cluster, gateways: dict) -> Iterator[None]:
    """The body leaves nothing held on ``cluster``'s workers nor on its HTTP ``gateways`` (a
    ``placement_pair``'s): a test's autouse fixture is ``with settled_after(*served): yield``."""
    check = LeakCheck.of_cluster(cluster, gateways=[http_gateway_counters(g.base) for g in gateways.values()]).begin()
    yield
    check.assert_settled()
