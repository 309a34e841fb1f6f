"""Recent overruns by the queue each was learnt behind, and the quantile that applies behind a queue.

An overrun (a request's TTFT, or how long past the prediction it still waited when it ended
without a first token, minus what admission predicted) is learnt behind ``ahead`` requests: those
admitted and still waiting for a first token when it was. A new request is judged only by the
overruns learnt behind about as many requests as wait now, or fewer: the samples whose ``ahead``
falls in the same power-of-two bucket as the queue now (0, 1, 2-3, 4-7, ...) or a lower one.
Below ``min_samples`` of those, there is no margin.

Why: a wave of requests served in one step crosses its deadline together, and its requests
teach one event's lateness many times over. Read as one pool, the 16 overruns of a wave cut at
a 2 s deadline set the margin of a request behind 1 as of one behind 15, and admission then let
in one request at a time until the window forgot them (bench-short: 47 of 48 refused, with
closed-loop clients that sent their next request at once after each refusal). Lateness
learnt behind a deep queue is no evidence about a shallow one; behind as deep a queue again it
still counts in full, so after a wave that crossed its deadline the next is admitted up to the
depth where enough of those overruns apply, not cut to one request.

Invariant: ``_by_bucket[b]`` holds every sample whose ahead's bucket is ``b`` or lower, so a read
is one index into one ``WindowQuantile``. Samples leave through ``expire`` only (the caller's
window start, in the caller's time unit).
"""

from __future__ import annotations

from runtime.policy.window_quantile import WindowQuantile

BUCKETS = 8   # ahead 0, 1, 2-3, 4-7, 8-15, 16-31, 32-63, and 64 or more


def depth_bucket(ahead: int) -> int:
    """The power-of-two bucket of a queue of ``ahead`` requests (0 for 0, 1 for 1, 2 for 2-3, ...)."""
    return min(max(0, ahead).bit_length(), BUCKETS - 1)


class DepthQuantile:
    __slots__ = ("_by_bucket",)

    def __init__(self) -> None:
        self._by_bucket = tuple(WindowQuantile() for _ in range(BUCKETS))

    def __len__(self) -> int:
        return len(self._by_bucket[-1])

    def add(self, now: float, value: float, ahead: int | None) -> None:
        """A sample learnt behind ``ahead`` requests (None: unknown, and it applies behind any queue)."""
        for window in self._by_bucket[depth_bucket(ahead or 0):]:
            window.add(now, value)

    def expire(self, since: float) -> None:
        """Drop the samples taken before ``since``."""
        for window in self._by_bucket:
            window.expire(since)

    def quantile(self, q: float, min_samples: int, waiting: int) -> float | None:
        """The ``q`` quantile of the samples that apply behind ``waiting`` requests; None below ``min_samples``."""
        return self._by_bucket[depth_bucket(waiting)].quantile(q, min_samples)
