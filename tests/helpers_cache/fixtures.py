"""Fixtures and helpers shared by the encoder-cache tests (imported by the test modules).

Everything runs against real Redis servers: the shared one on 127.0.0.1:6379
(each test in its own namespace, deleted afterwards), or a private
``redis-server`` this helper starts on a free port when a test must kill it.
"""

from __future__ import annotations

import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis
import torch

from cache import EncoderCache, open_encoder_cache

REDIS_URL = "redis://127.0.0.1:6379/0"


def tensor(seed: float = 0.0, rows: int = 16, cols: int = 32, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + seed).to(dtype)


class Encoder:
    """A fake encoder: counts its runs, optionally sleeps or fails."""

    def __init__(self, value: torch.Tensor | None = None, *, delay_s: float = 0.0, error: Exception | None = None):
        self.value = tensor() if value is None else value
        self.delay_s = delay_s
        self.error = error
        self.calls = 0

    async def __call__(self) -> torch.Tensor:
        import asyncio

        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        return self.value


async def must_not_compute() -> torch.Tensor:
    raise AssertionError("compute ran although the entry was cached")


def delete_namespace(url: str, namespace: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        for name in client.scan_iter(match=f"{namespace}:*", count=1000):
            client.delete(name)
    finally:
        client.close()


@pytest.fixture
def namespace() -> Iterator[str]:
    ns = f"epdtest:{uuid.uuid4().hex[:12]}"
    yield ns
    delete_namespace(REDIS_URL, ns)


@pytest.fixture
def raw(namespace: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


@pytest.fixture
async def open_cache(namespace: str) -> AsyncIterator[Callable[..., EncoderCache]]:
    """``open_cache(**settings)``: a Redis-backed cache in the test's namespace, closed afterwards."""
    opened: list[EncoderCache] = []

    def _open(url: str | None = REDIS_URL, **settings: Any) -> EncoderCache:
        settings.setdefault("max_bytes", 1 << 24)
        settings.setdefault("ttl_s", 60.0)
        settings.setdefault("poll_interval_s", 0.05)
        cache = open_encoder_cache(url, namespace=settings.pop("namespace", namespace), **settings)
        opened.append(cache)
        return cache

    yield _open
    for cache in opened:
        await cache.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A private redis-server (no persistence) that a test may kill and restart on the same port."""

    def __init__(self, *extra_args: str) -> None:
        self.port = free_port()
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--daemonize", "no", *self.extra_args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 5
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)
