"""Recent samples and a quantile of them, without sorting the window on every read.

The pressure trackers (``gateway/pressure.py``; the simulator's ``sim/pressure.py``) read a high
quantile of recent overruns (through ``depth_quantile``) and the gateway the median intake on
every request, twice (the pre-body shed and admission); sorting a 5-second
window of a few hundred samples each time was ~7% of the gateway event loop's time at 120
requests/s on the demo model. Here the values are also kept sorted as they arrive and leave
(``bisect``), so a read is one index.

Invariant: ``_sorted`` holds exactly the values of ``_samples``, ascending. Samples leave only
through ``expire``, oldest first; the caller passes the window's start each time (the window's
length is the caller's, and may change).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque


class WindowQuantile:
    __slots__ = ("_samples", "_sorted")

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque()   # (time, value), oldest first
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._sorted)

    def add(self, now: float, value: float) -> None:
        self._samples.append((now, value))
        insort(self._sorted, value)

    def expire(self, since: float) -> None:
        """Drop the samples taken before ``since``."""
        samples, ordered = self._samples, self._sorted
        while samples and samples[0][0] < since:
            _, value = samples.popleft()
            del ordered[bisect_left(ordered, value)]

    def quantile(self, q: float, min_samples: int) -> float | None:
        """The ``q`` quantile (the value at index ``int(q x n)``, the last at most); None below ``min_samples``."""
        n = len(self._sorted)
        if n < min_samples or n == 0:
            return None
        return self._sorted[min(n - 1, int(q * n))]
