"""The discrete-event clock: a heap of ``(time_ms, seq, callback, arg)``.

Events at equal times run in the order they were scheduled (``seq`` breaks ties).
A component that reschedules its own wake-up keeps a version number and ignores
stale events (``callback(now, arg)`` compares ``arg`` to its current version).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from heapq import heappop, heappush
from typing import Any

Callback = Callable[[float, Any], None]


class EventQueue:
    __slots__ = ("_heap", "_seq", "now", "processed")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callback, Any]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self.processed = 0

    def at(self, t_ms: float, callback: Callback, arg: Any = None) -> None:
        """Run ``callback(t_ms, arg)`` at ``t_ms`` (never earlier than now)."""
        heappush(self._heap, (t_ms if t_ms > self.now else self.now, next(self._seq), callback, arg))

    def run(self) -> float:
        """Run until no events are left; returns the time of the last one."""
        heap, pop = self._heap, heappop
        n = 0
        while heap:
            t, _, callback, arg = pop(heap)
            self.now = t
            callback(t, arg)
            n += 1
        self.processed += n
        return self.now
