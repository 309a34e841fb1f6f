"""The steps of one ``Generate`` call before its tokens stream: the transfer's verdict, or the colocated prompt.

Mixed into ``DecodeServicer`` (``servicer.py``, whose module doc states who owns and frees what);
these methods read its reservation table, receiver, scheduler and fetcher, and change a
reservation or sequence only through their own methods. Each returns (or aborts the call) before
anything is inserted when the lease it was given is no longer the reservation's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import grpc

from cache.embedding_fetch import EmbeddingFetchError, checked_embeddings
from proto.epd.v1 import epd_pb2 as pb
from runtime.model.errors import AdapterInputError
from runtime.worker import torch_thread
from runtime.worker.rpc_failure import FailureKind, abort_with
from runtime.worker.tracing import span
from runtime.worker.transfer_state import TransferState
from runtime.worker.wire import ref_grids, sampled_from_pb, token_digest

from .prefix_match import needed_images, request_keys, spans_of, with_stand_ins
from .request_status import DecodeStatus
from .reservations import Lease, Reservation
from .sequence import Sequence

log = logging.getLogger("epd.decode")


class GenerateSteps:
    """``Generate``'s helpers; ``DecodeServicer`` sets every attribute they read."""

    @staticmethod
    def _choice_firsts(res: Reservation) -> list | None:
        """Each choice's first token as the verified transfer's last chunk carries it (``None`` when it
        carries another count, or logprobs for some and not all)."""
        a = res.attempt
        firsts = [sampled_from_pb(a.first_token, a.first_logprobs)]
        others, other_logprobs = a.choice_first_tokens, a.choice_first_logprobs
        if len(others) != res.choices - 1 or (other_logprobs and len(other_logprobs) != len(others)):
            return None
        firsts += [sampled_from_pb(t, other_logprobs[i] if other_logprobs else None) for i, t in enumerate(others)]
        return firsts

    def _check_prefix_keys(self, request: pb.GenerateRequest, res: Reservation) -> str | None:
        """Mark the reservation's keys verified when the prompt the request carries gives them (and
        its digest is the reservation's); the refusal when a reused prefix cannot be verified."""
        if res.shared and not request.colocated:
            return "a reservation that reuses cached KV runs its prompt here (colocated) only"
        if not res.prefix_keys or not request.token_ids:
            return "a reused cached prefix needs the prompt to check its keys" if res.shared else None
        ids = list(request.token_ids)
        keys, grids = [im.cache_key for im in request.images], ref_grids(request.images)
        try:
            ours = request_keys(self.adapter, ids, request.images, request.cache_salt, self.pool.block_size)
        except ValueError as exc:
            ours, detail = [], str(exc)
        else:
            detail = "the prompt's prefix keys are not the reservation's"
        if token_digest(ids, keys, grids, res.rope_delta) != res.token_digest:
            ours, detail = [], "prompt does not match the reservation's digest"
        if ours[: len(res.prefix_keys)] == res.prefix_keys:
            res.keys_verified = True
            return None
        log.warning("request %s: %s; nothing of it is cached", request.request_id, detail)
        return detail if res.shared else None

    async def _await_transfer(self, res: Reservation, lease: Lease, deadline: float,
                              request_id: str = "") -> tuple[grpc.StatusCode, str, bool] | None:
        """Wait for the transfer's verdict: ``None`` when verified (the reservation is then INSERTED),
        else (status, detail, keep the reservation).

        The caller aborts with the status; it must know whether to keep the
        reservation *before* aborting, since the abort unwinds into its ``finally``.
        """
        attempt = res.attempt
        try:
            with span("decode.wait_for_kv", **{"epd.request_id": request_id}):
                await asyncio.wait_for(attempt.done.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return (grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"KV transfer not complete before the deadline (state {attempt.state.name})", False)
        with span("decode.verify", **{"epd.request_id": request_id, "epd.transfer_state": attempt.state.name}):
            return self._transfer_verdict(res, attempt, lease)

    def _transfer_verdict(self, res: Reservation, attempt, lease: Lease) -> tuple[grpc.StatusCode, str, bool] | None:
        """The landed transfer's verdict (the receiver verified every chunk, the digest, fingerprint and
        rope delta as they landed; ``decode_svc/kv_receiver.py``): ``None`` means inserted."""
        if res.status is DecodeStatus.RELEASED:
            return grpc.StatusCode.ABORTED, f"reservation released: {attempt.detail}", False
        if attempt is not res.attempt:
            # the blocks now belong to the new attempt: not ours to release
            return grpc.StatusCode.ABORTED, "reservation re-armed for a new transfer", True
        if attempt.state != TransferState.SUCCESS:
            # keep the blocks: the gateway may retry into them (Rearm) while the lease lasts
            return grpc.StatusCode.ABORTED, f"KV transfer failed: {attempt.detail}", True
        if not self.table.mark_inserted(lease):
            return grpc.StatusCode.ABORTED, "reservation released while waiting for the KV transfer", False
        return None

    async def _start_colocated(self, request: pb.GenerateRequest, res: Reservation, lease: Lease, seq: Sequence,
                               deadline: float, context) -> None:
        """Fetch the embeddings and prepare the prompt, then hand it to the scheduler, only if ``lease``
        survived both awaits and the prompt's rope delta is the reservation's."""
        token_ids = list(request.token_ids)
        keys, grids = [im.cache_key for im in request.images], ref_grids(request.images)
        if len(token_ids) != res.prompt_tokens or token_digest(token_ids, keys, grids, res.rope_delta) != res.token_digest:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "prompt does not match the reservation's digest")
        refs = list(request.images)
        prompt = None
        try:
            if not res.shared and self.local_encoder.carries_bytes(refs):   # encoded here: prepared in the same call
                _, prompt = await self.local_encoder.encode_then(request.request_id, refs,
                                                                 functools.partial(self.adapter.prepare, token_ids))
            else:
                embeddings = await self._fetch_uncached(request, res, deadline)
        except EmbeddingFetchError as exc:   # the request's images, not this worker: see runtime/worker/rpc_failure.py
            await abort_with(context, FailureKind.EMBEDDING_FETCH, grpc.StatusCode.FAILED_PRECONDITION,
                             f"embedding fetch failed: {exc}")
        except AdapterInputError as exc:   # bytes that are not the ref's image, or a prompt that does not fit them
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not res.holds(lease):
            await context.abort(grpc.StatusCode.ABORTED, "reservation released while fetching embeddings")
        if prompt is None:
            try:
                prompt = await torch_thread.run(self.adapter.prepare, token_ids, embeddings)
            except AdapterInputError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        problem = self.rope_delta.problem(res.rope_delta, prompt.rope_delta, "the prompt's positions")
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        if not self.table.mark_inserted(lease):
            await context.abort(grpc.StatusCode.ABORTED, "reservation released while embedding the prompt")
        seq.prefilled = res.cached_tokens      # the shared blocks hold these positions' KV
        seq.first_token_deadline_s = deadline
        self.scheduler.insert_colocated(seq, prompt, chunk_tokens=request.chunk_tokens or None)

    async def _fetch_uncached(self, request: pb.GenerateRequest, res: Reservation, deadline: float) -> list:
        """The prompt's image records: fetched (or encoded here, when the refs carry the bytes) for
        every image with placeholders past the cached prefix, zero stand-ins for the rest
        (``prefix_match.with_stand_ins``)."""
        refs = list(request.images)
        if not res.shared:
            return await self._image_records(request.request_id, refs, deadline)
        spans = spans_of(self.adapter, list(request.token_ids), refs)   # checked with the keys already
        need = needed_images(spans, res.cached_tokens)
        records = await self._image_records(request.request_id, [refs[k] for k in need], deadline)
        return with_stand_ins(self.adapter, spans, dict(zip(need, records)))

    async def _image_records(self, request_id: str, refs: list[pb.ImageRef], deadline: float) -> list:
        if self.local_encoder.carries_bytes(refs):
            return await self.local_encoder.encode(request_id, refs)
        fetched = await self.fetcher.fetch(request_id, refs, deadline - time.monotonic())
        return checked_embeddings(self.adapter.embeddings, refs, fetched)

    def _fill_first_event(self, out: pb.TokenEvent, res: Reservation, arrived: float, seq: Sequence) -> None:
        """The first event's account of the handoff: the transfer as decode saw it (first chunk
        landed -> verified, bytes, chunks), the prefill compute the last chunk reported, this
        worker's wait and first step. The gateway's TTFT breakdown reads these, so the first token
        never waits for the Prefill RPC's own reply."""
        a = res.attempt
        metric = pb.TransferMetric(alloc_latency_s=res.alloc_ms / 1000)
        if a.first_chunk_at is not None and a.completed_at is not None:
            metric.transfer_latency_s = a.completed_at - a.first_chunk_at
            metric.transfer_total_bytes = a.bytes_received
            metric.chunks = a.total_chunks or len(a.received)
        if a.prefill_ms is not None:
            metric.prefill_ms = a.prefill_ms
        out.transfer.CopyFrom(metric)
        # disaggregated: time this request waited on decode for its KV; colocated: 0
        out.queue_ms = max(0.0, (a.completed_at - arrived) * 1000) if a.completed_at and not seq.first_step_ms else 0.0
        out.first_step_ms = seq.first_step_ms or 0.0  # colocated: the step that produced the first token

