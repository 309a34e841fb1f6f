"""A worker's model calls share one thread (``runtime/worker/torch_thread.py``): one OpenMP team per process.

The failure this guards against was silent: forwards spread over the default executor's
threads each grew their own OpenMP team, which spun against the others. Checked here: every
call, from any number of concurrent tasks, runs on the one thread, one at a time and in
submission order, in its caller's context.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

import pytest
import torch

from runtime.worker import torch_thread

REQUEST = contextvars.ContextVar("request", default="")


def test_concurrent_calls_run_on_one_thread_in_order_with_their_context():
    active = []
    seen: list[tuple[str, str]] = []

    def work(name: str) -> str:
        active.append(name)
        assert len(active) == 1, "two calls overlapped"
        time.sleep(0.005)
        seen.append((threading.current_thread().name, REQUEST.get()))
        active.remove(name)
        return name

    async def one(i: int) -> str:
        REQUEST.set(f"r{i}")
        return await torch_thread.run(work, f"call{i}")

    async def main():
        return await asyncio.gather(*(one(i) for i in range(8)))

    assert asyncio.run(main()) == [f"call{i}" for i in range(8)]
    assert {name for name, _ in seen} == {seen[0][0]} and seen[0][0].startswith("epd-torch")
    assert [ctx for _, ctx in seen] == [f"r{i}" for i in range(8)]


def test_an_exception_reaches_the_caller_and_the_thread_goes_on():
    def boom():
        raise ValueError("bad input")

    async def main():
        with pytest.raises(ValueError, match="bad input"):
            await torch_thread.run(boom)
        return await torch_thread.run(lambda: torch.ones(2).sum().item())

    assert asyncio.run(main()) == 2.0

