"""Event-loop lag: how late the gateway's own loop runs what is ready.

A request's clock starts when ``ChatHandler.handle`` runs, but before that the
request has waited for the loop to read its socket, parse it and start its task.
When the loop is saturated that wait is invisible to the worker stats and to the
first-token backlog (``pressure.py``), yet the client feels it. The lag measured
here is that wait's size: the gateway starts each request's TTFT clock that much
earlier and sheds new requests while the lag plus the backlog already exceed the
TTFT SLO.

The lag a request is charged is the worst of the last ``window_s`` (0.25 s, about a dozen
probes): a request that waited out a stall runs right after it, next to the probe that measured
it, while one that arrives after the stall waited for nothing. A saturated loop keeps every
probe late, so it keeps shedding; a one-off stall does not shed what comes after it. With a
1 s window, a closed-loop demo round at a 1 s SLO had 71 of 96 requests refused before their
bodies were read while nothing admitted was waiting, which only the lag term can do: each
refusal's replacement arrived at once, into the same second.

Lifecycle: ``start()`` in the app's lifespan, ``stop()`` on shutdown. Before the
first sample (and when stopped) the lag reads 0.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from runtime.worker.background_loop import start_loop, stop_loop


class LoopLagMonitor:
    def __init__(self, interval_s: float = 0.02, window_s: float = 0.25, on_sample=lambda lag_s: None):
        self.interval_s = interval_s
        self.window_s = window_s
        self.on_sample = on_sample
        self._samples: deque[tuple[float, float]] = deque()   # (when, lag seconds)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = start_loop(self._probe(), "event-loop-lag")

    async def stop(self) -> None:
        await stop_loop(self._task)
        self._task = None

    async def _probe(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            self.record(now, max(0.0, now - before - self.interval_s))

    def record(self, now: float, lag_s: float) -> None:
        self._samples.append((now, lag_s))
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        self.on_sample(lag_s)

    def recent_s(self) -> float:
        """The worst lag seen in the last ``window_s`` (0 with no samples)."""
        return max((lag for _, lag in self._samples), default=0.0)
