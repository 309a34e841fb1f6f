"""The encoder-cache interface every backend implements, and the types it uses.

A cache maps a content key (``cache.keys``) to one embedding tensor per image.
Entries are immutable: one key always names the same embedding, so any copy
of an entry, wherever it is held, is a correct answer.

Contract shared by all backends:

* Every method may be called while the shared tier (Redis) is down: it never
  raises because of it; it counts the error and serves from this process.
* Tensors handed to ``put`` or returned by ``get``/``get_or_compute`` are
  shared with the cache, on the CPU, and must be treated as read-only.
* ``get_or_compute`` runs ``compute`` at most once per key among concurrent
  callers of this process (and, with Redis, of every process) and stores its
  result before returning it (in this process; with ``write_behind`` the
  shared tier's copy follows).
* An entry that disappears between ``contains`` and ``get`` (expiry,
  eviction, a partial write) is a miss, never an error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch

ComputeFn = Callable[[], Awaitable[torch.Tensor]]


class Fetched(NamedTuple):
    """Result of ``get_or_compute``: ``hit`` is True when this caller did not run ``compute``."""

    tensor: torch.Tensor
    hit: bool


@runtime_checkable
class EncoderCache(Protocol):
    @property
    def backend(self) -> str:
        """``"memory"`` or ``"redis"``."""
        ...

    @property
    def shared(self) -> bool:
        """True while entries written now are readable by other processes (advisory)."""
        ...

    @property
    def in_flight(self) -> int:
        """Keys with a single-flight computation in progress in this process (0 when idle)."""
        ...

    async def get(self, key: str) -> torch.Tensor | None: ...

    async def put(self, key: str, tensor: torch.Tensor) -> bool:
        """Store; True when the entry reached the shared tier (always False for memory)."""
        ...

    async def contains(self, key: str) -> bool: ...

    async def contains_many(self, keys: Sequence[str]) -> list[bool]: ...

    async def get_or_compute(
        self, key: str, compute: ComputeFn, *, wait_timeout_s: float | None = None,
        missed: bool = False, write_behind: bool = False,
    ) -> Fetched:
        """The entry, computed once among concurrent callers when absent. ``missed``: the caller's
        ``get`` has just missed it (the shared tier is not read again first); ``write_behind``: return
        before the shared tier's write (then readable from this process until it lands)."""
        ...

    def stats(self) -> dict[str, int | float | bool | str]: ...

    async def close(self) -> None: ...


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def as_cached_tensor(tensor: object) -> torch.Tensor:
    """The CPU, contiguous, grad-free form the cache stores (no copy when already so)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"an encoder-cache value must be a torch.Tensor, got {type(tensor).__name__}")
    return tensor.detach().to("cpu").contiguous()


def check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"cache key must be a non-empty string, got {key!r}")
    return key
