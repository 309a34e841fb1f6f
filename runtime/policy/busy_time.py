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
window's worth. The closed spans' total is kept as they come and go, so a read costs only the spans
that left the window since the last one, not one per request still in it (at one request at a
time every request opens and closes a span: ~300 in a 5-second window, twice read per request).
"""

from __future__ import annotations

from collections import deque


class BusyClock:
    __slots__ = ("horizon", "_since", "_spans", "_total")

    def __init__(self, horizon: float) -> None:
        self.horizon = horizon                             # the longest window it is read over
        self._since: float | None = None                  # when the current busy span began; None: idle
        self._spans: deque[tuple[float, float]] = deque()  # closed busy spans (start, end), oldest first
        self._total = 0.0                                  # their summed length

    def waiting_changed(self, now: float, waiting: int) -> None:
        """The waiting count is now ``waiting``: open a busy span at 0 -> 1, close it at 1 -> 0."""
        if waiting > 0 and self._since is None:
            self._since = now
        elif waiting <= 0 and self._since is not None:
            self._spans.append((self._since, now))
            self._total += now - self._since
            self._since = None
            while self._spans[0][1] < now - self.horizon:
                self._drop_oldest()

    def busy_since(self, now: float, start: float) -> float:
        """Time within ``[start, now]`` during which something waited."""
        spans = self._spans
        while spans and spans[0][1] <= start:
            self._drop_oldest()
        busy = 0.0
        if spans:   # only the oldest span left can begin before ``start``
            cut = start - spans[0][0]
            busy = self._total - cut if cut > 0 else self._total
        if self._since is not None:
            busy += now - max(self._since, start)
        return busy if busy > 0.0 else 0.0

    def _drop_oldest(self) -> None:
        begin, end = self._spans.popleft()
        self._total = self._total - (end - begin) if self._spans else 0.0   # empty: no rounding left over
