"""One packed forward's inputs: what each sequence brings, and how they are laid into one row.

A ``PackedItem`` is one sequence's new tokens (a prompt chunk, or one decode
token) with where they go in the KV pool and what positions they have:

* 1-D families: the tokens' positions are their sequence positions
  ``start..start+q_len`` (``positions`` and ``rope_delta`` stay ``None``);
* M-RoPE families: either ``positions`` ``[3, q_len]`` (a prompt chunk: the slice of
  the prompt's position plan) or ``rope_delta`` (decode, or text after the prompt:
  3-D position ``p + rope_delta`` on all three axes for sequence position ``p``).
  One of the two is required: a missing delta is an error, never a silent 0.

``key_limits`` (families whose image tokens attend bidirectionally, Gemma 3): ``[q_len]``
absolute positions, the last key each new token sees (an image token: its span's last
token, in the same chunk; a text token: itself). ``None`` is causal.

``deepstack`` (Qwen3-VL) is the item's share of the prompt's DeepStack features:
which of its tokens are image tokens, and those tokens' rows of every level.

``pack`` concatenates the items into one row ``[1, T]`` and returns the position
ids, the KV slot of every new token, each sequence's context runs (for the reference
loop only: a batched kernel's forward leaves them empty), the batched
attention groups (``attention_groups``: block tables and masks), and the
DeepStack inputs (``visual_pos_masks``, one ``[n, hidden]`` tensor per level), in
the layout the model's own forward takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.model.families.base import PositionKind
from runtime.model.kv_pool import KVBlockPool
from runtime.model.attention_groups import AttentionGroup, build_groups
from runtime.model.paged_attention_types import SequenceSpan


@dataclass(slots=True)
class DeepStackShare:
    """DeepStack features of one item's tokens: ``levels[:, j]`` belongs to the j-th True of ``mask``."""

    mask: torch.Tensor      # [q_len] bool
    levels: torch.Tensor    # [levels, mask.sum(), hidden]


@dataclass(slots=True)
class PackedItem:
    """One sequence's share of a packed forward: new tokens at sequence positions ``start..start+len``."""

    embeds: torch.Tensor     # [q_len, hidden]
    start: int               # sequence position (KV slot index) of the first new token
    blocks: list[int]        # block table covering at least start+q_len positions
    want_logits: bool = True
    positions: torch.Tensor | None = None   # M-RoPE: [3, q_len] position ids of the new tokens
    rope_delta: int | None = None           # M-RoPE: position = sequence position + rope_delta (all axes)
    deepstack: DeepStackShare | None = None
    key_limits: torch.Tensor | None = None  # [q_len] long: bidirectional image spans (None: causal)
    state_slot: int | None = None           # hybrid decoders: the sequence's state slot (linear_attention)
    rings: list[list[int]] | None = None    # windowed pool: the sequence's ring pages per ring group (kv_pool)
    token_ids: torch.Tensor | None = None   # [q_len] long: per-layer input embeddings (Gemma 4; images: the pad id)

    @property
    def q_len(self) -> int:
        return int(self.embeds.shape[0])


@dataclass(slots=True)
class PackedRow:
    embeds: torch.Tensor                 # [1, T, hidden]
    position_ids: torch.Tensor           # [1, T] (1-D) or [3, 1, T] (M-RoPE)
    slot_mapping: torch.Tensor           # [T]
    spans: list[SequenceSpan]
    visual_mask: torch.Tensor | None     # [1, T] bool: tokens that receive DeepStack features
    deepstack: list[torch.Tensor] | None  # per level [visual_mask.sum(), hidden]
    groups: list[AttentionGroup]         # decodes and prompt chunks, one batched attention call each
    ring_slot_mappings: list[torch.Tensor]  # windowed pool: per ring group, as slot_mapping


def item_positions(item: PackedItem, kind: PositionKind) -> torch.Tensor:
    """``[kind, q_len]`` position ids of the item's tokens (``ValueError`` for the wrong kind of item)."""
    seq = torch.arange(item.start, item.start + item.q_len)
    if kind == PositionKind.ONE_D:
        if item.positions is not None or item.rope_delta not in (None, 0):
            raise ValueError("a 1-D RoPE model takes no M-RoPE positions or rope delta")
        return seq[None]
    if (item.positions is None) == (item.rope_delta is None):
        raise ValueError("an M-RoPE item needs exactly one of positions [3, q_len] or rope_delta (got "
                         f"{'both' if item.positions is not None else 'neither'})")
    if item.positions is not None:
        if tuple(item.positions.shape) != (3, item.q_len):
            raise ValueError(f"M-RoPE positions must be [3, {item.q_len}], got {list(item.positions.shape)}")
        return item.positions.to("cpu", torch.long)
    return (seq + item.rope_delta)[None].expand(3, -1)


