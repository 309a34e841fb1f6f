"""A pool of single-request servers, each with its own FIFO queue (encoder, prefill).

Lifecycle of a job: ``submit`` -> the server's queue -> ``on_start(req, now, server)``
-> ``service_ms`` later ``on_done(req, now, server)``. The caller picks the server
(the simulator routes to the one with the least backlog, as the gateway would).
Invariant: ``backlog_ms(now)`` is exactly the time until a job submitted now
would start.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from sim.events import EventQueue
from sim.host_cpu import HostCpu

Hook = Callable[[Any, float, "Server"], None]


class Server:
    __slots__ = ("index", "name", "_events", "_on_start", "_on_done", "queue", "queued_ms", "busy", "busy_until", "busy_ms")

    def __init__(self, index: int, name: str, events: EventQueue, on_start: Hook, on_done: Hook) -> None:
        self.index, self.name = index, name
        self._events, self._on_start, self._on_done = events, on_start, on_done
        self.queue: deque[tuple[Any, float]] = deque()
        self.queued_ms = 0.0  # service time of queued (not started) jobs
        self.busy = False
        self.busy_until = 0.0
        self.busy_ms = 0.0

    def backlog_ms(self, now: float) -> float:
        return self.queued_ms + (self.busy_until - now if self.busy else 0.0)

    def submit(self, req: Any, service_ms: float, now: float) -> None:
        if self.busy:
            self.queue.append((req, service_ms))
            self.queued_ms += service_ms
        else:
            self._start(req, service_ms, now)

    def _start(self, req: Any, service_ms: float, now: float) -> None:
        self.busy = True
        self.busy_until = now + service_ms
        self.busy_ms += service_ms
        self._events.at(self.busy_until, self._done, req)
        self._on_start(req, now, self)

    def _done(self, now: float, req: Any) -> None:
        self.busy = False
        if self.queue:
            nxt, service_ms = self.queue.popleft()
            self.queued_ms -= service_ms
            if not self.queue:
                self.queued_ms = 0.0  # no float drift when the queue empties
            self._start(nxt, service_ms, now)
        self._on_done(req, now, self)


class ServerPool:
    __slots__ = ("name", "servers")

    def __init__(
        self, name: str, n: int, events: EventQueue, on_start: Hook, on_done: Hook, cpu: HostCpu | None = None
    ) -> None:
        """``n`` servers, each with its own processor, or (with ``cpu``) taking turns on a shared host."""
        self.name = name
        if cpu is None:
            self.servers = [Server(i, f"{name}-{i}", events, on_start, on_done) for i in range(n)]
        else:
            self.servers = [SharedServer(i, f"{name}-{i}", events, on_start, on_done, cpu) for i in range(n)]

    def least_loaded(self, now: float) -> Server:
        return min(self.servers, key=lambda s: s.backlog_ms(now))

    def queued(self) -> int:
        return sum(len(s.queue) for s in self.servers)

    def busy_ms(self, end: float) -> float:
        """Total busy time, clipped at ``end`` for jobs still running."""
        return sum(s.busy_ms - (max(0.0, s.busy_until - end) if s.busy else 0.0) for s in self.servers)


class SharedServer(Server):
    """A ``Server`` on a shared host (``sim.host_cpu``): each job's service is work that
    runs at the host's current speed, so it takes at least its idle time.

    ``busy_ms`` sums work, not wall time; ``backlog_ms`` cannot see the host's slowdown,
    so it is a lower bound here.
    """

    __slots__ = ("_cpu",)

    def __init__(self, index: int, name: str, events: EventQueue, on_start: Hook, on_done: Hook, cpu: HostCpu) -> None:
        super().__init__(index, name, events, on_start, on_done)
        self._cpu = cpu

    def _start(self, req: Any, service_ms: float, now: float) -> None:
        self.busy = True
        self.busy_until = now + service_ms  # at idle speed: the real end depends on the host
        self.busy_ms += service_ms
        self._cpu.run(now, service_ms, self._done, req)
        self._on_start(req, now, self)
