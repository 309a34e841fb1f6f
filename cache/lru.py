"""A least-recently-used map bounded by bytes, with a sliding time-to-live.

Invariants (after every public call):

* ``nbytes`` is the sum of the sizes of the stored entries and is never above
  ``max_bytes``; an entry larger than ``max_bytes`` is refused, not stored.
* Order is recency: ``get`` moves an entry to the young end; ``put`` evicts
  from the old end until the new entry fits.
* An entry not read or written for ``ttl_s`` is gone: ``get``/``contains``
  never return it (it is dropped lazily, and ``put`` purges expired entries
  from the old end before evicting live ones).
* ``on_change(bytes_delta, entries_delta, evictions)`` is called after each
  change, so gauges fed by it track ``nbytes`` and ``len`` exactly.

Single event loop, no locks: no method awaits.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar

V = TypeVar("V")


class _Slot(NamedTuple):
    value: object
    nbytes: int
    expires_at: float


class ByteLRU(Generic[V]):
    def __init__(
        self,
        max_bytes: int,
        ttl_s: float | None,
        *,
        on_change: Callable[[int, int, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        self._max_bytes = max_bytes
        self._ttl_s = ttl_s
        self._on_change = on_change
        self._clock = clock
        self._slots: OrderedDict[str, _Slot] = OrderedDict()
        self._nbytes = 0
        self.evictions = 0
        self.expirations = 0

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._slots)

    def _deadline(self) -> float:
        return float("inf") if self._ttl_s is None else self._clock() + self._ttl_s

    def _drop(self, key: str) -> int:
        slot = self._slots.pop(key)
        self._nbytes -= slot.nbytes
        return slot.nbytes

    def _live(self, key: str) -> _Slot | None:
        slot = self._slots.get(key)
        if slot is None:
            return None
        if slot.expires_at <= self._clock():
            freed = self._drop(key)
            self.expirations += 1
            self._notify(-freed, -1, 0)
            return None
        return slot

    def _notify(self, bytes_delta: int, entries_delta: int, evictions: int) -> None:
        if self._on_change is not None and (bytes_delta or entries_delta or evictions):
            self._on_change(bytes_delta, entries_delta, evictions)

    def get(self, key: str) -> V | None:
        """The value, refreshed to most recent with a new deadline; None if absent or expired."""
        slot = self._live(key)
        if slot is None:
            return None
        self._slots[key] = slot._replace(expires_at=self._deadline())
        self._slots.move_to_end(key)
        return slot.value  # type: ignore[return-value]

    def contains(self, key: str) -> bool:
        """Whether a live entry exists; does not change recency or deadline."""
        return self._live(key) is not None

    def put(self, key: str, value: V, nbytes: int) -> bool:
        """Store ``value`` as the most recent entry; False (nothing stored) if it can never fit."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes > self._max_bytes:
            return False
        delta = 0
        before = len(self._slots)
        if key in self._slots:
            delta -= self._drop(key)
        now = self._clock()
        while self._slots:  # purge expired entries at the old end first
            oldest = next(iter(self._slots))
            if self._slots[oldest].expires_at > now:
                break
            delta -= self._drop(oldest)
            self.expirations += 1
        evicted = 0
        while self._nbytes + nbytes > self._max_bytes:
            delta -= self._drop(next(iter(self._slots)))
            evicted += 1
        self._slots[key] = _Slot(value, nbytes, self._deadline())
        self._nbytes += nbytes
        self.evictions += evicted
        self._notify(delta + nbytes, len(self._slots) - before, evicted)
        return True

    def pop(self, key: str) -> None:
        if key in self._slots:
            self._notify(-self._drop(key), -1, 0)

    def clear(self) -> None:
        freed, count = self._nbytes, len(self._slots)
        self._slots.clear()
        self._nbytes = 0
        self._notify(-freed, -count, 0)
