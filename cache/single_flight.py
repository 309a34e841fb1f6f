"""In-process single-flight: concurrent calls for one key share one execution.

The first caller for a key (the leader) starts ``fn()`` as its own task; every
caller, the leader included, awaits that task through ``asyncio.shield``.

Invariants:

* At most one flight per key is in the table; a flight leaves the table as
  soon as its task finishes, so a call arriving afterwards starts a new one
  (results are not memoized here: that is the cache's job).
* All callers of a flight get the same value, or the same exception.
* A caller's cancellation cancels only its own wait. When the last waiting
  caller is cancelled, the flight leaves the table and its task is cancelled:
  nobody is left to use the result.

Single event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class _Flight(Generic[T]):
    __slots__ = ("task", "waiters")

    def __init__(self, task: asyncio.Task[T]) -> None:
        self.task = task
        self.waiters = 0


def _consume_outcome(task: asyncio.Task[object]) -> None:
    # Mark the exception as retrieved: every waiter may have gone away.
    if not task.cancelled():
        task.exception()


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._flights: dict[str, _Flight[T]] = {}

    def __len__(self) -> int:
        """Number of keys with a flight in progress."""
        return len(self._flights)

    def in_flight(self, key: str) -> bool:
        return key in self._flights

    async def run(self, key: str, fn: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """``(value, leader)``: ``leader`` is True for the caller whose ``fn`` ran."""
        flight = self._flights.get(key)
        leader = flight is None
        if flight is None:
            task: asyncio.Task[T] = asyncio.ensure_future(fn())  # type: ignore[arg-type]
            new_flight = flight = _Flight(task)
            self._flights[key] = new_flight

            def _finished(done: asyncio.Task[T], key: str = key, mine: _Flight[T] = new_flight) -> None:
                if self._flights.get(key) is mine:
                    del self._flights[key]
                _consume_outcome(done)  # type: ignore[arg-type]

            task.add_done_callback(_finished)
        flight.waiters += 1
        try:
            value = await asyncio.shield(flight.task)
        except asyncio.CancelledError:
            if not flight.task.done() and flight.waiters == 1:
                if self._flights.get(key) is flight:
                    del self._flights[key]
                flight.task.cancel()
            raise
        finally:
            flight.waiters -= 1
        return value, leader
