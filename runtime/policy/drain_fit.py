"""How fast a queue of admitted requests drains, read off their own first tokens.

First tokens over the time something waited (``busy_time``) is the rate the pipeline *served*
at; in a closed loop that stays busy it is the arrival rate of the steady state, not what a
burst drains at, because first tokens batch (a step carries several prompts). On the bench
model that rate read 7.4-7.9/s, so a 16-request burst was priced at 1.9-2.0 s of backlog
against a 2 s deadline and refused, while the requests admitted just before had TTFTs rising
only ~75 ms per request ahead of them (a drain rate of ~13/s): a refusal storm, which a
closed-loop client turns into lost throughput.

This fit measures the drain directly: each first token is a sample (requests that were
waiting when it was admitted, its TTFT from admission), and the least-squares slope of TTFT on
requests ahead over the window is the time one more request ahead costs. ``1000 / slope`` is a
rate in first tokens per second that the pressure trackers (the gateway's
``FirstTokenPressure``, the simulator's ``SimPressure``) weigh beside their own. None when it
cannot be trusted: too few samples, or too little spread in the queue lengths they saw (one at a
time every request has 0 ahead). A slope under ``MIN_SLOPE_MS``, flat or falling, says the
requests ahead cost nothing to wait behind: they got their first tokens in the same steps, as a
refill step starts a closed-loop burst together. It reads as that floor (1000/s), so the backlog
term is near 0 and the wait they all shared is the overrun margin's, learnt from their TTFTs.
Read as untrusted instead, it left the window's rate to price the burst: on a slower host the
bench-short waves' TTFTs were 1.1-1.4 s whatever the number ahead, yet the 16th of a wave was
priced 680 ms of backlog beside a 1.1 s margin against 2 s left, and 18 of 48 were refused.

Sums are kept as samples come and go, so a read costs only the samples that left the window
(at 150 first tokens/s a 5-second window holds ~750). Time is in the caller's unit (seconds in
the gateway, ms in the simulator); TTFTs are always ms.
"""

from __future__ import annotations

from collections import deque

# Below this variance of requests-ahead the slope is noise (at c1 every sample has 0 ahead).
MIN_AHEAD_VARIANCE = 2.0
# A fitted cost per request ahead below this (flat or falling TTFTs) reads as this: the queue drains at once.
MIN_SLOPE_MS = 1.0


class DrainFit:
    __slots__ = ("window", "min_samples", "_samples", "_n", "_sx", "_sy", "_sxx", "_sxy")

    def __init__(self, window: float, min_samples: int = 8) -> None:
        self.window, self.min_samples = window, min_samples
        self._samples: deque[tuple[float, int, float]] = deque()  # (time, ahead, ttft ms), oldest first
        self._n, self._sx, self._sy, self._sxx, self._sxy = 0, 0.0, 0.0, 0.0, 0.0

    def add(self, now: float, ahead: int, ttft_ms: float) -> None:
        """A first token at ``now``: ``ahead`` requests waited when it was admitted, ``ttft_ms`` since."""
        self._samples.append((now, ahead, ttft_ms))
        self._count(ahead, ttft_ms, 1)

    def rate_per_s(self, now: float) -> float | None:
        """First tokens per second a queue drains at: 1000 over the fitted ms per request ahead."""
        since, samples = now - self.window, self._samples
        while samples and samples[0][0] < since:
            _, ahead, ttft_ms = samples.popleft()
            self._count(ahead, ttft_ms, -1)
        n = self._n
        if n < self.min_samples:
            return None
        sxx = self._sxx - self._sx * self._sx / n
        if sxx < MIN_AHEAD_VARIANCE * n:
            return None
        slope_ms = (self._sxy - self._sx * self._sy / n) / sxx
        return 1000.0 / max(slope_ms, MIN_SLOPE_MS)

    def _count(self, x: int, y: float, sign: int) -> None:
        self._n += sign
        self._sx += sign * x
        self._sy += sign * y
        self._sxx += sign * x * x
        self._sxy += sign * x * y
        if self._n == 0:  # an empty window starts from exact zeros, not accumulated rounding
            self._sx = self._sy = self._sxx = self._sxy = 0.0