def _position_ids(items: Sequence[PackedItem], kind: PositionKind) -> torch.Tensor:
    """``[kind, T]`` position ids of all items' tokens in packed order (``item_positions`` of each, built as one
    tensor where every item's positions follow from its start: 1-D, or M-RoPE items with a ``rope_delta``)."""
    if kind == PositionKind.ONE_D:
        flat: list[int] = []
        for item in items:
            if item.positions is not None or item.rope_delta not in (None, 0):
                item_positions(item, kind)   # raises: the wrong kind of item
            flat.extend(range(item.start, item.start + item.q_len))
        return torch.tensor(flat, dtype=torch.long)[None]
    if all(item.positions is None and item.rope_delta is not None for item in items):
        flat = [p + item.rope_delta for item in items for p in range(item.start, item.start + item.q_len)]
        return torch.tensor(flat, dtype=torch.long)[None].repeat(3, 1)
    return torch.cat([item_positions(item, kind) for item in items], dim=1)


def _new_slots(context: list[tuple[int, int, int]], start: int, out: list[int]) -> None:
    """The new tokens' own slots (positions ``start..``): the context's tail."""
    for pos, slot, length in context:
        if pos + length > start:
            out.extend(range(slot + max(0, start - pos), slot + length))


def _check_ring(pool: KVBlockPool, item: PackedItem) -> None:
    """The ring invariant (``kv_pool``): what this forward reads of a ring never shares a slot with what it writes."""
    end = item.start + item.q_len
    need = min(end, pool.layout.sliding_window + item.q_len - 1)
    for ring in item.rings or ():
        if len(ring) * pool.block_size < need:
            raise ValueError(f"a ring of {len(ring)} blocks cannot hold a {item.q_len}-token chunk and its window "
                             f"({need} positions): the pool's window_chunk is smaller than this forward's chunk")


def pack(pool: KVBlockPool, items: Sequence[PackedItem], kind: PositionKind, device: torch.device,
         context_runs: bool = True) -> PackedRow:
    """``context_runs``: list each sequence's whole context (and each ring's) as runs in its span; only the
    reference loop reads them, so the batched kernels' forwards skip them (the new tokens' slots only)."""
    spans, new_slots, offset = [], [], 0
    ring_slots: list[list[int]] = [[] for _ in range(pool.groups.window_groups)]
    levels, any_deepstack = [], False
    for item in items:
        q_len, end = item.q_len, item.start + item.q_len
        context = pool.runs(item.blocks, 0 if context_runs else item.start, end)
        runs = []
        if pool.groups.windowed:
            _check_ring(pool, item)
            tables = pool.tables(item.blocks, item.rings)[1:]
            for ring, out in zip(tables, ring_slots):   # the new tokens' slots: their runs only
                _new_slots(pool.table_runs(ring, item.start, end, ring=True), item.start, out)
            if context_runs:
                runs = [[(s, n) for _, s, n in pool.table_runs(ring, 0, end, ring=True)] for ring in tables]
        spans.append(SequenceSpan(offset, q_len, [(slot, length) for _, slot, length in context] if context_runs else [],
                                  item.key_limits, runs))
        _new_slots(context, item.start, new_slots)
        if item.deepstack is not None and item.deepstack.levels.shape[1]:
            any_deepstack = True
            levels.append(item.deepstack.levels)
        offset += q_len
    position_ids = _position_ids(items, kind).to(device)
    position_ids = position_ids if kind == PositionKind.ONE_D else position_ids[:, None]
    embeds = torch.cat([i.embeds for i in items]).unsqueeze(0)
    visual_mask = deepstack = None
    if any_deepstack:
        masks = [i.deepstack.mask.to("cpu", torch.bool) if i.deepstack is not None and i.deepstack.levels.shape[1]
                 else torch.zeros(i.q_len, dtype=torch.bool) for i in items]
        visual_mask = torch.cat(masks)[None].to(device)
        stacked = torch.cat(levels, dim=1).to(device, embeds.dtype)
        deepstack = list(stacked.unbind(0))
    slot_mapping = torch.tensor(new_slots, dtype=torch.long, device=device)
    groups = build_groups([s.q_offset for s in spans], [s.q_len for s in spans], [i.start + i.q_len for i in items],
                          [i.blocks for i in items], pool.block_size, device, [i.key_limits for i in items],
                          [i.rings for i in items] if pool.groups.windowed else None)
    ring_mappings = [torch.tensor(slots, dtype=torch.long, device=device) for slots in ring_slots]
    return PackedRow(embeds, position_ids, slot_mapping, spans, visual_mask, deepstack, groups, ring_mappings)
