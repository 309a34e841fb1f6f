"""The gateway's calls to its workers, and what a failed call means for the request.

Every call's timeout is the time the request has left until its TTFT deadline
(``time_left_s``); a message that carries the deadline carries that same instant as
unix milliseconds (``deadline_unix_ms``).

Failure attribution (``WorkerRpc.failure``): only a worker that is gone — UNAVAILABLE
with no ``epd-failure`` kind (``runtime/worker/rpc_failure.py``) — is marked
unhealthy. A failure of one request's inputs (its embeddings could not be fetched)
fails that request alone, with a 503 that says so; a worker refusing the request's
content is a 502; a call past the TTFT deadline, before any token, is a 504.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from proto.epd.v1 import epd_pb2 as pb
from runtime.worker.rpc_failure import FailureKind, failure_kind

from . import pipeline_metrics as m
from .chat_backend import AdmissionRefused, BackendFailure, ChatJob, DeadlineExceeded
from .worker_registry import WorkerHandle, WorkerRegistry


def deadline_unix_ms(deadline_monotonic: float) -> int:
    """The ``time.monotonic()`` instant ``deadline_monotonic`` on the wall clock, in unix ms (what messages carry)."""
    return int((time.time() + (deadline_monotonic - time.monotonic())) * 1000)


def time_left_s(deadline_monotonic: float) -> float:
    """An RPC timeout for a call that must end by ``deadline_monotonic`` (at least 1 ms)."""
    return max(0.001, deadline_monotonic - time.monotonic())


def worker_gone(exc: BaseException) -> bool:
    """Whether ``exc`` says the worker itself stopped answering (not a failure of this request)."""
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE \
        and failure_kind(exc) is None


class WorkerRpc:
    """The RPC wrappers. Holds no state of its own; marks workers in ``registry`` when a call shows one is gone."""

    def __init__(self, registry: WorkerRegistry):
        self.registry = registry

    def failure(self, role: str, h: WorkerHandle, exc: grpc.aio.AioRpcError, job: ChatJob,
                streaming: bool = False) -> Exception:
        """Map a failed RPC to the request's error (see the module docstring). Once tokens are
        ``streaming`` the TTFT deadline is behind the request: a worker lost then is a 503."""
        past_ttft = not streaming and time.monotonic() >= job.ttft_deadline_s
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED or past_ttft:
            return DeadlineExceeded(f"{role} did not answer before the deadline")
        if failure_kind(exc) == FailureKind.EMBEDDING_FETCH:
            return BackendFailure(f"{role} worker {h.address} could not fetch the request's image embeddings: "
                                  f"{exc.details()}", 503)
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return BackendFailure(f"{role} rejected the request: {exc.details()}", 502)
        if worker_gone(exc):
            self.registry.mark_unhealthy(role, h.address)
        return BackendFailure(f"{role} worker {h.address} failed: {exc.code().name}: {exc.details()}", 503)

    async def cached(self, encoder: WorkerHandle, keys: list[str]) -> set[str]:
        """The ``keys`` the encoder's cache holds; empty when it does not answer within 1 s (a hint only)."""
        if not keys:
            return set()
        try:
            answer = (await encoder.stub.Cached(pb.CachedRequest(cache_keys=keys), timeout=1.0)).cached
        except grpc.aio.AioRpcError:
            return set()
        return {k for k, hit in zip(keys, answer) if hit}

    async def encode(self, encoder: WorkerHandle, job: ChatJob, images: list[pb.EncodeImage],
                     inline_up_to_bytes: int = 0) -> pb.EncodeResponse:
        """Encode ``images``; each embedding of at most ``inline_up_to_bytes`` comes back in the reply."""
        try:
            return await encoder.stub.Encode(
                pb.EncodeRequest(request_id=job.request_id, images=images, return_embeddings=False,
                                 inline_up_to_bytes=inline_up_to_bytes),
                timeout=time_left_s(job.ttft_deadline_s))
        except grpc.aio.AioRpcError as exc:
            raise self.failure("encoder", encoder, exc, job) from exc

    async def reserve(self, h: WorkerHandle, job: ChatJob, digest: str, prefix_keys: list[bytes] = (),
                      reuse_prefix: bool = False) -> pb.ReserveResponse:
        """Decode blocks for the prompt and ``max_tokens``; a worker that cannot fit them refuses at once (429).
        ``reuse_prefix``: the worker may start the reservation with the cached blocks of ``prefix_keys``."""
        try:
            resp = await h.stub.Reserve(self.reserve_request(h, job, digest, prefix_keys, reuse_prefix),
                                        timeout=time_left_s(job.ttft_deadline_s))
        except grpc.aio.AioRpcError as exc:
            raise self.reserve_failure(h, exc, job) from exc
        self.reserved(h, job, resp, bool(prefix_keys))
        return resp

    @staticmethod
    def reserve_request(h: WorkerHandle, job: ChatJob, digest: str, prefix_keys: list[bytes] = (),
                        reuse_prefix: bool = False) -> pb.ReserveRequest:
        """What ``Reserve`` sends (also what a colocated ``Generate`` that reserves itself carries)."""
        return pb.ReserveRequest(
            request_id=job.request_id, prompt_tokens=len(job.token_ids), max_tokens=job.max_tokens,
            deadline_unix_ms=deadline_unix_ms(job.ttft_deadline_s), token_digest=digest,
            model_fingerprint=h.stats.model_fingerprint, rope_delta=job.rope_delta,
            prefix_keys=list(prefix_keys), reuse_prefix=reuse_prefix, choices=job.sampling.n)

    def reserve_failure(self, h: WorkerHandle, exc: grpc.aio.AioRpcError, job: ChatJob) -> Exception:
        """A refused reservation: no room is a 429 (``no_decode_capacity``), the rest as ``failure``."""
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            m.ADMISSION_REJECTED.labels("no_decode_capacity").inc()
            return AdmissionRefused(429, f"decode capacity: {exc.details()}", 1.0)
        return self.failure("decode", h, exc, job)

    @staticmethod
    def reserved(h: WorkerHandle, job: ChatJob, resp: pb.ReserveResponse, asked_prefix: bool) -> None:
        """A reservation granted (by ``Reserve`` or a self-reserving ``Generate``): its bulk address, and
        the prefix-cache counters when the request named prefix keys."""
        if resp.bulk_address:
            h.bulk_address = resp.bulk_address
        if asked_prefix:
            m.PREFIX_QUERIES.labels(h.address).inc(len(job.token_ids))
            m.PREFIX_HITS.labels(h.address).inc(resp.cached_tokens)

    async def rearm(self, h: WorkerHandle, reservation: pb.Reservation, job: ChatJob) -> pb.Reservation:
        """The held reservation's next generation (blocks kept; chunks of the old one are refused)."""
        try:
            resp = await h.stub.Rearm(pb.RearmRequest(request_id=job.request_id, reservation=reservation),
                                      timeout=time_left_s(job.ttft_deadline_s))
        except grpc.aio.AioRpcError as exc:
            raise self.failure("decode", h, exc, job) from exc
        return resp.reservation

    async def release(self, h: WorkerHandle, reservation: pb.Reservation, job: ChatJob, reason: str) -> None:
        """Free the reservation's blocks now; idempotent on the worker, never raises here."""
        # shielded: a cancelled request (client gone) must still free its blocks now, not at lease expiry
        release = asyncio.ensure_future(h.stub.Release(
            pb.ReleaseRequest(request_id=job.request_id, reservation=reservation, reason=reason), timeout=2.0))
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            await asyncio.shield(release)

    async def retire_choices(self, h: WorkerHandle, reservation: pb.Reservation, job: ChatJob,
                             choices: list[int]) -> None:
        """Retire these choices (n > 1) on the decode worker now; the others run on. Never raises here."""
        retire = asyncio.ensure_future(h.stub.Release(
            pb.ReleaseRequest(request_id=job.request_id, reservation=reservation, reason="choice ended by the gateway",
                              choices=choices), timeout=2.0))
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            await asyncio.shield(retire)

    async def alive(self, h: WorkerHandle) -> bool:
        """A quick probe after a failure: is the worker itself still there?"""
        try:
            await h.stub.Stats(pb.StatsRequest(since_sample=h.last_sample), timeout=1.0)
            return True
        except grpc.aio.AioRpcError:
            return False
