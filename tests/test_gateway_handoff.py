"""The gateway's attempt/failure loop without processes: its transitions, and the handoff driven
against in-process fake worker stubs (gRPC's call shapes, ``grpc.aio.AioRpcError`` failures).

Pure transitions: ``gateway/recovery.py`` (``choose_action``, ``plan_recovery``). The driver:
``gateway/handoff.py`` with ``gateway/attempt.py`` — reserve, attempt, recover, stream — and
what it frees on every path (one Release, no Prefill task left running, ``inflight`` back to 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import anyio
import grpc
import pytest

from gateway.attempt import AttemptOutcome
from gateway.chat_backend import AdmissionRefused, BackendFailure, ChatJob
from gateway.handoff import Handoff, HandoffState
from gateway.admission import CPU_PRIOR
from gateway.recovery import Failure, Step, choose_action, plan_recovery
from gateway.worker_registry import WorkerHandle, WorkerRegistry
from gateway.worker_rpc import WorkerRpc
from proto.epd.v1 import epd_pb2 as pb
from runtime.model.sampling import SamplingParams
from runtime.policy.cost_model import CostModel
from runtime.policy.failure_policy import FailureAction
from runtime.policy.loads import DecodeWorkerLoad, PrefillWorkerLoad, RequestShape, StageLoads
from runtime.policy.placement_policy import PlacementDecision
from runtime.worker.rpc_failure import FAILURE_METADATA_KEY, FailureKind

SHAPE = RequestShape(prompt_tokens=3, max_tokens=4)


def rpc_error(code: grpc.StatusCode, details: str = "", kind: FailureKind | None = None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata(*(((FAILURE_METADATA_KEY, kind.value),) if kind else ()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


# -- fake workers ------------------------------------------------------------------------------

class FakeStream:
    """A ``Decode.Generate`` call: events (or an error) after ``gate`` opens; ``cancel`` ends it."""

    def __init__(self, items: list, gate: asyncio.Event | None = None):
        self.items, self.gate, self.cancelled = items, gate, False
        self._woken = asyncio.Event()
        self._iter = self._run()

    def __aiter__(self):
        return self._iter

    async def _run(self):
        if self.gate is not None:
            waits = [asyncio.ensure_future(self.gate.wait()), asyncio.ensure_future(self._woken.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        for item in self.items:
            if self.cancelled:
                raise rpc_error(grpc.StatusCode.CANCELLED, "cancelled by the client")
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        self.cancelled = True
        self._woken.set()


class FakeDecode:
    """Scripted decode worker: each Generate takes the next stream; records every call."""

    def __init__(self, streams: list[FakeStream], alive: bool = True, reserve_error: grpc.aio.AioRpcError | None = None,
                 reserve_gate: asyncio.Event | None = None):
        self.streams, self.alive, self.reserve_error, self.reserve_gate = streams, alive, reserve_error, reserve_gate
        self.reserved, self.rearmed, self.released, self.generated = 0, 0, [], []
        self.reserve_seen = asyncio.Event()   # a Reserve arrived (set before its reply or error)

    async def Reserve(self, request, timeout=None):
        self.reserve_seen.set()
        if self.reserve_gate is not None:
            await self.reserve_gate.wait()
        if self.reserve_error is not None:
            raise self.reserve_error
        self.reserved += 1
        return pb.ReserveResponse(reservation=pb.Reservation(reservation_id=f"r{self.reserved}", generation=1))

    async def Rearm(self, request, timeout=None):
        self.rearmed += 1
        r = request.reservation
        return pb.ReserveResponse(reservation=pb.Reservation(reservation_id=r.reservation_id, generation=r.generation + 1))

    async def Release(self, request, timeout=None):
        self.released.append(request.reservation.reservation_id)
        return pb.ReleaseResponse(released=True)

    async def Stats(self, request, timeout=None):
        if not self.alive:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
        return pb.WorkerStats(role="decode", serving=True)

    def Generate(self, request, timeout=None):
        self.generated.append(request)
        return self.streams.pop(0)


class FakePrefill:
    """Scripted prefill worker: each call raises its error, or replies once ``gate`` opens."""

    def __init__(self, errors: list | None = None, gate: asyncio.Event | None = None, alive: bool = True):
        self.errors, self.gate, self.alive = list(errors or []), gate, alive
        self.calls = 0
        self.replied = 0

    async def Prefill(self, request, timeout=None):
        self.calls += 1
        error = self.errors.pop(0) if self.errors else None
        if error is not None:
            raise error
        if self.gate is not None:
            await self.gate.wait()
        self.replied += 1
        return pb.PrefillResponse(first_token=7, chunks_sent=1)

    async def Stats(self, request, timeout=None):
        if not self.alive:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
        return pb.WorkerStats(role="prefill", serving=True)


def token(ids, finish: str = "", *, prefill_ms: float | None = None, transfer_s: float | None = None) -> pb.TokenEvent:
    ev = pb.TokenEvent(token_ids=ids, finish_reason=finish)
    if prefill_ms is not None:
        ev.transfer.prefill_ms = prefill_ms
    if transfer_s is not None:
        ev.transfer.transfer_latency_s = transfer_s
        ev.transfer.transfer_total_bytes = 4096
    return ev


def registry_with(**stubs) -> WorkerRegistry:
    """A registry (never started) holding one healthy handle per ``role_address=stub``."""
    registry = WorkerRegistry({}, None)
    for name, stub in stubs.items():
        role, address = name.split("_", 1)
        registry.workers[role][address] = WorkerHandle(role, address, None, stub, healthy=True,
                                                       stats=pb.WorkerStats(role=role))
    return registry


def make_handoff(registry: WorkerRegistry, decode: str = "d1", prefill: str | None = "p1",
                 deadline_s: float = 30.0, encode=None, on_move=None) -> Handoff:
    now = time.monotonic()
    job = ChatJob("req", [1, 2, 3], [], 4, SamplingParams(), now + deadline_s, 100.0, now)
    decision = PlacementDecision("disaggregated" if prefill else "colocated", decode, prefill, "forced", {"ttft_ms": 1.0})
    def loads() -> StageLoads:   # what the failure policy sees: the healthy workers, each with room
        return StageLoads(decode=tuple(DecodeWorkerLoad(h.address, free_slots=4) for h in registry.healthy("decode")),
                          prefill=tuple(PrefillWorkerLoad(h.address) for h in registry.healthy("prefill")))

    return Handoff(job, SHAPE, decision, [], "digest", {}, registry=registry, rpc=WorkerRpc(registry),
                   cost_model=CostModel(prior=CPU_PRIOR), loads=loads, chunk_tokens=8, encode=encode, on_move=on_move)


async def collect(handoff: Handoff) -> list:
    return [ev async for ev in handoff.events()]


def inflight(registry: WorkerRegistry) -> dict[str, int]:
    return {h.address: h.inflight for handles in registry.workers.values() for h in handles.values()}


async def tasks_left() -> set:
    """Tasks other than this test's still pending once the loop has run what was ready."""
    await asyncio.sleep(0)
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()}


