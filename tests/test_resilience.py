"""Workers dying and leaving on purpose, with real processes behind the gateway's orchestrator.

- SIGKILL of a decode worker mid-request: the request fails clearly (or is re-run) by its
  deadline, the gateway routes around the dead worker and takes it back once a worker is
  serving on that address again;
- SIGTERM drains: health turns NOT_SERVING first, accepted work finishes, the process exits 0
  (decode and prefill);
- discovery through Redis: replicas are found, a killed one vanishes with its key, a new one is
  found without restarting the gateway.

One set of workers is shared by the module (starting a worker costs seconds of CPU); every test
first makes sure the workers it needs are alive, and afterwards nothing is held anywhere
(``tests/leaks.py``: every worker but the ones the test killed or stopped, which it names;
the gateways' counters; the encoder cache's Redis locks; decode leases outlast the module,
so the lease reaper cannot hide a leak). A transfer in flight is made slow on purpose: the
prefill worker delays every KV chunk by 400 ms and the gateway cuts prompts into 4-token chunks.

All workers register in their own Redis database (not 0), so other test modules' workers,
registered in database 0 meanwhile, never show up in this module's discovery.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster import Cluster, Worker
from gateway.orchestrator import Orchestrator
from gateway.settings import GatewaySettings
from leaks import LONG_LEASES, LeakCheck, orchestrator_counters
from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.worker.discovery import list_workers
from test_faults import make_job, processor, run_job  # noqa: F401  (processor is a fixture)

REDIS_URL = "redis://127.0.0.1:6379/13"
HEARTBEAT_S = 0.3
ENV = {"EPD_HEARTBEAT_S": str(HEARTBEAT_S)}
SLOW_PREFILL = ("--faults", "delay_chunk_ms=400")
SLOW_CHUNK = 4        # tokens per KV chunk while a transfer must stay in flight (26-token prompt: 7 chunks, ~2.8 s)
FAST_CHUNK = 64       # one chunk: a request costs one 400 ms delay
DEADLINE_S = 10.0
MARGIN_S = 2.0

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# -- workers ----------------------------------------------------------------------------------

class Workers:
    """The module's worker processes; a worker can be (re)started on a given port. A test names
    each worker it kills or stops (``gone``) and each gateway it builds (``orchestrators``), so
    the leak check after it knows what to leave out and which counters to read."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self._n = 0
        self.gone: list[Worker] = []
        self.orchestrators: list[Orchestrator] = []

    @staticmethod
    def _env(role: str) -> dict[str, str]:
        return {**ENV, **(LONG_LEASES if role == "decode" else {})}

    def start(self, role: str, *extra: str, port: int | None = None) -> Worker:
        return self.cluster.start(role, "--redis-url", REDIS_URL, *extra, env=self._env(role), port=port)

    def live(self, role: str) -> list[Worker]:
        return [w for w in self.cluster.by_role(role) if w.proc.poll() is None]

    def ensure(self, need: dict[str, int]) -> None:
        """Start what is missing so that ``need[role]`` workers of each role are alive, and wait for them."""
        started = []
        for role, n in need.items():
            for _ in range(n - len(self.live(role))):
                started.append(self.start(role, *(SLOW_PREFILL if role == "prefill" else ())))
        wait_serving(started)

    def kill(self, w: Worker, sig: int = signal.SIGKILL) -> None:
        """Signal ``w`` on purpose: it is left out of the leak check from now on."""
        self.gone.append(w)
        w.proc.send_signal(sig)

    def forget_gone(self) -> None:
        self.cluster.workers = [w for w in self.cluster.workers if not any(w is g for g in self.gone)]
        self.gone.clear()
        self.orchestrators.clear()


def wait_serving(workers: list[Worker], timeout_s: float = 90.0) -> None:
    end = time.monotonic() + timeout_s
    for w in workers:
        while health(w.address) != SERVING:
            if w.proc.poll() is not None:
                raise RuntimeError(f"{w.role} exited early:\n{w.log()}")
            if time.monotonic() > end:
                raise TimeoutError(f"{w.role} at {w.address} not serving:\n{w.log()}")
            time.sleep(0.2)


