"""The shared host: ``N`` cores that every stage's work shares (optional; off by default).

On a small box (or stages sharing one accelerator) the gateway, encoder, prefill and
decode workers do not each have a processor of their own: they share the same few
cores, as the OS scheduler shares them, with whatever else runs there. With
``host_cores = N`` every piece of stage work -- a gateway request, an encode, a remote
prefill, one decode step, a local prefill or chunk -- runs on the host:

    run(now, work_ms, done, arg) -> done(t, arg) when the piece's ``work_ms`` is done

The model is processor sharing, the OS scheduler's fair share in the limit:
- while ``m`` pieces run next to ``background`` cores' worth of other work, each piece
  advances at speed ``min(1, N / (m + background))`` ms of work per ms; so one piece alone
  runs at its idle (profiled) time, and with N = 1 and two busy stages each takes twice
  as long;
- ``work_ms`` is the piece's idle service time; the stretch (time taken less work) is the
  only cost of sharing, recorded in ``stretch_ms`` / ``pieces``.

Invariants: every running piece has ``0 < remaining <= work_ms``; the next completion
event is the only one that counts (older ones carry a stale version); pieces finishing
at the same time complete together, in start order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sim.events import EventQueue

Done = Callable[[float, Any], None]


class HostCpu:
    __slots__ = ("cores", "background", "_events", "_running", "_last", "_speed", "_version", "stretch_ms", "pieces")

    def __init__(self, cores: int, events: EventQueue, background: float = 0.0) -> None:
        if cores < 1:
            raise ValueError(f"a shared host needs >= 1 core, got {cores}")
        if background < 0:
            raise ValueError(f"background cores must be >= 0, got {background}")
        self.cores, self.background, self._events = cores, background, events
        self._running: list[list[Any]] = []  # [remaining work ms, work ms, started, done, arg]
        self._last = 0.0
        self._speed = 1.0
        self._version = 0
        self.stretch_ms = 0.0  # summed over finished pieces: time taken less work
        self.pieces = 0

    def run(self, now: float, work_ms: float, done: Done, arg: Any = None) -> None:
        """Start a piece of ``work_ms`` now; ``done(t, arg)`` runs when it is finished."""
        self._advance(now)
        self._running.append([max(work_ms, 0.0), work_ms, now, done, arg])
        self._reschedule(now)

    def speed(self) -> float:
        """Work ms per ms each running piece gets now."""
        return self._speed

    def running(self) -> int:
        return len(self._running)

    def mean_stretch_ms(self) -> float:
        return self.stretch_ms / self.pieces if self.pieces else 0.0

    def _advance(self, now: float) -> None:
        elapsed = now - self._last
        if elapsed > 0.0 and self._running:
            work = elapsed * self._speed
            for piece in self._running:
                piece[0] -= work
        self._last = now

    def _reschedule(self, now: float) -> None:
        self._version += 1
        n = len(self._running)
        if not n:
            self._speed = 1.0
            return
        self._speed = min(1.0, self.cores / (n + self.background))
        first = min(piece[0] for piece in self._running)
        self._events.at(now + max(first, 0.0) / self._speed, self._complete, self._version)

    def _complete(self, now: float, version: int) -> None:
        if version != self._version:
            return
        self._advance(now)
        finished = [p for p in self._running if p[0] <= 1e-9]
        self._running = [p for p in self._running if p[0] > 1e-9]
        self._reschedule(now)
        for _, work_ms, started, done, arg in finished:
            self.stretch_ms += (now - started) - work_ms
            self.pieces += 1
            done(now, arg)
