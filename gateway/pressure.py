"""Little's-law pressure: how long a new request would queue before its first token.

Worker stats describe each stage's queue, but under overload the time also piles
up in places no worker reports (the gateway's own CPU, encoder batching, gRPC
queues). This tracker measures the whole pipeline from outside: requests admitted
and still waiting for a first token (L), and the rate at which first tokens come
out (lambda, over a sliding window). ``wait_ms = L / lambda`` is added to every
TTFT estimate at admission, so a backlog anywhere turns into early 429s.
"""

from __future__ import annotations

import time
from collections import deque


class FirstTokenPressure:
    def __init__(self, window_s: float = 5.0, min_samples: int = 8):
        self.window_s = window_s
        self.min_samples = min_samples         # below this, no rate is trusted (start-up, after idle)
        self.waiting = 0                       # admitted, no first token yet
        self._firsts: deque[float] = deque()   # times of recent first tokens

    def admitted(self) -> None:
        self.waiting += 1

    def left(self, got_first_token: bool) -> None:
        """Exactly once per admitted request: at its first token, or when it ends without one."""
        self.waiting -= 1
        if got_first_token:
            self._firsts.append(time.monotonic())

    def rate_per_s(self) -> float | None:
        """First tokens per second over the part of the window that had any; None when too few."""
        now = time.monotonic()
        while self._firsts and self._firsts[0] < now - self.window_s:
            self._firsts.popleft()
        if len(self._firsts) < self.min_samples:
            return None
        return len(self._firsts) / max(now - self._firsts[0], 1.0)

    def wait_ms(self) -> float:
        """Expected queueing before a new request's first token; 0 while nothing waits."""
        if self.waiting <= 0:
            return 0.0
        rate = self.rate_per_s()
        if rate is None:
            return 0.0  # no trustworthy throughput yet (start-up, after idle): the stage estimates decide
        return 1000.0 * self.waiting / rate
