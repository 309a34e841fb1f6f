"""A scheduler's background loop task: started once, cancelled on stop, never dying silently.

A crash of the loop would otherwise stay invisible (the task object is held, so
asyncio never reports its exception) while every request behind it waits for its
deadline. This helper logs it loudly the moment it happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine

log = logging.getLogger("epd.loop")


def start_loop(coro: Coroutine, name: str) -> asyncio.Task:
    task = asyncio.create_task(coro, name=name)
    task.add_done_callback(_log_if_crashed)
    return task


async def stop_loop(task: asyncio.Task | None) -> None:
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _log_if_crashed(task: asyncio.Task) -> None:
    """The loop only ends by cancellation; anything else is a bug that must be visible."""
    if not task.cancelled() and task.exception() is not None:
        log.critical("%s crashed", task.get_name(), exc_info=task.exception())
