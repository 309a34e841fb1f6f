"""Discrete-event simulation of the E/P/D pipeline under one placement.

Request lifecycle, as queues (each hop is a state change):

    arrival -> [gateway queue -> gateway]            (only when gateway_request_ms > 0)
            -> admission: the gateway's decision, from a stats snapshot of the simulated
               workers (``decide``; refused requests leave here)
            -> [encoder queue -> encoder]            (only with images to encode)
    colocated:  decode worker X's own work for it -> X's local queue -> local prefill on X
                -> X's batch -> done
    remote:     ``sim.remote_path`` (prefill, KV link, failures) -> X's batch -> done

The decision is the gateway's, made where the gateway makes it (before encoding) and from
the same inputs: every simulated worker reports what a real one puts in its ``Stats``
(``runtime.policy.worker_stats.WorkerReport``), the simulator adds what the gateway counts
itself (its requests on each worker, its remote requests still without a first token,
and with admission on its first-token pressure, ``sim.pressure``), and
``runtime.policy.worker_stats.stage_loads`` turns that snapshot into the policy's inputs,
as in ``gateway.admission``. Stage timings are the ``ServiceTimes`` in the config (the
simulator's ground truth); the policy's ``CostModel`` starts from the same numbers.

``hop_ms`` (the hand-offs between processes that are no stage's work) delays each request
as it arrives. With ``host_cores`` N > 0 every stage's work shares N cores
(``sim.shared_host``); with 0 (the default) each worker has its own processor. On a shared
host every worker reports the same machine, all N cores and their busy share over the last
poll window (``HostCpu.busy_share``), so the policy sees each prefill worker on the decode
workers' cores, as the gateway does on a real host.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from runtime.policy.cost_model import CostModel
from runtime.policy.loads import Pressure, RequestShape, StageLoads
from runtime.policy.placement_policy import COLOCATED, Admission, admit, choose_placement
from runtime.policy.worker_stats import Role, StatsSnapshot, stage_loads
from sim.config import SimConfig
from sim.decode_worker import DecodeWorker
from sim.events import EventQueue
from sim.metrics import Metrics
from sim.pressure import SimPressure
from sim.remote_path import RemotePath
from sim.request import SimRequest
from sim.server_pool import Hook, Server, ServerPool
from sim.shared_host import HostCpu, SharedDecodeWorker, SharedServer
from sim.workload import Arrival, Workload

SIM_HOST = "sim-host"   # the host_id every worker of a shared-host simulation reports


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
        p = cfg.service
        self.cpu = cpu = HostCpu(p.host_cores, ev, p.host_background_cores, active=lambda: self._more or self._open > 0,
                                 seed=cfg.seed) if p.host_cores else None
        colocated = cfg.placement == COLOCATED
        gateway = p.gateway_request_ms > 0 or p.gateway_finish_ms > 0
        self.gateway = self.pool("gateway", 1 if gateway else 0, None, self._gateway_start, self._gateway_done)
        self.encoders = self.pool("encoder", cfg.encoder_workers, Role.ENCODER, self._encode_start, self._encode_done)
        self.remote = RemotePath(self)
        self.prefill = self.pool("prefill", 0 if colocated else cfg.prefill_workers, Role.PREFILL,
                                 self.remote.prefill_started, self.remote.prefill_done)
        shared = {} if cpu is None else {"cpu": cpu, "step_extra_ms": p.decode_step_extra_ms}
        self.decode = [
            (DecodeWorker if cpu is None else SharedDecodeWorker)(
                i, ev, self, slots=p.decode_slots, kv_tokens=cfg.decode_kv_tokens, step_base_ms=p.decode_step_base_ms,
                step_ms_per_seq=p.decode_step_ms_per_seq, itl_slo_ms=cfg.itl_slo_ms, hist=self.m.itl_hist,
                local_chunk_tokens=cfg.local_chunk_tokens, fused_saving_ms=min(p.prefill_base_ms, p.decode_step_base_ms),
                **shared,
            )
            for i in range(cfg.language_workers if colocated else cfg.decode_workers)
        ]
        self.decode_by_name = {w.name: w for w in self.decode}
        self.prefill_by_name = {s.name: s for s in self.prefill.servers}
        self.pressure = SimPressure() if cfg.admission else None
        self.kv_transfers, self.kv_bytes = 0, 0.0  # remote requests admitted, no first token yet (the link's load)
        self._arrivals: Iterator[Arrival] = iter(())
        self._open = 0  # requests arrived and not yet retired
        self._more = False  # arrivals still to come
        self._rid = 0
        self._last_retired = 0.0
        self._transfer_chunks = cfg.chunk_tokens if cfg.transfer == "chunked" else None
        self._local_chunks = cfg.local_chunk_tokens if cfg.chunked_prefill else None
        self._sample_every = 1.0

    def pool(self, name: str, n: int, role: Role | None, on_start: Hook, on_done: Hook) -> ServerPool:
        """``n`` servers, each with its own processor, or taking turns on the shared host."""
        cpu, ev = self.cpu, self.events
        if cpu is None:
            return ServerPool(name, [Server(i, f"{name}-{i}", ev, on_start, on_done, role) for i in range(n)])
        return ServerPool(name, [SharedServer(i, f"{name}-{i}", ev, on_start, on_done, role, cpu) for i in range(n)])

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
        return self._result()

    def _result(self) -> SimResult:
        m, link = self.m, self.remote.link
        for w in self.decode:
            w.flush_gaps()
            if w.joins:  # remote requests: from KV landing to joining the batch
                m.wait_sum_ms["decode_join"] += w.join_wait_ms
                m.wait_n["decode_join"] += w.joins
        end = self._last_retired  # the run ends when the last request is done (not at the last sample)
        busy = {"encoder": self.encoders.busy_ms(end), "prefill": self.prefill.busy_ms(end),
                "decode": sum(w.busy_until(end) for w in self.decode), "link": link.busy_ms(end)}
        sizes = {"encoder": len(self.encoders.servers), "prefill": len(self.prefill.servers),
                 "decode": len(self.decode), "link": len(link.pipes)}
        delay, flows = link.mean_delay_ms()
        if flows:
            m.wait_sum_ms["link_queue"] += delay
            m.wait_n["link_queue"] += flows
        if self.cpu is not None and self.cpu.pieces:  # per piece of work: time taken less its idle time
            m.wait_sum_ms["host_core"] += self.cpu.stretch_ms
            m.wait_n["host_core"] += self.cpu.pieces
        if self.gateway.servers:  # only a modelled gateway is reported (the default reports stay as they were)
            busy["gateway"], sizes["gateway"] = self.gateway.busy_ms(end), 1
        return SimResult(self.cfg, m, end, busy, sizes, link.transferred_bytes(), self.events.processed)

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
        self.after(now, self.cfg.service.hop_ms, self._enter, req, work=False)

    def after(self, now: float, ms: float, then: Callable[[float, Any], None], req: SimRequest, *,
              work: bool = True, group: Any = None) -> None:
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
        """Past the request's hand-offs (``hop_ms``): to the gateway stage, else straight to admission."""
        if self.gateway.servers:
            req.t_mark = now
            self.gateway.servers[0].submit(req, self.cfg.service.gateway_request_ms, now)
        else:
            self._admit(req, now)

    def _sample(self, now: float, _: Any = None) -> None:
        m, workers = self.m, self.decode
        m.sample_t_ms.append(now)
        s = m.samples
        s["encoder"].append(self.encoders.queued())
        s["prefill"].append(self.prefill.queued())
        s["kv_reservation"].append(sum(len(w.prealloc) for w in workers))
        s["link"].append(self.remote.link.active())
        s["decode_join"].append(sum(len(w.pending) for w in workers))
        s["local_prefill"].append(sum(len(w.local_q) + (w.local_active is not None) for w in workers))
        s["decode_running"].append(sum(len(w.running) for w in workers))
        if self._more or self._open:
            self.events.at(now + self._sample_every, self._sample)

    def _gateway_start(self, req: SimRequest | None, now: float, server: Server) -> None:
        if req is not None:  # None: a finished request's closing work
            self.m.wait_sum_ms["gateway"] += now - req.t_mark
            self.m.wait_n["gateway"] += 1

    def _gateway_done(self, req: SimRequest | None, now: float, server: Server) -> None:
        if req is not None:
            self._admit(req, now)

    # ---- admission: the gateway's decision -----------------------------------------

    def snapshot(self, now: float) -> StatsSnapshot:
        """What the gateway would hold now: every worker's report and its own remote requests in flight."""
        reports = [w.report() for w in self.decode]
        reports += [s.report(now) for s in self.prefill.servers]
        reports += [s.report(now) for s in self.encoders.servers]
        if self.cpu is not None:   # one shared host: every worker computes on all its cores, as they report it
            busy, cpus = self.cpu.busy_share(now), tuple(range(self.cpu.cores))
            for r in reports:
                r.host_id, r.cpus, r.cpus_busy = SIM_HOST, cpus, busy
        return StatsSnapshot(tuple(reports), self.kv_transfers, self.kv_bytes)

    def loads(self, req: SimRequest, now: float, *, own_transfer: bool = False) -> StageLoads:
        """The policy's inputs for ``req`` now (``own_transfer``: its failed transfer left out of the link)."""
        snap = self.snapshot(now)
        return stage_loads(snap.less_transfer(req.kv_bytes) if own_transfer else snap, req.shape, self.cm,
                           self._local_chunks)

    def decide(self, shape: RequestShape, snapshot: StatsSnapshot, left_ms: float,
                pressure: Pressure | None = None) -> Admission:
        """The gateway's verdict on ``snapshot`` (``gateway.admission.GatewayAdmission.admit``), or
        with admission off the placement alone (refused only when no decode worker has the room)."""
        cfg, loads = self.cfg, stage_loads(snapshot, shape, self.cm, self._local_chunks)
        chunks, local = self._transfer_chunks, self._local_chunks
        if cfg.admission:
            return admit(shape, loads, self.cm, cfg.placement, left_ms, cfg.itl_slo_ms, pressure=pressure,  # type: ignore[arg-type]
                         transfer_chunk_tokens=chunks, local_chunk_tokens=local)
        decision = choose_placement(shape, loads, self.cm, cfg.placement, left_ms, cfg.itl_slo_ms,  # type: ignore[arg-type]
                                    transfer_chunk_tokens=chunks, local_chunk_tokens=local)
        if decision is None:
            return Admission(False, None, "no_decode_capacity", 1)
        return Admission(True, decision, decision.reason, 0)

    def _admit(self, req: SimRequest, now: float) -> None:
        pressure = self.pressure.inputs(now) if self.pressure is not None else None
        verdict = self.decide(req.shape, self.snapshot(now), req.deadline - now, pressure)
        decision = verdict.decision
        if decision is None:
            self.m.rejected += 1
            self.m.rejections[verdict.reason] += 1
            self._retire(now)
            return
        self.m.placements[decision.placement] += 1
        self.m.reasons[decision.reason] += 1
        req.worker = self.decode_by_name[decision.decode_worker]
        req.prefill_server = None if decision.prefill_worker is None else self.prefill_by_name[decision.prefill_worker]
        if req.prefill_server is not None:
            req.kv_bytes = float(self.cm.kv_bytes(req.tokens))
            self.kv_transfers += 1
            self.kv_bytes += req.kv_bytes
        if self.pressure is not None:
            req.ahead = self.pressure.waiting
            self.pressure.admitted(now)
            # None: the prediction could not price the queue, so its first token teaches no overrun
            req.t_admit = now
            req.model_ms = decision.estimates["ttft_ms"] + verdict.backlog_ms if pressure.backlog_priced() else None
        self._encode(req, now)

    def _encode(self, req: SimRequest, now: float) -> None:
        """To the encoder when the request has images that cost encoder time, else straight to its placement."""
        if req.images and self.encoders.servers:
            encode_ms = self.truth.encode_ms(req.new_image_tokens, req.cached)
            if req.cached < req.images:
                encode_ms += self.cfg.service.encode_request_ms
            if encode_ms > 0.0:  # all cache hits at 0 ms: the gateway never calls the encoder
                req.t_mark = now
                self.encoders.least_loaded(now).submit(req, encode_ms, now, req.new_image_tokens)
                return
        self._start(req, now)

    def _encode_start(self, req: SimRequest, now: float, server: Server) -> None:
        self.m.wait_sum_ms["encoder"] += now - req.t_mark
        self.m.wait_n["encoder"] += 1

    def _encode_done(self, req: SimRequest, now: float, server: Server) -> None:
        self._start(req, now)

    def _start(self, req: SimRequest, now: float) -> None:
        """Run the admitted placement: the remote path, or a colocated prefill on ``req.worker``."""
        if req.prefill_server is not None:
            self.remote.submit(req, req.prefill_server, now)
            return
        worker = req.worker
        req.local = True
        req.prefill_ms = self.truth.prefill_ms(req.tokens)
        if self._local_chunks is not None:  # chunk by chunk, each riding a step
            req.local_chunks = list(self.truth.chunk_times(req.tokens, self._local_chunks))
            req.prefill_ms = sum(req.local_chunks)
        worker.claim_local(req)
        req.t_mark = now
        # the worker's own work for it (embedding fetch, its stream) comes first, on its RPC threads
        self.after(now, self.cfg.service.decode_request_ms, self._fetched, req, group=worker)

    @staticmethod
    def _fetched(now: float, req: SimRequest) -> None:
        req.worker.queue_local(req, now)

    # ---- retirement and the decode workers' callbacks ------------------------------

    def _retire(self, now: float) -> None:
        self._open -= 1
        self._last_retired = now

    def _off_the_link(self, req: SimRequest) -> None:
        if req.kv_bytes:
            self.kv_transfers -= 1
            self.kv_bytes = self.kv_bytes - req.kv_bytes if self.kv_transfers else 0.0
            req.kv_bytes = 0.0

    def failed(self, req: SimRequest, now: float) -> None:
        """A request that fails without a first token (its transfer could not recover)."""
        self._off_the_link(req)
        if self.pressure is not None:
            late = None if req.model_ms is None else now - req.t_admit - req.model_ms
            self.pressure.left(now, got_first_token=False, overrun_ms=late, ahead=req.ahead)
        self.m.failed += 1
        self._retire(now)

    def reservation_granted(self, req: SimRequest, now: float) -> None:
        self.remote.reservation_granted(req, now)

    def local_prefill_started(self, req: SimRequest, now: float) -> None:
        self.m.wait_sum_ms["local_prefill"] += now - req.t_mark
        self.m.wait_n["local_prefill"] += 1

    def first_token(self, req: SimRequest, t: float) -> None:
        req.t_first = t
        self.m.ttft_ms.append(t - req.arrival)
        self._off_the_link(req)
        if self.pressure is not None:
            late = None if req.model_ms is None else t - req.t_admit - req.model_ms
            self.pressure.left(t, got_first_token=True, overrun_ms=late, ahead=req.ahead, ttft_ms=t - req.t_admit)

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
