"""The KV link as a schedulable resource: setup, a FIFO queue, then shared bandwidth.

A transfer (one flow) spends ``setup_ms`` in handshake (no bandwidth used), then
waits in the pipe's FIFO queue until fewer than ``max_active`` flows are moving
(0: no limit), then its bytes flow; the ``n`` moving flows each get
``bandwidth / n`` (processor sharing). ``max_active = 1`` serializes transfers,
which minimizes mean transfer latency; no limit shares the pipe among all.

Bookkeeping uses virtual time ``v`` (bytes served to every moving flow so far):
a flow that starts moving at ``v0`` with ``b`` bytes finishes when ``v`` reaches
``v0 + b``, so each start or finish costs O(log n). With several pipes a new
flow takes the least-busy one.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

from sim.events import EventQueue

Done = Callable[[Any, float], None]


class Pipe:
    __slots__ = (
        "_events", "_on_done", "_bw", "setup_ms", "max_active", "_flows", "_seq", "_v", "_last", "_version",
        "in_setup", "waiting", "busy_ms", "_busy_since", "transferred_bytes",
        "flows_done", "delay_ms",
    )

    def __init__(self, events: EventQueue, bytes_per_s: float, setup_ms: float, max_active: int, on_done: Done) -> None:
        self._events, self._on_done = events, on_done
        self._bw = bytes_per_s / 1000.0  # bytes per ms
        self.setup_ms, self.max_active = setup_ms, max_active
        self._flows: list[tuple[float, int, Any, float, float]] = []  # heap of (finish_v, seq, flow, nbytes, ready_at)
        self._seq = itertools.count()
        self._v = self._last = 0.0
        self._version = 0
        self.in_setup = 0
        self.waiting: deque[tuple[Any, float, float]] = deque()  # (flow, nbytes, ready_at)
        self.busy_ms = self._busy_since = 0.0
        self.transferred_bytes = 0.0
        self.flows_done = 0
        self.delay_ms = 0.0  # sum over flows of (setup end -> last byte) minus the flow's own bytes / bandwidth

    @property
    def active(self) -> int:
        """Flows in setup, queued or moving."""
        return len(self._flows) + self.in_setup + len(self.waiting)

    def start(self, flow: Any, nbytes: float, now: float) -> None:
        self.in_setup += 1
        self._events.at(now + self.setup_ms, self._setup_done, (flow, nbytes))

    def _setup_done(self, now: float, arg: tuple[Any, float]) -> None:
        flow, nbytes = arg
        self.in_setup -= 1
        if self.max_active and len(self._flows) >= self.max_active:
            self.waiting.append((flow, nbytes, now))
            return
        self._advance(now)
        self._move(flow, nbytes, now, now)
        self._reschedule(now)

    def _advance(self, now: float) -> None:
        if self._flows and now > self._last:
            self._v += (now - self._last) * self._bw / len(self._flows)
        self._last = now

    def _move(self, flow: Any, nbytes: float, ready_at: float, now: float) -> None:
        if not self._flows:
            self._busy_since = now
        heapq.heappush(self._flows, (self._v + nbytes, next(self._seq), flow, nbytes, ready_at))

    def _reschedule(self, now: float) -> None:
        self._version += 1
        if self._flows:
            t = now + (self._flows[0][0] - self._v) * len(self._flows) / self._bw
            self._events.at(t, self._complete, self._version)

    def _complete(self, now: float, version: int) -> None:
        if version != self._version:
            return
        self._advance(now)
        flows, done = self._flows, []
        # This event was scheduled for the head flow's finish: it is done whatever the
        # float rounding says; others finishing within a byte (or 1e-9 relative) go too.
        limit = self._v + (1.0 if self._v < 1e9 else 1e-9 * self._v)
        if flows[0][0] > limit:
            limit = flows[0][0]
        while flows and flows[0][0] <= limit:
            _, _, flow, nbytes, ready_at = heapq.heappop(flows)
            self.transferred_bytes += nbytes
            self.flows_done += 1
            self.delay_ms += now - ready_at - nbytes / self._bw
            done.append(flow)
        if not flows:
            self.busy_ms += now - self._busy_since
            self._v = 0.0  # restart virtual time: keeps the floats small
        while self.waiting and (not self.max_active or len(flows) < self.max_active):
            flow, nbytes, ready_at = self.waiting.popleft()
            self._move(flow, nbytes, ready_at, now)
        self._reschedule(now)
        for flow in done:
            self._on_done(flow, now)

    def busy_until(self, end: float) -> float:
        return self.busy_ms + (end - self._busy_since if self._flows else 0.0)


class KvLink:
    """``n`` independent pipes; ``on_done(flow, now)`` fires when a flow's last byte lands."""

    __slots__ = ("pipes", "send")

    def __init__(self, events: EventQueue, n: int, bytes_per_s: float, setup_ms: float, max_active: int, on_done: Done) -> None:
        self.pipes = [Pipe(events, bytes_per_s, setup_ms, max_active, on_done) for _ in range(n)]
        # send(flow, nbytes, now): start a flow on the least-busy pipe
        self.send: Callable[[Any, float, float], None] = self._send_least_busy
        if n == 1:  # the usual single pipe: no choice to make, call it directly
            self.send = self.pipes[0].start

    def least_busy(self) -> Pipe:
        return min(self.pipes, key=lambda p: p.active)

    def _send_least_busy(self, flow: Any, nbytes: float, now: float) -> None:
        self.least_busy().start(flow, nbytes, now)

    def active(self) -> int:
        return sum(p.active for p in self.pipes)

    def transferred_bytes(self) -> float:
        return sum(p.transferred_bytes for p in self.pipes)

    def busy_ms(self, end: float) -> float:
        return sum(p.busy_until(end) for p in self.pipes)

    def mean_delay_ms(self) -> tuple[float, int]:
        """(total queueing + sharing delay over all flows, flows finished)."""
        return sum(p.delay_ms for p in self.pipes), sum(p.flows_done for p in self.pipes)
