"""Faults injected into real worker processes: every request completes correctly or fails
clearly by its deadline, recovery happens wherever the fault leaves room for it, and nothing
is left held afterwards (``tests/leaks.py``; leases outlast the tests, so the lease reaper
cannot hide a leak).

The gateway's orchestrator drives requests the way the HTTP gateway does, in this process.
Disaggregated faults (one cluster per test, the fault is a worker flag): small chunks so a
prompt spans several KV chunks. Colocated faults share one module cluster whose decode
worker runs every step ``STEP_DELAY_MS`` late, so a colocated prefill (4-token chunks) is
long enough to be cancelled or released in the middle.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time

import grpc
import pytest

from cluster import Cluster
from demo_jobs import demo_processor, make_job as demo_make_job
from gateway.chat_backend import AdmissionRefused, BackendFailure, ChatJob, DeadlineExceeded
from gateway.orchestrator import Orchestrator
from gateway.settings import GatewaySettings
from leaks import LONG_LEASES, SETTLE_S, LeakCheck, orchestrator_counters
from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.policy.failure_policy import on_transfer_failure

DEADLINE_S = 6.0
MARGIN_S = 2.0
# the failure policy's bound on transfer attempts per request (the orchestrator uses the default)
MAX_ATTEMPTS = inspect.signature(on_transfer_failure).parameters["max_attempts"].default
STEP_DELAY_MS = 100


@pytest.fixture(scope="module")
def processor():
    return demo_processor()


def make_job(processor, seed: int, deadline_s: float = DEADLINE_S) -> tuple[ChatJob, str]:
    """``demo_jobs.make_job`` with this module's first-token deadline."""
    return demo_make_job(processor, seed, deadline_s)


async def run_job(orch: Orchestrator, processor, job: ChatJob) -> tuple[str, str | None, float]:
    """(outcome, text, seconds). Outcome "ok" (text: the answer), or a clear error (text: its
    message): "failed" (5xx), "refused" (429/503 before any work) or "deadline" (504)."""
    started = time.monotonic()
    tokens: list[int] = []
    try:
        async for ev in orch.generate(job):
            tokens += ev.token_ids
    except BackendFailure as exc:
        return "failed", str(exc), time.monotonic() - started
    except AdmissionRefused as exc:
        return "refused", str(exc), time.monotonic() - started
    except DeadlineExceeded as exc:
        return "deadline", str(exc), time.monotonic() - started
    return "ok", processor.tokenizer.decode(tokens, skip_special_tokens=True).strip(), time.monotonic() - started


def orchestrator(cluster: Cluster, placement: str, chunk: int = 8) -> Orchestrator:
    addrs = {f"{r}_addrs": [w.address for w in cluster.by_role(r)] for r in ("encoder", "prefill", "decode")}
    # images through the encoder in both placements (its faults are what these tests inject)
    return Orchestrator(GatewaySettings(**addrs, placement=placement, prefill_chunk_tokens=chunk,
                                        colocated_encode_max_ms=0))


async def run_batch(cluster: Cluster, processor, seeds, *, concurrent: bool = False, exclude=()):
    """Run one job per seed (disaggregated), then the leak check over every worker not in ``exclude``."""
    check = LeakCheck.of_cluster(cluster, exclude=exclude).begin()
    orch = orchestrator(cluster, "disaggregated")
    check.gateways.append(orchestrator_counters(orch))
    await orch.start()
    try:
        jobs = [make_job(processor, s) for s in seeds]
        if concurrent:
            results = await asyncio.gather(*(run_job(orch, processor, j) for j, _ in jobs))
        else:
            results = [await run_job(orch, processor, j) for j, _ in jobs]
        await check.settled()
        return [(job.request_id, outcome, text, secs, answer) for (outcome, text, secs), (job, answer) in zip(results, jobs)]
    finally:
        await orch.close()


