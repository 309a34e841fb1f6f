"""The remote path of a simulated request: prefill pool -> KV link -> decode worker, and its failures.

Lifecycle, as queues (each hop is a state change):

    prefill worker's queue -> prefill (reserves a slot on the decode worker X when it
    starts) -> KV link (after prefill, or chunk by chunk as each is ready) -> X's own work
    for it (``decode_request_ms``) -> X lands it: the prefill's first token goes out, it
    joins X's batch at the next step boundary

A failed transfer (``failure_prob`` per attempt, drawn when its last byte lands) asks
``runtime.policy.failure_policy.on_transfer_failure``, with the simulator's stats snapshot
as the gateway would ask it: retry into the held reservation / another decode worker /
re-prefill / fail. Released state is counted in ``cleanups``.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from runtime.policy.failure_policy import on_transfer_failure
from sim.kv_link import KvLink
from sim.request import SimRequest
from sim.server_pool import Server

if TYPE_CHECKING:
    from sim.simulator import Simulator


class RemotePath:
    """Owns the prefill pool's jobs and the KV link's flows; the ``Simulator`` owns the rest."""

    __slots__ = ("sim", "link", "_chunks", "_fail_rng")

    def __init__(self, sim: Simulator) -> None:
        cfg, p = sim.cfg, sim.cfg.service
        self.sim = sim
        self.link = KvLink(sim.events, cfg.kv_links, p.link_bytes_per_s, p.link_setup_ms, cfg.link_concurrency,
                           self._flow_done)
        self._chunks = cfg.chunk_tokens if cfg.transfer == "chunked" else None
        self._fail_rng = random.Random(f"epd-sim/{cfg.seed}/failures")

    def submit(self, req: SimRequest, server: Server, now: float) -> None:
        """To ``server``'s queue; its slot on ``req.worker`` is reserved when the prefill starts."""
        truth, chunk = self.sim.truth, self._chunks
        overhead = self.sim.cfg.service.prefill_request_ms  # before the first pass (embedding fetch, RPCs)
        if chunk is not None and req.tokens > chunk:
            ready = truth.chunk_ready_ms(req.tokens, chunk)
            req.chunk_bytes = [truth.kv_bytes(c) for c in truth.chunk_sizes(req.tokens, chunk)]
            service = ready[-1] + overhead
        else:
            req.chunk_bytes = None
            service = truth.prefill_ms(req.tokens) + overhead
        req.prefill_done, req.chunks_ready, req.chunks_sent = False, 0, 0
        req.t_mark = now
        server.submit(req, service, now, req.tokens)

    def prefill_started(self, req: SimRequest, now: float, server: Server) -> None:
        sim = self.sim
        sim.m.wait_sum_ms["prefill"] += now - req.t_mark
        sim.m.wait_n["prefill"] += 1
        if req.chunk_bytes is not None:
            start = now + sim.cfg.service.prefill_request_ms
            for t in sim.truth.chunk_ready_ms(req.tokens, self._chunks)[:-1]:  # type: ignore[arg-type]
                sim.events.at(start + t, self._chunk_ready, req)
        if not req.reserved:
            req.t_reserve = now
            req.worker.reserve(req, now)

    def prefill_done(self, req: SimRequest, now: float, server: Server) -> None:
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
        m = self.sim.m
        m.wait_sum_ms["kv_reservation"] += now - req.t_reserve
        m.wait_n["kv_reservation"] += 1
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
        self.link.send(req, self.sim.truth.kv_bytes(req.tokens), now)

    @staticmethod
    def _new_attempt(req: SimRequest, now: float, flows: int) -> None:
        req.attempts += 1
        req.flows, req.landed, req.t_send = flows, 0, now

    def _flow_done(self, req: SimRequest, now: float) -> None:
        req.landed += 1
        if req.landed < req.flows:
            return
        sim = self.sim
        sim.m.transfers += 1
        if sim.cfg.failure_prob and self._fail_rng.random() < sim.cfg.failure_prob:
            self._transfer_failed(req, now)
            return
        sim.m.wait_sum_ms["link"] += now - req.t_send
        sim.m.wait_n["link"] += 1
        req.t_mark = now
        # the decode worker's own work for it (reserve, KV receive and insert, its stream) runs on
        # its RPC threads, beside its step loop; then its first token goes out
        sim.after(now, sim.cfg.service.decode_request_ms, self._received, req, group=req.worker)

    @staticmethod
    def _received(now: float, req: SimRequest) -> None:
        req.worker.land(req, now)

    def _transfer_failed(self, req: SimRequest, now: float) -> None:
        sim, worker = self.sim, req.worker
        m, cfg = sim.m, sim.cfg
        m.transfer_failures += 1
        m.cleanups["partial_transfer"] += 1  # chunk / flow bookkeeping of the failed attempt
        held = cfg.reservation_held_on_failure
        if not held:
            self._release(req, now)
        loads = sim.loads(req, now, own_transfer=True)
        action = on_transfer_failure(req.deadline - now, req.attempts, req.shape, sim.cm, loads, worker.name,
                                     reservation_held=held, max_attempts=cfg.max_transfer_attempts)
        m.failure_actions[action.kind] += 1
        if action.kind == "retry":
            self._send_full(req, now)
            return
        if req.reserved:
            self._release(req, now)
        if action.kind == "other_decode":
            req.worker = max((w for w in sim.decode if w is not worker), key=lambda w: w.free_slots())
            req.resend_full = True
            req.t_reserve = now
            req.worker.reserve(req, now)
        elif action.kind == "reprefill":
            req.resend_full = False
            self.submit(req, sim.prefill.least_loaded(now), now)
        else:
            sim.failed(req, now)

    def _release(self, req: SimRequest, now: float) -> None:
        req.reserved = False
        self.sim.m.cleanups["reservation"] += 1
        req.worker.release(req, now)
