"""The cross-process single-flight lock: one encoder per key at a time.

Key ``{namespace}:lock:{content_key}`` holds a random token of its holder
(``host:pid:uuid``), set with ``SET NX PX lock_ttl``.

Invariants:

* Only the holder's token renews (``renew``) or deletes (``release``) the
  lock (compare-and-set in Lua), so a holder whose lock already expired can
  never free a lock another process now holds.
* A holder that dies stops renewing; the lock expires after at most
  ``lock_ttl_s`` and the next waiter to poll takes it.
* ``release`` always publishes the content key on the ready channel (after
  the holder stored the entry, or after its compute failed), so waiters
  re-check at once instead of at their next poll.
* ``acquire_unless_stored`` takes the lock only while the entry is absent (one
  script, one round trip): a caller that has just missed the entry cannot
  encode it again because another holder stored it and released in between.

Raises redis-py / socket errors to the caller.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import NamedTuple

from redis.asyncio import Redis

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_ACQUIRE_UNLESS_STORED = """
if redis.call('EXISTS', KEYS[2]) == 1 then
  return -1
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
return 0
"""

_RELEASE = """
local released = 0
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  released = 1
end
redis.call('PUBLISH', ARGV[2], ARGV[3])
return released
"""


def ready_channel(namespace: str) -> str:
    return f"{namespace}:ready"


class Attempt(NamedTuple):
    """One ``acquire_unless_stored``: the holder token (None: held elsewhere, or ``stored``)."""
    token: str | None
    stored: bool   # the entry exists: read it, nothing to lock


class RedisLocks:
    def __init__(self, client: Redis, namespace: str, lock_ttl_s: float) -> None:
        self._client = client
        self._namespace = namespace
        self._ttl_ms = max(1, int(lock_ttl_s * 1000))
        self._channel = ready_channel(namespace)
        self._owner = f"{socket.gethostname()}:{os.getpid()}"
        self._renew = client.register_script(_RENEW)
        self._acquire_unless_stored = client.register_script(_ACQUIRE_UNLESS_STORED)
        self._release = client.register_script(_RELEASE)

    def lock_key(self, key: str) -> str:
        return f"{self._namespace}:lock:{key}"

    async def acquire(self, key: str) -> str | None:
        """The holder token, or None when another process holds the lock."""
        token = f"{self._owner}:{uuid.uuid4().hex}"
        acquired = await self._client.set(self.lock_key(key), token, nx=True, px=self._ttl_ms)
        return token if acquired else None

    async def acquire_unless_stored(self, key: str, entry_name: str) -> Attempt:
        """``acquire``, unless the entry ``entry_name`` exists already (then nothing is locked)."""
        token = f"{self._owner}:{uuid.uuid4().hex}"
        got = int(await self._acquire_unless_stored(keys=[self.lock_key(key), entry_name], args=[token, self._ttl_ms]))
        return Attempt(token if got == 1 else None, got == -1)

    async def renew(self, key: str, token: str) -> bool:
        """Extend the lock by a full TTL; False when it is no longer ours."""
        return bool(await self._renew(keys=[self.lock_key(key)], args=[token, self._ttl_ms]))

    async def release(self, key: str, token: str) -> bool:
        """Delete the lock if still ours and wake the waiters; True if it was ours."""
        return bool(await self._release(keys=[self.lock_key(key)], args=[token, self._channel, key]))