def health(address: str) -> int | None:
    try:
        with grpc.insecure_channel(address) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0).status
    except grpc.RpcError:
        return None


def decode_stats(address: str) -> pb.WorkerStats:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.DecodeStub(ch).Stats(pb.StatsRequest(), timeout=2.0)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("resilience"))
    w = Workers(c)
    try:
        # encoder, slowed prefill, two decode workers: everything the first test needs, started together
        w.ensure({"encoder": 1, "decode": 2, "prefill": 1})
        yield w
    finally:
        c.stop()


@pytest.fixture(autouse=True)
def nothing_held(workers):
    """After every test: nothing held on any worker the test did not kill, nor by its gateways."""
    check = LeakCheck.of_cluster(workers.cluster, redis_url=REDIS_URL).begin()
    yield
    check.exclude(*workers.gone)
    check.gateways = [orchestrator_counters(o) for o in workers.orchestrators]
    try:
        check.assert_settled()
    finally:
        workers.forget_gone()


# -- gateway helpers ----------------------------------------------------------------------------

def static_orchestrator(workers: Workers, chunk: int) -> Orchestrator:
    addrs = {f"{r}_addrs": [w.address for w in workers.live(r)] for r in ("encoder", "prefill", "decode")}
    orch = Orchestrator(GatewaySettings(**addrs, placement="disaggregated", prefill_chunk_tokens=chunk))
    workers.orchestrators.append(orch)
    return orch


def discovery_orchestrator(workers: Workers, chunk: int) -> Orchestrator:
    orch = Orchestrator(GatewaySettings(redis_url=REDIS_URL, placement="disaggregated", prefill_chunk_tokens=chunk))
    workers.orchestrators.append(orch)
    return orch


def track_decode_choices(orch: Orchestrator) -> list[str]:
    """Addresses of the decode workers the orchestrator placed requests on, in order."""
    picked: list[str] = []
    get = orch.registry.get

    def recording_get(role, address):
        if role == "decode":
            picked.append(address)
        return get(role, address)

    orch.registry.get = recording_get
    return picked


