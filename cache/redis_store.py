"""Entry reads and writes against Redis (layout in ``cache.redis_entry``).

Every method raises redis-py / socket errors to its caller: deciding what an
outage means is the backend's job (``cache.redis_backend``).

Invariants:

* ``put`` writes all fields and the TTL in one MULTI/EXEC: other processes
  see the whole entry or nothing.
* ``get`` slides the TTL of the entry it reads in the same round trip, so an
  entry in use does not expire.
* ``get`` never returns a partial or corrupt entry: it deletes it and
  reports ``stale``; the caller re-encodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from redis.asyncio import Redis

from cache.redis_entry import FIELDS, EntryFormatError, entry_key, from_fields, to_fields


class RemoteLookup(NamedTuple):
    tensor: torch.Tensor | None
    stale: bool


class RedisEntryStore:
    def __init__(self, client: Redis, namespace: str, ttl_s: float) -> None:
        self._client = client
        self._namespace = namespace
        self._ttl_ms = max(1, int(ttl_s * 1000))

    def entry_key(self, key: str) -> str:
        return entry_key(self._namespace, key)

    async def get(self, key: str) -> RemoteLookup:
        name = self.entry_key(key)
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.hmget(name, list(FIELDS))
            pipe.pexpire(name, self._ttl_ms)
            values, _ = await pipe.execute()
        if all(v is None for v in values):
            return RemoteLookup(None, False)
        try:
            return RemoteLookup(from_fields(values), False)
        except EntryFormatError:
            await self._client.delete(name)
            return RemoteLookup(None, True)

    async def put(self, key: str, tensor: torch.Tensor) -> None:
        name = self.entry_key(key)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(name)
            pipe.hset(name, mapping=to_fields(tensor))  # type: ignore[arg-type]
            pipe.pexpire(name, self._ttl_ms)
            await pipe.execute()

    async def touch(self, key: str) -> bool:
        """Slide the TTL; False when the entry is gone."""
        return bool(await self._client.pexpire(self.entry_key(key), self._ttl_ms))

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        async with self._client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.exists(self.entry_key(key))
            counts = await pipe.execute()
        return [bool(c) for c in counts]
