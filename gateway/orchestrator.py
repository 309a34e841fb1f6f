"""The gateway's ChatBackend: one request's top-level flow, E -> P -> D over gRPC.

Life of one request (the deadline travels in every message and as every RPC's timeout):

1. keys: content keys for its images; ask an encoder which are cached already
   (only for images this gateway has sent before; ``gateway/encoder_step.py``);
2. admission: estimate TTFT for each placement from live worker loads and the
   online-calibrated cost model; refuse at once (429 + Retry-After) if none meets
   the deadline or no decode capacity will exist;
3. encode the images that are not cached (the encoder fills the cache; the image
   bytes travel only here, later messages carry keys) — or, for a colocated request whose
   images are all new and quick to encode, send their bytes on the Generate for the decode
   worker to encode itself (``EncoderStep.encode_on_decode``) — and at the same time
4. the handoff (``gateway/handoff.py``): reserve decode blocks (fails fast when they
   cannot fit; Reserve needs nothing from Encode, so the two RPCs overlap), then either
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
``gateway_queue_ms``, ``estimated_ttft_ms``, ``estimated_queue_ms``, ``backlog_ms``, ``overrun_ms``; from the encoder
step ``encode_ms``, ``images_cache_hit``, ``images_prefix_cached`` (counts: images not
encoded because the colocated decode worker holds their KV) and ``images_encoded_on_decode``; ``cached_tokens``, the prompt
tokens the decode worker's prefix cache served (its Reserve reply); from decode's first event
(``attempt.record_first_event``) ``prefill_ms``, ``transfer_ms``, ``transfer_bytes`` (bytes)
when disaggregated, ``colocated_prefill_ms`` when colocated, ``decode_wait_ms`` and
``pipeline_ms`` (the attempt's streams opened to its first event).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from runtime.policy.loads import RequestShape
from runtime.worker.tracing import annotate, span
from runtime.worker.wire import token_digest

from . import pipeline_metrics as m
from .admission import GatewayAdmission
from .chat_backend import AdmissionRefused, ChatJob, TokenEvent
from .encoder_step import EncoderStep
from .fit_check import MeasuredTimings
from .handoff import Handoff
from .prefix_routing import PrefixView
from .seen_images import SeenImages
from .settings import GatewaySettings
from .worker_registry import WorkerRegistry
from .worker_rpc import WorkerRpc


class Orchestrator:
    def __init__(self, settings: GatewaySettings, registry: WorkerRegistry | None = None):
        self.settings = settings
        self.admission = GatewayAdmission(settings)   # the cost model, the pressure, the decision
        static = {"encoder": settings.encoder_addrs, "prefill": settings.prefill_addrs, "decode": settings.decode_addrs}
        self.measured = MeasuredTimings()
        self.registry = registry or WorkerRegistry(static, settings.redis_url, on_sample=self._on_sample,
                                                   on_refresh=self._publish_gauges, token=settings.internal_token,
                                                   generate_stream=settings.generate_stream)
        self.chunk_tokens = settings.prefill_chunk_tokens
        self.rpc = WorkerRpc(self.registry)
        self.encoder_step = EncoderStep(self.registry, self.rpc, SeenImages(), settings.inline_embedding_bytes,
                                        settings.colocated_encode_max_ms)

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
        return self.admission.pressure.shed_estimate_ms()

    def status(self) -> dict:
        """Workers as the registry sees them (each with this gateway's ``inflight_from_gateway``),
        plus ``waiting_first_token``: requests admitted here that have no first token yet."""
        return {**self.registry.status(), "placement_mode": self.settings.placement,
                "cost_model": self.admission.cost_model.calibration(),
                "cost_model_vs_measured": self.measured.summary(self.admission.cost_model),
                "waiting_first_token": self.admission.pressure.waiting}

    def _on_sample(self, role: str, sample) -> None:
        """A worker's timing sample: it calibrates the cost model, and the dashboard shows both."""
        self.admission.observe(role, sample)
        self.measured.add(sample.kind, sample.size, sample.ms)

    def _publish_gauges(self) -> None:
        """After every poll round: ``epd:queue_depth{stage}`` (what the autoscalers, HPA, scale each
        stage on), ``epd:healthy_workers{stage}``, and the cost model's fit beside the measured times."""
        for role in ("encoder", "prefill", "decode"):
            healthy = self.registry.healthy(role)
            m.QUEUE_DEPTH.labels(role).set(sum(h.stats.queue_depth for h in healthy if h.stats))
            m.HEALTHY_WORKERS.labels(role).set(len(healthy))
        for kind, row in self.measured.summary(self.admission.cost_model).items():
            if row["samples"]:
                m.COST_FIT_MS.labels(kind).set(row["fitted_ms"])
                m.COST_MEASURED_MS.labels(kind).set(row["measured_ms"])

    # -- the request ---------------------------------------------------------------
    async def generate(self, job: ChatJob) -> AsyncIterator[TokenEvent]:
        remaining_ms = (job.ttft_deadline_s - time.monotonic()) * 1000
        if remaining_ms <= 0:  # infeasible from the start: refuse now rather than start and time out
            m.ADMISSION_REJECTED.labels("ttft_deadline").inc()
            raise AdmissionRefused(429, "request refused at admission: the TTFT deadline is already past", 1.0)
        breakdown: dict[str, float] = {"gateway_queue_ms": (time.monotonic() - job.arrival_s) * 1000}
        rid = {"epd.request_id": job.request_id}
        annotate(**rid)
        with span("gateway.cache_check", **rid, **{"epd.images": len(job.images)}):
            images = await self.encoder_step.plan(job)
        prefix = PrefixView.of(job, images.keys, self.registry.healthy("decode"))
        remaining_ms = (job.ttft_deadline_s - time.monotonic()) * 1000   # hashing and the cache check took some
        shape = RequestShape(prompt_tokens=len(job.token_ids), max_tokens=job.max_tokens,
                             n_images=len(job.images), n_images_cached=images.n_cached, choices=job.sampling.n,
                             image_tokens=sum(images.image_tokens), image_tokens_cached=images.cached_tokens)
        with span("gateway.admission", **rid, **{"epd.remaining_ms": remaining_ms}) as s:
            admission = self.admission.admit(shape, self.registry, remaining_ms, job.itl_slo_ms, prefix)
            if s is not None:
                s.set_attribute("epd.admitted", admission.ok)
                s.set_attribute("epd.reason", admission.reason or "")
        if not admission.ok:
            raise self.admission.refusal(admission, remaining_ms)
        decision = admission.decision
        job.placement, job.placement_reason = decision.placement, decision.reason
        colocated = decision.placement == "colocated"
        # colocated on a worker that holds a prefix: it prefills the rest, and the images wholly inside it are not encoded
        expected = prefix.cached_tokens(decision.decode_worker) if colocated else 0
        # the worker that prefills it counts the prompt until its first token (its own report lags a burst)
        prefills_on = self.registry.workers["decode" if colocated else "prefill"].get(
            decision.decode_worker if colocated else decision.prefill_worker or "")
        with span("gateway.placement", **rid, **{"epd.placement": decision.placement,
                                                 "epd.placement_reason": decision.reason}):
            ticket = self.admission.admitted(admission, shape, job.arrival_s, breakdown, prefills_on, job.request_id,
                                             len(job.token_ids) - expected)
        annotate(**{"epd.placement": decision.placement, "epd.placement_reason": decision.reason})
        first = True
        try:
            skipped = frozenset(range(len(images.refs))) - set(prefix.images_needed(expected)) if expected else frozenset()

            # all new, and cheap enough: the decode worker encodes them itself from the bytes
            on_decode = colocated and not skipped and self.encoder_step.encode_on_decode(
                images, self.admission.cost_model, decision.decode_worker)

            async def encode() -> None:   # the handoff runs it beside Decode.Reserve
                if on_decode:
                    self.encoder_step.sent_to_decode(images, breakdown)
                    return
                with span("gateway.encode", **rid, **{"epd.images": len(job.images) - len(skipped),
                                                      "epd.images_cached": images.n_cached}):
                    await self.encoder_step.encode(job, images, breakdown, skip=skipped)

            async def encode_images(needed: set[int]) -> None:
                await self.encoder_step.encode(job, images, breakdown, skip=set(range(len(images.refs))) - needed)

            digest = token_digest(job.token_ids, images.keys, job.image_grids, job.rope_delta)
            handoff = Handoff(job, shape, decision, images.refs, digest, breakdown,
                              registry=self.registry, rpc=self.rpc, cost_model=self.admission.cost_model,
                              loads=lambda: self.admission.loads(shape, self.registry, own_transfer=not colocated),
                              chunk_tokens=self.chunk_tokens, prefix=prefix, skipped=skipped,
                              encode=encode, encode_images=encode_images, images_on_decode=on_decode,
                              reserve_in_generate=colocated and not skipped and (on_decode or not images.needs_encode),
                              on_move=ticket.moved)
            # aclosing: when the consumer closes us (disconnect, stop string), the handoff's
            # finally (release the reservation) runs now, not whenever the generator is collected
            async with contextlib.aclosing(handoff.events()) as events:
                async for event in events:
                    if first:
                        first = False
                        ticket.left(got_first_token=True)
                    yield event
        finally:
            ticket.left(got_first_token=False)   # a no-op after the first token