def transfer_attempts(caplog) -> dict[str, list[tuple[str, str]]]:
    """Per request id, the (action, reason) the gateway took after each failed transfer attempt,
    from its one warning per failed attempt (``gateway/orchestrator.py``)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for r in caplog.records:
        if r.name == "epd.gateway" and r.msg.startswith("request %s transfer attempt %d failed"):
            request_id, _, _, kind, reason = r.args
            out.setdefault(request_id, []).append((kind, reason))
    return out


def check_retried(results, attempts: dict[str, list[tuple[str, str]]]) -> None:
    """The outcome a transfer fault allows when every retry fits the deadline (a few hundred ms
    an attempt against 6 s): a request fails only once all ``MAX_ATTEMPTS`` attempts failed,
    with a clear 503; every other one is retried into its held reservation until it completes
    with the right answer. Never a deadline, never another error."""
    for request_id, outcome, text, secs, answer in results:
        failures = attempts.get(request_id, [])
        assert secs <= DEADLINE_S + MARGIN_S, f"request took {secs:.1f}s, past its deadline"
        if outcome == "ok":
            assert text == answer, "a request that completed must be correct"
            assert len(failures) < MAX_ATTEMPTS and all(kind == "retry" for kind, _ in failures), failures
        else:
            assert outcome == "failed", (outcome, text)
            assert failures == [("retry", "reservation_held_retry_fits")] * (MAX_ATTEMPTS - 1) + \
                [("fail", "attempts_exhausted")], (text, failures)
            assert "no recovery fits" in text
    assert attempts, "the fault never fired: the test proves nothing"
    recovered = sum(outcome == "ok" and bool(attempts.get(rid)) for rid, outcome, *_ in results)
    print(f"\n{len(results)} requests: {sum(r[1] == 'ok' for r in results)} ok ({recovered} after a failed attempt), "
          f"{sum(r[1] != 'ok' for r in results)} failed after {MAX_ATTEMPTS} attempts")


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.stop()


async def test_corrupt_and_dropped_chunks_are_retried_or_fail_clearly(cluster, processor, caplog):
    caplog.set_level(logging.WARNING, "epd.gateway")
    cluster.start("encoder")
    cluster.start("decode", "--faults", "corrupt_chunk=0.15,drop_chunk=0.05,seed=3", env=LONG_LEASES)
    cluster.start("prefill")
    cluster.wait_healthy()
    results = await run_batch(cluster, processor, range(10))
    attempts = transfer_attempts(caplog)
    check_retried(results, attempts)
    # sequential requests and seeded coins: the same faults every run, and some request recovered
    assert any(outcome == "ok" and attempts.get(rid) for rid, outcome, *_ in results), attempts


async def test_broken_duplicated_and_delayed_transfers(cluster, processor, caplog):
    caplog.set_level(logging.WARNING, "epd.gateway")
    cluster.start("encoder")
    cluster.start("decode", env=LONG_LEASES)
    cluster.start("prefill", "--faults", "fail_transfer=0.5,dup_chunk=0.3,delay_chunk_ms=5,seed=5")
    cluster.wait_healthy()
    results = await run_batch(cluster, processor, range(12, 22), concurrent=True)
    check_retried(results, transfer_attempts(caplog))   # a duplicated or delayed chunk alone never fails one


async def test_prefill_crash_reprefills_on_another_worker(cluster, processor):
    cluster.start("encoder")
    cluster.start("decode", env=LONG_LEASES)
    crashing = cluster.start("prefill", "--faults", "crash_prefill=1.0")
    cluster.start("prefill")
    cluster.wait_healthy()
    # the crashed worker is gone: left out of the leak check by name (the gateway's counters on it still count)
    results = await run_batch(cluster, processor, range(24, 28), exclude=[crashing.address])
    # a healthy second prefill worker and a 6 s deadline: every request must recover there
    assert [(outcome, text) for _, outcome, text, _, answer in results] == [("ok", r[4]) for r in results]
    assert crashing.proc.poll() is not None, "the faulty prefill worker should have crashed"


async def test_encoder_stall_fails_by_the_deadline_in_both_placements(cluster, processor):
    deadline_s = 3.0
    # the stalled encode outlives the leak check: only the cancellation path can have cleared the
    # encoder's single-flight entry and queue (a compute that finished would hide a leak)
    cluster.start("encoder", "--faults", f"stall_encoder_ms={int((deadline_s + SETTLE_S + 4) * 1000)}")
    cluster.start("decode", env=LONG_LEASES)
    cluster.start("prefill")
    cluster.wait_healthy()
    check = LeakCheck.of_cluster(cluster).begin()
    orchs = [orchestrator(cluster, placement) for placement in ("disaggregated", "colocated")]
    check.gateways += [orchestrator_counters(o) for o in orchs]
    try:
        for o in orchs:
            await o.start()
        running = asyncio.gather(*(run_job(o, processor, make_job(processor, 28 + i, deadline_s)[0])
                                   for i, o in enumerate(orchs)))
        # Reserve goes out beside Encode: both requests hold a reservation on decode while their
        # Encode is still stalled on the encoder (it answers only after every deadline)
        decode = cluster.by_role("decode")[0].address
        while (await asyncio.to_thread(decode_stats, decode)).reservations_active < len(orchs):
            assert not running.done(), "the requests ended without both reserving while Encode stalled"
            await asyncio.sleep(0.02)
        results = await running
        # the encoder answers later than any deadline: each request ends with its deadline (504),
        # no sooner and not much later, whatever its placement, and releases its reservation
        for outcome, text, secs in results:
            assert outcome == "deadline", (outcome, text)
            assert secs <= deadline_s + MARGIN_S
        t0 = time.monotonic()
        await check.settled()   # the encoder dropped both flights; both reservations were released
        print(f"\nsettled {time.monotonic() - t0:.1f} s after the deadlines")
    finally:
        for o in orchs:
            await o.close()


# -- the colocated path ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    """An encoder and a decode worker whose steps are slowed: a colocated prefill of a ~26-token
    prompt in 4-token chunks takes 7 steps, about 0.7 s."""
    c = Cluster(tmp_path_factory.mktemp("colocated-faults"))
    try:
        c.start("encoder")
        c.start("decode", "--faults", f"delay_step_ms={STEP_DELAY_MS}", env=LONG_LEASES)
        c.wait_healthy()
        yield c
    finally:
        c.stop()


def decode_stats(address: str) -> pb.WorkerStats:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.DecodeStub(ch).Stats(pb.StatsRequest(), timeout=2.0)


async def until_prefilling(address: str, timeout_s: float = 10.0) -> None:
    """Until the decode worker is in the middle of a colocated prefill."""
    end = time.monotonic() + timeout_s
    while (stats := await asyncio.to_thread(decode_stats, address)).queued_prefill_tokens == 0:
        assert time.monotonic() < end, "no colocated prefill started"
        await asyncio.sleep(0.02)
    # each queued prompt's share, as admission prices the worker's least-remaining-first order
    assert stats.queued_prompt_tokens and sum(stats.queued_prompt_tokens) == stats.queued_prefill_tokens
    assert stats.step_prompt_tokens > 0   # how many of them one step may carry, as admission prices the queue
    assert 0 < stats.step_long_prompt_tokens <= stats.step_prompt_tokens   # ... and of a prompt it does not finish


class RecordReservations:
    """The gateway's stub for one decode worker: the real calls, with each Reserve reply kept."""

    def __init__(self, stub):
        self._stub, self.reservations = stub, []

    async def Reserve(self, request, timeout=None):
        reply = await self._stub.Reserve(request, timeout=timeout)
        self.reservations.append(reply.reservation)
        return reply

    def __getattr__(self, name):
        return getattr(self._stub, name)


