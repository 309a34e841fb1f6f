"""One attempt at a placed request: open the decode stream (and the prefill push), wait for the first event.

``run_attempt`` returns an ``AttemptResult`` whose ``outcome`` is one of
``AttemptOutcome``; on every outcome the decode stream is still open, since it holds the
reservation until the caller has decided (a re-arm keeps the blocks, a release frees them):

====================  =============================================================
``FIRST_TOKEN``       decode's first event arrived (``first``): the request streams
``TRANSFER_FAILED``   the handoff failed — decode said ABORTED, or the Prefill RPC
                      failed — and neither worker is known to be gone
``PREFILL_LOST``      the prefill worker stopped answering (UNAVAILABLE, no failure kind)
``DECODE_LOST``       the decode worker stopped answering
====================  =============================================================

What no recovery can fix raises instead: the request's embeddings could not be fetched
(503), the stream ended without a token (502); any other decode error propagates as the
``grpc.aio.AioRpcError`` for the caller to map (``WorkerRpc.failure``).

The Prefill RPC runs beside the decode stream as a ``PrefillCall``. The first token never
waits for its reply: decode's first event carries the prefill and transfer timings
(``record_first_event``). On a failure outcome the call has ended when ``run_attempt``
returns; after ``FIRST_TOKEN`` it may still be finishing, and whoever holds the result
``settle``s it on every path, so no task outlives its request.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

import grpc

from proto.epd.v1 import epd_pb2 as pb
from runtime.worker.rpc_failure import FailureKind, failure_kind
from runtime.worker.wire import sampling_to_pb

from . import pipeline_metrics as m
from .chat_backend import BackendFailure, ChatJob
from .worker_registry import WorkerHandle
from .worker_rpc import WorkerRpc, deadline_unix_ms, time_left_s, worker_gone


class AttemptOutcome(Enum):
    FIRST_TOKEN = "first_token"
    TRANSFER_FAILED = "transfer_failed"
    PREFILL_LOST = "prefill_lost"
    DECODE_LOST = "decode_lost"


class PrefillCall:
    """One attempt's Prefill RPC, run as a task. The worker's ``inflight`` counts it from
    creation until the task is done (a handle that left discovery keeps its channel meanwhile)."""

    def __init__(self, handle: WorkerHandle, request: pb.PrefillRequest, timeout_s: float):
        self.handle = handle
        handle.inflight += 1
        self.task: asyncio.Future = asyncio.ensure_future(handle.stub.Prefill(request, timeout=timeout_s))
        self.task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Future) -> None:
        self.handle.inflight -= 1
        if not task.cancelled():
            task.exception()   # retrieved: a failure after the first token is nobody's business

    def error(self) -> BaseException | None:
        """How the call failed, once it has (``None`` while it runs, after its reply, or when cancelled)."""
        if not self.task.done() or self.task.cancelled():
            return None
        return self.task.exception()

    def cancel(self) -> None:
        self.task.cancel()

    async def settle(self, wait_s: float = 0.0) -> None:
        """Give a call still running ``wait_s`` to reply, then cancel it; on return it is done."""
        if not self.task.done() and wait_s > 0:
            await asyncio.wait({self.task}, timeout=wait_s)
        if not self.task.done():
            self.task.cancel()
            await asyncio.wait({self.task})


@dataclass(slots=True)
class AttemptResult:
    outcome: AttemptOutcome
    stream: Any                          # the decode stream (a grpc call): open, holding the reservation
    prefill: PrefillCall | None = None   # disaggregated: this attempt's Prefill RPC
    first: pb.TokenEvent | None = None   # FIRST_TOKEN: decode's first event
    detail: str = ""                     # a failure: what went wrong, for logs and the final error
    started_at: float = 0.0              # time.monotonic() when the attempt opened its streams

    def close_stream(self) -> None:
        self.stream.cancel()


async def run_attempt(rpc: WorkerRpc, job: ChatJob, decode: WorkerHandle, prefill: WorkerHandle | None,
                      reservation: pb.Reservation, refs: list[pb.ImageRef], digest: str,
                      chunk_tokens: int, images_on_decode: bool = False,
                      reserve: pb.ReserveRequest | None = None) -> AttemptResult:
    """Open the streams of one attempt (colocated when ``prefill`` is None) and wait for its verdict.
    ``images_on_decode`` (colocated only): each image's bytes ride on its ref for decode to encode.
    ``reserve`` (colocated only, ``reservation`` None): the Generate reserves itself; its first
    event names the reservation (``TokenEvent.reserved``)."""
    colocated = prefill is None
    e2e_timeout = time_left_s(job.ttft_deadline_s) + job.max_tokens * max(job.itl_slo_ms, 1000.0) / 1000.0
    request = pb.GenerateRequest(request_id=job.request_id, reservation=reservation, max_tokens=job.max_tokens,
                                 sampling=sampling_to_pb(job.sampling),
                                 deadline_unix_ms=deadline_unix_ms(job.ttft_deadline_s), reserve=reserve)
    # the prompt travels either way: colocated, decode prefills it; disaggregated, decode checks
    # the prefix keys it caches the prompt's blocks under against it (and sampling that reads the
    # prompt's ids, repetition_penalty, reads them)
    request.token_ids.extend(job.token_ids)
    request.images.extend(refs)
    request.cache_salt = job.cache_salt
    if colocated:
        request.colocated = True
        request.chunk_tokens = chunk_tokens
        if images_on_decode:
            for ref, image in zip(request.images, job.images):
                ref.image_data = image.data
    started = time.monotonic()
    stream = decode.generate(request, e2e_timeout)
    call = None
    if not colocated:
        call = PrefillCall(prefill, pb.PrefillRequest(
            request_id=job.request_id, token_ids=job.token_ids, images=refs, sampling=sampling_to_pb(job.sampling),
            decode_address=decode.address, decode_bulk_address=decode.bulk_address,
            reservation=reservation, chunk_tokens=chunk_tokens,
            deadline_unix_ms=deadline_unix_ms(job.ttft_deadline_s), token_digest=digest, rope_delta=job.rope_delta),
            time_left_s(job.ttft_deadline_s))
    first_task = asyncio.ensure_future(anext(stream.__aiter__()))
    result = AttemptResult(AttemptOutcome.FIRST_TOKEN, stream, call, started_at=started)
    try:
        while not first_task.done():
            pending = {first_task} | ({call.task} if call is not None and not call.task.done() else set())
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            exc = call.error() if call is not None else None
            if exc is None:
                continue
            if isinstance(exc, grpc.aio.AioRpcError) and failure_kind(exc) == FailureKind.EMBEDDING_FETCH:
                # the request's images, not a transfer: no retry or re-prefill would fetch them
                stream.cancel()
                raise rpc.failure("prefill", prefill, exc, job)
            # leave the decode stream open: the reservation stays held until the caller decides
            first_task.add_done_callback(lambda t: t.cancelled() or t.exception())
            result.outcome = AttemptOutcome.PREFILL_LOST if worker_gone(exc) else AttemptOutcome.TRANSFER_FAILED
            result.detail = "prefill: " + (f"{exc.code().name}: {exc.details()}"
                                           if isinstance(exc, grpc.aio.AioRpcError) else str(exc))
            return result
        try:
            result.first = first_task.result()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.ABORTED and not colocated:
                result.outcome, result.detail = AttemptOutcome.TRANSFER_FAILED, f"decode: {exc.details()}"
            elif worker_gone(exc):   # gone: the request can move to another decode worker
                result.outcome = AttemptOutcome.DECODE_LOST
                result.detail = f"decode worker {decode.address} lost: {exc.details()}"
            else:
                raise
            if call is not None:
                await call.settle()   # its push has nowhere to land: stop it before the next attempt
            return result
        except StopAsyncIteration:
            raise BackendFailure("decode stream ended without a token", 502) from None
        return result
    except BaseException:
        first_task.cancel()
        stream.cancel()   # the request fails or is gone: decode frees what this attempt held before insertion
        if call is not None:
            call.cancel()   # done within a loop iteration; its done callback consumes the outcome
        raise


def record_first_event(result: AttemptResult, breakdown: dict[str, float]) -> None:
    """Decode's account of the handoff (``TransferMetric``) into the metrics and the TTFT breakdown."""
    ev = result.first
    t = ev.transfer
    if t.HasField("transfer_total_bytes"):
        m.KV_TRANSFER_BYTES.inc(t.transfer_total_bytes)
        breakdown["transfer_bytes"] = float(t.transfer_total_bytes)
    if t.HasField("transfer_latency_s"):
        m.KV_TRANSFER_LATENCY.observe(t.transfer_latency_s)
        breakdown["transfer_ms"] = t.transfer_latency_s * 1000
    if t.HasField("prefill_ms"):
        breakdown["prefill_ms"] = t.prefill_ms
    if result.prefill is None:
        breakdown["colocated_prefill_ms"] = ev.first_step_ms
    breakdown["decode_wait_ms"] = ev.queue_ms
    breakdown["pipeline_ms"] = (time.monotonic() - result.started_at) * 1000

