"""A KV block pool: one preallocated tensor, handed out in fixed-size blocks.

Layout::

    kv[layer, k_or_v, block, offset_in_block, kv_head, head_dim]

A token at position ``p`` of a sequence whose block table is ``blocks`` lives in
flat slot ``blocks[p // block_size] * block_size + p % block_size``. A KV chunk
on the wire is ``[layers, 2, tokens, kv_heads, head_dim]``: exactly the pool's
per-slot layout, so landing a chunk is one indexed copy into the pool.

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
``layer_from``: per layer, the first position carried). Choice: every layer keeps one
slot per position in the pool (a block holds all layers, so a block cannot be freed for
some layers only); a sliding layer's slots before ``window_from`` stay unwritten on the
receiving side and are never read, because the mask excludes them. The saving is on the
wire, not in the pool, and so the reservation size is unchanged; such a sequence's
blocks are never handed to the prefix cache (a later prompt's chunks would read
positions its sliding layers lack).

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
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one token's KV looks like; also the cache-format part of the fingerprint."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_layers: tuple[int, ...] = ()   # layers with a sliding window (the rest attend to every position)
    sliding_window: int | None = None      # W: a sliding layer at position p reads keys p-W+1..p

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def layer_token_bytes(self) -> int:
        """One layer's K and V of one position."""
        return 2 * self.kv_heads * self.head_dim * self.dtype.itemsize

    def describe(self) -> str:
        base = f"L{self.layers}xKV{self.kv_heads}xD{self.head_dim}:{str(self.dtype).removeprefix('torch.')}"
        if self.sliding_layers:
            base += f":W{self.sliding_window}@{','.join(map(str, self.sliding_layers))}"
        return base

    def window_from(self, prompt_tokens: int) -> int:
        """The first position a sliding layer's KV is needed from once ``prompt_tokens`` are in (0: all)."""
        if not self.sliding_layers or self.sliding_window is None:
            return 0
        return max(0, prompt_tokens - self.sliding_window + 1)

    def layer_from(self, start: int, end: int, sliding_from: int) -> list[int]:
        """Per layer, the first position of ``start..end`` carried when sliding layers start at ``sliding_from``."""
        sliding = set(self.sliding_layers)
        return [min(end, max(start, sliding_from)) if layer in sliding else start for layer in range(self.layers)]

    def wire_bytes(self, start: int, end: int, sliding_from: int = 0) -> int:
        """Bytes of positions ``start..end`` on the wire (sliding layers from ``sliding_from``)."""
        return sum(end - f for f in self.layer_from(start, end, sliding_from)) * self.layer_token_bytes


FREE = 0   # the owner token of a free block; issued tokens start at 1
CACHED = -1  # the tag of a block in the prefix cache (shared, read-only)


class StaleBlocksError(RuntimeError):
    """A write, view or free named blocks that no longer belong to the caller's owner token."""


