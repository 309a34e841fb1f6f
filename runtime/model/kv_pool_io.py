"""Where a sequence's positions live in the KV pool, and the copies in and out of it.

``KVBlockPool`` (``kv_pool.py``) owns the pages and who holds them; this half addresses
them. A sequence is named by its block table ``blocks`` (group 0: the full-attention
layers, every position) and, on a windowed pool, its ``rings`` (one per ring group of
sliding layers: position ``p`` in page ``ring[(p // block_size) % len(ring)]``; see the
``kv_pool`` module doc for the ring's size rule). A *run* is ``(position, slot, length)``:
consecutive positions in consecutive flat slots of one table.

Wire form: a KV chunk ``[layers, 2, tokens, kv_heads, head_dim]`` in model layer order
(``read``, ``write``), or the trimmed form of ``read_wire`` / ``write_wire`` /
``host_views``, where layer ``l`` carries positions ``layer_from[l]..end`` only (per
layer K then V). Every write and view names the owner token of the pages it touches
and touches nothing unless they all still carry it (``StaleBlocksError``).
"""

from __future__ import annotations

import torch

Rings = list[list[int]]   # a sequence's ring pages, one list per ring group ([] on a dense pool)
Run = tuple[int, int, int]


class KVPoolIO:
    """Addressing and copies; mixed into ``KVBlockPool`` (which sets the attributes used here)."""

    # -- addressing -------------------------------------------------------------
    def tables(self, blocks: list[int], rings: Rings | None) -> list[list[int]]:
        """Per page group its table: ``blocks`` then the rings (checked against the pool's groups)."""
        rings = rings or []
        if len(rings) != self.groups.window_groups:
            raise ValueError(f"{len(rings)} rings for a pool of {self.groups.window_groups} ring groups")
        return [blocks, *rings]

    def owned_pages(self, blocks: list[int], rings: Rings | None) -> list[int]:
        """Every page of the sequence (what its owner token must cover)."""
        return blocks + [p for ring in rings or () for p in ring]

    def table_runs(self, table: list[int], start: int, end: int, ring: bool) -> list[Run]:
        """Runs of positions ``start..end`` in ``table`` (a ring when ``ring``: block ``j`` is ``table[j % len]``)."""
        if start < 0 or end < start or (not ring and end > len(table) * self.block_size) or (ring and not table and end > start):
            raise IndexError(f"positions {start}..{end} outside {len(table)} blocks of {self.block_size}")
        out: list[Run] = []
        pos, n = start, len(table)
        while pos < end:
            b, off = divmod(pos, self.block_size)
            length = min(self.block_size - off, end - pos)
            slot = table[b % n if ring else b] * self.block_size + off
            if out and out[-1][1] + out[-1][2] == slot:
                p0, s0, l0 = out[-1]
                out[-1] = (p0, s0, l0 + length)
            else:
                out.append((pos, slot, length))
            pos += length
        return out

    def runs(self, blocks: list[int], start: int, end: int) -> list[Run]:
        """Runs of positions ``start..end`` in block table ``blocks`` (group 0).

        Blocks are handed out low ids first, so a sequence's blocks are mostly
        adjacent and a whole chunk is usually one or a few runs: landing it is a
        few plain strided copies instead of a gather/scatter per token.
        """
        return self.table_runs(blocks, start, end, ring=False)

    def group_runs(self, blocks: list[int], rings: Rings | None, start: int, end: int) -> list[list[Run]]:
        """Per page group, the runs of positions ``start..end``."""
        return [self.table_runs(t, start, end, ring=g > 0) for g, t in enumerate(self.tables(blocks, rings))]

    def slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """Flat slots of positions ``start..end-1`` in a sequence with block table ``blocks``."""
        if end > len(blocks) * self.block_size or start < 0 or end < start:
            raise IndexError(f"positions {start}..{end} outside {len(blocks)} blocks of {self.block_size}")
        pos = torch.arange(start, end)
        table = torch.tensor(blocks, dtype=torch.long)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.kv.device)

    def _layer_view(self, layer: int) -> torch.Tensor:
        """``[2, blocks, block_size, kv_heads, head_dim]`` of model layer ``layer`` (a view: its slot of its
        group's pages; when layers differ in size, the first ``layer_elems`` values of each position)."""
        kv = self.kv[self.groups.slot_of[layer]]
        if self.layout.uniform:
            return kv
        heads, dim = self.layout.shape(layer)
        return kv[..., 0, : heads * dim].unflatten(-1, (heads, dim))

    def _dense_only(self, what: str) -> None:
        if not self.layout.uniform:
            raise ValueError(f"{what}: layers of different sizes have no dense chunk form; use the wire form")

    # -- copies -----------------------------------------------------------------
    def write(self, blocks: list[int], start: int, chunk: torch.Tensor, *, owner: int, rings: Rings | None = None) -> None:
        """Land a wire chunk ``[layers, 2, n, kv_heads, head_dim]`` at positions ``start..start+n``,
        only while the sequence's pages belong to ``owner`` (``StaleBlocksError`` otherwise, nothing written)."""
        self._dense_only("write")
        self.check_owner(self.owned_pages(blocks, rings), owner)
        chunk = chunk.to(self.kv.device, self.kv.dtype)
        end = start + chunk.shape[2]
        for g, runs in enumerate(self.group_runs(blocks, rings, start, end)):
            layers = self.groups.layers_in(g)
            slots = [self.groups.slot_of[l] for l in layers]
            dense = len(layers) == self.layout.layers
            for pos, slot, length in runs:
                piece = chunk[:, :, pos - start: pos - start + length]
                if dense:
                    self._flat[:, :, slot: slot + length] = piece
                else:
                    self._flat[slots, :, slot: slot + length] = piece[layers]

    def read(self, blocks: list[int], start: int, end: int, rings: Rings | None = None) -> torch.Tensor:
        """Copy out positions ``start..end`` as a wire chunk ``[layers, 2, n, kv_heads, head_dim]``."""
        self._dense_only("read")
        out = self.kv.new_empty((self.layout.layers, 2, end - start, self.layout.kv_heads, self.layout.head_dim))
        for g, runs in enumerate(self.group_runs(blocks, rings, start, end)):
            layers = self.groups.layers_in(g)
            slots = [self.groups.slot_of[l] for l in layers]
            dense = len(layers) == self.layout.layers
            for pos, slot, length in runs:
                if dense:
                    out[:, :, pos - start: pos - start + length] = self._flat[:, :, slot: slot + length]
                else:
                    out[layers, :, pos - start: pos - start + length] = self._flat[slots, :, slot: slot + length]
        return out

    @property
    def host_resident(self) -> bool:
        """Whether sockets can write into the pool directly: in host memory, and every layer's slots
        contiguous (layers of different sizes leave gaps: their chunks are staged, then written)."""
        return self.kv.device.type == "cpu" and self.layout.uniform

    def _layer_runs(self, blocks: list[int], rings: Rings | None, end: int, layer_from: list[int]) -> list[list[Run]]:
        """Per model layer, the runs of its positions ``layer_from[l]..end`` in its group's table."""
        tables = self.tables(blocks, rings)
        cache: dict[tuple[int, int], list[Run]] = {}
        out = []
        for layer, first in enumerate(layer_from):
            g = self.groups.group_of[layer]
            if (g, first) not in cache:
                cache[g, first] = self.table_runs(tables[g], first, end, ring=g > 0)
            out.append(cache[g, first])
        return out

    def host_views(self, blocks: list[int], start: int, end: int, *, owner: int,
                   layer_from: list[int] | None = None, rings: Rings | None = None) -> list[memoryview] | None:
        """Writable byte views of positions ``start..end``, in wire order, or ``None`` off the CPU.

        Concatenated, the views are exactly a wire chunk ``[layers, 2, n, kv_heads, head_dim]``:
        for each layer, K then V, each run of adjacent slots (with ``layer_from``, layer ``l``'s
        positions ``layer_from[l]..end`` only: the trimmed wire form). A socket can ``recv_into`` them
        one after another, so the bytes of a chunk land in the pool with no staging copy.
        Handed out only while the sequence's pages belong to ``owner`` (``StaleBlocksError`` otherwise).
        The views alias the pool: the caller must stop writing once the pages change owner
        (check ``owns`` before each write into them, as the bulk receiver does before each read).
        """
        if not self.host_resident:
            return None
        self.check_owner(self.owned_pages(blocks, rings), owner, "host view")
        as_bytes = self._flat.view(torch.uint8)
        per_layer = self._layer_runs(blocks, rings, end, layer_from or [start] * self.layout.layers)
        return [
            memoryview(as_bytes[self.groups.slot_of[layer], kv, slot: slot + length].numpy()).cast("B")
            for layer, runs in enumerate(per_layer) for kv in (0, 1) for _, slot, length in runs
        ]

    def read_wire(self, blocks: list[int], start: int, end: int, layer_from: list[int],
                  rings: Rings | None = None) -> torch.Tensor:
        """Positions ``start..end`` in the trimmed wire form (flat bytes; layer ``l`` from ``layer_from[l]``)."""
        out = []   # per layer its K positions then its V positions: the order host_views gives
        for layer, runs in enumerate(self._layer_runs(blocks, rings, end, layer_from)):
            first, flat = layer_from[layer], self._lflat[layer]
            piece = flat.new_empty((2, end - first, flat.shape[-1]))
            for pos, slot, length in runs:
                piece[:, pos - first: pos - first + length] = flat[:, slot: slot + length]
            out.append(piece.reshape(-1))
        return torch.cat(out).view(torch.uint8)

    def write_wire(self, blocks: list[int], start: int, end: int, payload: torch.Tensor, layer_from: list[int], *,
                   owner: int, rings: Rings | None = None) -> None:
        """Land ``read_wire``'s form (flat ``uint8``) of positions ``start..end``, only while the sequence's
        pages belong to ``owner`` (``StaleBlocksError`` otherwise, nothing written)."""
        self.check_owner(self.owned_pages(blocks, rings), owner)
        values = payload.to(self.kv.device).view(self.kv.dtype)
        cursor = 0
        for layer, runs in enumerate(self._layer_runs(blocks, rings, end, layer_from)):
            first, flat = layer_from[layer], self._lflat[layer]
            n, per_pos = end - first, flat.shape[-1]
            piece = values[cursor: cursor + 2 * n * per_pos].view(2, n, per_pos)
            cursor += 2 * n * per_pos
            for pos, slot, length in runs:
                flat[:, slot: slot + length] = piece[:, pos - first: pos - first + length]

    def copy_block(self, src: int, dst: int, *, owner: int) -> None:
        """Copy page ``src`` (every slot, K and V) into ``dst``, only while ``dst`` belongs to ``owner``
        (``StaleBlocksError`` otherwise): a forked sequence's own copy of a shared partial block or a ring page."""
        self.check_owner([dst], owner, "copy")
        self.kv[:, :, dst] = self.kv[:, :, src]
