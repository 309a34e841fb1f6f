"""The gateway's ChatBackend: admission, placement, and driving E -> P -> D over gRPC.

Life of one request (the deadline travels in every message and as every RPC's timeout):

1. keys: content keys for its images; ask an encoder which are cached already
   (only for images this gateway has sent before, see ``seen_images``);
2. admission: estimate TTFT for each placement from live worker loads and the
   online-calibrated cost model; refuse at once (429 + Retry-After) if none meets
   the deadline or no decode capacity will exist;
3. encode the images that are not cached (the encoder fills the cache);
4. reserve decode blocks (fails fast when they cannot fit), then either
   - colocated: ``Decode.Generate(colocated)`` prefills on the decode worker, or
   - disaggregated: ``Decode.Generate`` waits for KV while ``Prefill.Prefill``
     pushes it chunk by chunk into the reservation;
5. on a failed transfer, the failure policy picks retry / other decode worker /
   re-prefill / fail from the time left; every path releases the reservation
   (``Decode.Release`` is idempotent, and the lease reaper backs it up). A stream
   that ended with a finish reason needs no Release: the decode worker retired
   the sequence, which freed its blocks, before it sent that event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc

from cache.keys import image_content_key
from proto.epd.v1 import epd_pb2 as pb
from runtime.policy.failure_policy import on_transfer_failure
from runtime.policy.loads import RequestShape
from runtime.policy.placement_policy import PlacementDecision
from runtime.worker.rpc_failure import FailureKind, failure_kind
from runtime.worker.wire import sampling_to_pb, token_digest

from . import gateway_metrics as m
from .admission import GatewayAdmission
from .chat_backend import AdmissionRefused, BackendFailure, ChatJob, DeadlineExceeded, TokenEvent
from .seen_images import SeenImages
from .settings import GatewaySettings
from .worker_registry import WorkerHandle, WorkerRegistry

log = logging.getLogger("epd.gateway")


class TransferFailed(Exception):
    """A handoff attempt failed. ``stream`` is the attempt's decode stream, still open so the
    reservation stays held until the gateway has decided (re-arm keeps it, release frees it)."""

    def __init__(self, detail: str, worker_lost: str | None = None, stream=None, decode_lost: bool = False):
        super().__init__(detail)
        self.worker_lost = worker_lost      # a prefill worker that stopped answering
        self.decode_lost = decode_lost      # the decode worker itself stopped answering
        self.stream = stream


def _now_unix_ms(deadline_monotonic: float) -> int:
    return int((time.time() + (deadline_monotonic - time.monotonic())) * 1000)


class Orchestrator:
    def __init__(self, settings: GatewaySettings, registry: WorkerRegistry | None = None):
        self.settings = settings
        self.admission = GatewayAdmission(settings)   # the cost model, the pressure, the decision
        static = {"encoder": settings.encoder_addrs, "prefill": settings.prefill_addrs, "decode": settings.decode_addrs}
        self.registry = registry or WorkerRegistry(static, settings.redis_url, on_sample=self.admission.observe,
                                                   on_refresh=self._publish_queue_depths, token=settings.internal_token)
        self.chunk_tokens = settings.prefill_chunk_tokens
        self.seen_images = SeenImages()

    # -- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        await self.registry.start()

    async def close(self) -> None:
        await self.registry.close()

    def healthy(self) -> bool:
        r = self.registry
        prefill_ok = bool(r.healthy("prefill")) or not r.workers["prefill"]
        return bool(r.healthy("encoder")) and bool(r.healthy("decode")) and prefill_ok

    def backlog_ms(self) -> float:
        return self.admission.pressure.shed_estimate_ms()

    def status(self) -> dict:
        """Workers as the registry sees them (each with this gateway's ``inflight_from_gateway``),
        plus ``waiting_first_token``: requests admitted here that have no first token yet."""
        return {**self.registry.status(), "placement_mode": self.settings.placement,
                "cost_model": self.admission.cost_model.calibration(),
                "waiting_first_token": self.admission.pressure.waiting}

    def _publish_queue_depths(self) -> None:
        """``epd:queue_depth{stage}``: what the autoscalers (HPA) scale each stage on."""
        for role in ("encoder", "prefill", "decode"):
            m.QUEUE_DEPTH.labels(role).set(sum(h.stats.queue_depth for h in self.registry.healthy(role) if h.stats))

    # -- the request ---------------------------------------------------------------
    async def generate(self, job: ChatJob) -> AsyncIterator[TokenEvent]:
        remaining_ms = (job.ttft_deadline_s - time.monotonic()) * 1000
        if remaining_ms <= 0:  # infeasible from the start: refuse now rather than start and time out
            m.ADMISSION_REJECTED.labels("ttft_deadline").inc()
            raise AdmissionRefused(429, "request refused at admission: the TTFT deadline is already past", 1.0)
        breakdown: dict[str, float] = {"gateway_queue_ms": (time.monotonic() - job.arrival_s) * 1000}
        refs, keys, checked, n_cached, encoder = await self._image_refs(job)
        remaining_ms = (job.ttft_deadline_s - time.monotonic()) * 1000   # hashing and the cache check took some
        shape = RequestShape(prompt_tokens=len(job.token_ids), max_tokens=job.max_tokens,
                             n_images=len(job.images), n_images_cached=n_cached)
        admission = self.admission.admit(shape, self.registry, remaining_ms, job.itl_slo_ms)
        if not admission.ok:
            raise self.admission.refusal(admission)
        decision = admission.decision
        ticket = self.admission.admitted(admission, shape, job.arrival_s, breakdown)
        first = True
        try:
            if encoder is not None and n_cached < len(refs):
                t0 = time.monotonic()
                try:
                    resp = await encoder.stub.Encode(
                        pb.EncodeRequest(request_id=job.request_id, images=refs, return_embeddings=False),
                        timeout=self._left_s(job))
                except grpc.aio.AioRpcError as exc:
                    raise self._rpc_failure("encoder", encoder, exc, job)
                breakdown["encode_ms"] = (time.monotonic() - t0) * 1000
                breakdown["images_cache_hit"] = float(sum(i.cache_hit for i in resp.images))
                for was_checked, image in zip(checked, resp.images):
                    if not was_checked:
                        m.ENCODER_CACHE_CHECKS.labels(str(bool(image.cache_hit)).lower()).inc()
                self.seen_images.add(keys)
            elif refs:
                breakdown["encode_ms"] = 0.0
                breakdown["images_cache_hit"] = float(len(refs))
            digest = token_digest(job.token_ids, keys)
            # aclosing: when the consumer closes us (disconnect, stop string), the placement's
            # finally (release the reservation) runs now, not whenever the generator is collected
            async with contextlib.aclosing(self._run_placement(job, shape, decision, refs, digest, breakdown)) as events:
                async for event in events:
                    if first:
                        first = False
                        ticket.left(got_first_token=True)
                    yield event
        finally:
            ticket.left(got_first_token=False)   # a no-op after the first token

    async def _image_refs(self, job: ChatJob):
        if not job.images:
            return [], [], [], 0, None
        encoders = self.registry.healthy("encoder")
        if not encoders:
            m.ADMISSION_REJECTED.labels("no_encoder_workers").inc()
            raise AdmissionRefused(503, "no healthy encoder worker", 1.0)
        encoder = min(encoders, key=lambda h: h.stats.queue_depth + h.inflight)
        fp, digest, salt = encoder.stats.model_fingerprint, encoder.stats.preprocess_digest, job.cache_salt
        # salted keys everywhere below (seen_images, Cached, Encode, the breakdown's hit count): a
        # request learns about cached images only within its own salt, never another tenant's
        keys = await asyncio.to_thread(lambda: [image_content_key(im.image, fp, digest, salt) for im in job.images])
        checked = [self.seen_images.seen(k) for k in keys]   # never-seen images: Encode finds out
        ask = [k for k, c in zip(keys, checked) if c]
        found: set[str] = set()
        if ask:
            try:
                answer = (await encoder.stub.Cached(pb.CachedRequest(cache_keys=ask), timeout=1.0)).cached
                found = {k for k, hit in zip(ask, answer) if hit}
            except grpc.aio.AioRpcError:
                pass
            for k in ask:
                m.ENCODER_CACHE_CHECKS.labels(str(k in found).lower()).inc()
        refs = [pb.ImageRef(cache_key=k, data=im.data, encoder_address=encoder.address, cache_salt=salt)
                for k, im in zip(keys, job.images)]
        return refs, keys, checked, sum(k in found for k in keys), encoder

    def _left_s(self, job: ChatJob) -> float:
        return max(0.001, job.ttft_deadline_s - time.monotonic())

    def _rpc_failure(self, role: str, h: WorkerHandle, exc: grpc.aio.AioRpcError, job: ChatJob,
                     streaming: bool = False) -> Exception:
        """Map a failed RPC to the request's error. Only a worker that is gone (UNAVAILABLE with no
        ``epd-failure`` kind, see ``runtime/rpc_failure.py``) is marked unhealthy: a failure of one
        request's inputs (its embeddings could not be fetched) fails that request alone. Once tokens
        are ``streaming`` the TTFT deadline is behind the request: a worker lost then is a 503."""
        past_ttft = not streaming and time.monotonic() >= job.ttft_deadline_s
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED or past_ttft:
            return DeadlineExceeded(f"{role} did not answer before the deadline")
        kind = failure_kind(exc)
        if kind == FailureKind.EMBEDDING_FETCH:
            return BackendFailure(f"{role} worker {h.address} could not fetch the request's image embeddings: "
                                  f"{exc.details()}", 503)
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return BackendFailure(f"{role} rejected the request: {exc.details()}", 502)
        if exc.code() == grpc.StatusCode.UNAVAILABLE and kind is None:
            self.registry.mark_unhealthy(role, h.address)
        return BackendFailure(f"{role} worker {h.address} failed: {exc.code().name}: {exc.details()}", 503)

    async def _reserve(self, h: WorkerHandle, job: ChatJob, digest: str) -> pb.Reservation:
        try:
            resp = await h.stub.Reserve(pb.ReserveRequest(
                request_id=job.request_id, prompt_tokens=len(job.token_ids), max_tokens=job.max_tokens,
                deadline_unix_ms=_now_unix_ms(job.ttft_deadline_s), token_digest=digest,
                model_fingerprint=h.stats.model_fingerprint), timeout=self._left_s(job))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                m.ADMISSION_REJECTED.labels("no_decode_capacity").inc()
                raise AdmissionRefused(429, f"decode capacity: {exc.details()}", 1.0) from exc
            raise self._rpc_failure("decode", h, exc, job) from exc
        h.bulk_address = resp.bulk_address
        return resp.reservation

    async def _release(self, h: WorkerHandle, reservation: pb.Reservation | None, job: ChatJob, reason: str) -> None:
        if reservation is None:
            return
        # shielded: a cancelled request (client gone) must still free its blocks now, not at lease expiry
        release = asyncio.ensure_future(h.stub.Release(
            pb.ReleaseRequest(request_id=job.request_id, reservation=reservation, reason=reason), timeout=2.0))
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            await asyncio.shield(release)

    async def _run_placement(self, job: ChatJob, shape: RequestShape, decision: PlacementDecision,
                             refs: list[pb.ImageRef], digest: str, breakdown: dict[str, float]) -> AsyncIterator[TokenEvent]:
        decode = self.registry.get("decode", decision.decode_worker)
        prefill = self.registry.get("prefill", decision.prefill_worker) if decision.prefill_worker else None
        if decode is None or (decision.prefill_worker and prefill is None):
            raise BackendFailure("the worker chosen for this request left before it got there", 503)
        colocated = decision.placement == "colocated"
        reservation = None
        attempts = 0
        streaming = False     # the first token went out: failures from here on are mid-stream
        decode.inflight += 1  # from before Reserve: a handle dropped from discovery keeps its channel while > 0
        try:
            try:
                reservation = await self._reserve(decode, job, digest)
            except BackendFailure:
                # the chosen worker may have died since the last poll; nothing was sent anywhere yet
                moved = await self._replacement_decode(decode)
                if moved is None:
                    raise
                decode.inflight -= 1
                decode = moved
                decode.inflight += 1
                reservation = await self._reserve(decode, job, digest)
            while True:
                try:
                    stream, first = await self._start_attempt(job, decode, prefill, reservation, refs, digest, colocated, breakdown)
                    break
                except TransferFailed as failure:
                    attempts += 1
                    m.KV_TRANSFER_FAILED.inc()
                    if failure.worker_lost and (prefill is None or not await self._alive(prefill)):
                        # confirmed: a prefill whose push broke because the decode worker died is innocent
                        self.registry.mark_unhealthy("prefill", failure.worker_lost)
                    if not failure.decode_lost:
                        failure.decode_lost = not await self._alive(decode)
                    if failure.decode_lost:
                        self.registry.mark_unhealthy("decode", decode.address)
                    others = [h for h in self.registry.healthy("decode") if h.address != decode.address]
                    free_prefill = [h for h in self.registry.healthy("prefill") if prefill is None or h.address != prefill.address]
                    action = on_transfer_failure((job.ttft_deadline_s - time.monotonic()) * 1000, attempts, shape,
                                                 self.admission.cost_model,
                                                 self.admission.loads(shape, self.registry, own_transfer=not colocated),
                                                 decode.address, decode_lost=failure.decode_lost)
                    m.FAILURE_ACTIONS.labels(action.kind).inc()
                    log.warning("request %s transfer attempt %d failed (%s); action %s (%s)",
                                job.request_id, attempts, failure, action.kind, action.reason)
                    if action.kind != "fail" and failure.worker_lost and free_prefill:
                        prefill = min(free_prefill, key=lambda h: h.inflight + h.stats.queue_depth)
                    if action.kind in ("fail", "other_decode"):
                        await self._release(decode, reservation, job, f"transfer failed: {action.kind}")
                        reservation = None   # released: the finally below must not release it again
                        self._close_stream(failure.stream)
                    if action.kind == "fail":
                        if time.monotonic() >= job.ttft_deadline_s:
                            raise DeadlineExceeded(f"KV transfer failed and the deadline passed: {failure}") from None
                        raise BackendFailure(f"KV transfer failed and no recovery fits the time left: {failure}", 503) from None
                    if action.kind == "other_decode":
                        decode.inflight -= 1
                        decode = min(others, key=lambda h: h.inflight + h.stats.running_seqs)
                        decode.inflight += 1
                        reservation = await self._reserve(decode, job, digest)
                    else:
                        if action.kind == "reprefill" and free_prefill:
                            prefill = min(free_prefill, key=lambda h: h.inflight + h.stats.queue_depth)
                        reservation = await self._rearm(decode, reservation, job)  # old stream ends, blocks kept
                        self._close_stream(failure.stream)
            first.ttft_breakdown = breakdown
            if first.finish_reason:
                reservation = None   # the decode worker retired the sequence and freed its blocks itself
            streaming = True
            yield first
            if first.finish_reason:
                return
            async for ev in stream:
                if ev.finish_reason:
                    reservation = None
                yield TokenEvent(list(ev.token_ids), ev.finish_reason or None)
                if ev.finish_reason:
                    return
        except grpc.aio.AioRpcError as exc:
            raise self._rpc_failure("decode", decode, exc, job, streaming) from exc
        finally:
            await self._release(decode, reservation, job, "request ended")
            decode.inflight -= 1

    async def _replacement_decode(self, lost: WorkerHandle) -> WorkerHandle | None:
        """After a failed Reserve: if ``lost`` is really gone, mark it and name the least loaded
        other healthy decode worker (``None``: the failure stands)."""
        if await self._alive(lost):
            return None
        self.registry.mark_unhealthy("decode", lost.address)
        others = [h for h in self.registry.healthy("decode") if h.address != lost.address]
        if not others:
            return None
        m.FAILURE_ACTIONS.labels("other_decode").inc()
        log.warning("decode worker %s is gone; placing the request on another", lost.address)
        return min(others, key=lambda h: h.inflight + h.stats.running_seqs)

    async def _alive(self, h: WorkerHandle) -> bool:
        """A quick probe after a failure: is the worker itself still there?"""
        try:
            await h.stub.Stats(pb.StatsRequest(since_sample=h.last_sample), timeout=1.0)
            return True
        except grpc.aio.AioRpcError:
            return False

    @staticmethod
    def _close_stream(stream) -> None:
        if stream is not None:
            stream.cancel()

    async def _rearm(self, decode: WorkerHandle, reservation: pb.Reservation, job: ChatJob) -> pb.Reservation:
        try:
            resp = await decode.stub.Rearm(pb.RearmRequest(request_id=job.request_id, reservation=reservation),
                                           timeout=self._left_s(job))
        except grpc.aio.AioRpcError as exc:
            raise self._rpc_failure("decode", decode, exc, job) from exc
        return resp.reservation

    async def _start_attempt(self, job, decode: WorkerHandle, prefill: WorkerHandle | None, reservation: pb.Reservation,
                             refs, digest, colocated: bool, breakdown: dict[str, float]):
        """Open the decode stream (and the prefill push); return (stream, first TokenEvent) or raise TransferFailed."""
        e2e_timeout = self._left_s(job) + job.max_tokens * max(job.itl_slo_ms, 1000.0) / 1000.0
        request = pb.GenerateRequest(request_id=job.request_id, reservation=reservation, max_tokens=job.max_tokens,
                                     sampling=sampling_to_pb(job.sampling), deadline_unix_ms=_now_unix_ms(job.ttft_deadline_s))
        if colocated:
            request.colocated = True
            request.token_ids.extend(job.token_ids)
            request.images.extend(refs)
            request.chunk_tokens = self.chunk_tokens
        stream = decode.stub.Generate(request, timeout=e2e_timeout)
        prefill_task = None
        t0 = time.monotonic()
        if not colocated:
            prefill.inflight += 1
            prefill_task = asyncio.ensure_future(prefill.stub.Prefill(pb.PrefillRequest(
                request_id=job.request_id, token_ids=job.token_ids, images=refs, sampling=sampling_to_pb(job.sampling),
                decode_address=decode.address, decode_bulk_address=decode.bulk_address,
                reservation=reservation, chunk_tokens=self.chunk_tokens,
                deadline_unix_ms=_now_unix_ms(job.ttft_deadline_s), token_digest=digest), timeout=self._left_s(job)))
        first_task = asyncio.ensure_future(anext(stream.__aiter__()))
        try:
            pending = {first_task} | ({prefill_task} if prefill_task else set())
            while not first_task.done():
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if prefill_task in done and prefill_task.exception() is not None:
                    exc = prefill_task.exception()
                    rpc_error = isinstance(exc, grpc.aio.AioRpcError)
                    if rpc_error and failure_kind(exc) == FailureKind.EMBEDDING_FETCH:
                        # the request's images, not a transfer: no retry or re-prefill would fetch them
                        self._close_stream(stream)
                        raise self._rpc_failure("prefill", prefill, exc, job)
                    gone = rpc_error and exc.code() == grpc.StatusCode.UNAVAILABLE and failure_kind(exc) is None
                    lost = prefill.address if gone else None
                    detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                    # leave the decode stream open: the reservation stays held until we decide
                    first_task.add_done_callback(lambda t: t.cancelled() or t.exception())
                    raise TransferFailed(f"prefill: {detail}", lost, stream)
            try:
                ev = first_task.result()
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.ABORTED and not colocated:
                    raise TransferFailed(f"decode: {exc.details()}", None, stream) from None
                if exc.code() == grpc.StatusCode.UNAVAILABLE and failure_kind(exc) is None:  # gone: the request can move
                    raise TransferFailed(f"decode worker {decode.address} lost: {exc.details()}", None, stream,
                                         decode_lost=True) from None
                raise
            except StopAsyncIteration:
                raise BackendFailure("decode stream ended without a token", 502) from None
        except BaseException as exc:
            if not isinstance(exc, TransferFailed):
                first_task.cancel()
            if prefill_task is not None and not prefill_task.done():
                prefill_task.cancel()
            raise
        finally:
            if prefill is not None and not colocated:
                prefill.inflight -= 1
        if prefill_task is not None:
            with contextlib.suppress(BaseException):
                result = await asyncio.wait_for(asyncio.shield(prefill_task), 1.0)
                breakdown["prefill_ms"] = result.prefill_ms
                breakdown["transfer_ms"] = result.transfer_ms
        t = ev.transfer
        if t.HasField("transfer_total_bytes"):
            m.KV_TRANSFER_BYTES.inc(t.transfer_total_bytes)
            breakdown["transfer_bytes"] = float(t.transfer_total_bytes)
        if t.HasField("transfer_latency_s"):
            m.KV_TRANSFER_LATENCY.observe(t.transfer_latency_s)
        if colocated:
            breakdown["colocated_prefill_ms"] = ev.first_step_ms
        breakdown["decode_wait_ms"] = ev.queue_ms
        breakdown["pipeline_ms"] = (time.monotonic() - t0) * 1000
        return stream, TokenEvent(list(ev.token_ids), ev.finish_reason or None)