async def until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Wait for ``predicate``; returns the seconds it took."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"not within {timeout_s:.0f} s: {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def in_flight_on(orch: Orchestrator, role: str, timeout_s: float = 20.0) -> str:
    """Address of the ``role`` worker a request is now running on (the gateway counts it)."""
    found: list[str] = []

    def check() -> bool:
        found[:] = [h.address for h in orch.registry.workers[role].values() if h.inflight > 0]
        return bool(found)

    await until(check, timeout_s, f"a request in flight on a {role} worker")
    return found[0]


def worker_at(workers: Workers, role: str, address: str) -> Worker:
    return next(w for w in workers.live(role) if w.address == address)


def healthy_addresses(orch: Orchestrator, role: str) -> set[str]:
    return {h.address for h in orch.registry.healthy(role)}


def assert_clean(outcome: str, text: str | None, secs: float, answer: str, *, deadline_s: float = DEADLINE_S) -> None:
    assert secs <= deadline_s + MARGIN_S, f"request took {secs:.1f} s, past its deadline"
    if outcome == "ok":
        assert text == answer, "a request that completed must be correct"


async def wait_exit(w: Worker, timeout_s: float) -> int:
    end = time.monotonic() + timeout_s
    while w.proc.poll() is None:
        if time.monotonic() > end:
            pytest.fail(f"{w.role} at {w.address} did not exit within {timeout_s:.0f} s:\n{w.log()[-3000:]}")
        await asyncio.sleep(0.1)
    return w.proc.returncode


# -- tests --------------------------------------------------------------------------------------

async def test_decode_killed_mid_request_is_routed_around_and_taken_back(workers, processor):
    workers.ensure({"encoder": 1, "decode": 2, "prefill": 1})
    orch = static_orchestrator(workers, SLOW_CHUNK)
    await orch.start()
    try:
        job, answer = make_job(processor, 40, DEADLINE_S)
        task = asyncio.create_task(run_job(orch, processor, job))
        victim_addr = await in_flight_on(orch, "decode")
        await asyncio.sleep(0.5)                       # some chunks landed, more are on their way
        assert not task.done(), "the request should still be in its slowed transfer"
        victim = worker_at(workers, "decode", victim_addr)
        port = int(victim_addr.rsplit(":", 1)[1])
        workers.kill(victim)
        victim.proc.wait()
        replacement = workers.start("decode", port=port)  # loads while the rest of the test runs

        outcome, text, secs = await asyncio.wait_for(task, DEADLINE_S + MARGIN_S)
        assert_clean(outcome, text, secs, answer)
        # before its first token the request moves: re-reserved and re-prefilled on the surviving decode worker
        assert (outcome, text) == ("ok", answer)

        # the gateway routes around the dead worker ...
        await until(lambda: victim_addr not in healthy_addresses(orch, "decode"), 2.0, "the killed worker marked unhealthy")
        survivor = next(h.address for h in orch.registry.workers["decode"].values() if h.address != victim_addr)
        orch.chunk_tokens = FAST_CHUNK
        picked = track_decode_choices(orch)
        for seed in (41, 42):
            job, answer = make_job(processor, seed, DEADLINE_S)
            outcome, text, secs = await run_job(orch, processor, job)
            assert (outcome, text) == ("ok", answer)
        assert picked == [survivor, survivor]

        # ... and takes it back once a worker serves on that address again
        await asyncio.to_thread(wait_serving, [replacement])
        waited = await until(lambda: victim_addr in healthy_addresses(orch, "decode"), 10.0,
                             "the restarted worker healthy again in the gateway")
        assert waited < 10.0
        # two overlapping requests: the second goes to the idle worker, so both workers serve one
        orch.chunk_tokens = SLOW_CHUNK
        picked.clear()
        (job_a, answer_a), (job_b, answer_b) = make_job(processor, 43, DEADLINE_S), make_job(processor, 44, DEADLINE_S)
        task_a = asyncio.create_task(run_job(orch, processor, job_a))
        await in_flight_on(orch, "decode")
        outcome_b, text_b, _ = await run_job(orch, processor, job_b)
        outcome_a, text_a, _ = await task_a
        assert (outcome_a, text_a) == ("ok", answer_a)
        assert (outcome_b, text_b) == ("ok", answer_b)
        assert sorted(picked) == sorted([victim_addr, survivor]), picked
        assert decode_stats(victim_addr).max_batch >= 1, "the restarted worker ran decode steps"
    finally:
        await orch.close()


async def test_decode_sigterm_drains_the_request_in_flight(workers, processor):
    workers.ensure({"encoder": 1, "decode": 2, "prefill": 1})
    orch = discovery_orchestrator(workers, SLOW_CHUNK)   # deregistration must not cut the request either
    await orch.start()
    try:
        mine = {w.address for w in workers.live("decode")}
        await until(lambda: mine <= healthy_addresses(orch, "decode"), 5.0, "decode workers discovered")
        job, answer = make_job(processor, 50, DEADLINE_S)
        task = asyncio.create_task(run_job(orch, processor, job))
        address = await in_flight_on(orch, "decode")
        await asyncio.sleep(0.5)
        assert not task.done()
        draining = worker_at(workers, "decode", address)
        workers.kill(draining, signal.SIGTERM)

        await until(lambda: health(address) == NOT_SERVING, 3.0, "health NOT_SERVING after SIGTERM")
        assert not task.done(), "NOT_SERVING must come before the accepted request ends"
        # the gateway stops placing new work there (it left Redis and its Stats say not serving)
        await until(lambda: address not in healthy_addresses(orch, "decode"), 3.0, "the draining worker routed around")

        outcome, text, secs = await asyncio.wait_for(task, DEADLINE_S + MARGIN_S)
        assert (outcome, text) == ("ok", answer), "the accepted request finishes while the worker drains"
        assert secs <= DEADLINE_S + MARGIN_S
        assert await wait_exit(draining, 20.0) == 0
    finally:
        await orch.close()


async def test_discovery_through_redis(workers, processor):
    workers.ensure({"encoder": 1, "decode": 1, "prefill": 1})
    new_replica = workers.start("decode")             # loads while the gateway finds the others
    orch = discovery_orchestrator(workers, FAST_CHUNK)
    await orch.start()
    try:
        listed = lambda role: {h.address for h in orch.registry.workers[role].values()}  # noqa: E731
        for role in ("encoder", "prefill"):
            mine = {w.address for w in workers.live(role)}
            await until(lambda: mine <= healthy_addresses(orch, role), 5.0, f"{role} workers discovered")
        old = [w for w in workers.live("decode") if w is not new_replica]
        await until(lambda: {w.address for w in old} <= healthy_addresses(orch, "decode"), 5.0, "decode discovered")
        job, answer = make_job(processor, 60, DEADLINE_S)
        assert (await run_job(orch, processor, job))[:2] == ("ok", answer)

        # a replica started later is found, without restarting the gateway
        await asyncio.to_thread(wait_serving, [new_replica])
        await until(lambda: new_replica.address in healthy_addresses(orch, "decode"), 5.0, "the new replica found")

        # a killed replica's key expires within a few heartbeats and it leaves the gateway's status
        victim = old[0]
        workers.kill(victim)
        victim.proc.wait()
        redis = orch.registry._redis
        gone_in = await until_async(lambda: _absent(redis, victim.address), 6 * HEARTBEAT_S + 1.0, "the killed worker's key expired")
        await until(lambda: victim.address not in listed("decode"), 2.0, "the killed worker dropped by the gateway")
        assert victim.address not in {w["address"] for w in orch.status()["decode"]}
        assert gone_in <= 6 * HEARTBEAT_S + 1.0

        picked = track_decode_choices(orch)
        job, answer = make_job(processor, 61, DEADLINE_S)
        assert (await run_job(orch, processor, job))[:2] == ("ok", answer)
        assert picked == [new_replica.address]
    finally:
        await orch.close()


async def _absent(redis, address: str) -> bool:
    return address not in await list_workers(redis, "decode")


async def until_async(predicate, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not await predicate():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"not within {timeout_s:.1f} s: {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def test_prefill_sigterm_finishes_the_prefill_in_flight(workers, processor):
    workers.ensure({"encoder": 1, "decode": 1, "prefill": 1})
    orch = discovery_orchestrator(workers, SLOW_CHUNK)
    await orch.start()
    try:
        prefill = workers.live("prefill")[0]
        await until(lambda: prefill.address in healthy_addresses(orch, "prefill")
                    and any(w.address in healthy_addresses(orch, "decode") for w in workers.live("decode")),
                    5.0, "workers discovered")
        job, answer = make_job(processor, 70, DEADLINE_S)
        task = asyncio.create_task(run_job(orch, processor, job))
        assert await in_flight_on(orch, "prefill") == prefill.address
        await asyncio.sleep(0.5)
        assert not task.done()
        workers.kill(prefill, signal.SIGTERM)

        await until(lambda: health(prefill.address) == NOT_SERVING, 3.0, "prefill health NOT_SERVING after SIGTERM")
        assert not task.done(), "NOT_SERVING must come before the prefill in flight ends"
        outcome, text, secs = await asyncio.wait_for(task, DEADLINE_S + MARGIN_S)
        assert (outcome, text) == ("ok", answer), "the prefill in flight finishes and the request completes"
        assert secs <= DEADLINE_S + MARGIN_S
        assert await wait_exit(prefill, 20.0) == 0
    finally:
        await orch.close()
