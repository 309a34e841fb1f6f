"""Discrete-event simulation of the E/P/D pipeline under one placement.

Request lifecycle, as queues (each hop is a state change):

    arrival -> [gateway queue -> gateway]            (only when gateway_request_ms > 0)
            -> [encoder queue -> encoder]            (only with images to encode)
            -> placement (runtime.policy.placement_policy: choose_placement, or admit)
    colocated:  decode worker X's local queue -> local prefill on X -> X's batch -> done
    remote:     prefill queue -> prefill worker (reserves a slot on X when it starts)
                -> KV link (after prefill, or chunk by chunk) -> first token (the
                prefill's, emitted as the KV lands) -> X's pending joins -> X's batch -> done
    on a failed transfer: runtime.policy.placement_policy.on_transfer_failure decides
                retry / other_decode / reprefill / fail; released state is counted
                in ``cleanups``.

``hop_ms`` (the hand-offs between processes that are no stage's work) delays each request
as it arrives. With ``host_cores`` N > 0 in the service times, every stage's work (gateway, encode,
prefill, decode steps, local prefill) shares N cores (``sim.host_cpu``: processor
sharing, next to ``host_background_cores`` of other work);
with 0 (the default) each worker has its own processor and nothing here changes.

The placement and failure decisions are the gateway's own functions, fed the same
load snapshots a gateway would see. Stage timings are the ``ServiceTimes`` in
the config (the simulator's ground truth); the policy's ``CostModel`` starts
from the same numbers.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from runtime.policy.cost_model import CostModel
from runtime.policy.placement_policy import (
    COLOCATED,
    PrefillWorkerLoad,
    StageLoads,
    admit,
    choose_placement,
    on_transfer_failure,
)
from sim.config import SimConfig
from sim.decode_worker import DecodeWorker, SharedDecodeWorker
from sim.events import EventQueue
from sim.host_cpu import HostCpu
from sim.kv_link import KvLink
from sim.metrics import Metrics
from sim.request import SimRequest
from sim.server_pool import Server, ServerPool
from sim.workload import Arrival, Workload


@dataclass(slots=True)
class SimResult:
    config: SimConfig
    metrics: Metrics
    horizon_ms: float
    busy_ms: dict[str, float]  # pool -> total busy ms over the run
    pool_sizes: dict[str, int]
    transferred_bytes: float  # every byte moved over the link, failed attempts included
    events: int


class Simulator:
    """Runs one ``Workload`` under one ``SimConfig``; use ``simulate()`` for the one-call form."""

    def __init__(self, config: SimConfig, cost_model: CostModel | None = None) -> None:
        self.cfg = cfg = config
        self.cm = cost_model if cost_model is not None else CostModel(cfg.service)
        self.truth = CostModel(cfg.service)  # stage timings (ground truth)
        self.events = ev = EventQueue()
        self.m = Metrics()
        self._wait_ms, self._waits = self.m.wait_sum_ms, self.m.wait_n  # per-stage wait sums and counts
        colocated = cfg.placement == COLOCATED
        p = cfg.service
        self.cpu = cpu = HostCpu(p.host_cores, ev, p.host_background_cores, active=lambda: self._more or self._open > 0,
                                 seed=cfg.seed) if p.host_cores else None
        gateway = p.gateway_request_ms > 0 or p.gateway_finish_ms > 0
        self.gateway = ServerPool("gateway", 1 if gateway else 0, ev, self._gateway_start, self._gateway_done, cpu)
        self.encoders = ServerPool("encoder", cfg.encoder_workers, ev, self._encode_start, self._encode_done, cpu)
        n_prefill = 0 if colocated else cfg.prefill_workers
        self.prefill = ServerPool("prefill", n_prefill, ev, self._prefill_start, self._prefill_done, cpu)
        n_decode = cfg.language_workers if colocated else cfg.decode_workers
        shared = {} if cpu is None else {"cpu": cpu, "step_extra_ms": p.decode_step_extra_ms}
        self.decode = [
            (DecodeWorker if cpu is None else SharedDecodeWorker)(
                i, ev, self, slots=p.decode_slots, kv_tokens=cfg.decode_kv_tokens,
                step_base_ms=p.decode_step_base_ms,
                step_ms_per_seq=p.decode_step_ms_per_seq, itl_slo_ms=cfg.itl_slo_ms, hist=self.m.itl_hist,
                accepts_local=cfg.placement != "disaggregated", fused_saving_ms=min(p.prefill_base_ms, p.decode_step_base_ms),
                **shared,
            )
            for i in range(n_decode)
        ]
        self.decode_by_name = {w.name: w for w in self.decode}
        self.prefill_by_name = {s.name: s for s in self.prefill.servers}
        self.link = KvLink(ev, cfg.kv_links, p.link_bytes_per_s, p.link_setup_ms, cfg.link_concurrency, self._flow_done)
        self._fail_rng = random.Random(f"epd-sim/{cfg.seed}/failures")
        self._arrivals: Iterator[Arrival] = iter(())
        self._open = 0  # requests arrived and not yet retired
        self._more = False  # arrivals still to come
        self._rid = 0
        self._last_retired = 0.0
        self._transfer_chunks = cfg.chunk_tokens if cfg.transfer == "chunked" else None
        self._local_chunks = cfg.local_chunk_tokens if cfg.chunked_prefill else None
        self._sample_every = 1.0
        # What the policy sees: one snapshot object per worker and pipe, refreshed in place by
        # _loads before each decision (the policy keeps no reference), so a placement allocates none.
        self._prefill_loads = [(s, PrefillWorkerLoad(s.name, 0.0)) for s in self.prefill.servers]
        self._stage_loads = StageLoads(
            tuple(w.snapshot for w in self.decode), tuple(load for _, load in self._prefill_loads), self.link.load(0.0)
        )

    # ---- driver --------------------------------------------------------------------

    def run(self, workload: Workload) -> SimResult:
        self._arrivals = workload.arrivals()
        first = next(self._arrivals, None)
        self._more = first is not None
        if first is not None:
            self.events.at(first[0], self._arrive, first)
        span = workload.span_ms() + 4 * self.cfg.ttft_slo_ms
        self._sample_every = max(span / self.cfg.samples, 1.0)
        self.events.at(0.0, self._sample)
        # Per-request objects form no reference cycles (a finished request is freed by
        # reference counting), so the cyclic collector would only rescan the long-lived
        # heap over and over: pause it for the run (~15% faster at a million requests).
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.events.run()
        finally:
            if collecting:
                gc.enable()
        for w in self.decode:
            w.flush_gaps()
            if w.joins:  # remote requests: from KV landing to joining the batch
                self.m.wait_sum_ms["decode_join"] += w.join_wait_ms
                self.m.wait_n["decode_join"] += w.joins
        end = self._last_retired  # the run ends when the last request is done (not at the last sample)
        busy = {
            "encoder": self.encoders.busy_ms(end),
            "prefill": self.prefill.busy_ms(end),
            "decode": sum(w.busy_until(end) for w in self.decode),
            "link": self.link.busy_ms(end),
        }
        delay, flows = self.link.mean_delay_ms()
        if flows:
            self.m.wait_sum_ms["link_queue"] += delay
            self.m.wait_n["link_queue"] += flows
        if self.cpu is not None and self.cpu.pieces:  # per piece of work: time taken less its idle time
            self.m.wait_sum_ms["host_core"] += self.cpu.stretch_ms
            self.m.wait_n["host_core"] += self.cpu.pieces
        sizes = {
            "encoder": len(self.encoders.servers),
            "prefill": len(self.prefill.servers),
            "decode": len(self.decode),
            "link": len(self.link.pipes),
        }
        if self.gateway.servers:  # only a modelled gateway is reported (the default reports stay as they were)
            busy["gateway"], sizes["gateway"] = self.gateway.busy_ms(end), 1
        return SimResult(self.cfg, self.m, end, busy, sizes, self.link.transferred_bytes(), self.events.processed)

    def _arrive(self, now: float, spec: Arrival) -> None:
        nxt = next(self._arrivals, None)
        if nxt is None:
            self._more = False
        else:
            self.events.at(nxt[0], self._arrive, nxt)
        req = SimRequest(self._rid, spec, self.cfg.ttft_slo_ms)
        self._rid += 1
        self._open += 1
        self.m.arrived += 1
        self._after(now, self.cfg.service.hop_ms, self._enter, req, work=False)

    def _after(self, now: float, ms: float, then: Any, req: SimRequest, *, work: bool = True, group: Any = None) -> None:
        """``then(t, req)`` once ``ms`` have passed: at once for 0; on a shared host as a piece of
        work (``group``: the process it runs in) or, ``work=False``, a wait; else a plain delay."""
        if ms <= 0.0:
            then(now, req)
        elif self.cpu is None:
            self.events.at(now + ms, then, req)
        elif work:
            self.cpu.run(now, ms, then, req, group=group)
        else:
            self.cpu.wait(now, ms, then, req)

    def _enter(self, now: float, req: SimRequest) -> None:
        """Past the request's hand-offs (``hop_ms``): to the gateway stage, else the encoder."""
        if self.gateway.servers:
            req.t_mark = now
            self.gateway.servers[0].submit(req, self.cfg.service.gateway_request_ms, now)
        else:
            self._encode(req, now)

    def _encode(self, req: SimRequest, now: float) -> None:
        """To the encoder when the request has images that cost encoder time, else straight to placement."""
        if req.images and self.encoders.servers:
            encode_ms = self.truth.encode_ms(req.images, req.cached)
            if req.cached < req.images:
                encode_ms += self.cfg.service.encode_request_ms
            if encode_ms > 0.0:  # all cache hits at 0 ms: the gateway never calls the encoder
                req.t_mark = now
                self.encoders.least_loaded(now).submit(req, encode_ms, now)
                return
        self._place(req, now)

    def _sample(self, now: float, _: Any = None) -> None:
        m, workers = self.m, self.decode
        m.sample_t_ms.append(now)
        s = m.samples
        s["encoder"].append(self.encoders.queued())
        s["prefill"].append(self.prefill.queued())
        s["kv_reservation"].append(sum(len(w.prealloc) for w in workers))
        s["link"].append(self.link.active())
        s["decode_join"].append(sum(len(w.pending) for w in workers))
        s["local_prefill"].append(sum(len(w.local_q) + (w.local_active is not None) for w in workers))
        s["decode_running"].append(sum(len(w.running) for w in workers))
        if self._more or self._open:
            self.events.at(now + self._sample_every, self._sample)

    # ---- encode and place ----------------------------------------------------------

    def _gateway_start(self, req: SimRequest | None, now: float, server: Server) -> None:
        if req is not None:  # None: a finished request's closing work
            self._wait_ms["gateway"] += now - req.t_mark
            self._waits["gateway"] += 1

    def _gateway_done(self, req: SimRequest | None, now: float, server: Server) -> None:
        if req is not None:
            self._encode(req, now)

    def _encode_start(self, req: SimRequest, now: float, server: Server) -> None:
        self._wait_ms["encoder"] += now - req.t_mark
        self._waits["encoder"] += 1

    def _encode_done(self, req: SimRequest, now: float, server: Server) -> None:
        self._place(req, now)

    def _loads(self, now: float) -> StageLoads:
        """The stage snapshot at ``now`` (the same objects each time, refreshed in place)."""
        for w in self.decode:
            w.load(now)
        for s, load in self._prefill_loads:
            load.queue_wait_ms = s.backlog_ms(now) if s.busy else 0.0
        loads = self._stage_loads
        loads.link = self.link.load(now)
        return loads

    def _place(self, req: SimRequest, now: float) -> None:
        cfg = self.cfg
        shape, loads, left = req.shape, self._loads(now), req.deadline - now
        chunks, local_chunks = self._transfer_chunks, self._local_chunks
        if cfg.admission:
            verdict = admit(
                shape, loads, self.cm, cfg.placement, left, cfg.itl_slo_ms,
                transfer_chunk_tokens=chunks, local_chunk_tokens=local_chunks,
            )
            decision = verdict.decision
            if not verdict.ok:
                self._reject(req, verdict.reason, now)
                return
        else:
            decision = choose_placement(
                shape, loads, self.cm, cfg.placement, left, cfg.itl_slo_ms,
                transfer_chunk_tokens=chunks, local_chunk_tokens=local_chunks,
            )
        if decision is None:
            self._reject(req, "no_decode_capacity", now)
            return
        self.m.placements[decision.placement] += 1
        self.m.reasons[decision.reason] += 1
        req.worker = worker = self.decode_by_name[decision.decode_worker]
        req.t_mark = now
        if decision.placement == COLOCATED:
            req.local = True
            req.prefill_ms = self.truth.prefill_ms(req.tokens)
            if self._local_chunks is not None and req.tokens > 0:  # chunk by chunk, each riding a step
                req.local_chunks = list(self.truth.chunk_times(req.tokens, self._local_chunks))
                req.prefill_ms = sum(req.local_chunks)
            worker.claim_local(req)
            # the worker's own work for it (embedding fetch, its stream) comes first
            self._after(now, cfg.service.decode_request_ms, self._fetched, req, group=worker)
        else:
            self._submit_prefill(req, self.prefill_by_name[decision.prefill_worker], now)

    def _reject(self, req: SimRequest, reason: str, now: float) -> None:
        self.m.rejected += 1
        self.m.rejections[reason] += 1
        self._retire(now)

    def _retire(self, now: float) -> None:
        self._open -= 1
        self._last_retired = now

    # ---- remote prefill and transfer -----------------------------------------------

    def _submit_prefill(self, req: SimRequest, server: Server, now: float) -> None:
        chunk = self._transfer_chunks
        overhead = self.cfg.service.prefill_request_ms  # before the first pass (embedding fetch, RPCs)
        if chunk is not None and req.tokens > chunk:
            ready = self.truth.chunk_ready_ms(req.tokens, chunk)
            req.chunk_bytes = [self.truth.kv_bytes(c) for c in self.truth.chunk_sizes(req.tokens, chunk)]
            service = ready[-1] + overhead
        else:
            req.chunk_bytes = None
            service = self.truth.prefill_ms(req.tokens) + overhead
        req.prefill_done, req.chunks_ready, req.chunks_sent = False, 0, 0
        req.t_mark = now
        server.submit(req, service, now)

    def _prefill_start(self, req: SimRequest, now: float, server: Server) -> None:
        self._wait_ms["prefill"] += now - req.t_mark
        self._waits["prefill"] += 1
        if req.chunk_bytes is not None:
            start = now + self.cfg.service.prefill_request_ms
            for t in self.truth.chunk_ready_ms(req.tokens, self._transfer_chunks)[:-1]:  # type: ignore[arg-type]
                self.events.at(start + t, self._chunk_ready, req)
        if not req.reserved:
            req.t_reserve = now
            req.worker.reserve(req, now)

    def _prefill_done(self, req: SimRequest, now: float, server: Server) -> None:
        req.prefill_done = True
        if req.chunk_bytes is not None:
            self._chunk_ready(now, req)
        elif req.reserved:
            self._send_full(req, now)

    def _chunk_ready(self, now: float, req: SimRequest) -> None:
        req.chunks_ready += 1
        if req.reserved:
            self._send_chunks(req, now)

    def reservation_granted(self, req: SimRequest, now: float) -> None:
        req.reserved = True
        self._wait_ms["kv_reservation"] += now - req.t_reserve
        self._waits["kv_reservation"] += 1
        if req.resend_full or req.chunk_bytes is None:
            if req.prefill_done:
                self._send_full(req, now)
        else:
            self._send_chunks(req, now)

    def _send_chunks(self, req: SimRequest, now: float) -> None:
        if req.chunks_sent == 0 and req.chunks_ready:
            self._new_attempt(req, now, flows=len(req.chunk_bytes))  # type: ignore[arg-type]
        while req.chunks_sent < req.chunks_ready:
            self.link.send(req, req.chunk_bytes[req.chunks_sent], now)  # type: ignore[index]
            req.chunks_sent += 1

    def _send_full(self, req: SimRequest, now: float) -> None:
        self._new_attempt(req, now, flows=1)
        self.link.send(req, self.truth.kv_bytes(req.tokens), now)

    def _new_attempt(self, req: SimRequest, now: float, flows: int) -> None:
        req.attempts += 1
        req.flows, req.landed, req.t_send = flows, 0, now

    def _flow_done(self, req: SimRequest, now: float) -> None:
        req.landed += 1
        if req.landed < req.flows:
            return
        self.m.transfers += 1
        if self.cfg.failure_prob and self._fail_rng.random() < self.cfg.failure_prob:
            self._transfer_failed(req, now)
            return
        self._wait_ms["link"] += now - req.t_send
        self._waits["link"] += 1
        req.t_mark = now
        self._after(now, self.cfg.service.decode_request_ms, self._received, req, group=req.worker)

    def _fetched(self, now: float, req: SimRequest) -> None:
        """The decode worker's own work for a colocated request (embedding fetch, reserve, its
        stream) is done: it queues for local prefill. Like ``_received``, that work runs on the
        worker's RPC threads, taking turns with the step loop."""
        req.worker.queue_local(req, now)  # type: ignore[union-attr]

    def _received(self, now: float, req: SimRequest) -> None:
        """The decode worker's own work for a remote request (reserve, KV receive and insert, its
        stream) is done: its first token goes out. That work runs on the worker's RPC threads,
        beside its step loop, taking turns with it on the one interpreter lock (on a shared host;
        with a processor per worker it delays only this request)."""
        req.worker.land(req, now)  # type: ignore[union-attr]

    def _transfer_failed(self, req: SimRequest, now: float) -> None:
        m, cfg, worker = self.m, self.cfg, req.worker
        m.transfer_failures += 1
        m.cleanups["partial_transfer"] += 1  # chunk / flow bookkeeping of the failed attempt
        held = cfg.reservation_held_on_failure
        if not held:
            self._release(req, now)
        others = [w for w in self.decode if w is not worker and w.free_slots() > 0]
        action = on_transfer_failure(
            req.deadline - now, held, req.attempts, req.shape, self.cm, bool(others),
            any(not s.busy for s in self.prefill.servers), max_attempts=cfg.max_transfer_attempts,
            link=self.link.load(now),
            prefill_wait_ms=min((s.backlog_ms(now) for s in self.prefill.servers), default=0.0),
            decode_batch=len(worker.running) + 1,  # type: ignore[union-attr]
        )
        m.failure_actions[action.kind] += 1
        if action.kind == "retry":
            self._send_full(req, now)
            return
        if req.reserved:
            self._release(req, now)
        if action.kind == "other_decode":
            req.worker = max(others, key=lambda w: w.free_slots())
            req.resend_full = True
            req.t_reserve = now
            req.worker.reserve(req, now)
        elif action.kind == "reprefill":
            req.resend_full = False
            self._submit_prefill(req, self.prefill.least_loaded(now), now)
        else:
            m.failed += 1
            self._retire(now)

    def _release(self, req: SimRequest, now: float) -> None:
        req.reserved = False
        self.m.cleanups["reservation"] += 1
        req.worker.release(req, now)  # type: ignore[union-attr]

    # ---- host callbacks from decode workers ----------------------------------------

    def local_prefill_started(self, req: SimRequest, now: float) -> None:
        self._wait_ms["local_prefill"] += now - req.t_mark
        self._waits["local_prefill"] += 1

    def first_token(self, req: SimRequest, t: float) -> None:
        req.t_first = t
        self.m.ttft_ms.append(t - req.arrival)

    def finished(self, req: SimRequest, now: float, worker: DecodeWorker) -> None:
        m = self.m
        m.completed += 1
        ttft_ok = req.t_first - req.arrival <= self.cfg.ttft_slo_ms
        itl_ok = worker.breach == req.breach_base
        m.ttft_ok += ttft_ok
        m.itl_ok += itl_ok
        m.good += ttft_ok and itl_ok
        finish_ms = self.cfg.service.gateway_finish_ms
        if finish_ms > 0.0:  # the gateway's closing work (streaming, release): occupies it, off the latency path
            self.gateway.servers[0].submit(None, finish_ms, now)
        self._retire(now)


def simulate(config: SimConfig, workload: Workload, cost_model: CostModel | None = None) -> SimResult:
    """Run one simulation (the simulator object is not reusable)."""
    return Simulator(config, cost_model).run(workload)