async def test_colocated_cancel_mid_prefill_frees_it_and_spares_the_neighbour(colocated, processor):
    decode = colocated.by_role("decode")[0].address
    check = LeakCheck.of_cluster(colocated).begin()
    orch = orchestrator(colocated, "colocated", chunk=4)
    check.gateways.append(orchestrator_counters(orch))
    await orch.start()
    try:
        (job_a, _), (job_b, answer_b) = make_job(processor, 80), make_job(processor, 81)
        task_a = asyncio.create_task(run_job(orch, processor, job_a))
        await until_prefilling(decode)
        task_b = asyncio.create_task(run_job(orch, processor, job_b))
        await asyncio.sleep(STEP_DELAY_MS / 1000)      # b is reserved and joins the prefill
        task_a.cancel()                                # the client of a went away mid-prefill
        with pytest.raises(asyncio.CancelledError):
            await task_a
        assert (await task_b)[:2] == ("ok", answer_b), "the neighbour's prompt and KV are untouched"
        await check.settled()
    finally:
        await orch.close()


async def test_colocated_release_during_prefill_ends_it_cleanly_and_frees_once(colocated, processor):
    decode = colocated.by_role("decode")[0].address
    check = LeakCheck.of_cluster(colocated).begin()
    orch = orchestrator(colocated, "colocated", chunk=4)
    check.gateways.append(orchestrator_counters(orch))
    await orch.start()
    try:
        handle = orch.registry.get("decode", decode)
        recorder = handle.stub = RecordReservations(handle.stub)
        job, _ = make_job(processor, 82)
        task = asyncio.create_task(run_job(orch, processor, job))
        await until_prefilling(decode)
        # someone else frees the reservation under the prefill (a second releaser: an operator,
        # a gateway that gave up): the sequence is retired unwritten, its Generate ends
        (reservation,) = recorder.reservations
        with grpc.insecure_channel(decode) as ch:
            released = pb_grpc.DecodeStub(ch).Release(pb.ReleaseRequest(request_id=job.request_id, reservation=reservation,
                                                                        reason="test"), timeout=2.0)
        assert released.released
        outcome, text, secs = await task
        assert outcome == "failed" and "CANCELLED" in text, (outcome, text)   # a clear 503 at once, not a deadline
        assert secs < DEADLINE_S
        assert handle.healthy, "a released request is not the worker's fault"
        await check.settled()                         # and the gateway's own Release after it freed nothing twice
        job, answer = make_job(processor, 83)          # the same blocks serve the next request correctly
        assert (await run_job(orch, processor, job))[:2] == ("ok", answer)
        await check.settled()
    finally:
        await orch.close()
