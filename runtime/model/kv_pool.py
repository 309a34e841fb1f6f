"""A KV block pool: one preallocated tensor, handed out in fixed-size blocks.

Layout (``kv_layout.PageGroups``; addressing and copies in ``kv_pool_io``)::

    kv[page_slot, k_or_v, block, offset_in_block, kv_head, head_dim]

``page_slot`` is the layer on a dense pool (every layer in every block); on a windowed
pool a block holds ``page_layers`` layers of one page group (below). Layers of
different sizes (Gemma 4) share the tensor as ``[..., 1, slot_elems]``, each using
the first ``layer_elems`` values (``layer_kv``: per-layer views). A token at position ``p`` of a sequence whose block table is ``blocks`` lives in
flat slot ``blocks[p // block_size] * block_size + p % block_size``. A KV chunk
on the wire is ``[layers, 2, tokens, kv_heads, head_dim]``: on a dense pool of
one layer size exactly the per-slot layout, so landing a chunk is one indexed copy
into the pool; otherwise the per-layer wire form (``read_wire``) is used.

Ownership: ``allocate`` hands blocks to exactly one caller and tags every one of
them with that caller's **owner token** (a number never reused in the pool's life);
``free`` returns them and clears the tag. Every write names its token: ``write``,
``host_views`` and ``check_owner`` (the decode scheduler's check before each step)
raise ``StaleBlocksError`` and touch nothing when a block no longer carries it, so
a holder whose blocks were freed, and perhaps handed to someone else meanwhile,
can never write into them. ``retag`` moves an allocation to a new token (a new
transfer generation into the same blocks: the old generation's writes are fenced).
Freeing a block twice raises (double free is a bookkeeping bug, never ignored).
Capacity is counted in blocks; nothing is allocated per request after start-up.

Sliding-window layers (Gemma 3; ``KVLayout.sliding_layers``, ``sliding_window`` W): a
query at position ``p`` of such a layer reads no key before ``p - W + 1``, so after a
prompt of ``n`` tokens decode needs those layers' KV only from ``window_from(n) =
n - W + 1`` on. The handoff sends no more (``*_wire`` and ``host_views`` with
``layer_from``: per layer, the first position carried). With ``window_chunk`` set (the
longest run of new positions one forward writes for a sequence: the prompt chunk, or
an image span the chunker keeps whole) the pool keeps no more either: its pages are
grouped (``kv_layout.PageGroups``), the full-attention layers in group 0 with the
sequence's block table ``blocks``, the sliding layers in ring groups, each with a ring
of ``ring_blocks(tokens, chunk)`` pages (``rings``, one list per ring group). Position
``p`` of a ring lives in page ``ring[(p // block_size) % len(ring)]``. Invariant: a
ring holds ``len(ring) * block_size >= W + chunk - 1`` positions (or every position of
the sequence), so the positions a forward reads (its chunk and the ``W - 1`` before
it) never share a slot, and a slot holds its newest position; older positions of the
ring's pages are masked by the window and never read. Every method that addresses a
sequence takes its ``rings`` beside ``blocks``; a windowed pool's prefix cache is off
(a cached prefix would lack its sliding layers' older KV).

Prefix cache (``prefix_cache=True``): a block is FREE, OWNED (one owner token, writable)
or CACHED (tag ``CACHED``: immutable KV under a key, ``runtime/model/prefix_keys.py``,
shared by reference count). ``cache`` turns a retiring holder's full prompt blocks into
CACHED ones (a key already cached frees the copy); ``acquire`` takes references on the
longest cached chain of keys, ``unref`` drops them. A CACHED block nobody references is
on the LRU list and is evicted (its key forgotten, the block FREE) only when ``allocate``
needs it: a reservation always wins over cached KV, and a referenced block is never
evicted. ``free_blocks`` counts FREE blocks, ``cached_blocks`` CACHED ones; at rest
(nothing held) ``free_blocks + cached_blocks == num_blocks``. ``available_blocks``
(FREE + unreferenced CACHED) is what an allocation can take.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
import torch

from runtime.model.kv_layout import KVLayout, PageGroups
from runtime.model.kv_pool_io import KVPoolIO, Rings

__all__ = ["CACHED", "FREE", "KVBlockPool", "KVLayout", "PageGroups", "Rings", "StaleBlocksError"]


FREE = 0   # the owner token of a free block; issued tokens start at 1
CACHED = -1  # the tag of a block in the prefix cache (shared, read-only)


class StaleBlocksError(RuntimeError):
    """A write, view or free named blocks that no longer belong to the caller's owner token."""


