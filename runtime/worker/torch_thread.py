"""The one thread a worker process runs its model work on.

PyTorch's CPU kernels parallelise with OpenMP, and OpenMP keeps a team of worker threads per
calling thread. ``asyncio.to_thread`` hands each call to whichever thread of the loop's default
executor is free, so a worker that ran its forwards there grew one team per executor thread
(measured: 13 busy threads in a bench-model decode worker with 2 torch threads), and each
team's idle threads spin while another team computes, on cores the computing team needs.
Every model call of a worker (load, encode, prepare, forward) goes through ``run`` instead:
one thread, one OpenMP team, calls run one at a time in the order they were submitted.

Where ``EPD_MODEL_CORES`` is set (``epd serve --cpu-bind reserve``), the thread binds itself to those
cores as it starts, so its OpenMP team (started by it, inheriting the binding) computes there
while the process's other threads (event loop, gRPC) stay on the process's own cores: nothing of
the worker's RPC work preempts the model's cores, and no GIL hand-off waits on a core the model
holds. The value was checked when the process started (``launcher.cli``).

Lifecycle: the thread starts on the first call and lives as long as the process (a daemon of
the executor); nothing on it may wait for the event loop, which awaits it.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from runtime.worker.host_cpu import model_cores

T = TypeVar("T")


def _bind_to_model_cores() -> None:
    cores = model_cores()
    if cores:
        os.sched_setaffinity(0, cores)   # 0: the calling thread alone (Linux)


_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epd-torch", initializer=_bind_to_model_cores)


async def run(fn: Callable[..., T], /, *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on the torch thread, in the caller's context (as ``asyncio.to_thread``)."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_EXECUTOR, call)
