"""The shared host: ``N`` cores that every stage's work shares (optional; off by default).

On a small box (or stages sharing one accelerator) the gateway, encoder, prefill and
decode workers do not each have a processor of their own: they share the same few
cores, as the OS scheduler shares them, with whatever else runs there. With
``host_cores = N`` every piece of stage work -- a gateway request, an encode, a remote
prefill, one decode step, a local prefill or chunk -- runs on the host:

    run(now, work_ms, done, arg) -> done(t, arg) when the piece's ``work_ms`` is done

The model is processor sharing, the OS scheduler's fair share in the limit:
- while ``m`` pieces run, each advances at speed ``min(1, N / m)`` ms of work per ms; so one
  piece alone runs at its idle (profiled) time, and with N = 1 and two busy stages each takes
  twice as long;
- pieces of one process (``group``: a decode worker's steps and the RPC work of its requests)
  share that process's one interpreter lock: the group counts once among the ``m`` and its
  ``k`` pieces split its share, ``min(1, N / m) / k`` each. On a small model a step is mostly
  Python, so the worker's threads take turns, not cores;
- the host's other work (``background`` cores' worth: the load generator, other services)
  comes as pieces too, at random (Poisson) times, each ``BACKGROUND_PIECE_MS`` long on
  average (exponential), while ``active()`` says the simulation is live. Spread evenly
  instead (a fluid share), it would never slow a piece while a core is free; measured on a
  busy 2-core host, three or more threads were runnable 22% of the time at 1.4 cores of load;
- ``work_ms`` is the piece's idle service time; the stretch (time taken less work) is the
  only cost of sharing, recorded in ``stretch_ms`` / ``pieces``.

A wait -- ``wait(now, ms, done, arg)`` -- is latency that is not work: a hand-off between
processes (a socket wake-up, a thread switch), each of which needs a core for a moment. It
advances at the speed one more piece would get, ``min(1, N / (m + 1))``, so it
takes its idle time on a quiet host and stretches as the cores fill; it adds no work and slows
no piece.

Invariants: every running piece of the stack's has ``0 < remaining <= work_ms`` (other work
is marked ``work_ms = -1`` and left out of ``stretch_ms`` / ``pieces``); the next completion
event is the only one that counts (older ones carry a stale version); pieces (and waits)
finishing at the same time complete together, in start order, pieces first.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from runtime.policy.worker_stats import Role
from sim.decode_worker import CHUNK, IDLE, PREFILL, STEPPING, DecodeWorker
from sim.events import EventQueue
from sim.server_pool import Hook, Server

Done = Callable[[float, Any], None]
BACKGROUND_PIECE_MS = 1.0  # mean size of a piece of other work (about a scheduler slice; 1-3 ms predict alike)
BUSY_WINDOW_MS = 500.0  # the gateway's Stats poll (WorkerRegistry.poll_s): the window cpus_busy covers


def ignore(t: float, arg: Any) -> None:
    """A ``done`` for work whose end nothing waits on."""
    return None


class HostCpu:
    __slots__ = ("cores", "background", "_events", "_running", "_waits", "_last", "_wait_speed", "_version",
                 "stretch_ms", "pieces", "work_ms", "_active", "_rng", "_generating", "_in_use", "_busy_core_ms",
                 "_mark", "_busy")

    def __init__(self, cores: int, events: EventQueue, background: float = 0.0,
                 active: Callable[[], bool] = lambda: False, seed: int = 0) -> None:
        if cores < 1:
            raise ValueError(f"a shared host needs >= 1 core, got {cores}")
        if background < 0:
            raise ValueError(f"background cores must be >= 0, got {background}")
        self.cores, self.background, self._events = cores, background, events
        self._active = active  # while True, the other work keeps coming
        self._rng = random.Random(f"epd-sim/{seed}/host-background")
        self._generating = False
        self._running: list[list[Any]] = []  # [remaining work ms, work ms, started, done, arg, group, speed]
        self._waits: list[list[Any]] = []  # [remaining ms, done, arg]
        self._last = 0.0
        self._wait_speed = 1.0
        self._version = 0
        self.stretch_ms = 0.0  # summed over finished pieces: time taken less work
        self.pieces = 0
        self.work_ms = 0.0  # the stack's work done (idle ms), other work not counted
        self._in_use = 0.0  # cores busy now: min(cores, running entities)
        self._busy_core_ms = 0.0  # core-ms busy up to ``_last`` (the stack's work and other work)
        self._mark = (0.0, 0.0)  # (time, busy core-ms then) of the last ``busy_share`` window
        self._busy = -1.0

    def busy_share(self, now: float) -> float:
        """The share of the cores' time busy over the last window of at least ``BUSY_WINDOW_MS``
        (what a worker's ``Stats`` reports as ``cpus_busy`` at the gateway's poll); -1 before the first."""
        busy = self._busy_core_ms + (now - self._last) * self._in_use
        t0, b0 = self._mark
        if now - t0 >= BUSY_WINDOW_MS:
            self._busy = min(1.0, (busy - b0) / (self.cores * (now - t0)))
            self._mark = (now, busy)
        return self._busy

    def run(self, now: float, work_ms: float, done: Done, arg: Any = None, group: Any = None) -> None:
        """Start a piece of ``work_ms`` now; ``done(t, arg)`` runs when it is finished. Pieces with
        the same ``group`` (not None) are one process's: they take turns on one core."""
        self._advance(now)
        self._running.append([max(work_ms, 0.0), work_ms, now, done, arg, group, 1.0])
        self._reschedule(now)
        self._start_background(now)

    def _start_background(self, now: float) -> None:
        if self.background > 0.0 and not self._generating:
            self._generating = True
            self._events.at(now + self._rng.expovariate(self.background / BACKGROUND_PIECE_MS), self._other_work)

    def _other_work(self, now: float, _: Any = None) -> None:
        """One piece of the host's other work arrives; the next is drawn while the simulation is live."""
        self._advance(now)
        self._running.append([self._rng.expovariate(1.0 / BACKGROUND_PIECE_MS), -1.0, now, ignore, None, None, 1.0])
        self._reschedule(now)
        if self._active():
            self._events.at(now + self._rng.expovariate(self.background / BACKGROUND_PIECE_MS), self._other_work)
        else:
            self._generating = False

    def wait(self, now: float, ms: float, done: Done, arg: Any = None) -> None:
        """Start a wait of ``ms`` idle-host milliseconds now; ``done(t, arg)`` runs when it is over."""
        self._advance(now)
        self._waits.append([max(ms, 0.0), done, arg])
        self._reschedule(now)
        self._start_background(now)

    def _advance(self, now: float) -> None:
        elapsed = now - self._last
        if elapsed > 0.0:
            self._busy_core_ms += elapsed * self._in_use
            for piece in self._running:
                piece[0] -= elapsed * piece[6]
            if self._waits:
                progress = elapsed * self._wait_speed
                for w in self._waits:
                    w[0] -= progress
        self._last = now

    def _reschedule(self, now: float) -> None:
        self._version += 1
        per_group: dict[Any, int] = {}
        entities = 0
        for piece in self._running:
            group = piece[5]
            if group is None:
                entities += 1
            else:
                k = per_group.get(group, 0)
                entities += k == 0
                per_group[group] = k + 1
        share = min(1.0, self.cores / entities) if entities else 1.0
        self._in_use = float(min(self.cores, entities))
        self._wait_speed = min(1.0, self.cores / (entities + 1))
        first = math.inf
        for piece in self._running:
            piece[6] = speed = share if piece[5] is None else share / per_group[piece[5]]
            first = min(first, piece[0] / speed)
        if self._waits:
            first = min(first, min(w[0] for w in self._waits) / self._wait_speed)
        if first < math.inf:
            self._events.at(now + max(first, 0.0), self._complete, self._version)

    def _complete(self, now: float, version: int) -> None:
        if version != self._version:
            return
        self._advance(now)
        finished = [p for p in self._running if p[0] <= 1e-9]
        self._running = [p for p in self._running if p[0] > 1e-9]
        over = [w for w in self._waits if w[0] <= 1e-9]
        if over:
            self._waits = [w for w in self._waits if w[0] > 1e-9]
        self._reschedule(now)
        for _, work_ms, started, done, arg, _, _ in finished:
            if work_ms >= 0.0:  # the stack's own (other work is marked -1)
                self.stretch_ms += (now - started) - work_ms
                self.pieces += 1
                self.work_ms += work_ms
            done(now, arg)
        for _, done, arg in over:
            done(now, arg)


