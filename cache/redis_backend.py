"""The cluster-wide encoder cache: a per-process LRU in front of Redis.

Lookup order for ``get_or_compute(key, compute)``:

    1. local LRU (this process)            -> hit   (slides the Redis TTL,
                                                      re-uploads if Redis lost it)
    2. in-process single-flight on key     -> merge (joined this process's flight)
    3. the flight's leader, in a loop:
       a. Redis entry                      -> hit, or merge if we waited
          (skipped the first time when the caller has just missed it,
          ``missed``: then (b) locks only while the entry is absent)
       b. SET lock NX PX                   -> ours: compute, store, release+publish
       c. held elsewhere: wait for the ready message or one poll interval,
          then back to (a); after ``wait_timeout_s``, compute anyway
    Redis unreachable at any step          -> compute here, keep it locally

With ``write_behind`` the leader returns once the embedding is computed and in the
LRU; storing it and releasing the lock (b) finish in a background task.

Invariants:

* No method raises because of Redis. A connection failure marks Redis down
  (``RedisHealth``: logged once, counted in ``errors``); calls then skip it
  (counted in ``bypassed``) and serve from the local LRU, which is also the
  degraded cache, until a probe succeeds. redis-py reconnects by itself.
* When ``get_or_compute`` returns and Redis is up, the entry is in Redis, so a
  key handed to another process (the prefill worker) can be fetched there;
  with ``write_behind``, it is in this process's LRU and in Redis once the write
  lands. The lock is held until then, so another process waiting on the key
  reads it rather than encoding it again, and a worker that asks Redis too
  early asks the encoder that holds it next (``cache/embedding_fetch.py``).
  ``in_flight`` counts the writes still pending; ``close`` waits for them.
* While Redis is up and lock holders live, one key is encoded once across all
  processes sharing the namespace; a holder that dies frees the key after at
  most ``lock_ttl_s``; a holder that hangs costs waiters ``wait_timeout_s``.
* One connection pool per cache (or the client injected by the owner, never
  closed here); the pub/sub listener takes one connection from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Sequence
from enum import Enum

import torch
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from cache.config import EncoderCacheConfig
from cache.encoder_cache import ComputeFn, Fetched, as_cached_tensor, check_key, tensor_nbytes
from cache.health import RedisHealth
from cache.lru import ByteLRU
from cache.metrics import REDIS_UP, CacheCounters
from cache.redis_lock import RedisLocks, ready_channel
from cache.redis_notify import ReadyNotifier
from cache.redis_store import RedisEntryStore
from cache.single_flight import SingleFlight

log = logging.getLogger("epd.cache")

# Failures that mean "Redis is not reachable": open the breaker.
_OUTAGE = (RedisConnectionError, RedisTimeoutError, OSError)


class _Source(Enum):
    REMOTE = "remote"  # read from Redis at once
    MERGED = "merged"  # read from Redis after waiting on another process's lock
    COMPUTED = "computed"


def _describe(client: Redis) -> str:
    """host:port/db of the client, without credentials, for logs."""
    kwargs = client.connection_pool.connection_kwargs
    where = kwargs.get("path") or f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
    return f"{where}/{kwargs.get('db', 0)}"


class RedisEncoderCache:
    def __init__(self, config: EncoderCacheConfig, *, client: Redis | None = None) -> None:
        self._config = config
        self._owns_client = client is None
        if client is None:
            if config.redis_url is None:
                raise ValueError("RedisEncoderCache needs config.redis_url or a client")
            client = Redis.from_url(
                config.redis_url,
                socket_timeout=config.redis_timeout_s,
                socket_connect_timeout=config.redis_timeout_s,
                retry=Retry(NoBackoff(), 1),  # one retry: a pooled socket from before a Redis restart
                client_name="epd-encoder-cache",
            )
        self._client = client
        self._counters = CacheCounters()
        self._lru: ByteLRU[torch.Tensor] = ByteLRU(
            config.max_bytes, config.ttl_s, on_change=self._counters.memory_changed
        )
        self._flights: SingleFlight[tuple[torch.Tensor, _Source]] = SingleFlight()
        self._writes: set[asyncio.Task[object]] = set()   # write-behind stores (a locked one holds its key's lock)
        self._store = RedisEntryStore(client, config.namespace, config.ttl_s)
        self._locks = RedisLocks(client, config.namespace, config.lock_ttl_s)
        self._notifier = ReadyNotifier(
            client, ready_channel(config.namespace), retry_interval_s=config.retry_interval_s
        )
        self._reported: set[str] = set()  # command-error kinds already logged at warning level
        self._health = RedisHealth(config.retry_interval_s, name=_describe(client), on_change=self._set_up)
        REDIS_UP.set(1)

    # --- properties -----------------------------------------------------------------

    @property
    def backend(self) -> str:
        return "redis"

    @property
    def shared(self) -> bool:
        return self._health.up

    @property
    def in_flight(self) -> int:
        return len(self._flights) + len(self._writes)

    @staticmethod
    def _set_up(up: bool) -> None:
        REDIS_UP.set(1 if up else 0)

    # --- Redis calls that never raise ----------------------------------------------

    def _failed(self, exc: BaseException, op: str) -> None:
        self._counters.error()
        if isinstance(exc, _OUTAGE):
            self._health.failure(exc, op)
        else:  # a command error (e.g. OOM under a noeviction policy): Redis itself answers
            kind = f"{op}:{type(exc).__name__}"
            level = logging.DEBUG if kind in self._reported else logging.WARNING
            self._reported.add(kind)
            log.log(level, "encoder cache: Redis %s failed: %s: %s", op, type(exc).__name__, exc)

    def _try_redis(self) -> bool:
        if self._health.available():
            return True
        self._counters.bypass()
        return False

    async def _remote_get(self, key: str) -> torch.Tensor | None:
        if not self._try_redis():
            return None
        try:
            lookup = await self._store.get(key)
        except (RedisError, OSError) as exc:
            self._failed(exc, "get")
            return None
        self._health.success()
        if lookup.stale:
            self._counters.stale_entry()
            log.info("encoder cache: dropped incomplete entry %s; re-encoding", key)
        return lookup.tensor

    async def _remote_put(self, key: str, tensor: torch.Tensor) -> bool:
        if not self._try_redis():
            return False
        try:
            await self._store.put(key, tensor)
        except (RedisError, OSError) as exc:
            self._failed(exc, "put")
            return False
        self._health.success()
        return True

    async def _remote_refresh(self, key: str, tensor: torch.Tensor) -> None:
        """Keep a locally held entry in Redis: slide its TTL, re-upload if it was evicted."""
        if not self._try_redis():
            return
        try:
            present = await self._store.touch(key)
        except (RedisError, OSError) as exc:
            self._failed(exc, "touch")
            return
        self._health.success()
        if not present:
            await self._remote_put(key, tensor)

    # --- the EncoderCache interface ------------------------------------------------

    async def get(self, key: str) -> torch.Tensor | None:
        check_key(key)
        self._counters.query()
        tensor = self._lru.get(key)
        if tensor is not None:
            self._counters.hit(remote=False)
            return tensor
        tensor = await self._remote_get(key)
        if tensor is not None:
            self._counters.hit(remote=True)
            self._lru.put(key, tensor, tensor_nbytes(tensor))
        return tensor

    async def put(self, key: str, tensor: torch.Tensor) -> bool:
        check_key(key)
        value = as_cached_tensor(tensor)
        self._lru.put(key, value, tensor_nbytes(value))
        return await self._remote_put(key, value)

    async def contains(self, key: str) -> bool:
        return (await self.contains_many([key]))[0]

    async def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """One Redis round trip for the keys this process does not hold."""
        found = [self._lru.contains(check_key(k)) for k in keys]
        ask = [k for k, f in zip(keys, found) if not f]
        if not ask or not self._try_redis():
            return found
        try:
            remote = iter(await self._store.exists_many(ask))
        except (RedisError, OSError) as exc:
            self._failed(exc, "exists")
            return found
        self._health.success()
        return [f or next(remote) for f in found]

    async def get_or_compute(self, key: str, compute: ComputeFn, *, wait_timeout_s: float | None = None,
                             missed: bool = False, write_behind: bool = False) -> Fetched:
        """The embedding for ``key``, computed (once, cluster-wide) if no one has it.

        ``wait_timeout_s`` bounds the wait on another process's encode (default
        ``config.wait_timeout_s``); concurrent callers in this process share the
        first caller's wait. Exceptions of ``compute`` reach every merged caller
        of this process; nothing is stored for them. ``missed``: the caller's
        ``get`` has just found no entry, so the first Redis read is not repeated.
        ``write_behind``: return before the entry is written to Redis (above).
        """
        check_key(key)
        wait = self._config.wait_timeout_s if wait_timeout_s is None else wait_timeout_s
        self._counters.query()
        tensor = self._lru.get(key)
        if tensor is not None:
            self._counters.hit(remote=False)
            await self._remote_refresh(key, tensor)
            return Fetched(tensor, True)
        (tensor, source), leader = await self._flights.run(
            key, lambda: self._resolve(key, compute, wait, missed=missed, write_behind=write_behind))
        if not leader or source is _Source.MERGED:
            self._counters.merge()
        elif source is _Source.REMOTE:
            self._counters.hit(remote=True)
        return Fetched(tensor, not leader or source is not _Source.COMPUTED)

    # --- the flight leader -----------------------------------------------------------

    async def _resolve(self, key: str, compute: ComputeFn, wait_timeout_s: float, *, missed: bool,
                       write_behind: bool) -> tuple[torch.Tensor, _Source]:
        if not self._health.up:
            tensor = await self._remote_get(key)  # a bypass, or the one probe per retry interval
            if tensor is not None:
                self._lru.put(key, tensor, tensor_nbytes(tensor))
                return tensor, _Source.REMOTE
            if not self._health.up:
                return await self._compute_and_store(key, compute, write_behind), _Source.COMPUTED
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_timeout_s
        waited = False
        with self._notifier.watch(key) as ready:
            while True:
                ready.clear()
                if not missed:
                    tensor = await self._remote_get(key)
                    if tensor is not None:
                        self._lru.put(key, tensor, tensor_nbytes(tensor))
                        return tensor, _Source.MERGED if waited else _Source.REMOTE
                    if not self._health.up:
                        break
                try:
                    if missed:   # the caller's read missed: lock unless the entry appeared since
                        missed = False
                        token, stored = await self._locks.acquire_unless_stored(key, self._store.entry_key(key))
                        if stored:
                            continue
                    else:
                        token = await self._locks.acquire(key)
                except (RedisError, OSError) as exc:
                    self._failed(exc, "lock")
                    break
                if token is not None:
                    return await self._compute_locked(key, compute, token, write_behind), _Source.COMPUTED
                remaining = deadline - loop.time()
                if remaining <= 0:
                    self._counters.wait_timeout()
                    log.warning(
                        "encoder cache: waited %.1fs for another encoder of %s; encoding here", wait_timeout_s, key
                    )
                    break
                waited = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ready.wait(), min(self._config.poll_interval_s, remaining))
        return await self._compute_and_store(key, compute, write_behind), _Source.COMPUTED

    async def _compute_and_store(self, key: str, compute: ComputeFn, write_behind: bool) -> torch.Tensor:
        """Compute without the lock (Redis down, or another holder hung past the wait) and store."""
        self._counters.compute()
        tensor = as_cached_tensor(await compute())
        self._lru.put(key, tensor, tensor_nbytes(tensor))
        await self._write(key, self._remote_put(key, tensor), write_behind)
        return tensor

    async def _compute_locked(self, key: str, compute: ComputeFn, token: str, write_behind: bool) -> torch.Tensor:
        heartbeat = asyncio.create_task(self._keep_lock(key, token))
        try:
            self._counters.compute()
            tensor = as_cached_tensor(await compute())
        except BaseException:
            heartbeat.cancel()
            await self._release(key, token)
            raise
        heartbeat.cancel()
        self._lru.put(key, tensor, tensor_nbytes(tensor))
        await self._write(key, self._store_and_release(key, tensor, token), write_behind)
        return tensor

    async def _write(self, key: str, write: Coroutine[object, None, object], behind: bool) -> None:
        """Await ``write`` (the Redis store, and the lock's release if any), or with ``behind`` leave it to
        a background task in ``_writes``: a caller cancelled from here on leaves the write to it."""
        if not behind:
            await write
            return
        task = asyncio.create_task(write, name=f"encoder-cache-write {key}")
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _store_and_release(self, key: str, tensor: torch.Tensor, token: str) -> None:
        try:
            await self._remote_put(key, tensor)
        finally:
            await self._release(key, token)

    async def _keep_lock(self, key: str, token: str) -> None:
        period = self._config.lock_ttl_s / 3
        while True:
            await asyncio.sleep(period)
            try:
                if not await self._locks.renew(key, token):
                    log.warning("encoder cache: lost the encode lock of %s; another encoder may duplicate it", key)
                    return
            except (RedisError, OSError) as exc:
                log.debug("encoder cache: lock renewal of %s failed: %s", key, exc)
                return

    async def _release(self, key: str, token: str) -> None:
        if not self._health.up:
            return  # the lock expires by itself
        try:
            await self._locks.release(key, token)
        except (RedisError, OSError) as exc:
            self._failed(exc, "unlock")

    # --- introspection and shutdown ----------------------------------------------

    def stats(self) -> dict[str, int | float | bool | str]:
        return {
            "backend": "redis",
            "entries": len(self._lru),
            "bytes": self._lru.nbytes,
            "max_bytes": self._lru.max_bytes,
            "expirations": self._lru.expirations,
            "in_flight": self.in_flight,
            "shared": self._health.up,
            "redis_up": self._health.up,
            **self._counters.as_dict(),
        }

    async def close(self) -> None:
        if self._writes:   # pending write-behinds: each ends by itself (Redis calls are bounded)
            await asyncio.gather(*self._writes, return_exceptions=True)
        await self._notifier.close()
        self._lru.clear()
        if self._owns_client:
            await self._client.aclose()
