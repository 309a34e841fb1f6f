"""One decode worker: continuous batching with a slot limit, plus optional local prefill.

Lifecycle of a sequence on this worker, as queues:

    remote:  prealloc (waiting for a slot) -> reserved (KV in flight) -> pending
             (KV landed, waits for the next step boundary) -> running -> finished
    local:   local_q -> prefilling (holds a slot; stalls the batch) -> running -> finished
             (the shortest queued prompt next, a deadline at risk first: ``_next_local``)

Invariants:
- membership changes only at step boundaries; between two boundaries all running
  sequences advance one token per step of ``step_base + step_slope x batch`` ms,
  so a sequence joining at step counter ``s`` with ``n`` tokens to make leaves at
  ``s + n``. The worker therefore schedules one event per membership change, not
  one per step.
- ``running + reserved + prefilling <= slots`` (and KV tokens <= ``kv_tokens``).
- ``claimed == running + reserved + prefilling + len(prealloc) + len(local_q) + arriving``:
  a request claims a slot from ``reserve`` / ``claim_local`` until it finishes or its
  reservation is released; moving between those queues leaves ``claimed`` unchanged
  (``arriving``: colocated requests placed here whose own work runs before they queue).
- a whole-prompt local prefill runs between two steps and stalls every running
  sequence: their next gap is ``prefill + step``. After one, at least one decode
  step runs before the next prefill (prefill and decode alternate). A chunked
  local prefill instead fuses one chunk into each step: gap ``chunk + step``, less
  ``fused_saving_ms`` on the first chunk (one packed forward: the prefill's fixed cost,
  the same forward overhead as the step's, is paid once).
- a remote request's first token is the prefill's: it is emitted when the KV lands
  (as the real decode worker emits it on insertion), and the batch makes the other
  ``output - 1``; its first gap runs from landing to the end of its first step. A
  one-token answer finishes at landing and never joins the batch.
- ITL: every inter-token gap is counted in ``hist`` (gap in 1/100 ms -> count); a request's
  ITL SLO holds when no gap it saw exceeded ``itl_slo_ms``, tracked with the
  ``breach`` counter (a request snapshots it on joining and compares on leaving).
  Plain gaps (one step, nothing stalled) are counted in ``gaps_n`` while the step
  length stays ``gaps_d`` and filed into ``hist`` when it changes and by
  ``flush_gaps()``, which the owner calls before reading ``hist``.
"""

from __future__ import annotations

import math
from bisect import insort
from collections import deque
from typing import Any

from runtime.policy.loads import PREFILL_AT_RISK_FACTOR
from runtime.policy.worker_stats import Role, WorkerReport
from sim.events import EventQueue

IDLE, STEPPING, PREFILL, CHUNK = 0, 1, 2, 3


