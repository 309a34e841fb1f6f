"""Which peers a worker may dial: the ones discovery lists, never one a request names.

Requests name peers (``PrefillRequest.decode_address``, ``ImageRef.encoder_address``).
A worker dials one only when it is in discovery:

- the static lists ``EPD_ENCODER_ADDRS`` / ``EPD_DECODE_ADDRS`` (the gateway's names and
  comma format; ``epd serve`` passes the same lists to every child), and
- with ``EPD_REDIS_URL``, the Redis worker registry (``runtime/discovery.py``).

Registry answers are cached per role for ``ttl_s``; an address missing from the cache
(or a cache older than that) triggers one refresh, shared by every caller waiting on it,
so a worker that registered a moment ago is found. When Redis cannot be read the last
answer stands: known peers keep working, unknown ones stay refused. With neither a
static list nor Redis, every named peer is refused and the message says to configure
discovery. A refused address is never dialled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from enum import StrEnum

import redis.asyncio as aioredis

from runtime.worker.discovery import list_workers

log = logging.getLogger("epd.peers")


class PeerRole(StrEnum):
    ENCODER = "encoder"
    DECODE = "decode"


_ENV = {PeerRole.ENCODER: "EPD_ENCODER_ADDRS", PeerRole.DECODE: "EPD_DECODE_ADDRS"}


class UnknownPeerError(RuntimeError):
    """A request named a peer that discovery does not list; nothing was dialled."""


class PeerDirectory:
    """The addresses this worker may dial, per role. Owns its Redis client; ``close()`` ends it."""

    def __init__(self, static: Mapping[PeerRole, Iterable[str]], redis_url: str | None, *, ttl_s: float = 2.0):
        self._static = {role: frozenset(static.get(role, ())) for role in PeerRole}
        self._redis = aioredis.from_url(redis_url, socket_timeout=1, socket_connect_timeout=1) if redis_url else None
        self.ttl_s = ttl_s
        self._registered: dict[PeerRole, frozenset[str]] = {role: frozenset() for role in PeerRole}
        self._fetched_at: dict[PeerRole, float] = {role: float("-inf") for role in PeerRole}
        self._refreshing: dict[PeerRole, asyncio.Task] = {}

    @classmethod
    def for_settings(cls, settings) -> "PeerDirectory":
        return cls({PeerRole.ENCODER: settings.encoder_addrs, PeerRole.DECODE: settings.decode_addrs},
                   settings.redis_url)

    @property
    def configured(self) -> bool:
        return self._redis is not None or any(self._static.values())

    async def require(self, role: PeerRole, address: str) -> None:
        """Return when ``address`` is a discovered ``role`` worker; else raise ``UnknownPeerError``."""
        if address in self._static[role]:
            return
        if not self.configured:
            raise UnknownPeerError(
                f"refusing to dial {role} {address!r} named in the request: this worker has no peer discovery "
                f"configured (set {_ENV[role]} or EPD_REDIS_URL)")
        if self._redis is not None:
            if address in self._registered[role]:
                if time.monotonic() - self._fetched_at[role] >= self.ttl_s:
                    self._refresh(role)              # known: serve now, refresh beside it
                return
            await self._refresh(role)                # a miss waits for a fresh answer
            if address in self._registered[role]:
                return
        where = f"{_ENV[role]}" + (" or the Redis registry" if self._redis is not None else "")
        raise UnknownPeerError(f"unknown {role} peer {address!r}: not in {where}; not dialled")

    def _refresh(self, role: PeerRole) -> asyncio.Future:
        """The role's registry read in progress, or a new one: one at a time per role."""
        task = self._refreshing.get(role)
        if task is None:
            task = asyncio.ensure_future(self._fetch(role))
            self._refreshing[role] = task
            task.add_done_callback(lambda _t: self._refreshing.pop(role, None))
        return asyncio.shield(task)

    async def _fetch(self, role: PeerRole) -> None:
        try:
            self._registered[role] = frozenset(await list_workers(self._redis, role.value))
        except Exception as exc:  # Redis unreachable: the last answer stands
            log.warning("peer discovery through Redis failed (%s); using the last known %s list", exc, role)
        self._fetched_at[role] = time.monotonic()

    async def close(self) -> None:
        for task in list(self._refreshing.values()):
            task.cancel()
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._redis.aclose(), 2.0)