# -- the transitions, pure ----------------------------------------------------------------------

def handle(role: str, address: str, load: int = 0) -> WorkerHandle:
    return WorkerHandle(role, address, None, None, healthy=True,
                        stats=pb.WorkerStats(role=role, queue_depth=load, running_seqs=load))


def test_a_lost_prefill_is_replaced_by_the_least_loaded_free_one_on_retry():
    d, p = handle("decode", "d"), handle("prefill", "p")
    busy, idle = handle("prefill", "busy", 5), handle("prefill", "idle", 1)
    failure = Failure(AttemptOutcome.PREFILL_LOST, "prefill: UNAVAILABLE", prefill_gone=True)
    plan = plan_recovery(failure, FailureAction("retry", "reservation_held_retry_fits", 1.0), d, p, [], [busy, idle])
    assert (plan.step, plan.decode, plan.prefill) == (Step.RETRY, d, idle)
    assert plan.step.keeps_reservation


def test_a_retry_after_a_broken_transfer_keeps_both_workers_and_a_reprefill_moves_prefill():
    d, p, other = handle("decode", "d"), handle("prefill", "p"), handle("prefill", "q")
    failure = Failure(AttemptOutcome.TRANSFER_FAILED, "decode: KV transfer failed")
    retry = plan_recovery(failure, FailureAction("retry", "r", 1.0), d, p, [], [other])
    assert (retry.step, retry.decode, retry.prefill) == (Step.RETRY, d, p)
    reprefill = plan_recovery(failure, FailureAction("reprefill", "r", 1.0), d, p, [], [other])
    assert (reprefill.step, reprefill.decode, reprefill.prefill) == (Step.REPREFILL, d, other)


def test_other_decode_takes_the_least_loaded_other_worker_and_gives_up_the_reservation():
    d, p = handle("decode", "d"), handle("prefill", "p")
    busy, idle = handle("decode", "busy", 9), handle("decode", "idle", 0)
    failure = Failure(AttemptOutcome.DECODE_LOST, "decode lost", decode_gone=True)
    plan = plan_recovery(failure, FailureAction("other_decode", "r", 1.0), d, p, [busy, idle], [])
    assert (plan.step, plan.decode, plan.prefill) == (Step.OTHER_DECODE, idle, p)
    assert not plan.step.keeps_reservation