class SharedServer(Server):
    """A ``Server`` on a shared host (``HostCpu``): each job's service is work that
    runs at the host's current speed, so it takes at least its idle time.

    ``busy_ms`` sums work, not wall time; ``backlog_ms`` cannot see the host's slowdown,
    so it is a lower bound here.
    """

    __slots__ = ("_cpu",)

    def __init__(self, index: int, name: str, events: EventQueue, on_start: Hook, on_done: Hook, role: Role | None,
                 cpu: HostCpu) -> None:
        super().__init__(index, name, events, on_start, on_done, role)
        self._cpu = cpu

    def _start(self, req: Any, service_ms: float, now: float) -> None:
        self.busy = True
        self.busy_until = now + service_ms  # at idle speed: the real end depends on the host
        self.busy_ms += service_ms
        self._cpu.run(now, service_ms, self._done, req)
        self._on_start(req, now, self)


class SharedDecodeWorker(DecodeWorker):
    """A ``DecodeWorker`` on a shared host (``HostCpu``): every step, whole local
    prefill and chunk is a piece of work that runs at the host's speed.

    ``step_extra_ms`` (the worker's untimed CPU per step: sampling, streaming the tokens) runs
    as a piece of its own beside each step: the profiled step is a round trip timed on the
    worker's event loop, so it already holds what that work does to the step's length; the
    cores still have to do it.

    One event per step (``per_step``). When a piece takes ``f`` times its idle time, what
    it covers stretches by ``f``: a step's ``d`` (so every gap in it, first gaps and
    breaches follow), a local prefill's stall, a chunk and the step fused with it.
    """

    __slots__ = ("_cpu", "_started", "_work", "step_extra_ms")

    def __init__(self, *args: Any, cpu: HostCpu, step_extra_ms: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cpu = cpu
        self.step_extra_ms = step_extra_ms
        self._started = self._work = 0.0
        self.per_step = True

    def _schedule(self, t: float) -> None:
        now = self._events.now
        self.version += 1
        self.next_t = t  # at idle speed; the host decides the real end
        self._started, self._work = now, t - now
        self._cpu.run(now, t - now, self._piece_done, self.version, group=self)
        if self.step_extra_ms and self.running and self.mode != PREFILL:  # a step runs: its untimed work, beside it
            self._cpu.run(now, self.step_extra_ms, ignore)

    def _piece_done(self, now: float, version: int) -> None:
        if version != self.version:
            return
        taken = now - self._started
        if taken > self._work > 0.0:
            f = taken / self._work
            if self.mode == STEPPING:
                self.d = now - self.t0
            elif self.mode == CHUNK:  # stall_extra holds the chunk's idle time
                if self.running:
                    self.t0 = self._started + self.stall_extra * f
                    self.d *= f
                self.stall_extra *= f
            else:  # PREFILL: stall_extra holds the prefill's idle time; the residents wait through it
                self.stall_extra *= f
        self.next_t = now
        DecodeWorker._on_event(self, now, version)

    def wake(self, now: float) -> None:
        """Start when idle; otherwise the running piece ends at a step boundary anyway (one step per event)."""
        if self.mode == IDLE:
            DecodeWorker.wake(self, now)
