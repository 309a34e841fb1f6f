"""What one token's KV looks like, and how the pool groups layers into pages.

``KVLayout`` is the model's side: layers, KV heads, head size, dtype, and which layers
slide (Gemma 3: ``sliding_layers``, window ``W``: a sliding layer at position ``p``
reads keys ``p - W + 1..p`` only). Its ``describe()`` is the cache-format part of the
model fingerprint.

``PageGroups`` is the pool's side (``runtime/model/kv_pool.py``): every block of the
pool (a *page*) holds ``page_layers`` layers' K and V for ``block_size`` positions,
and a sequence holds one block table per **group** of layers. Group 0 is the
full-attention layers: its table covers every position, as a dense pool's one table
does. With sliding-window KV on (``windowed``), the sliding layers form
``window_groups`` further groups of ``page_layers`` layers each (the last one padded
with unused slots when the counts do not divide), and each such group's table is a
**ring** of a few pages: position ``p`` lives in page ``ring[(p // block_size) %
len(ring)]``, so a sequence keeps only about ``W`` positions of a sliding layer (see
``KVBlockPool`` for the ring's size rule). All groups take their pages from one free
list: a short chat and a long document share the same memory, as vLLM's hybrid
allocator does. Without sliding layers, or with sliding-window KV off, there is one
group holding every layer (``page_layers == layers``): the dense pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one token's KV looks like; also the cache-format part of the fingerprint.

    ``layer_shapes`` (Gemma 4: global layers with other head sizes and KV-head counts than
    sliding ones): per layer ``(kv_heads, head_dim)``; empty means every layer is ``kv_heads``
    x ``head_dim``. A pool slot holds ``slot_elems`` values per layer, K and V each (the
    largest layer's; a smaller layer uses the first ``layer_elems(l)`` of them), and the wire
    carries each layer's own size only (``wire_bytes``)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_layers: tuple[int, ...] = ()   # layers with a sliding window (the rest attend to every position)
    sliding_window: int | None = None      # W: a sliding layer at position p reads keys p-W+1..p
    layer_shapes: tuple[tuple[int, int], ...] = ()   # per layer (kv_heads, head_dim); () = all the same

    def __post_init__(self) -> None:
        if self.layer_shapes and len(self.layer_shapes) != self.layers:
            raise ValueError(f"{len(self.layer_shapes)} layer shapes for {self.layers} layers")

    @property
    def uniform(self) -> bool:
        """Every layer has the same ``(kv_heads, head_dim)`` (then a wire chunk is one dense tensor)."""
        return all(s == (self.kv_heads, self.head_dim) for s in self.layer_shapes)

    def shape(self, layer: int) -> tuple[int, int]:
        """Layer ``layer``'s ``(kv_heads, head_dim)``."""
        return self.layer_shapes[layer] if self.layer_shapes else (self.kv_heads, self.head_dim)

    def layer_elems(self, layer: int) -> int:
        heads, dim = self.shape(layer)
        return heads * dim

    @property
    def slot_elems(self) -> int:
        """Values per layer per position (K or V) in a pool slot: the largest layer's."""
        return max(self.layer_elems(l) for l in range(self.layers))

    @property
    def storage_shape(self) -> tuple[int, int]:
        """The pool tensor's last two dims: ``(kv_heads, head_dim)``, or ``(1, slot_elems)`` when layers differ."""
        return (self.kv_heads, self.head_dim) if self.uniform else (1, self.slot_elems)

    def layer_bytes(self, layer: int) -> int:
        """Layer ``layer``'s K and V of one position on the wire."""
        return 2 * self.layer_elems(layer) * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return sum(self.layer_bytes(l) for l in range(self.layers))

    @property
    def layer_token_bytes(self) -> int:
        """One layer's K and V of one position in a pool slot (the largest layer's when layers differ)."""
        return 2 * self.slot_elems * self.dtype.itemsize

    def describe(self) -> str:
        base = f"L{self.layers}xKV{self.kv_heads}xD{self.head_dim}:{str(self.dtype).removeprefix('torch.')}"
        if self.sliding_layers:
            base += f":W{self.sliding_window}@{','.join(map(str, self.sliding_layers))}"
        if not self.uniform:
            base += ":shapes=" + ",".join(f"{h}x{d}" for h, d in self.layer_shapes)
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
        return sum((end - f) * self.layer_bytes(l) for l, f in enumerate(self.layer_from(start, end, sliding_from)))



@dataclass(frozen=True, slots=True)
class PageGroups:
    """Layer ``l`` lives in group ``group_of[l]`` at slot ``slot_of[l]`` of every page of that group."""

    page_layers: int               # layers per page (the pool tensor's first dimension)
    window_groups: int             # groups of sliding layers kept as rings (0: dense)
    group_of: tuple[int, ...]      # per model layer: 0 (full attention) or 1..window_groups
    slot_of: tuple[int, ...]       # per model layer: its slot in the page, 0..page_layers-1

    @property
    def windowed(self) -> bool:
        return self.window_groups > 0

    @property
    def groups(self) -> int:
        return 1 + self.window_groups

    @classmethod
    def dense(cls, layers: int) -> "PageGroups":
        return cls(layers, 0, (0,) * layers, tuple(range(layers)))

    @classmethod
    def for_layout(cls, layout: KVLayout, windowed: bool) -> "PageGroups":
        """Dense unless ``windowed`` and the layout has sliding layers (and at least one full one)."""
        sliding = set(layout.sliding_layers)
        full = [l for l in range(layout.layers) if l not in sliding]
        if not windowed or not sliding or not full or layout.sliding_window is None:
            return cls.dense(layout.layers)   # (a model whose every layer slides keeps the dense pool)
        page = len(full)
        group_of, slot_of = [0] * layout.layers, [0] * layout.layers
        for i, l in enumerate(full):
            slot_of[l] = i
        for k, l in enumerate(sorted(sliding)):
            group_of[l], slot_of[l] = 1 + k // page, k % page
        return cls(page, -(-len(sliding) // page), tuple(group_of), tuple(slot_of))

    def layers_in(self, group: int) -> list[int]:
        """The model layers of ``group``, in slot order."""
        return sorted((l for l, g in enumerate(self.group_of) if g == group), key=lambda l: self.slot_of[l])
