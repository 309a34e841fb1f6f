"""Is Redis usable right now? A small circuit breaker for the shared tier.

States: up -> (a failure) -> down -> (after ``retry_interval_s``, one probe
call is let through) -> up on success, or down for another interval.

Invariants:

* While down, ``available()`` is True for at most one caller per interval,
  so an outage costs one failed call per interval, not one per request.
* The outage is logged once, when it starts, and its end once; the calls
  in between are only counted (by the owner).
* Nothing here talks to Redis: redis-py's pool reconnects by itself, this
  only decides when to let a call try.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("epd.cache")


class RedisHealth:
    def __init__(
        self,
        retry_interval_s: float,
        *,
        name: str,
        on_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._retry_interval_s = retry_interval_s
        self._name = name
        self._on_change = on_change
        self._clock = clock
        self._down_since: float | None = None
        self._next_probe = 0.0

    @property
    def up(self) -> bool:
        return self._down_since is None

    def available(self) -> bool:
        """Whether the next Redis call should be attempted (claims the probe when down)."""
        if self._down_since is None:
            return True
        now = self._clock()
        if now < self._next_probe:
            return False
        self._next_probe = now + self._retry_interval_s
        return True

    def failure(self, exc: BaseException, op: str) -> None:
        now = self._clock()
        self._next_probe = now + self._retry_interval_s
        if self._down_since is None:
            self._down_since = now
            log.warning(
                "encoder cache: Redis at %s unreachable (%s: %s: %s); serving without the shared cache, "
                "retrying every %.1fs",
                self._name, op, type(exc).__name__, exc, self._retry_interval_s,
            )
            if self._on_change is not None:
                self._on_change(False)
        else:
            log.debug("encoder cache: Redis still unreachable (%s: %s)", op, exc)

    def success(self) -> None:
        if self._down_since is not None:
            log.info(
                "encoder cache: Redis at %s reachable again after %.1fs; shared cache restored",
                self._name, self._clock() - self._down_since,
            )
            self._down_since = None
            if self._on_change is not None:
                self._on_change(True)
