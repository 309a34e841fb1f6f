"""A pool of single-request servers, each with its own FIFO queue (encoder, prefill).

Lifecycle of a job: ``submit`` -> the server's queue -> ``on_start(req, now, server)``
-> ``service_ms`` later ``on_done(req, now, server)``. The caller picks the server
(the simulator routes to the one with the least backlog, as the gateway would).
Invariant: ``backlog_ms(now)`` is exactly the time until a job submitted now
would start. A job may carry ``tokens`` (a prompt's; an encoder's job, its images' placeholder
tokens), which ``report`` counts as a prefill worker counts its queued prompt tokens (an encoder,
its queued image tokens).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from runtime.policy.worker_stats import Role, WorkerReport
from sim.events import EventQueue

Hook = Callable[[Any, float, "Server"], None]


class Server:
    __slots__ = ("index", "name", "_events", "_on_start", "_on_done", "queue", "queued_ms", "queued_tokens", "busy",
                 "busy_until", "busy_ms", "_tokens", "_service_ms", "_report")

    def __init__(self, index: int, name: str, events: EventQueue, on_start: Hook, on_done: Hook,
                 role: Role | None = None) -> None:
        """``role``: the worker this server stands for (None: the gateway, which reports nothing)."""
        self.index, self.name = index, name
        self._events, self._on_start, self._on_done = events, on_start, on_done
        self.queue: deque[tuple[Any, float, int]] = deque()
        self.queued_ms = 0.0  # service time of queued (not started) jobs
        self.queued_tokens = 0  # tokens of queued jobs
        self.busy = False
        self.busy_until = 0.0
        self.busy_ms = 0.0
        self._tokens, self._service_ms = 0, 0.0  # the running job's
        self._report = WorkerReport(role or Role.PREFILL, name)

    def backlog_ms(self, now: float) -> float:
        return self.queued_ms + (self.busy_until - now if self.busy else 0.0)

    def report(self, now: float) -> WorkerReport:
        """What this worker would report in its ``Stats``: the jobs it holds and their tokens still
        to process (the running job's in proportion to its time left). Refreshed in place."""
        r = self._report
        r.queue_depth = r.in_flight = len(self.queue) + self.busy
        left = 0
        if self.busy and self._tokens and self._service_ms > 0.0:
            left = int(self._tokens * (self.busy_until - now) / self._service_ms + 0.999)
        tokens = self.queued_tokens + (left if left > 0 else 0)
        if r.role is Role.ENCODER:
            r.queued_image_tokens = tokens
        else:
            r.queued_prefill_tokens = tokens
        return r

    def submit(self, req: Any, service_ms: float, now: float, tokens: int = 0) -> None:
        if self.busy:
            self.queue.append((req, service_ms, tokens))
            self.queued_ms += service_ms
            self.queued_tokens += tokens
        else:
            self._tokens, self._service_ms = tokens, service_ms
            self._start(req, service_ms, now)

    def _start(self, req: Any, service_ms: float, now: float) -> None:
        self.busy = True
        self.busy_until = now + service_ms
        self.busy_ms += service_ms
        self._events.at(self.busy_until, self._done, req)
        self._on_start(req, now, self)

    def _done(self, now: float, req: Any) -> None:
        self.busy = False
        self._tokens = 0
        if self.queue:
            nxt, service_ms, tokens = self.queue.popleft()
            self.queued_ms -= service_ms
            self.queued_tokens -= tokens
            if not self.queue:
                self.queued_ms = 0.0  # no float drift when the queue empties
            self._tokens, self._service_ms = tokens, service_ms
            self._start(nxt, service_ms, now)
        self._on_done(req, now, self)


class ServerPool:
    __slots__ = ("name", "servers")

    def __init__(self, name: str, servers: list[Server]) -> None:
        """``servers``, each with its own processor (``Server``) or taking turns on a shared host
        (``sim.shared_host.SharedServer``)."""
        self.name, self.servers = name, servers

    def least_loaded(self, now: float) -> Server:
        return min(self.servers, key=lambda s: s.backlog_ms(now))

    def queued(self) -> int:
        return sum(len(s.queue) for s in self.servers)

    def busy_ms(self, end: float) -> float:
        """Total busy time, clipped at ``end`` for jobs still running."""
        return sum(s.busy_ms - (max(0.0, s.busy_until - end) if s.busy else 0.0) for s in self.servers)
