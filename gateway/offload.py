"""Where a request's CPU work runs: on the event loop when it is small, else in a worker thread.

The gateway's per-request CPU work (the prompt-length check, each image's decode, its cache key,
the prompt's template and tokens) used to go to a thread every time, so that a large image or a
long document never stalls the loop that streams every other request's tokens. A hop is two
cross-thread wake-ups (the executor's, then the loop's self-pipe) and the GIL handed back and
forth: 0.06-0.1 ms each on an idle 2-vCPU guest, more once other processes share the cores,
against 0.02 ms to decode a 48 x 48 PNG. One request at a time, the four hops of a chat request
with one small image were 0.8 ms of a 9.8 ms first token (``bench.epd_ab``, 6 rounds; see
bench/RESULTS.md).

So work whose input is small runs where it is, and the rest still goes to a thread:

- text: at most ``INLINE_MAX_TEXT_CHARS`` characters in all (templating and tokenizing a few
  thousand characters is tens of microseconds);
- images: at most ``INLINE_MAX_PIXELS`` pixels in all, judged from each header before anything is
  decoded (a decode costs by pixels, not by bytes: a flat 2000 x 2000 PNG is a few KiB); a
  request's images, loaded side by side, get an equal share of that bound each.

The bound on what a request may hold the loop for is then about a millisecond (a 256 x 256 PNG
decodes in 0.9 ms on this host class), never a large image's decode.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

INLINE_MAX_TEXT_CHARS = 8192
INLINE_MAX_PIXELS = 256 * 256


def small_text(texts: Iterable[str]) -> bool:
    """Whether ``texts`` together are short enough to template and tokenize on the loop."""
    total = 0
    for text in texts:
        total += len(text)
        if total > INLINE_MAX_TEXT_CHARS:
            return False
    return True


def small_images(sizes: Iterable[tuple[int, int]], limit: int | None = None) -> bool:
    """Whether images of these ``(width, height)`` together are small enough to decode and hash on the loop
    (``limit`` pixels; default ``INLINE_MAX_PIXELS``: a request's images loaded one by one get a share each)."""
    return sum(w * h for w, h in sizes) <= (INLINE_MAX_PIXELS if limit is None else limit)


async def run(inline: bool, fn: Callable[..., T], /, *args) -> T:
    """``fn(*args)`` here when ``inline``, else in the loop's default thread pool."""
    if inline:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)
