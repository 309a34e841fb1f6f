"""How long the pipeline had work waiting, over a recent window: the denominator of a service rate.

First tokens per second of wall time is the pipeline's *throughput*, which after an idle spell, in
a closed loop, or while admission refuses, is the arrival rate and not what the pipeline can do.
Divided by the time something was waiting for a first token instead, the same count is the rate
the queue drains at while it has work (its service rate), which is what ``waiting / rate`` needs:
the demo model's pipeline served ~40 first tokens/s in its bursts, and the 5-second window's wall
rate, diluted by the idle gap before the load, read 4.6/s and refused a third of the requests.

One clock per pressure tracker (the gateway's ``FirstTokenPressure``, the simulator's
``SimPressure``), in that tracker's time unit. ``waiting_changed`` is called on every change of
the waiting count; intervals that ended before a window are dropped as it is read.
"""

from __future__ import annotations

from collections import deque


class BusyClock:
    __slots__ = ("_since", "_spans")

    def __init__(self) -> None:
        self._since: float | None = None                  # when the current busy span began; None: idle
        self._spans: deque[tuple[float, float]] = deque()  # closed busy spans (start, end), oldest first

    def waiting_changed(self, now: float, waiting: int) -> None:
        """The waiting count is now ``waiting``: open a busy span at 0 -> 1, close it at 1 -> 0."""
        if waiting > 0 and self._since is None:
            self._since = now
        elif waiting <= 0 and self._since is not None:
            self._spans.append((self._since, now))
            self._since = None

    def busy_since(self, now: float, start: float) -> float:
        """Time within ``[start, now]`` during which something waited."""
        spans = self._spans
        while spans and spans[0][1] <= start:
            spans.popleft()
        busy = sum(end - max(begin, start) for begin, end in spans)
        if self._since is not None:
            busy += now - max(self._since, start)
        return busy
