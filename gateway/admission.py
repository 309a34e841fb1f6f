"""The gateway's admission: what it knows about the pipeline, and the one decision per request.

State it owns (one asyncio loop, so no locks):

- the ``CostModel``, calibrated online from the timing samples every worker returns in its
  ``Stats`` (``observe``, the registry's ``on_sample``);
- the ``FirstTokenPressure`` (``gateway.pressure``): requests admitted and still waiting for
  a first token, the first-token rate, the model's recent misprediction;
- the remote requests admitted and still without a first token, with their KV bytes: the
  KV link's load as this gateway sees it.

Per request: ``snapshot`` turns the registry's ``WorkerStats`` into the policy's
``StatsSnapshot`` (the record the simulator fills from its simulated workers), and
``admit`` runs the policy on it (``runtime.policy.worker_stats.stage_loads``, then
``runtime.policy.placement_policy.admit`` with the pressure as data). An admitted request
holds a ``Ticket`` from admission to its first token or its end: ``Ticket.left`` exactly once.
"""

from __future__ import annotations

import time

from proto.epd.v1 import epd_pb2 as pb
from runtime.policy.cost_model import CostModel
from runtime.policy.loads import RequestShape, StageLoads
from runtime.policy.placement_policy import COLOCATED, Admission, admit
from runtime.policy.service_times import ServiceTimes
from runtime.policy.worker_stats import Role, StatsSnapshot, WorkerReport, stage_loads

from . import pipeline_metrics as m
from .chat_backend import AdmissionRefused
from .prefix_routing import PrefixView
from .pressure import FirstTokenPressure
from .settings import GatewaySettings
from .worker_registry import ROLES, WorkerHandle, WorkerRegistry

# CPU-scale priors; replaced by online calibration from worker timings within a few requests.
CPU_PRIOR = ServiceTimes(prefill_base_ms=5.0, prefill_ms_per_token=0.05, decode_step_base_ms=5.0,
                         decode_step_ms_per_seq=0.5, decode_slots=64, kv_bytes_per_token=4096,
                         link_setup_ms=1.0, link_bytes_per_s=1e9, encode_base_ms=5.0,
                         encode_ms_per_token=0.02,   # 5.3 ms for the demo model's 16-token image, 16.5 for a 576-token one
                         encode_cache_hit_ms=0.5)


def worker_report(role: str, address: str, stats: pb.WorkerStats, in_flight: int, *, cached_prefix_tokens: int = 0,
                  cached_images: int = 0, placed_prompts: tuple[int, ...] = ()) -> WorkerReport:
    """One worker's ``WorkerStats`` (and this gateway's requests on it) as the policy reads it; a decode
    worker's ``cached_prefix_tokens`` / ``cached_images`` of this request come from its prefix summary."""
    decode = role == Role.DECODE
    return WorkerReport(
        role=Role(role), address=address, running_seqs=stats.running_seqs, queue_depth=stats.queue_depth,
        queued_prefill_tokens=stats.queued_prefill_tokens, free_blocks=stats.free_blocks if decode else None,
        queued_image_tokens=stats.queued_image_tokens if role == Role.ENCODER else 0,
        queued_prompts=tuple(stats.queued_prompt_tokens) if decode else (),
        step_prompt_tokens=stats.step_prompt_tokens if decode else 0,
        step_long_prompt_tokens=stats.step_long_prompt_tokens if decode else 0,
        total_blocks=stats.total_blocks, block_size=max(1, stats.block_size),
        ring_groups=stats.ring_groups if decode else 0, ring_blocks=stats.ring_blocks if decode else 0,
        max_batch=stats.max_batch_configured if decode else 0, in_flight=max(0, in_flight),
        placed_prompts=placed_prompts,
        cached_prefix_tokens=cached_prefix_tokens if decode else 0, cached_images=cached_images if decode else 0,
        host_id=stats.host_id, cpus=tuple(stats.cpus), cpus_busy=stats.cpus_busy,
    )


