"""The gateway's ChatBackend: one request's top-level flow, E -> P -> D over gRPC.

Life of one request (the deadline travels in every message and as every RPC's timeout):

1. keys: content keys for its images; ask an encoder which are cached already
   (only for images this gateway has sent before; ``gateway/encoder_step.py``);
2. admission: estimate TTFT for each placement from live worker loads and the
   online-calibrated cost model; refuse at once (429 + Retry-After) if none meets
   the deadline or no decode capacity will exist;
3. encode the images that are not cached (the encoder fills the cache; the image
   bytes travel only here, later messages carry keys);
4. the handoff (``gateway/handoff.py``): reserve decode blocks (fails fast when they
   cannot fit), then either
   - colocated: ``Decode.Generate(colocated)`` prefills on the decode worker, or
   - disaggregated: ``Decode.Generate`` waits for KV while ``Prefill.Prefill``
     pushes it chunk by chunk into the reservation;
   the first token goes out as soon as decode sends it;
5. on a failed transfer, the failure policy picks retry / other decode worker /
   re-prefill / fail from the time left (``gateway/recovery.py``); every path releases
   the reservation (``Decode.Release`` is idempotent, and the lease reaper backs it up).
   A stream that ended with a finish reason needs no Release: the decode worker
   retired the sequence, which freed its blocks, before it sent that event.

The RPC wrappers and what a failed RPC means are ``gateway/worker_rpc.py``; one attempt's
streams are ``gateway/attempt.py``.

The first event's ``ttft_breakdown`` (milliseconds unless named otherwise): here
``gateway_queue_ms``, ``estimated_ttft_ms``, ``backlog_ms``, ``overrun_ms``; from the encoder
step ``encode_ms`` and ``images_cache_hit`` (a count); from decode's first event
(``attempt.record_first_event``) ``prefill_ms``, ``transfer_ms``, ``transfer_bytes`` (bytes)
when disaggregated, ``colocated_prefill_ms`` when colocated, ``decode_wait_ms`` and
``pipeline_ms`` (the attempt's streams opened to its first event).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from proto.epd.v1 import epd_pb2 as pb
from runtime.policy.cost_model import CostModel
from runtime.policy.placement_policy import (
    DecodeWorkerLoad,
    EncoderLoad,
    PrefillWorkerLoad,
    RequestShape,
    StageLoads,
    admit,
)
from runtime.policy.service_times import ServiceTimes
from runtime.worker.wire import token_digest

from . import pipeline_metrics as m
from .chat_backend import AdmissionRefused, ChatJob, TokenEvent
from .encoder_step import EncoderStep
from .handoff import Handoff
from .pressure import FirstTokenPressure
from .seen_images import SeenImages
from .settings import GatewaySettings
from .worker_registry import WorkerRegistry
from .worker_rpc import WorkerRpc

# CPU-scale priors; replaced by online calibration from worker timings within a few requests.
CPU_PRIOR = ServiceTimes(prefill_base_ms=5.0, prefill_ms_per_token=0.05, decode_step_base_ms=5.0,
                         decode_step_ms_per_seq=0.5, decode_slots=64, kv_bytes_per_token=4096,
                         link_setup_ms=1.0, link_bytes_per_s=1e9, encode_base_ms=5.0, encode_ms_per_image=5.0,
                         encode_cache_hit_ms=0.5)


class Orchestrator:
    def __init__(self, settings: GatewaySettings, registry: WorkerRegistry | None = None):
        self.settings = settings
        self.cost_model = CostModel(prior=CPU_PRIOR, min_points=4)
        static = {"encoder": settings.encoder_addrs, "prefill": settings.prefill_addrs, "decode": settings.decode_addrs}
        self.registry = registry or WorkerRegistry(static, settings.redis_url, on_sample=self._observe,
                                                   on_refresh=self._publish_queue_depths, token=settings.internal_token)
        self.chunk_tokens = settings.prefill_chunk_tokens
        self.pressure = FirstTokenPressure(overrun_quantile=settings.admission_quantile)
        self.rpc = WorkerRpc(self.registry)
        self.encoder_step = EncoderStep(self.registry, self.rpc, SeenImages())

    # -- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        await self.registry.start()

    async def close(self) -> None:
        await self.registry.close()

    def healthy(self) -> bool:
        r = self.registry
        prefill_ok = bool(r.healthy("prefill")) or not r.workers["prefill"]
        return bool(r.healthy("encoder")) and bool(r.healthy("decode")) and prefill_ok

    def shed_estimate_ms(self) -> float:
        return self.pressure.shed_estimate_ms()

    def status(self) -> dict:
        return {**self.registry.status(), "placement_mode": self.settings.placement,
                "cost_model": self.cost_model.calibration()}

    def _publish_queue_depths(self) -> None:
        """``epd:queue_depth{stage}``: what the autoscalers (HPA) scale each stage on."""
        for role in ("encoder", "prefill", "decode"):
            m.QUEUE_DEPTH.labels(role).set(sum(h.stats.queue_depth for h in self.registry.healthy(role) if h.stats))

    def _observe(self, role: str, s: pb.TimingSample) -> None:
        if s.kind == "prefill":
            self.cost_model.observe_prefill(int(s.size), s.ms)
        elif s.kind == "decode_step":
            self.cost_model.observe_decode_step(int(s.size), s.ms)
        elif s.kind == "transfer":
            self.cost_model.observe_transfer(int(s.size), s.ms)
        elif s.kind == "encode":
            self.cost_model.observe_encode(int(s.size), s.ms)

    # -- load signals -------------------------------------------------------------
    def _stage_loads(self) -> StageLoads:
        decode = []
        for h in self.registry.healthy("decode"):
            s = h.stats
            running = s.running_seqs + h.inflight
            decode.append(DecodeWorkerLoad(
                address=h.address, running_seqs=running, free_slots=max(0, 64 - running),
                free_blocks=s.free_blocks, block_size=max(1, s.block_size),
                queue_wait_ms=self.cost_model.prefill_ms(s.queued_prefill_tokens) if s.queued_prefill_tokens else 0.0,
            ))
        prefill = []
        for h in self.registry.healthy("prefill"):
            s = h.stats
            queued = s.queued_prefill_tokens
            prefill.append(PrefillWorkerLoad(address=h.address,
                                             queue_wait_ms=self.cost_model.prefill_ms(queued) if queued else 0.0))
        enc = self.registry.healthy("encoder")
        encoder = EncoderLoad(queue_wait_ms=min((h.stats.queue_depth for h in enc), default=0) * self.cost_model.encode_ms(1))
        return StageLoads(decode=tuple(decode), prefill=tuple(prefill), encoder=encoder)

    # -- the request ---------------------------------------------------------------
    async def generate(self, job: ChatJob) -> AsyncIterator[TokenEvent]:
        remaining_ms = (job.ttft_deadline_s - time.monotonic()) * 1000
        if remaining_ms <= 0:  # infeasible from the start: refuse now rather than start and time out
            m.ADMISSION_REJECTED.labels("ttft_deadline").inc()
            raise AdmissionRefused(429, "request refused at admission: the TTFT deadline is already past", 1.0)
        breakdown: dict[str, float] = {"gateway_queue_ms": (time.monotonic() - job.arrival_s) * 1000}
        images = await self.encoder_step.plan(job)
        remaining_ms = (job.ttft_deadline_s - time.monotonic()) * 1000   # hashing and the cache check took some
        shape = RequestShape(prompt_tokens=len(job.token_ids), max_tokens=job.max_tokens,
                             n_images=len(job.images), n_images_cached=images.n_cached)
        admission = admit(shape, self._stage_loads(), self.cost_model, self.settings.placement, remaining_ms,
                          job.itl_slo_ms, transfer_chunk_tokens=self.chunk_tokens, local_chunk_tokens=self.chunk_tokens)
        if not admission.ok:
            m.ADMISSION_REJECTED.labels(admission.reason).inc()
            status = 503 if admission.reason == "no_decode_workers" else 429
            raise AdmissionRefused(status, f"request refused at admission: {admission.reason}", admission.retry_after_s)
        decision = admission.decision
        backlog_ms, overrun_ms = self.pressure.wait_ms(), self.pressure.overrun_ms()
        # the overrun is learnt against the model's own prediction, without itself: a stationary target
        model_ms = decision.estimates["ttft_ms"] + backlog_ms
        admitted_at = time.monotonic()
        if model_ms + overrun_ms > remaining_ms:
            m.ADMISSION_REJECTED.labels("pipeline_backlog").inc()
            raise AdmissionRefused(429, "request refused at admission: the pipeline backlog exceeds the TTFT deadline",
                                   max(1.0, (backlog_ms + overrun_ms) / 1000.0))
        m.PLACEMENT.labels(decision.placement, decision.reason).inc()
        breakdown["estimated_ttft_ms"] = decision.estimates.get("ttft_ms", 0.0)
        breakdown["backlog_ms"] = backlog_ms
        breakdown["overrun_ms"] = overrun_ms
        self.pressure.admitted(intake_ms=(admitted_at - job.arrival_s) * 1000)
        first = True
        try:
            await self.encoder_step.encode(job, images, breakdown)
            handoff = Handoff(job, shape, decision, images.refs, token_digest(job.token_ids, images.keys), breakdown,
                              registry=self.registry, rpc=self.rpc, cost_model=self.cost_model,
                              chunk_tokens=self.chunk_tokens)
            # aclosing: when the consumer closes us (disconnect, stop string), the handoff's
            # finally (release the reservation) runs now, not whenever the generator is collected
            async with contextlib.aclosing(handoff.events()) as events:
                async for event in events:
                    if first:
                        first = False
                        took_ms = (time.monotonic() - admitted_at) * 1000
                        self.pressure.left(got_first_token=True, overrun_ms=took_ms - model_ms)
                    yield event
        finally:
            if first:
                self.pressure.left(got_first_token=False)
