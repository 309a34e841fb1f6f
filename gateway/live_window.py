"""The last minute of the gateway, for ``/dashboard``: raw latency samples and counter history.

- ``TimedSamples``: TTFT and ITL values with their arrival time, pruned past the window;
  percentiles are exact over what is kept (bounded by ``max_samples``, oldest dropped first).
- ``CounterHistory``: a snapshot of chosen Prometheus counters (the same series Grafana
  reads: ``deploy/grafana/``) taken every second by ``run``; a rate is the change between
  the oldest snapshot within the window and the newest, over the time between them.

Both use ``time.monotonic``; neither does I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry

WINDOW_S = 60.0

# counter families the dashboard rates, by their exported sample name
COUNTERS = (
    "epd:request_success_total",
    "epd:request_failure_total",
    "epd:admission_rejected_total",
    "epd:kv_transfer_bytes_total",
    "epd:gateway_image_cache_checks_total",
)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) by nearest rank; ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


class TimedSamples:
    def __init__(self, window_s: float = WINDOW_S, max_samples: int = 100_000):
        self.window_s = window_s
        self._items: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, value: float, count: int = 1, now: float | None = None) -> None:
        t = time.monotonic() if now is None else now
        for _ in range(count):
            self._items.append((t, value))

    def values(self, now: float | None = None) -> list[float]:
        t = time.monotonic() if now is None else now
        while self._items and self._items[0][0] < t - self.window_s:
            self._items.popleft()
        return [v for _, v in self._items]


def read_counters(registries: Iterable[CollectorRegistry], names: Iterable[str] = COUNTERS) -> dict[str, float]:
    """``{'name{label="v"}': value}`` for every sample of the named counters (labels sorted)."""
    wanted = set(names)
    out: dict[str, float] = {}
    for registry in registries:
        for family in registry.collect():
            for sample in family.samples:
                if sample.name in wanted:
                    labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                    out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


class CounterHistory:
    def __init__(self, read: Callable[[], dict[str, float]], window_s: float = WINDOW_S):
        self.read = read
        self.window_s = window_s
        self._snapshots: deque[tuple[float, dict[str, float]]] = deque()

    def sample(self, now: float | None = None) -> None:
        t = time.monotonic() if now is None else now
        self._snapshots.append((t, self.read()))
        while len(self._snapshots) > 2 and self._snapshots[1][0] <= t - self.window_s:
            self._snapshots.popleft()

    def rates(self) -> tuple[float, dict[str, float]]:
        """(seconds covered, per-second rate of every series) between the oldest and newest snapshot."""
        if len(self._snapshots) < 2:
            return 0.0, {}
        (t0, first), (t1, last) = self._snapshots[0], self._snapshots[-1]
        span = t1 - t0
        if span <= 0:
            return 0.0, {}
        return span, {k: max(0.0, v - first.get(k, 0.0)) / span for k, v in last.items()}

    async def run(self, every_s: float = 1.0) -> None:
        """Sample until cancelled (the app's lifespan owns the task)."""
        while True:
            with contextlib.suppress(Exception):   # a collector that fails once must not end the history
                self.sample()
            await asyncio.sleep(every_s)
