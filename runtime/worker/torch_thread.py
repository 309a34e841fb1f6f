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

A call reaches the thread through a pipe: the loop appends it to ``_calls`` and writes a byte, and
Python makes that write with the GIL released. An executor wakes its thread with a lock release made
holding the GIL, so where the loop and this thread share a core (the demo model's decode worker) the
woken thread ran first, found the GIL taken, and the two traded the core and the GIL before the call
started. The result goes back by the loop's ``call_soon_threadsafe``, as an executor's does (a pipe
that way too served fewer demo requests/s under load: bench/RESULTS.md).

Lifecycle: the thread starts on the first call and lives as long as the process (a daemon); nothing
on it may wait for the event loop, which awaits it. Calls wait in ``_calls`` until the thread takes
them, in order; a call whose caller was cancelled before that is skipped, one cancelled while it runs
has its result dropped. A call of a loop that has closed meanwhile is not settled.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from runtime.worker.host_cpu import model_cores

T = TypeVar("T")


def _bind_to_model_cores() -> None:
    cores = model_cores()
    if cores:
        os.sched_setaffinity(0, cores)   # 0: the calling thread alone (Linux)


@dataclass(slots=True)
class _Call:
    fn: Callable[[], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    result: Any = None
    error: BaseException | None = None


class _ModelThread:
    """The thread, the pipe that wakes it and the calls waiting for it (one per process: ``_THREAD``)."""

    def __init__(self) -> None:
        self._calls: deque[_Call] = deque()   # submitted, not yet taken by the thread; one pipe byte each
        self._start = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake_read = self._wake_write = -1

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        self._ensure_started()
        call = _Call(fn, loop.create_future(), loop)
        self._calls.append(call)
        os.write(self._wake_write, b"\0")
        return call.future

    def _ensure_started(self) -> None:
        if self._thread is not None:   # every call after the first: no lock
            return
        with self._start:
            if self._thread is None:
                self._wake_read, self._wake_write = os.pipe()
                self._thread = threading.Thread(target=self._serve, name="epd-torch", daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        _bind_to_model_cores()
        while True:
            os.read(self._wake_read, 1)
            call = self._calls.popleft()
            if call.future.cancelled():   # its caller gave up before it started: nothing to run
                continue
            try:
                call.result = call.fn()
            except BaseException as exc:   # the caller's to handle, as an executor would hand it over
                call.error = exc
            try:
                call.loop.call_soon_threadsafe(_settle, call)
            except RuntimeError:   # its loop has closed meanwhile: nobody waits
                pass


def _settle(call: _Call) -> None:
    if call.future.done():   # cancelled while it ran
        return
    if call.error is not None:
        call.future.set_exception(call.error)
    else:
        call.future.set_result(call.result)


_THREAD = _ModelThread()


async def run(fn: Callable[..., T], /, *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on the torch thread, in the caller's context (as ``asyncio.to_thread``)."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await _THREAD.submit(call)
