"""Independent copies of one processor, so prompt builds run in parallel.

A fast (Rust) tokenizer raises "Already borrowed" when one thread reconfigures
it while another encodes (huggingface/tokenizers#537), and one copy behind a
lock made every request wait for the one before it. Each build leases its own
copy instead; the Rust tokenizer releases the GIL while it encodes, so builds
really overlap.

Lifecycle: ``lease()`` hands out an idle copy (the original processor first)
and takes it back when the block exits, whatever happened inside. When every
copy is busy a new one is made, by ``copy.deepcopy`` of a pristine copy that
no build ever uses (so it is never copied mid-encode). Copies are kept: the
pool grows to the peak number of builds in flight, which its caller bounds
(``ChatHandler``: ``settings.prompt_workers`` in threads, plus one small build at a time on the
event loop, ``gateway.offload``).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class ProcessorPool:
    def __init__(self, processor: Any):
        self._pristine = copy.deepcopy(processor)   # only ever copied, under the lock
        self._idle: list[Any] = [processor]
        self._lock = threading.Lock()
        self.size = 1

    @contextmanager
    def lease(self) -> Iterator[Any]:
        with self._lock:
            if self._idle:
                processor = self._idle.pop()
            else:
                processor = copy.deepcopy(self._pristine)
                self.size += 1
        try:
            yield processor
        finally:
            with self._lock:
                self._idle.append(processor)