class Ticket:
    """An admitted request, from admission to its first token or its end."""

    __slots__ = ("_owner", "_admitted_at", "_model_ms", "_kv_bytes", "_ahead", "_open", "_placed_on", "_request_id")

    def __init__(self, owner: GatewayAdmission, model_ms: float | None, kv_bytes: float, ahead: int,
                 placed_on: WorkerHandle | None = None, request_id: str = "") -> None:
        """``model_ms``: the TTFT predicted at admission; None when the prediction could not price
        the queue (``Pressure.backlog_priced``), so the first token teaches no overrun. ``ahead``:
        the requests admitted and still waiting for a first token when this one was. ``placed_on``:
        the worker whose ``placed_prompts`` hold this request's prompt until it leaves."""
        self._owner, self._model_ms, self._kv_bytes, self._ahead = owner, model_ms, kv_bytes, ahead
        self._placed_on, self._request_id = placed_on, request_id
        self._admitted_at = time.monotonic()
        self._open = True

    def left(self, got_first_token: bool) -> None:
        """Exactly once: at the first token, or when the request ends without one (later calls do nothing)."""
        if not self._open:
            return
        self._open = False
        if self._placed_on is not None:
            self._placed_on.placed_prompts.pop(self._request_id, None)
        owner = self._owner
        if self._kv_bytes:
            owner.kv_transfers -= 1
            owner.kv_bytes = max(0.0, owner.kv_bytes - self._kv_bytes) if owner.kv_transfers else 0.0
        took_ms = (time.monotonic() - self._admitted_at) * 1000
        overrun = None if self._model_ms is None else took_ms - self._model_ms
        # without a first token, ``overrun`` is how long past the prediction it still waited (a lower bound)
        owner.pressure.left(got_first_token=got_first_token, overrun_ms=overrun, ahead=self._ahead, ttft_ms=took_ms)

    def moved(self, to: WorkerHandle) -> None:
        """A recovery gave the prompt to ``to``, the worker that prefills it now: it counts there, and no
        longer where it was placed, until it leaves (no-op once it left, or if it counted nowhere)."""
        if not self._open or self._placed_on is None or to is self._placed_on:
            return
        tokens = self._placed_on.placed_prompts.pop(self._request_id, None)
        self._placed_on = to
        if tokens is not None:
            to.placed_prompts[self._request_id] = tokens


