"""Worker discovery through Redis: register with a heartbeat and a TTL.

A worker writes ``epd:workers:<role>:<address>`` with a TTL a few heartbeats
long and refreshes it; a dead worker's key expires by itself. The gateway lists
the keys to find replicas (``docker compose up --scale decode=3``); workers list them
too, to check the peers a request names (``runtime/peers.py``).
Redis being briefly unreachable is tolerated: the worker keeps retrying.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import redis.asyncio as aioredis

log = logging.getLogger("epd.discovery")

KEY_PREFIX = "epd:workers"


def worker_key(role: str, address: str) -> str:
    return f"{KEY_PREFIX}:{role}:{address}"


class WorkerRegistration:
    def __init__(self, redis_url: str, role: str, address: str, heartbeat_s: float = 2.0):
        self._redis = aioredis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self.key = worker_key(role, address)
        self.role, self.address, self.heartbeat_s = role, address, heartbeat_s
        self._task: asyncio.Task | None = None
        self._stopping = False

    async def _beat_once(self) -> None:
        value = json.dumps({"role": self.role, "address": self.address, "ts": time.time()})
        await self._redis.set(self.key, value, px=int(self.heartbeat_s * 3000))

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self._beat_once()
            except Exception as exc:  # Redis down: keep serving, keep trying
                log.warning("registration heartbeat failed: %s", exc)
            await asyncio.sleep(self.heartbeat_s)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Deregister. Every wait is bounded: a cancel landing inside redis-py can be swallowed."""
        self._stopping = True
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._task, 5.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._redis.delete(self.key), 2.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._redis.aclose(), 2.0)


async def list_workers(redis: aioredis.Redis, role: str) -> list[str]:
    """Addresses of live workers of ``role``."""
    addresses = []
    async for key in redis.scan_iter(match=f"{KEY_PREFIX}:{role}:*", count=200):
        key = key.decode() if isinstance(key, bytes) else key
        addresses.append(key.split(":", 3)[3])
    return sorted(addresses)
