"""The simulator's first-token pressure: what the gateway's ``FirstTokenPressure`` measures, in
simulated time, handed to the admission policy as ``runtime.policy.loads.Pressure``.

Kept only with admission on. Lifecycle per admitted request: ``admitted`` once, then ``left``
once (at its first token, with how much later than predicted it came, or when it fails
without one, with how long past the prediction it still waited). The rate is the first tokens
of the last ``window_ms`` over the time in it that something waited
(``runtime.policy.busy_time``; none trusted below ``min_samples``, as in the gateway); the
overrun is a quantile of the lateness, never negative, of the first tokens whose prediction
priced the queue (``Pressure.backlog_priced``; the others count for the rate only) and of the
failures still waiting past their prediction, learnt behind a queue no deeper than the one a
request arriving now joins (``runtime.policy.depth_quantile``), as in the gateway. As in the
gateway, the rate is the higher of that and the rate the window's queues drained at
(``runtime.policy.drain_fit``: a burst's first tokens batch, so it drains faster than the
window's rate). The gateway also remembers its peak rate, for closed-loop clients after an
idle spell; simulated arrivals are open loop, so the window's rates are the ones that hold here.
"""

from __future__ import annotations

from collections import deque

from runtime.policy.busy_time import BusyClock
from runtime.policy.depth_quantile import DepthQuantile
from runtime.policy.drain_fit import DrainFit
from runtime.policy.loads import MIN_RATE_SPAN_S, Pressure


class SimPressure:
    __slots__ = ("window_ms", "min_samples", "quantile", "waiting", "_firsts", "_busy", "_late", "_drain")

    def __init__(self, window_ms: float = 5000.0, min_samples: int = 8, quantile: float = 0.95) -> None:
        self.window_ms, self.min_samples, self.quantile = window_ms, min_samples, quantile
        self.waiting = 0  # admitted, no first token yet
        self._busy = BusyClock(window_ms)  # when ``waiting`` was above 0 (the rate's denominator), ms
        self._firsts: deque[float] = deque()  # times of first tokens, oldest first (the rate's count)
        self._late = DepthQuantile()  # ms late: priced first tokens, and failures past their prediction
        self._drain = DrainFit(window_ms, min_samples)  # TTFT against requests ahead at admission

    def admitted(self, now: float) -> None:
        self.waiting += 1
        self._busy.waiting_changed(now, self.waiting)

    def left(self, now: float, got_first_token: bool, overrun_ms: float | None = 0.0, *, ahead: int | None = None,
             ttft_ms: float = 0.0) -> None:
        self.waiting -= 1
        self._busy.waiting_changed(now, self.waiting)
        if got_first_token:
            self._firsts.append(now)
            if ahead is not None:
                self._drain.add(now, ahead, ttft_ms)
            if overrun_ms is not None:
                self._late.add(now, overrun_ms, ahead)
        elif overrun_ms is not None and overrun_ms > 0:   # still waiting this long past the prediction
            self._late.add(now, overrun_ms, ahead)

    def inputs(self, now: float) -> Pressure:
        firsts = self._firsts
        while firsts and firsts[0] < now - self.window_ms:
            firsts.popleft()
        self._late.expire(now - self.window_ms)
        rate = None
        if len(firsts) >= self.min_samples:
            busy = self._busy.busy_since(now, now - self.window_ms)
            rate = 1000.0 * len(firsts) / max(busy, 1000.0 * MIN_RATE_SPAN_S)
        drain = self._drain.rate_per_s(now)
        if drain is not None:
            rate = max(rate or 0.0, drain)
        late = self._late.quantile(self.quantile, self.min_samples, self.waiting) or 0.0
        return Pressure(self.waiting, rate, max(0.0, late))