class GatewayAdmission:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.cost_model = CostModel(prior=CPU_PRIOR, min_points=4)
        self.pressure = FirstTokenPressure(overrun_quantile=settings.admission_quantile)
        self.kv_transfers = 0  # remote requests admitted, no first token yet
        self.kv_bytes = 0.0  # ... and their prompts' KV bytes

    def observe(self, role: str, s: pb.TimingSample) -> None:
        """A worker's timing sample: calibrate the cost model's fit for its kind."""
        if s.kind == "prefill":
            self.cost_model.observe_prefill(int(s.size), s.ms)
        elif s.kind == "decode_step":
            self.cost_model.observe_decode_step(int(s.size), s.ms)
        elif s.kind == "transfer":
            self.cost_model.observe_transfer(int(s.size), s.ms)
        elif s.kind == "encode":
            self.cost_model.observe_encode(int(s.size), s.ms)

    def snapshot(self, registry: WorkerRegistry, prefix: PrefixView | None = None) -> StatsSnapshot:
        """Every healthy worker's last stats, with this gateway's requests on it and on the link, and
        (``prefix``) how much of this request's prompt each decode worker holds cached."""
        workers = []
        for role in ROLES:
            for h in registry.healthy(role):
                if h.stats is None:
                    continue
                cached = prefix.cached_tokens(h.address) if prefix is not None and role == "decode" else 0
                workers.append(worker_report(role, h.address, h.stats, h.inflight, cached_prefix_tokens=cached,
                                             cached_images=prefix.images_within(cached) if cached else 0,
                                             placed_prompts=tuple(h.placed_prompts.values())))
        return StatsSnapshot(tuple(workers), self.kv_transfers, self.kv_bytes)

    def loads(self, shape: RequestShape, registry: WorkerRegistry, *, own_transfer: bool = False,
              prefix: PrefixView | None = None) -> StageLoads:
        """The policy's inputs now; ``own_transfer``: the request's own transfer is one of the link's
        (a failed one being re-priced), so it is left out."""
        snap = self.snapshot(registry, prefix)
        if own_transfer:
            snap = snap.less_transfer(self.cost_model.kv_bytes(shape.prompt_tokens))
        return stage_loads(snap, shape, self.cost_model, self.settings.prefill_chunk_tokens)

    def admit(self, shape: RequestShape, registry: WorkerRegistry, remaining_ms: float, itl_slo_ms: float,
              prefix: PrefixView | None = None) -> Admission:
        """The policy's verdict for ``shape`` with ``remaining_ms`` to its TTFT deadline (side-effect free)."""
        chunk = self.settings.prefill_chunk_tokens
        return admit(shape, self.loads(shape, registry, prefix=prefix), self.cost_model, self.settings.placement, remaining_ms,
                     itl_slo_ms, pressure=self.pressure.inputs(), transfer_chunk_tokens=chunk, local_chunk_tokens=chunk)

    @staticmethod
    def refusal(admission: Admission, remaining_ms: float) -> AdmissionRefused:
        """The 429 (503 without decode workers) for a refused ``admission``, counted by reason; a refusal
        on time carries the terms it weighed against the ``remaining_ms`` to the deadline."""
        m.ADMISSION_REJECTED.labels(admission.reason).inc()
        status = 503 if admission.reason == "no_decode_workers" else 429
        terms = None
        if admission.reason in ("ttft_deadline", "pipeline_backlog"):
            terms = {"estimated_ttft_ms": admission.estimated_ttft_ms, "estimated_queue_ms": admission.estimated_queue_ms,
                     "backlog_ms": admission.backlog_ms, "overrun_ms": admission.overrun_ms, "remaining_ms": remaining_ms}
        wait_s = admission.retry_after_ms / 1000 if admission.retry_after_ms else float(admission.retry_after_s)
        if admission.reason == "pipeline_backlog":
            return AdmissionRefused(status, "request refused at admission: the pipeline backlog exceeds the TTFT "
                                            "deadline", wait_s, terms)
        return AdmissionRefused(status, f"request refused at admission: {admission.reason}", wait_s, terms)

    def admitted(self, admission: Admission, shape: RequestShape, arrival_s: float, breakdown: dict[str, float],
                 placed_on: WorkerHandle | None = None, request_id: str = "", prompt_tokens: int = 0) -> Ticket:
        """Count an admitted request in: metrics, its breakdown's estimates, the pressure, the link, and
        (``placed_on``: the worker that prefills it) its ``prompt_tokens`` there until its first token."""
        decision = admission.decision
        if decision is None:
            raise ValueError("only an admitted request gets a ticket")
        m.PLACEMENT.labels(decision.placement, decision.reason).inc()
        breakdown["estimated_ttft_ms"] = decision.estimates.get("ttft_ms", 0.0)
        breakdown["estimated_queue_ms"] = decision.estimates.get("queue_ms", 0.0)
        breakdown["backlog_ms"] = admission.backlog_ms
        breakdown["overrun_ms"] = admission.overrun_ms
        kv_bytes = 0.0
        if decision.placement != COLOCATED:
            kv_bytes = float(self.cost_model.kv_bytes(shape.prompt_tokens))
            self.kv_transfers += 1
            self.kv_bytes += kv_bytes
        priced = self.pressure.backlog_priced()   # read before this request counts as waiting
        ahead = self.pressure.waiting
        self.pressure.admitted(intake_ms=(time.monotonic() - arrival_s) * 1000)
        # the overrun is learnt against the model's own prediction, without itself: a stationary target
        if placed_on is not None:
            placed_on.placed_prompts[request_id] = prompt_tokens
        return Ticket(self, decision.estimates["ttft_ms"] + admission.backlog_ms if priced else None, kv_bytes, ahead,
                      placed_on, request_id)
