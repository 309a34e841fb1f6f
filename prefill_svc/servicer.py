"""The Prefill gRPC service: fetch embeddings by key, prefill in chunks, push KV to decode.

The response returns only after decode has acknowledged every chunk (its
transfer state is SUCCESS) or the transfer failed; the gateway decides what to
do next from the time the request has left (retry into the held reservation,
another decode worker, re-prefill elsewhere, or fail).

The prompt is checked before any compute: each image's layout variant against the family's
for the request's image count (``wire.variant_problem``); the token digest against the ids, image keys,
grids and rope delta the request carries; each fetched embedding against its ref's grid
(``cache/embedding_fetch.checked_embeddings``: a stale entry is an embedding-fetch failure);
the prepared prompt's rope delta against the request's (``runtime/worker/rope_delta.py``).
The final chunk carries that delta (and the digest) for decode to verify.

Peers named in the request (the decode worker, its bulk address, the images' encoders)
are checked against discovery before any work (``decode_links.py``, ``runtime/worker/peers.py``):
an unknown one is refused with FAILED_PRECONDITION and never dialled.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from pydantic import SecretStr

from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from cache.embedding_fetch import EmbeddingFetcher, EmbeddingFetchError, checked_embeddings
from runtime.model.errors import AdapterInputError
from runtime.model.model_adapter import VLMAdapter
from runtime.worker import torch_thread
from runtime.worker.faults import FaultInjector
from runtime.worker.peers import UnknownPeerError
from runtime.worker.rope_delta import RopeDeltaRule
from runtime.worker.rpc_failure import FailureKind, abort_with
from runtime.worker.serving_state import ServingState
from runtime.worker.wire import ref_grids, sampling_from_pb, token_digest, variant_problem

from .decode_links import DecodeLinks
from .kv_sender import ChunkFraming, KVSender, TransferBroken
from .scheduler import PrefillJob, PrefillScheduler


def _outcome_read(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


class PrefillServicer(pb_grpc.PrefillServicer):
    def __init__(self, adapter: VLMAdapter, scheduler: PrefillScheduler, fetcher: EmbeddingFetcher,
                 *, default_chunk_tokens: int, faults: FaultInjector, token: SecretStr | None = None):
        self.adapter = adapter
        self.scheduler = scheduler
        self.fetcher = fetcher
        self.default_chunk_tokens = default_chunk_tokens
        self.faults = faults
        self.state = ServingState("prefill", scheduler.timings, adapter.model_fingerprint, adapter.attention_kernel,
                                  adapter.linear_kernel, adapter.device.type)
        self.in_flight = 0
        self._token = token
        self.decodes = DecodeLinks(fetcher.peers, token)   # borrows the fetcher's peer directory
        self.rope_delta = RopeDeltaRule(adapter.family.position_kind)

    def busy(self) -> bool:
        return self.in_flight > 0

    async def close(self) -> None:
        await self.scheduler.stop()
        await self.decodes.close()
        await self.fetcher.close()     # also closes the peer directory the decode links borrow

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        if not self.state.serving:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker is draining; re-prefill elsewhere")
        remaining = context.time_remaining()
        timeout_s = remaining if remaining is not None else 600.0
        started = time.monotonic()
        token_ids = list(request.token_ids)
        keys, grids = [im.cache_key for im in request.images], ref_grids(request.images)
        expected_delta = self.rope_delta.read(request)
        problem = self.rope_delta.invalid(expected_delta, "the request")
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            sampling = sampling_from_pb(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {exc}")
        problem = variant_problem(self.adapter.family, request.images)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if request.token_digest and request.token_digest != token_digest(token_ids, keys, grids, expected_delta):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "token digest does not match the token ids, image keys and grids, and rope delta")
        try:
            decode_stub, bulk_address = await self.decodes.resolve(request.decode_address, request.decode_bulk_address,
                                                                   timeout_s)
            await self.fetcher.require_encoders(request.images)
        except UnknownPeerError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except TransferBroken as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        self.in_flight += 1
        job = None
        try:
            try:
                fetched = await self.fetcher.fetch(request.request_id, request.images, timeout_s)
                embeddings = checked_embeddings(self.adapter.embeddings, request.images, fetched)
                prompt = await torch_thread.run(self.adapter.prepare, token_ids, embeddings)
            except EmbeddingFetchError as exc:   # the request's images, not this worker (runtime/worker/rpc_failure.py)
                await abort_with(context, FailureKind.EMBEDDING_FETCH, grpc.StatusCode.FAILED_PRECONDITION,
                                 f"embedding fetch failed: {exc}")
            except AdapterInputError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            problem = self.rope_delta.problem(expected_delta, prompt.rope_delta, "the prompt's positions", "the request")
            if problem:   # the gateway's position plan and this worker's disagree: never send such KV
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
            # the digest decode verifies: of what this worker ran, with its own delta
            digest = token_digest(token_ids, keys, grids, prompt.rope_delta)
            framing = ChunkFraming(request.request_id, request.reservation, self.scheduler.pool.layout, digest,
                                   self.adapter.model_fingerprint)
            sender = KVSender(decode_stub, timeout_s - (time.monotonic() - started), self.faults,
                              bulk_address=bulk_address, bulk_token=self._token, timings=self.scheduler.timings,
                              framing=framing)
            job = PrefillJob(
                request_id=request.request_id, prompt=prompt, sampling=sampling,
                chunk_tokens=request.chunk_tokens or self.default_chunk_tokens, sender=sender,
                prompt_ids=token_ids,
            )
            try:
                self.scheduler.submit(job)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            sender.start()
            sending = asyncio.ensure_future(sender.wait())
            try:
                first_token = await self.scheduler.first_token(job, sending)
            except TransferBroken as exc:
                await context.abort(grpc.StatusCode.ABORTED, str(exc))
            finally:
                sending.add_done_callback(_outcome_read)   # a handler cancelled meanwhile reads it no more
            # the timings travel on decode's first TokenEvent (the last chunk carries prefill_ms)
            return pb.PrefillResponse(first_token=first_token, chunks_sent=sender.chunks_sent, bytes_sent=sender.bytes_sent)
        finally:
            self.in_flight -= 1
            if job is not None and not job.done.done():
                self.scheduler.cancel(job)      # gateway cancelled or deadline passed
                job.sender.abort()

    def local_stats(self) -> dict[str, int]:
        return {"queue_depth": self.scheduler.queue_depth, "in_flight": self.in_flight}

    async def Stats(self, request: pb.StatsRequest, context) -> pb.WorkerStats:
        return self.state.stats(
            request, queue_depth=self.scheduler.queue_depth,
            in_flight=self.in_flight, queued_prefill_tokens=self.scheduler.queued_tokens,
            free_blocks=self.scheduler.pool.free_blocks, total_blocks=self.scheduler.pool.num_blocks,
            free_state_slots=self.scheduler.states.free_slots if self.scheduler.states else 0,
            total_state_slots=self.scheduler.states.num_slots if self.scheduler.states else 0,
            max_batch=self.scheduler.max_observed_batch,
        )
