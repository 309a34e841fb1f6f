"""The shared host: ``N`` cores that every stage's work needs (optional; off by default).

On a small box (or stages sharing one accelerator) the gateway, encoder, prefill and
decode workers do not each have a processor of their own: they take turns on the same
few cores. With ``host_cores = N`` every piece of stage work -- a gateway request, an
encode, a remote prefill, one decode step, a local prefill or chunk -- must hold one of
``N`` cores while it runs:

    acquire(now, granted, arg) -> granted(t, arg) when a core is held (at once if one is
                                  free, else when one is released, first come first served)
    release(now)               -> the core goes to the longest waiter, or back to the pool

Rules (the whole model):
- a piece holds its core for exactly its idle service time (the profiled one); a piece
  never runs on two cores and is never pre-empted, so contention shows up only as the
  wait for a core;
- a stage that runs many pieces (a decode worker's steps) asks again for every piece, so
  a busy stage cannot keep a core while others wait.

Invariants: at most ``cores`` pieces hold a core; ``free + holders == cores``; waiters
are served in arrival order; ``wait_ms`` / ``grants`` is the mean wait for a core.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

Granted = Callable[[float, Any], None]


class HostCpu:
    __slots__ = ("cores", "free", "_waiting", "wait_ms", "grants")

    def __init__(self, cores: int) -> None:
        if cores < 1:
            raise ValueError(f"a shared host needs >= 1 core, got {cores}")
        self.cores = self.free = cores
        self._waiting: deque[tuple[float, Granted, Any]] = deque()
        self.wait_ms = 0.0  # total time pieces waited for a core
        self.grants = 0

    def acquire(self, now: float, granted: Granted, arg: Any = None) -> None:
        """Ask for a core; ``granted(t, arg)`` runs when this piece holds one (now, if one is free)."""
        if self.free:
            self.free -= 1
            self._grant(now, now, granted, arg)
        else:
            self._waiting.append((now, granted, arg))

    def release(self, now: float) -> None:
        """A piece is done: hand its core to the longest waiter (at ``now``) or back to the pool."""
        if self._waiting:
            asked, granted, arg = self._waiting.popleft()
            self._grant(now, asked, granted, arg)
        else:
            self.free += 1
            if self.free > self.cores:
                raise RuntimeError("released a core that was not held")

    def _grant(self, now: float, asked: float, granted: Granted, arg: Any) -> None:
        self.grants += 1
        self.wait_ms += now - asked
        granted(now, arg)

    def waiting(self) -> int:
        return len(self._waiting)

    def mean_wait_ms(self) -> float:
        return self.wait_ms / self.grants if self.grants else 0.0