def test_a_colocated_request_stays_colocated_and_fail_changes_nothing():
    d, free = handle("decode", "d"), handle("prefill", "q")
    failure = Failure(AttemptOutcome.DECODE_LOST, "decode lost", decode_gone=True)
    moved = plan_recovery(failure, FailureAction("other_decode", "r", 1.0), d, None, [handle("decode", "e")], [free])
    assert moved.prefill is None
    failed = plan_recovery(failure, FailureAction("fail", "deadline_exhausted", float("inf")), d, None, [], [free])
    assert (failed.step, failed.decode, failed.prefill) == (Step.FAIL, d, None)


def test_a_decode_worker_that_is_gone_never_gets_a_retry_into_its_blocks():
    cm = CostModel(prior=CPU_PRIOR)

    def loads(other_decode: bool) -> StageLoads:
        workers = [DecodeWorkerLoad("d")] + ([DecodeWorkerLoad("e", free_slots=4)] if other_decode else [])
        return StageLoads(decode=tuple(workers), prefill=(PrefillWorkerLoad("q"),))

    gone = Failure(AttemptOutcome.DECODE_LOST, "decode lost", decode_gone=True)
    assert choose_action(gone, 1, SHAPE, cm, loads(True), "d", 30_000.0).kind == "other_decode"
    alone = choose_action(gone, 1, SHAPE, cm, loads(False), "d", 30_000.0)
    assert (alone.kind, alone.reason) == ("fail", "decode_worker_lost_no_other")
    held = Failure(AttemptOutcome.TRANSFER_FAILED, "decode: aborted")
    assert choose_action(held, 1, SHAPE, cm, loads(True), "d", 30_000.0).kind == "retry"
    assert choose_action(held, 3, SHAPE, cm, loads(True), "d", 30_000.0).kind == "fail"


def test_a_first_token_is_no_failure():
    with pytest.raises(ValueError):
        Failure(AttemptOutcome.FIRST_TOKEN, "")


# -- the driver, against fake stubs --------------------------------------------------------------

async def test_the_first_token_goes_out_before_the_prefill_reply_with_decodes_timings():
    reply = asyncio.Event()
    prefill = FakePrefill(gate=reply)
    decode = FakeDecode([FakeStream([token([5], prefill_ms=12.5, transfer_s=0.004), token([6], "length")])])
    registry = registry_with(decode_d1=decode, prefill_p1=prefill)
    handoff = make_handoff(registry)
    events = handoff.events()
    first = await anext(events)
    assert first.token_ids == [5]
    assert prefill.calls == 1 and prefill.replied == 0, "the first token waited for the Prefill reply"
    assert first.ttft_breakdown["prefill_ms"] == 12.5 and first.ttft_breakdown["transfer_ms"] == pytest.approx(4.0)
    assert first.ttft_breakdown["transfer_bytes"] == 4096
    assert registry.get("prefill", "p1").inflight == 1      # the call still runs, and is counted
    reply.set()
    rest = [ev async for ev in events]
    assert [ev.finish_reason for ev in rest] == ["length"]
    assert handoff.state is HandoffState.FINISHED
    assert handoff.result.prefill.task.done() and prefill.replied == 1   # awaited, not abandoned
    assert decode.released == [] and inflight(registry) == {"d1": 0, "p1": 0}
    assert not await tasks_left()


async def test_a_client_gone_after_the_first_token_releases_once_and_stops_the_prefill_call():
    prefill = FakePrefill(gate=asyncio.Event())     # never replies by itself
    decode = FakeDecode([FakeStream([token([5], prefill_ms=1.0), token([6]), token([7], "stop")])])
    registry = registry_with(decode_d1=decode, prefill_p1=prefill)
    handoff = make_handoff(registry)
    async with contextlib.aclosing(handoff.events()) as events:
        await anext(events)
    assert decode.released == ["r1"]
    call = handoff.result.prefill.task
    assert call.done() and call.cancelled() and prefill.replied == 0
    assert handoff.result.stream.cancelled
    assert inflight(registry) == {"d1": 0, "p1": 0}
    assert not await tasks_left()


