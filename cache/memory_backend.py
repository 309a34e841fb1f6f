"""The embedded encoder cache: one process, no Redis.

Serves a single-host run where the encoder lives in the process that owns the
cache. Entries are invisible to other processes: a keys-only handoff to a
prefill worker in another process needs the Redis backend (``shared`` is
always False here, ``put`` always returns False).

Invariants: memory is bounded by ``max_bytes`` (LRU by bytes, sliding TTL);
concurrent ``get_or_compute`` calls for one key run ``compute`` once
(``SingleFlight``); a failed compute stores nothing and reaches every merged
caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from cache.encoder_cache import ComputeFn, Fetched, as_cached_tensor, check_key, tensor_nbytes
from cache.lru import ByteLRU
from cache.metrics import CacheCounters
from cache.single_flight import SingleFlight


class MemoryEncoderCache:
    def __init__(self, *, max_bytes: int, ttl_s: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._counters = CacheCounters()
        self._lru: ByteLRU[torch.Tensor] = ByteLRU(
            max_bytes, ttl_s, on_change=self._counters.memory_changed, clock=clock
        )
        self._flights: SingleFlight[torch.Tensor] = SingleFlight()

    @property
    def backend(self) -> str:
        return "memory"

    @property
    def shared(self) -> bool:
        return False

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    async def get(self, key: str) -> torch.Tensor | None:
        check_key(key)
        self._counters.query()
        tensor = self._lru.get(key)
        if tensor is not None:
            self._counters.hit(remote=False)
        return tensor

    async def put(self, key: str, tensor: torch.Tensor) -> bool:
        check_key(key)
        value = as_cached_tensor(tensor)
        self._lru.put(key, value, tensor_nbytes(value))
        return False

    async def contains(self, key: str) -> bool:
        return self._lru.contains(check_key(key))

    async def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [self._lru.contains(check_key(k)) for k in keys]

    async def get_or_compute(self, key: str, compute: ComputeFn, *, wait_timeout_s: float | None = None,
                             missed: bool = False, write_behind: bool = False) -> Fetched:
        """``wait_timeout_s``, ``missed`` and ``write_behind`` are accepted for interface parity: in-process
        waits end with the compute, and there is no shared tier to read first or to write behind."""
        check_key(key)
        self._counters.query()
        tensor = self._lru.get(key)
        if tensor is not None:
            self._counters.hit(remote=False)
            return Fetched(tensor, True)
        value, leader = await self._flights.run(key, lambda: self._compute_and_store(key, compute))
        if not leader:
            self._counters.merge()
        return Fetched(value, not leader)

    async def _compute_and_store(self, key: str, compute: ComputeFn) -> torch.Tensor:
        self._counters.compute()
        value = as_cached_tensor(await compute())
        self._lru.put(key, value, tensor_nbytes(value))
        return value

    def stats(self) -> dict[str, int | float | bool | str]:
        return {
            "backend": "memory",
            "entries": len(self._lru),
            "bytes": self._lru.nbytes,
            "max_bytes": self._lru.max_bytes,
            "expirations": self._lru.expirations,
            "in_flight": self.in_flight,
            "shared": False,
            **self._counters.as_dict(),
        }

    async def close(self) -> None:
        self._lru.clear()