class KVBlockPool:
    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int = 16, device: str | torch.device = "cpu",
                 prefix_cache: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.layout = layout
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv = torch.zeros(
            (layout.layers, 2, num_blocks, block_size, layout.kv_heads, layout.head_dim), dtype=layout.dtype, device=device
        )
        self._flat = self.kv.view(layout.layers, 2, num_blocks * block_size, layout.kv_heads, layout.head_dim)
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
                           prefix_cache: bool = False) -> "KVBlockPool":
        num_blocks = budget_bytes // (layout.bytes_per_token * block_size)
        if num_blocks < 1:
            raise ValueError(f"KV memory budget {budget_bytes} B is smaller than one block ({layout.bytes_per_token * block_size} B)")
        return cls(layout, int(num_blocks), block_size, device, prefix_cache)

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

    def can_allocate(self, tokens: int) -> bool:
        """Side-effect free probe."""
        return self.blocks_for(tokens) <= self.available_blocks

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

    # -- addressing -------------------------------------------------------------
    def slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """Flat slots of positions ``start..end-1`` in a sequence with block table ``blocks``."""
        if end > len(blocks) * self.block_size or start < 0 or end < start:
            raise IndexError(f"positions {start}..{end} outside {len(blocks)} blocks of {self.block_size}")
        pos = torch.arange(start, end)
        table = torch.tensor(blocks, dtype=torch.long)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.kv.device)

    def runs(self, blocks: list[int], start: int, end: int) -> list[tuple[int, int, int]]:
        """``(position, slot, length)`` runs where consecutive positions sit in consecutive slots.

        Blocks are handed out low ids first, so a sequence's blocks are mostly
        adjacent and a whole chunk is usually one or a few runs: landing it is a
        few plain strided copies instead of a gather/scatter per token.
        """
        if end > len(blocks) * self.block_size or start < 0 or end < start:
            raise IndexError(f"positions {start}..{end} outside {len(blocks)} blocks of {self.block_size}")
        out: list[tuple[int, int, int]] = []
        pos = start
        while pos < end:
            b, off = divmod(pos, self.block_size)
            length = min(self.block_size - off, end - pos)
            slot = blocks[b] * self.block_size + off
            if out and out[-1][1] + out[-1][2] == slot:
                p0, s0, l0 = out[-1]
                out[-1] = (p0, s0, l0 + length)
            else:
                out.append((pos, slot, length))
            pos += length
        return out

    def write(self, blocks: list[int], start: int, chunk: torch.Tensor, *, owner: int) -> None:
        """Land a wire chunk ``[layers, 2, n, kv_heads, head_dim]`` at positions ``start..start+n``,
        only while ``blocks`` belong to ``owner`` (``StaleBlocksError`` otherwise, nothing written)."""
        self.check_owner(blocks, owner)
        chunk = chunk.to(self.kv.device, self.kv.dtype)
        for pos, slot, length in self.runs(blocks, start, start + chunk.shape[2]):
            self._flat[:, :, slot: slot + length] = chunk[:, :, pos - start: pos - start + length]

    @property
    def host_resident(self) -> bool:
        """Whether the pool lives in host memory, so sockets can write into it directly."""
        return self.kv.device.type == "cpu"

    def host_views(self, blocks: list[int], start: int, end: int, *, owner: int,
                   layer_from: list[int] | None = None) -> list[memoryview] | None:
        """Writable byte views of positions ``start..end``, in wire order, or ``None`` off the CPU.

        Concatenated, the views are exactly a wire chunk ``[layers, 2, n, kv_heads, head_dim]``:
        for each layer, K then V, each run of adjacent slots (with ``layer_from``, layer ``l``'s
        positions ``layer_from[l]..end`` only: the trimmed wire form, see the module doc). A socket can ``recv_into`` them
        one after another, so the bytes of a chunk land in the pool with no staging copy.
        Handed out only while ``blocks`` belong to ``owner`` (``StaleBlocksError`` otherwise).
        The views alias the pool: the caller must stop writing once the blocks change owner
        (check ``owns`` before each write into them, as the bulk receiver does before each read).
        """
        if not self.host_resident:
            return None
        self.check_owner(blocks, owner, "host view")
        as_bytes = self._flat.view(torch.uint8)
        if layer_from is None:
            runs = self.runs(blocks, start, end)
            return [
                memoryview(as_bytes[layer, kv, slot: slot + length].numpy()).cast("B")
                for layer in range(self.layout.layers) for kv in (0, 1) for _, slot, length in runs
            ]
        runs_from = {f: self.runs(blocks, f, end) for f in set(layer_from)}
        return [
            memoryview(as_bytes[layer, kv, slot: slot + length].numpy()).cast("B")
            for layer in range(self.layout.layers) for kv in (0, 1) for _, slot, length in runs_from[layer_from[layer]]
        ]

    def read_wire(self, blocks: list[int], start: int, end: int, layer_from: list[int]) -> torch.Tensor:
        """Positions ``start..end`` in the trimmed wire form (flat bytes; layer ``l`` from ``layer_from[l]``)."""
        out = []   # per layer its K positions then its V positions: the order host_views gives
        for layer, first in enumerate(layer_from):
            piece = self._flat.new_empty((2, end - first, self.layout.kv_heads, self.layout.head_dim))
            for pos, slot, length in self.runs(blocks, first, end):
                piece[:, pos - first: pos - first + length] = self._flat[layer, :, slot: slot + length]
            out.append(piece.reshape(-1))
        return torch.cat(out).view(torch.uint8)

    def write_wire(self, blocks: list[int], start: int, end: int, payload: torch.Tensor, layer_from: list[int], *,
                   owner: int) -> None:
        """Land ``read_wire``'s form (flat ``uint8``) of positions ``start..end``, only while ``blocks``
        belong to ``owner`` (``StaleBlocksError`` otherwise, nothing written)."""
        self.check_owner(blocks, owner)
        values = payload.to(self.kv.device).view(self.kv.dtype)
        per_pos = self.layout.kv_heads * self.layout.head_dim
        cursor = 0
        for layer, first in enumerate(layer_from):
            n = end - first
            piece = values[cursor: cursor + 2 * n * per_pos].view(2, n, self.layout.kv_heads, self.layout.head_dim)
            cursor += 2 * n * per_pos
            for pos, slot, length in self.runs(blocks, first, end):
                self._flat[layer, :, slot: slot + length] = piece[:, pos - first: pos - first + length]

    def copy_block(self, src: int, dst: int, *, owner: int) -> None:
        """Copy block ``src``'s KV (every layer, K and V) into ``dst``, only while ``dst`` belongs to
        ``owner`` (``StaleBlocksError`` otherwise): a forked sequence's own copy of a shared partial block."""
        self.check_owner([dst], owner, "copy")
        self.kv[:, :, dst] = self.kv[:, :, src]

    def read(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """Copy out positions ``start..end`` as a wire chunk ``[layers, 2, n, kv_heads, head_dim]``."""
        out = self.kv.new_empty((self.layout.layers, 2, end - start, self.layout.kv_heads, self.layout.head_dim))
        for pos, slot, length in self.runs(blocks, start, end):
            out[:, :, pos - start: pos - start + length] = self._flat[:, :, slot: slot + length]
        return out