async def test_a_client_gone_while_the_server_cancels_every_await_still_frees_everything():
    """The HTTP server cancels a gone client's request at every await (anyio's cancel scope),
    the generator's ``finally`` included: the release, the Prefill call and ``inflight`` all end."""
    prefill = FakePrefill(gate=asyncio.Event())     # still running when the client leaves
    decode = FakeDecode([FakeStream([token([5], prefill_ms=1.0), token([6]), token([7], "stop")])])
    registry = registry_with(decode_d1=decode, prefill_p1=prefill)
    handoff = make_handoff(registry)
    first = asyncio.Event()

    async def client() -> None:
        async with contextlib.aclosing(handoff.events()) as events:
            await anext(events)
            first.set()
            await anyio.sleep_forever()   # the stream waits on the client, which is gone

    async with anyio.create_task_group() as server:
        server.start_soon(client)
        await first.wait()
        server.cancel_scope.cancel()
    for _ in range(100):   # the freeing may finish after the cancelled task: it must finish, soon
        if not await tasks_left():
            break
        await asyncio.sleep(0.01)
    assert decode.released == ["r1"]
    assert handoff.result.prefill.task.cancelled() and prefill.replied == 0
    assert inflight(registry) == {"d1": 0, "p1": 0}
    assert not await tasks_left()


async def test_a_lost_prefill_worker_is_marked_and_the_retry_rearms_onto_another():
    gate = asyncio.Event()
    lost = FakePrefill(errors=[rpc_error(grpc.StatusCode.UNAVAILABLE, "socket closed")], alive=False)
    spare = FakePrefill()
    old, new = FakeStream([token([9])], gate=gate), FakeStream([token([5], "length", prefill_ms=2.0)])
    decode = FakeDecode([old, new])
    registry = registry_with(decode_d1=decode, prefill_p1=lost, prefill_p2=spare)
    moves = []
    handoff = make_handoff(registry, on_move=moves.append)
    events = await collect(handoff)
    assert [ev.token_ids for ev in events] == [[5]]
    assert not registry.get("prefill", "p1").healthy and registry.get("prefill", "p2").healthy
    assert moves == [registry.get("prefill", "p2")]   # the admission ticket's placed prompt follows it
    assert (decode.rearmed, lost.calls, spare.calls) == (1, 1, 1)
    assert old.cancelled, "the first attempt's stream was left open"
    assert decode.generated[1].reservation.generation == 2       # the re-armed generation
    assert handoff.attempts == 1 and decode.released == [] and inflight(registry) == {"d1": 0, "p1": 0, "p2": 0}
    assert not await tasks_left()


async def test_transfers_that_keep_failing_end_in_one_release_and_a_503():
    aborted = rpc_error(grpc.StatusCode.ABORTED, "KV transfer failed: checksum mismatch")
    streams = [FakeStream([aborted]) for _ in range(3)]
    decode = FakeDecode(streams)
    prefill = FakePrefill()
    registry = registry_with(decode_d1=decode, prefill_p1=prefill)
    handoff = make_handoff(registry)
    with pytest.raises(BackendFailure) as info:
        await collect(handoff)
    assert info.value.status == 503 and "checksum mismatch" in str(info.value)
    assert handoff.attempts == 3 and decode.rearmed == 2
    assert decode.released == ["r1"], "released exactly once"
    assert all(s.cancelled for s in streams[-1:])
    assert registry.get("decode", "d1").healthy and inflight(registry) == {"d1": 0, "p1": 0}
    assert not await tasks_left()


async def test_a_lost_decode_worker_moves_the_request_to_another():
    dead = FakeDecode([FakeStream([rpc_error(grpc.StatusCode.UNAVAILABLE, "connection reset")])], alive=False)
    spare = FakeDecode([FakeStream([token([5], "stop")])])
    registry = registry_with(decode_d1=dead, decode_d2=spare, prefill_p1=FakePrefill())
    handoff = make_handoff(registry)
    events = await collect(handoff)
    assert [ev.token_ids for ev in events] == [[5]]
    assert not registry.get("decode", "d1").healthy
    assert dead.released == ["r1"] and dead.rearmed == 0 and spare.reserved == 1 and spare.released == []
    assert handoff.decode is registry.get("decode", "d2")
    assert inflight(registry) == {"d1": 0, "d2": 0, "p1": 0}
    assert not await tasks_left()


