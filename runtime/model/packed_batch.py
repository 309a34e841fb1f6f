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
ids, the KV slot of every new token, each sequence's context runs, the batched
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
         ring_runs: bool = False) -> PackedRow:
    """``ring_runs``: also list each ring's whole context as runs (only the reference loop reads them)."""
    spans, new_slots, positions, offset = [], [], [], 0
    ring_slots: list[list[int]] = [[] for _ in range(pool.groups.window_groups)]
    masks, levels, any_deepstack = [], [], False
    for item in items:
        q_len, end = item.q_len, item.start + item.q_len
        context = pool.runs(item.blocks, 0, end)
        runs = []
        if pool.groups.windowed:
            _check_ring(pool, item)
            tables = pool.tables(item.blocks, item.rings)[1:]
            for ring, out in zip(tables, ring_slots):   # the new tokens' slots: their runs only
                _new_slots(pool.table_runs(ring, item.start, end, ring=True), item.start, out)
            if ring_runs:
                runs = [[(s, n) for _, s, n in pool.table_runs(ring, 0, end, ring=True)] for ring in tables]
        spans.append(SequenceSpan(offset, q_len, [(slot, length) for _, slot, length in context], item.key_limits, runs))
        _new_slots(context, item.start, new_slots)
        positions.append(item_positions(item, kind))
        if item.deepstack is not None and item.deepstack.levels.shape[1]:
            any_deepstack = True
            masks.append(item.deepstack.mask.to("cpu", torch.bool))
            levels.append(item.deepstack.levels)
        else:
            masks.append(torch.zeros(q_len, dtype=torch.bool))
        offset += q_len
    position_ids = torch.cat(positions, dim=1).to(device)
    position_ids = position_ids if kind == PositionKind.ONE_D else position_ids[:, None]
    embeds = torch.cat([i.embeds for i in items]).unsqueeze(0)
    visual_mask = deepstack = None
    if any_deepstack:
        visual_mask = torch.cat(masks)[None].to(device)
        stacked = torch.cat(levels, dim=1).to(device, embeds.dtype)
        deepstack = list(stacked.unbind(0))
    slot_mapping = torch.tensor(new_slots, dtype=torch.long, device=device)
    groups = build_groups([s.q_offset for s in spans], [s.q_len for s in spans], [i.start + i.q_len for i in items],
                          [i.blocks for i in items], pool.block_size, device, [i.key_limits for i in items],
                          [i.rings for i in items] if pool.groups.windowed else None)
    ring_mappings = [torch.tensor(slots, dtype=torch.long, device=device) for slots in ring_slots]
    return PackedRow(embeds, position_ids, slot_mapping, spans, visual_mask, deepstack, groups, ring_mappings)
