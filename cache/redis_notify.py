"""Wake-ups for single-flight waiters: one pub/sub subscription per cache.

One background task holds one Redis connection subscribed to the
namespace's ready channel (``cache.redis_lock.ready_channel``) and sets the
``asyncio.Event`` of every local waiter watching the published content key.

Invariants:

* Delivery is best effort (Redis pub/sub drops messages while a subscriber
  is disconnected); waiters must also poll. A lost message costs at most one
  poll interval, never a hang.
* The listener starts on the first ``watch`` and resubscribes by itself
  after a connection loss; it logs at debug level only, since the data path
  already counts and logs Redis outages.
* ``watch`` registers before the caller checks Redis, so a publish after the
  check is never missed while the subscription is live; every (re)subscription
  wakes all current waiters once, so one published before it is not missed
  either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from redis.asyncio import Redis
from redis.exceptions import RedisError

log = logging.getLogger("epd.cache")


class ReadyNotifier:
    def __init__(self, client: Redis, channel: str, *, retry_interval_s: float) -> None:
        self._client = client
        self._channel = channel
        self._retry_interval_s = retry_interval_s
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @contextlib.contextmanager
    def watch(self, key: str) -> Iterator[asyncio.Event]:
        """An event set whenever ``key`` is published while the block runs."""
        self._ensure_listening()
        event = asyncio.Event()
        self._waiters.setdefault(key, set()).add(event)
        try:
            yield event
        finally:
            events = self._waiters.get(key)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiters[key]

    def _ensure_listening(self) -> None:
        if self._closed or (self._task is not None and not self._task.done()):
            return
        self._task = asyncio.get_running_loop().create_task(self._listen(), name=f"epd-cache-notify:{self._channel}")

    def _wake(self, key: bytes) -> None:
        for event in self._waiters.get(key.decode(errors="replace"), ()):
            event.set()

    def _wake_all(self) -> None:
        for events in self._waiters.values():
            for event in events:
                event.set()

    async def _listen(self) -> None:
        while not self._closed:
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._channel)
                self._wake_all()  # anything published before this subscription was live: re-check
                # redis-py 8.1 can swallow a cancellation that lands inside subscribe():
                # the flag, checked after every await, ends the loop regardless.
                while not self._closed:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        self._wake(message["data"])
            except (RedisError, OSError) as exc:
                log.debug("encoder cache: ready-channel subscription lost (%s); resubscribing", exc)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()
            if not self._closed:
                await asyncio.sleep(self._retry_interval_s)

    async def close(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=2.0)  # the flag ends it within one read timeout
            if not task.done():
                task.cancel()
                log.debug("encoder cache: ready-channel listener slow to stop")
        self._wake_all()