async def test_an_unfetchable_embedding_fails_the_request_without_a_retry_or_a_blamed_worker():
    fetch = rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "embedding fetch failed", FailureKind.EMBEDDING_FETCH)
    stream = FakeStream([token([1])], gate=asyncio.Event())
    decode = FakeDecode([stream])
    registry = registry_with(decode_d1=decode, prefill_p1=FakePrefill(errors=[fetch]))
    handoff = make_handoff(registry)
    with pytest.raises(BackendFailure) as info:
        await collect(handoff)
    assert info.value.status == 503 and "could not fetch the request's image embeddings" in str(info.value)
    assert decode.rearmed == 0 and handoff.attempts == 0 and stream.cancelled
    assert decode.released == ["r1"]
    assert registry.get("prefill", "p1").healthy and inflight(registry) == {"d1": 0, "p1": 0}
    assert not await tasks_left()


async def test_a_reserve_on_a_dead_decode_worker_is_placed_on_another():
    dead = FakeDecode([], alive=False, reserve_error=rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    spare = FakeDecode([FakeStream([token([5], "length")])])
    registry = registry_with(decode_d1=dead, decode_d2=spare)
    moves = []
    handoff = make_handoff(registry, prefill=None, on_move=moves.append)
    events = await collect(handoff)
    assert [ev.token_ids for ev in events] == [[5]]
    assert not registry.get("decode", "d1").healthy and spare.reserved == 1
    assert moves == [registry.get("decode", "d2")]    # colocated now on d2: its prompt counts there
    assert spare.generated[0].colocated and inflight(registry) == {"d1": 0, "d2": 0}
    assert not await tasks_left()


# -- Reserve beside Encode ---------------------------------------------------------------------

ENCODE_WAIT_S = 10.0   # a deadlock bound, not a timing: an Encode run before Reserve waits it out and fails


def encode_after_reserve(decode: FakeDecode, log: list, error: Exception | None = None):
    """The images' Encode as the handoff runs it: it finishes only once decode has seen a Reserve
    (so it can succeed only when the two overlap), then fails with ``error`` if given."""
    async def encode() -> None:
        log.append("encode started")
        try:
            await asyncio.wait_for(decode.reserve_seen.wait(), ENCODE_WAIT_S)
        except TimeoutError:
            raise BackendFailure("Encode finished without a Reserve beside it", 503) from None
        log.append("encode saw reserve")
        if error is not None:
            raise error
    return encode


async def test_reserve_is_sent_while_the_images_are_encoded():
    decode = FakeDecode([FakeStream([token([5], "length")])])
    registry = registry_with(decode_d1=decode)
    log: list = []
    events = await collect(make_handoff(registry, prefill=None, encode=encode_after_reserve(decode, log)))
    assert [ev.token_ids for ev in events] == [[5]]
    assert log == ["encode started", "encode saw reserve"] and decode.reserved == 1
    assert decode.released == [] and inflight(registry) == {"d1": 0}
    assert not await tasks_left()


async def test_an_encode_failing_after_its_reserve_releases_the_reservation_once():
    decode = FakeDecode([FakeStream([token([5], "length")])])
    registry = registry_with(decode_d1=decode)
    log: list = []
    handoff = make_handoff(registry, prefill=None,
                           encode=encode_after_reserve(decode, log, BackendFailure("encoder grid differs", 503)))
    with pytest.raises(BackendFailure, match="encoder grid differs"):
        await collect(handoff)
    assert decode.reserved == 1 and decode.released == ["r1"] and decode.generated == []
    assert handoff.reservation is None and inflight(registry) == {"d1": 0}
    assert not await tasks_left()


async def test_a_refused_reserve_keeps_its_error_and_cancels_the_encode():
    started = asyncio.Event()   # Reserve answers (refused) only once the Encode is in flight
    decode = FakeDecode([], reserve_error=rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free blocks"),
                        reserve_gate=started)
    registry = registry_with(decode_d1=decode)
    cancelled = []

    async def encode() -> None:   # still encoding when Reserve is refused
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    with pytest.raises(AdmissionRefused, match="decode capacity: no free blocks") as info:
        await collect(make_handoff(registry, prefill=None, encode=encode))
    assert info.value.status == 429 and cancelled == [True]
    assert decode.released == [] and inflight(registry) == {"d1": 0}
    assert not await tasks_left()


async def test_an_encode_that_failed_before_a_failed_reserve_is_the_error():
    gate = asyncio.Event()
    decode = FakeDecode([], reserve_error=rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free blocks"),
                        reserve_gate=gate)
    registry = registry_with(decode_d1=decode)

    async def encode() -> None:   # fails first, then lets Reserve answer (refused)
        gate.set()
        raise BackendFailure("encoder gone", 503)

    with pytest.raises(BackendFailure, match="encoder gone"):
        await collect(make_handoff(registry, prefill=None, encode=encode))
    assert decode.released == [] and inflight(registry) == {"d1": 0}
    assert not await tasks_left()
