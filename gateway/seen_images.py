"""Which encoder-cache keys this gateway has already sent to an encoder: a hint, never a verdict.

Before admission the gateway wants to know which of a request's images are
already encoded (a hit costs no encoder time). Asking the encoder (``Cached``)
is one RPC per request. For an image this gateway has never sent, the answer is
almost always "no", so it skips the question, counts the image as a miss (a
pessimistic estimate) and lets ``Encode`` find out: ``Encode`` consults the
cache itself and reports each image's ``cache_hit``. Only images seen before
are checked with ``Cached``.

Invariants: at most ``capacity`` keys are kept, least recently seen evicted
first; a wrong hint costs at most one RPC or a pessimistic estimate, never a
wrong embedding (the encoder, not this set, decides what is cached).
Single event loop, no locks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class SeenImages:
    def __init__(self, capacity: int = 65536):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def seen(self, key: str) -> bool:
        return key in self._keys

    def add(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
