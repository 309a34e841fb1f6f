"""How long the pipeline had work waiting, over a recent window: the denominator of a service rate.

First tokens per second of wall time is the pipeline's *throughput*, which after an idle spell, in
a closed loop, or while admission refuses, is the arrival rate and not what the pipeline can do.
Divided by the time something was waiting for a first token instead, the same count is the rate
the queue drains at while it has work (its service rate), which is what ``waiting / rate`` needs:
the demo model's pipeline served ~40 first tokens/s in its bursts, and the 5-second window's wall
rate, diluted by the idle gap before the load, read 4.6/s and refused a third of the requests.

One clock per pressure tracker (the gateway's ``FirstTokenPressure``, the simulator's
``SimPressure``), in that tracker's time unit. ``waiting_changed`` is called on every change of
the waiting count; spans that ended more than ``horizon`` ago are dropped as new ones close
(and before a window as it is read), so an outage of tokenless requests keeps no more than a
window's worth.
"""

from __future__ import annotations

from collections import deque


class BusyClock:
    __slots__ = ("horizon", "_since", "_spans")

    def __init__(self, horizon: float) -> None:
        self.horizon = horizon                             # the longest window it is read over
        self._since: float | None = None                  # when the current busy span began; None: idle
        self._spans: deque[tuple[float, float]] = deque()  # closed busy spans (start, end), oldest first

    def waiting_changed(self, now: float, waiting: int) -> None:
        """The waiting count is now ``waiting``: open a busy span at 0 -> 1, close it at 1 -> 0."""
        if waiting > 0 and self._since is None:
            self._since = now
        elif waiting <= 0 and self._since is not None:
            self._spans.append((self._since, now))
            self._since = None
            while self._spans[0][1] < now - self.horizon:
                self._spans.popleft()

    def busy_since(self, now: float, start: float) -> float:
        """Time within ``[start, now]`` during which something waited."""
        spans = self._spans
        while spans and spans[0][1] <= start:
            spans.popleft()
        busy = sum(end - max(begin, start) for begin, end in spans)
        if self._since is not None:
            busy += now - max(self._since, start)
        return busy
