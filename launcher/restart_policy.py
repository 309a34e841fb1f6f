"""When ``epd serve`` restarts a child that exited on its own, and when it gives up.

A child's exits are kept with their times. After an exit, the exits within the
last ``window_s`` count: the restart waits ``backoff_s * 2**(count - 1)``
(capped at ``max_backoff_s``); at ``limit`` exits within the window the
supervisor gives up on that child. Exits older than the window are forgotten,
so a worker that crashes once a day is restarted every time.

Pure logic over the times it is given (no clock, no processes), so it is tested
directly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff_s: float = 1.0       # the first restart's delay; doubles with each further exit in the window
    max_backoff_s: float = 30.0
    limit: int = 5               # this many exits within window_s: give up
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("restart backoff must be >= 0 and no more than its maximum")
        if self.limit < 1:
            raise ValueError("the restart limit must be >= 1")
        if self.window_s <= 0:
            raise ValueError("the restart window must be > 0 s")


@dataclass(slots=True)
class ExitHistory:
    """One child's recent unexpected exits: ``(monotonic time, exit code)``, oldest first."""

    policy: RestartPolicy
    exits: deque[tuple[float, int]] = field(default_factory=deque)

    def record(self, now: float, code: int) -> float | None:
        """Note an exit; return the delay before the restart, or ``None``: give up."""
        self.exits.append((now, code))
        while self.exits and self.exits[0][0] < now - self.policy.window_s:
            self.exits.popleft()
        n = len(self.exits)
        if n >= self.policy.limit:
            return None
        return min(self.policy.max_backoff_s, self.policy.backoff_s * 2 ** (n - 1))

    def codes(self) -> list[int]:
        return [code for _, code in self.exits]