class DecodeWorker:
    __slots__ = (
        "index", "name", "_events", "_host", "slots", "kv_cap", "kv_used", "base", "slope", "slo", "hist",
        "mode", "version", "next_t", "t0", "d", "steps", "running", "reserved", "prealloc",
        "pending", "fresh", "joined_local", "local_q", "local_tokens", "local_chunk", "local_active", "just_prefilled",
        "stall_extra", "stall_n", "breach", "busy_ms", "_busy_since", "_report", "gaps_d", "gaps_n", "claimed",
        "join_wait_ms", "joins", "per_step", "fused_saving_ms", "arriving",
    )

    def __init__(
        self, index: int, events: EventQueue, host: Any, *, slots: int, kv_tokens: int | None,
        step_base_ms: float, step_ms_per_seq: float, itl_slo_ms: float, hist: dict[int, int],
        local_chunk_tokens: int = 1, fused_saving_ms: float = 0.0,
    ) -> None:
        self.index, self.name = index, f"decode-{index}"
        self._events, self._host = events, host
        self.slots, self.kv_cap, self.kv_used = slots, kv_tokens, 0
        self.base, self.slope, self.slo, self.hist = step_base_ms, step_ms_per_seq, itl_slo_ms, hist
        self.local_chunk = local_chunk_tokens  # tokens per local chunk (when ``req.local_chunks`` is set)
        self.fused_saving_ms = fused_saving_ms  # a first chunk riding a step does not pay the prefill's fixed cost
        self.mode, self.version, self.next_t = IDLE, 0, math.inf
        self.t0, self.d, self.steps = 0.0, 0.0, 0
        self.running: list[tuple[int, int, Any]] = []  # (finish step, rid, req), sorted: [0] finishes first
        self.reserved = 0
        self.claimed = 0  # slots running, reserved, prefilling or promised to queued requests
        self.arriving = 0  # colocated requests claimed here, not queued yet
        self.prealloc: deque[Any] = deque()
        self.pending: list[Any] = []
        self.fresh: list[Any] = []  # joined remotely, first token not yet out
        self.joined_local: list[Any] = []  # joined after a whole local prefill, before the next step
        self.local_q: deque[Any] = deque()
        self.local_tokens = 0  # prompt tokens of claimed colocated requests not yet prefilled
        self.local_active: Any = None
        self.just_prefilled = False
        self.stall_extra, self.stall_n = 0.0, 0
        self.breach = 0
        self.gaps_d, self.gaps_n = 0.0, 0  # plain gaps of gaps_d ms not yet filed in hist
        self.busy_ms, self._busy_since = 0.0, 0.0
        self.join_wait_ms, self.joins = 0.0, 0  # remote requests: landing -> joining the batch
        self.per_step = False  # True: one event per step (a shared host needs a core per step)
        self._report = WorkerReport(Role.DECODE, self.name, max_batch=slots, free_blocks=kv_tokens,
                                    total_blocks=kv_tokens or 0, block_size=1)

    # ---- capacity ------------------------------------------------------------------

    def _fits(self, req: Any) -> bool:
        used = len(self.running) + self.reserved + (self.local_active is not None)
        return used < self.slots and (self.kv_cap is None or self.kv_used + req.kv_need <= self.kv_cap)

    def free_slots(self) -> int:
        """Slots not running, reserved, prefilling or promised to queued requests."""
        return max(0, self.slots - self.claimed)

    # ---- remote path ---------------------------------------------------------------

    def reserve(self, req: Any, now: float) -> None:
        """Ask for a slot; ``host.reservation_granted(req, now)`` fires when it is held."""
        self.claimed += 1
        if not self.prealloc and self._fits(req):
            self._grant(req, now)
        else:
            self.prealloc.append(req)

    def _grant(self, req: Any, now: float) -> None:
        self.reserved += 1
        self.kv_used += req.kv_need
        self._host.reservation_granted(req, now)

    def _grant_waiting(self, now: float) -> None:
        queue = self.prealloc
        while queue and self._fits(queue[0]):
            self._grant(queue.popleft(), now)

    def release(self, req: Any, now: float) -> None:
        """Give back a granted reservation (transfer failed or request moved)."""
        self.reserved -= 1
        self.claimed -= 1
        self.kv_used -= req.kv_need
        self._grant_waiting(now)
        if self.local_q:
            self.wake(now)

    def land(self, req: Any, now: float) -> None:
        """The request's KV (and the prefill's first token, emitted now) is here.

        It joins the batch at the next step boundary for its ``decode_tokens`` more; with
        none left (a one-token answer) it finishes here and frees its reservation.
        """
        self._host.first_token(req, now)
        if req.decode_tokens > 0:
            self.pending.append(req)
            self.wake(now)
            return
        self.reserved -= 1
        self.claimed -= 1
        self.kv_used -= req.kv_need
        req.breach_base = self.breach
        self._host.finished(req, now, self)
        self._grant_waiting(now)
        if self.local_q:
            self.wake(now)

    # ---- local path ----------------------------------------------------------------

    def claim_local(self, req: Any) -> None:
        """A colocated request (``req.prefill_ms``, ``req.local_chunks``) is placed here: its slot
        and its prefill count from now, before its own work lets it queue (``queue_local``)."""
        self.claimed += 1
        self.arriving += 1
        self.local_tokens += req.tokens

    def queue_local(self, req: Any, now: float) -> None:
        """The claimed request queues for local prefill."""
        self.arriving -= 1
        self.local_q.append(req)
        self.wake(now)

    # ---- scheduling ----------------------------------------------------------------

    def wake(self, now: float) -> None:
        """New work arrived: start now if idle, else make sure we stop at the next boundary."""
        if self.mode == IDLE:
            self._busy_since = now
            self._boundary(now)
        elif self.mode == STEPPING:
            tb = self.t0 + math.ceil((now - self.t0) / self.d - 1e-9) * self.d
            if tb < self.next_t - 1e-9:
                self._schedule(tb)

    def _schedule(self, t: float) -> None:
        self.version += 1
        self.next_t = t
        self._events.at(t, self._on_event, self.version)

    def _on_event(self, now: float, version: int) -> None:
        if version != self.version:
            return
        if self.mode == STEPPING:
            self._advance(now)
        elif self.mode == PREFILL:
            self._local_done(now)
        else:  # CHUNK: one chunk (+ one decode step when the batch is not empty) finished
            if self.running:
                self._advance(now)
            req = self.local_active
            self.local_tokens -= min(self.local_chunk, req.tokens - req.chunk_i * self.local_chunk)
            req.chunk_i += 1
            if req.chunk_i < len(req.local_chunks):
                if self.pending:
                    self._join_pending(now)
                self._start_chunk(now)
                return
            self._local_done(now)
            self.just_prefilled = False  # chunks already interleaved with steps
        self._boundary(now)

    def _boundary(self, now: float) -> None:
        """At a step boundary with nothing computing: admit, then prefill or step or idle."""
        if self.pending:
            self._join_pending(now)
        queue = self.local_q
        nxt = self._next_local(now) if queue else None
        if nxt is not None and (not self.just_prefilled or not self.running) and self._fits(nxt):
            queue.remove(nxt)   # identity: requests compare as objects
            self._start_local(nxt, now)
            return
        if self.running:
            self.mode = STEPPING
            self.d = d = self.base + self.slope * len(self.running)
            steps_to_next = 1 if self.per_step or (nxt is not None and self._fits(nxt)) else self.running[0][0] - self.steps
            self.t0 = now
            self._schedule(now + steps_to_next * d)
        else:
            self.mode = IDLE
            self.version += 1
            self.next_t = math.inf
            self.busy_ms += now - self._busy_since

    def _next_local(self, now: float) -> Any:
        """The queued colocated prompt to prefill next, in the real worker's order
        (``decode_svc/prefill_order.py``): the shortest, unless some would miss their deadline
        if every queued prompt went first (then the earliest deadline of those). One prompt runs
        at a time here, so the order applies when the next one starts."""
        queue = self.local_q
        if len(queue) == 1:
            return queue[0]
        drain = PREFILL_AT_RISK_FACTOR * sum(r.prefill_ms for r in queue)
        at_risk = [r for r in queue if r.deadline - now < drain]
        if at_risk:
            return min(at_risk, key=_deadline)
        return min(queue, key=_tokens)

    def _join_pending(self, now: float) -> None:
        for req in self.pending:
            insort(self.running, (self.steps + req.decode_tokens, req.rid, req))
            req.breach_base = self.breach
            self.fresh.append(req)
            self.join_wait_ms += now - req.t_first
        self.joins += len(self.pending)
        self.reserved -= len(self.pending)
        self.pending.clear()

    def _start_local(self, req: Any, now: float) -> None:
        self.local_active = req
        self.kv_used += req.kv_need
        self.joined_local.clear()  # earlier local joiners are plain residents from here on
        self._host.local_prefill_started(req, now)
        if req.local_chunks:
            req.chunk_i = 0
            self._start_chunk(now)
        else:
            self.mode = PREFILL
            self.stall_extra, self.stall_n = req.prefill_ms, len(self.running) - len(self.fresh)
            self._schedule(now + req.prefill_ms)

    def _start_chunk(self, now: float) -> None:
        req = self.local_active
        chunk_ms = req.local_chunks[req.chunk_i]
        if self.running and req.chunk_i == 0:  # rides a step: one forward, its fixed cost paid once
            chunk_ms = max(0.0, chunk_ms - self.fused_saving_ms)
        self.mode = CHUNK
        self.stall_extra, self.stall_n = chunk_ms, len(self.running) - len(self.fresh)
        if self.running:
            self.d = self.base + self.slope * len(self.running)
            self.t0 = now + chunk_ms
            self._schedule(now + chunk_ms + self.d)
        else:
            self._schedule(now + chunk_ms)

    def _local_done(self, now: float) -> None:
        req, self.local_active = self.local_active, None
        if not req.local_chunks:  # chunks count themselves off as they finish
            self.local_tokens -= req.tokens
        self._host.first_token(req, now)
        self.just_prefilled = True  # a decode step runs before the next whole prefill
        if req.decode_tokens > 0:
            insort(self.running, (self.steps + req.decode_tokens, req.rid, req))
            req.breach_base = self.breach
            self.joined_local.append(req)
        else:  # a one-token answer: the prefill made it, no gaps to judge
            req.breach_base = self.breach
            self.kv_used -= req.kv_need
            self.claimed -= 1
            self._host.finished(req, now, self)
            self._grant_waiting(now)

    def _advance(self, now: float) -> None:
        """Account the steps since ``t0``: gaps, first tokens, breaches, completions."""
        d = self.d
        k = int((now - self.t0) / d + 0.5)
        if k <= 0:
            return
        running, fresh, stalled = self.running, self.fresh, self.stall_n
        if stalled:
            gap = d + self.stall_extra
            key = int(gap * 100.0 + 0.5)
            self.hist[key] = self.hist.get(key, 0) + stalled
            if gap > self.slo:
                self.breach += 1
                for r in fresh:
                    r.breach_base += 1
                for r in self.joined_local:
                    r.breach_base += 1
            self.stall_n = 0
        self.stall_extra = 0.0
        b = len(running)
        plain = b - len(fresh) - stalled + (k - 1) * b
        if plain:
            if d != self.gaps_d:
                self.flush_gaps()
                self.gaps_d = d
            self.gaps_n += plain
            if d > self.slo:
                self.breach += 1
                if k == 1:
                    for r in fresh:
                        r.breach_base += 1
        if fresh:  # each one's first gap: from its landing (first token) to its first step's token
            end, hist, slo = self.t0 + d, self.hist, self.slo
            for r in fresh:
                gap = end - r.t_first
                key = int(gap * 100.0 + 0.5)
                hist[key] = hist.get(key, 0) + 1
                if gap > slo:
                    r.breach_base = -1  # never equal to the counter: this request saw a breach
            fresh.clear()
        if self.joined_local:
            self.joined_local.clear()
        self.just_prefilled = False
        self.steps = steps = self.steps + k
        self.t0 = now
        if running and running[0][0] <= steps:
            n = 1  # finished: every (finish <= steps, rid, req) at the front, usually one
            while n < len(running) and running[n][0] <= steps:
                n += 1
            done = running[:n]
            del running[:n]
            self.claimed -= n
            for _, _, req in done:
                self.kv_used -= req.kv_need
                self._host.finished(req, now, self)
            if self.prealloc:
                self._grant_waiting(now)

    # ---- observation ---------------------------------------------------------------

    def flush_gaps(self) -> None:
        """File the plain gaps counted since the last flush (each ``gaps_d`` ms) into ``hist``."""
        if self.gaps_n:
            key = int(self.gaps_d * 100.0 + 0.5)
            self.hist[key] = self.hist.get(key, 0) + self.gaps_n
            self.gaps_n = 0

    def busy_until(self, end: float) -> float:
        return self.busy_ms + (end - self._busy_since if self.mode != IDLE else 0.0)

    def report(self) -> WorkerReport:
        """What this worker would report in its ``Stats`` (``runtime.policy.worker_stats``), as
        the real one counts it: the batch, the claimed slots not in it, the colocated prompt
        tokens still to prefill, the free KV. One object per worker, refreshed in place."""
        r, running = self._report, len(self.running)
        r.running_seqs, r.queue_depth, r.in_flight = running, self.claimed - running, self.claimed
        r.queued_prefill_tokens = self.local_tokens
        if self.kv_cap is not None:
            r.free_blocks = self.kv_cap - self.kv_used
        return r


def _deadline(req: Any) -> float:
    return req.deadline


def _tokens(req: Any) -> int:
    return req.tokens