class KVBlockPool(KVPoolIO):
    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int = 16, device: str | torch.device = "cpu",
                 prefix_cache: bool = False, window_chunk: int | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.layout = layout
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.groups = PageGroups.for_layout(layout, window_chunk is not None)
        self.window_chunk = window_chunk if self.groups.windowed else None
        if self.groups.windowed and prefix_cache:
            raise ValueError("a pool that keeps only the sliding window cannot cache prefixes")
        g, storage = self.groups.page_layers, layout.storage_shape
        self.kv = torch.zeros((g, 2, num_blocks, block_size, *storage), dtype=layout.dtype, device=device)
        self._flat = self.kv.view(g, 2, num_blocks * block_size, *storage)
        # per model layer: its K/V blocks [2, blocks, block_size, kv_heads, head_dim] and flat slots [2, slots, elems]
        self.layer_kv = [self._layer_view(layer) for layer in range(layout.layers)]
        self._lflat = [view.flatten(3).flatten(1, 2) for view in self.layer_kv]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._owner = [FREE] * num_blocks      # owner token per block
        self._tokens = itertools.count(FREE + 1)
        self.prefix_cache = prefix_cache
        self._key: list[bytes | None] = [None] * num_blocks    # a CACHED block's key
        self._refs = [0] * num_blocks                          # a CACHED block's holders
        self._by_key: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()      # CACHED, unreferenced; first = evicted first
        self.evicted_total = 0
        self.cache_version = 0      # bumped whenever the set of cached keys changes

    @classmethod
    def from_memory_budget(cls, layout: KVLayout, budget_bytes: int, block_size: int = 16, device="cpu",
                           prefix_cache: bool = False, window_chunk: int | None = None) -> "KVBlockPool":
        page = PageGroups.for_layout(layout, window_chunk is not None).page_layers * layout.layer_token_bytes * block_size
        num_blocks = budget_bytes // page
        if num_blocks < 1:
            raise ValueError(f"KV memory budget {budget_bytes} B is smaller than one block ({page} B)")
        return cls(layout, int(num_blocks), block_size, device, prefix_cache, window_chunk)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block (page): ``page_layers`` layers' K and V of ``block_size`` positions."""
        return self.groups.page_layers * self.layout.layer_token_bytes * self.block_size

    # -- capacity ---------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def free_blocks(self) -> int:
        """FREE blocks (holding nothing)."""
        return len(self._free)

    @property
    def cached_blocks(self) -> int:
        """CACHED blocks, referenced or not."""
        return len(self._by_key)

    @property
    def available_blocks(self) -> int:
        """What an allocation can take now: FREE blocks plus unreferenced CACHED ones (evicted on demand)."""
        return len(self._free) + len(self._lru)

    def ring_blocks(self, tokens: int, chunk: int | None = None) -> int:
        """Pages of one ring of a ``tokens``-position sequence whose forwards write at most ``chunk``
        (default ``window_chunk``) new positions: enough for ``W + chunk - 1`` positions, never more
        than the sequence has (0 on a dense pool)."""
        if not self.groups.windowed:
            return 0
        chunk = self.window_chunk if chunk is None else chunk
        return min(self.blocks_for(tokens), self.blocks_for(self.layout.sliding_window + chunk - 1))

    @property
    def ring_blocks_max(self) -> int:
        """The most pages one ring of this pool's sequences holds (0 on a dense pool)."""
        return self.ring_blocks(1 << 40)

    def pages_for(self, tokens: int, chunk: int | None = None) -> int:
        """Every page one sequence of ``tokens`` positions holds: its block table and its rings."""
        return self.blocks_for(tokens) + self.groups.window_groups * self.ring_blocks(tokens, chunk)

    def split_rings(self, pages: list[int], per_ring: int) -> Rings:
        """``window_groups`` rings of ``per_ring`` pages each, from ``pages`` (exactly that many)."""
        if len(pages) != self.groups.window_groups * per_ring:
            raise ValueError(f"{len(pages)} pages for {self.groups.window_groups} rings of {per_ring}")
        return [pages[i * per_ring: (i + 1) * per_ring] for i in range(self.groups.window_groups)]

    def allocate_sequence(self, tokens: int, owner: int | None = None,
                          chunk: int | None = None) -> tuple[list[int], Rings] | None:
        """A block table and rings for ``tokens`` positions under one owner token (``None``: no room)."""
        per_ring = self.ring_blocks(tokens, chunk)
        pages = self.allocate_blocks(self.pages_for(tokens, chunk), owner)
        if pages is None:
            return None
        n = self.blocks_for(tokens)
        return pages[:n], self.split_rings(pages[n:], per_ring)

    def can_allocate(self, tokens: int) -> bool:
        """Side-effect free probe."""
        return self.pages_for(tokens) <= self.available_blocks

    def new_token(self) -> int:
        """A fresh owner token, never issued before by this pool."""
        return next(self._tokens)

    def allocate(self, tokens: int, owner: int | None = None) -> list[int] | None:
        """Blocks for ``tokens`` positions tagged with ``owner`` (a fresh token when ``None``),
        or ``None`` when they do not fit (nothing taken)."""
        return self.allocate_blocks(self.blocks_for(tokens), owner)

    def allocate_blocks(self, need: int, owner: int | None = None) -> list[int] | None:
        """``need`` blocks tagged with ``owner``, evicting unreferenced cached blocks (least recently
        used first) when too few are free; ``None`` when they do not fit (nothing taken or evicted)."""
        if need > self.available_blocks:
            return None
        owner = self.new_token() if owner is None else owner
        if owner <= FREE:
            raise ValueError("owner tokens 0 and -1 mean free and cached; take one from new_token()")
        while len(self._free) < need:
            self._evict_one()
        blocks = [self._free.pop() for _ in range(need)]
        for b in blocks:
            self._owner[b] = owner
        return blocks

    def free(self, blocks: list[int], owner: int | None = None) -> None:
        """Return blocks (checked against ``owner`` first when given: nothing is freed on a
        mismatch). Pushed last-first, so the next ``allocate`` pops them back in their old
        order: a freed sequence's adjacent blocks stay adjacent for the next owner."""
        if owner is not None:
            self.check_owner(blocks, owner, "free")
        for b in reversed(blocks):
            if self._owner[b] == FREE:
                raise RuntimeError(f"KV block {b} freed twice")
            if self._owner[b] == CACHED:
                raise RuntimeError(f"KV block {b} is cached: drop a reference with unref()")
            self._owner[b] = FREE
            self._free.append(b)

    # -- prefix cache -------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` are cached (no side effect)."""
        n = 0
        for key in keys:
            if key not in self._by_key:
                break
            n += 1
        return n

    def acquire(self, keys: list[bytes]) -> list[int]:
        """A reference on each block of the longest cached chain of ``keys`` (none taken past the
        first miss); the blocks leave the LRU list while referenced."""
        blocks = [self._by_key[key] for key in keys[: self.lookup(keys)]]
        for b in blocks:
            self._refs[b] += 1
            self._lru.pop(b, None)
        return blocks

    def unref(self, blocks: list[int]) -> None:
        """Drop one reference per block (deepest first onto the LRU list, so a chain is evicted from its tail)."""
        for b in blocks:
            if self._owner[b] != CACHED or self._refs[b] < 1:
                raise RuntimeError(f"KV block {b} is not a referenced cached block")
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._lru[b] = None

    def cache(self, blocks: list[int], keys: list[bytes], owner: int) -> None:
        """Hand ``owner``'s ``blocks`` (full, written) to the cache under ``keys``, unreferenced; a
        block whose key is already cached (or every block, with the cache off) is freed instead."""
        if len(blocks) != len(keys):
            raise ValueError(f"{len(blocks)} blocks for {len(keys)} keys")
        self.check_owner(blocks, owner, "cache")
        for b, key in zip(reversed(blocks), reversed(keys)):
            if not self.prefix_cache or key in self._by_key:
                self._owner[b] = FREE
                self._free.append(b)
                continue
            self._owner[b], self._key[b], self._refs[b] = CACHED, key, 0
            self._by_key[key] = b
            self._lru[b] = None
            self.cache_version += 1

    def _evict_one(self) -> None:
        b, _ = self._lru.popitem(last=False)
        del self._by_key[self._key[b]]
        self._key[b], self._owner[b] = None, FREE
        self._free.append(b)
        self.evicted_total += 1
        self.cache_version += 1

    def summary(self) -> list[bytes]:
        """Every cached key (what this pool can serve a prefix from)."""
        return list(self._by_key)

    # -- ownership fence ----------------------------------------------------------
    def owner_of(self, block: int) -> int:
        """The block's owner token (``FREE`` when free)."""
        return self._owner[block]

    def owns(self, blocks: list[int], owner: int) -> bool:
        """Whether every block in ``blocks`` still carries ``owner``. Per block, never per token."""
        tags = self._owner
        return owner != FREE and all(tags[b] == owner for b in blocks)

    def check_owner(self, blocks: list[int], owner: int, what: str = "write") -> None:
        """Raise ``StaleBlocksError`` unless every block still carries ``owner``."""
        if not self.owns(blocks, owner):
            lost = next((b for b in blocks if self._owner[b] != owner), None)
            raise StaleBlocksError(f"{what} refused: KV block {lost} no longer belongs to owner {owner}")

    def retag(self, blocks: list[int], old: int, new: int) -> None:
        """Move an allocation from token ``old`` to ``new`` (checked): writes under ``old`` are fenced."""
        if new == FREE:
            raise ValueError("cannot retag blocks as free; use free()")
        self.check_owner(blocks, old, "retag")
        for b in blocks:
            self._owner[b] = new
