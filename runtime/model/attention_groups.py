"""The index tensors one batched attention call needs, built once per forward (not per layer).

A packed forward's sequences fall into two groups: decodes (one new token each) and
prompt chunks (several). Each group is attended by ONE call per layer over a padded
layout that every kernel in ``attention_kernels`` shares:

* ``q_index [B, Q]``: packed-row index of each sequence's new tokens, padded to the
  group's longest (padding points at row 0 and is never written back);
* ``block_table [B, N]``: the blocks holding each sequence's context (positions
  ``0..ctx_len-1``), padded with block 0; the context of sequence ``b`` is the first
  ``ctx_lens[b]`` slots of its blocks laid end to end (``S = N * block_size``). On a
  windowed pool (``kv_pool``: sliding layers kept in rings) ``tables[g]`` is page group
  ``g``'s table in the same layout: group 0 is ``block_table``, a ring group's logical
  block ``j`` is ``ring[j % len(ring)]`` (a page repeats; the positions it no longer
  holds are outside the window, so the window mask hides them);
* ``ctx_lens [B]``, ``q_starts [B]`` (= ``ctx_len - q_len``: the new tokens are the
  context's tail), and ``mask [B, 1, Q, S]``: key ``s`` is visible to query ``i`` of
  sequence ``b`` when ``s <= q_limits[b, i]`` and ``s < ctx_lens[b]``. ``q_limits`` is the
  query's own position (causal) unless the item gave ``key_limits``: a token of an image span
  that attends bidirectionally (Gemma 3) sees up to the span's last token, which the chunker
  keeps in the same chunk. A padded query row sees the valid keys (never an empty row, so no
  NaN), and is dropped.
* sliding-window layers (``window_mask(W)``, built once per forward per window and cached in
  ``kernel_state``): the mask above AND ``s > position - W`` (the query's own position,
  transformers' ``sliding_window_overlay``), so an image token still sees its span's later
  tokens but no key ``W`` or more positions back.

Invariant: ``out_index`` lists the packed rows of the valid queries in the order
``q_valid`` selects them, so ``out[out_index] = result[q_valid]`` writes each new
token's output exactly once; where no query is padded and those rows are consecutive
(``out_rows``: decodes, a lone chunk) that is the plain slice copy ``out[start:stop] = result``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class AttentionGroup:
    q_index: torch.Tensor      # [B, Q] long
    q_valid: torch.Tensor      # [B, Q] bool
    out_index: torch.Tensor    # [valid] long: packed rows of q_index[q_valid]
    tables: list[torch.Tensor]  # per page group [B, N] long (group 0: the block table; then the rings)
    ctx_lens: torch.Tensor     # [B] long
    q_starts: torch.Tensor     # [B] long
    mask: torch.Tensor | None  # [B, 1, Q, S] bool; None when B == 1, the chunk is the whole context and causal
    q_positions: torch.Tensor  # [B, Q] long: each query's position (padded rows: the last valid one)
    q_limits: torch.Tensor     # [B, Q] long: the last key position each query sees (its position when causal)
    max_ctx: int               # the longest context (keys past it are never visible)
    block_size: int
    bidirectional: bool = False       # some query sees past its position (an image span)
    one_runs: list[int | None] = field(default_factory=list)  # per group, B == 1 with consecutive pages: the first (no gather)
    out_rows: tuple[int, int] | None = None   # no padded query and the packed rows in order: rows [start, stop)
    kernel_state: dict[Any, Any] = field(default_factory=dict)  # per-forward cache of a kernel (flex's block mask)

    @property
    def block_table(self) -> torch.Tensor:
        return self.tables[0]

    @property
    def size(self) -> int:
        return int(self.q_index.shape[0])

    @property
    def max_q(self) -> int:
        return int(self.q_index.shape[1])

    def limits(self, causal_only: bool = False) -> torch.Tensor:
        """The last key each query sees: ``q_limits``, or its own position on a layer where images are causal."""
        return self.q_positions if causal_only else self.q_limits

    def window_mask(self, window: int | None, causal_only: bool = False) -> torch.Tensor | None:
        """The mask of a layer with sliding ``window`` (``None``: a full-attention layer, ``self.mask``).
        A window no context reaches past changes nothing, so the plain mask (or causal path) is kept.
        ``causal_only``: a layer where image tokens attend causally (Gemma 4's full layers)."""
        causal_only = causal_only and self.bidirectional
        if (window is None or self.max_ctx <= window) and not causal_only:
            return self.mask
        key = ("window", window, causal_only)
        mask = self.kernel_state.get(key)
        if mask is None:
            keys = torch.arange(self.tables[0].shape[1] * self.block_size, device=self.q_limits.device)
            mask = _visible(keys, self.limits(causal_only), self.ctx_lens)
            if window is None or self.max_ctx <= window:
                mask = self.kernel_state[key] = mask.unsqueeze(1)
                return mask
            mask &= keys[None, None, :] > (self.q_positions - window)[:, :, None]
            mask = self.kernel_state[key] = mask.unsqueeze(1)
        return mask


def _visible(keys: torch.Tensor, q_limits: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
    """``[B, Q, S]``: key ``s`` visible to query ``i`` of sequence ``b`` (window left out)."""
    return (keys[None, None, :] <= q_limits[:, :, None]) & (keys[None, None, :] < ctx[:, None, None])


def _table(block_tables: Sequence[Sequence[int]], ctx_lens: Sequence[int], n_blocks: int, block_size: int,
           ring: bool) -> torch.Tensor:
    """``[B, n_blocks]``: each sequence's first blocks of its context (a ring repeats its pages)."""
    rows = []
    for i, (blocks, c) in enumerate(zip(block_tables, ctx_lens)):
        need = -(-c // block_size)
        if ring:
            if not blocks:
                raise ValueError(f"sequence {i}: an empty ring")
            row = [blocks[j % len(blocks)] for j in range(need)]
        elif len(blocks) < need:
            raise ValueError(f"sequence {i}: {len(blocks)} blocks cannot hold a context of {c} tokens")
        else:
            row = list(blocks[:need])
        rows.append(row + [0] * (n_blocks - need))
    return torch.tensor(rows, dtype=torch.long).view(len(rows), n_blocks)


def _one_run(table: torch.Tensor, ctx_len: int, block_size: int) -> int | None:
    first = table[0, : -(-ctx_len // block_size)]
    return int(first[0]) if bool((first[1:] - first[:-1] == 1).all()) else None


def build_group(q_offsets: Sequence[int], q_lens: Sequence[int], ctx_lens: Sequence[int],
                block_tables: Sequence[Sequence[int]], block_size: int, device: torch.device,
                key_limits: Sequence[torch.Tensor | None] | None = None,
                rings: Sequence[Sequence[Sequence[int]]] | None = None) -> AttentionGroup:
    """One group from per-sequence facts (all lists of the same length B >= 1). ``key_limits[b]``,
    when given and not ``None``: ``[q_len]`` absolute positions, the last key each new token sees.
    ``rings[b]``: sequence ``b``'s rings on a windowed pool (one per ring group)."""
    b = len(q_offsets)
    max_q = max(q_lens)
    max_ctx = max(ctx_lens)
    n_blocks = max(-(-c // block_size) for c in ctx_lens)
    tables = [_table(block_tables, ctx_lens, n_blocks, block_size, ring=False)]
    for g in range(len(rings[0]) if rings else 0):
        tables.append(_table([r[g] for r in rings], ctx_lens, n_blocks, block_size, ring=True))
    offsets = torch.as_tensor(list(q_offsets), dtype=torch.long)
    lens = torch.as_tensor(list(q_lens), dtype=torch.long)
    ctx = torch.as_tensor(list(ctx_lens), dtype=torch.long)
    rows = torch.arange(max_q)
    q_valid = rows[None, :] < lens[:, None]
    q_index = torch.where(q_valid, offsets[:, None] + rows[None, :], torch.zeros((), dtype=torch.long))
    q_starts = ctx - lens
    q_pos = torch.minimum(q_starts[:, None] + rows[None, :], (ctx - 1)[:, None])    # [B, Q]
    q_limits = q_pos.clone()
    bidirectional = False
    for i, limits in enumerate(key_limits or ()):
        if limits is not None:
            q_limits[i, : q_lens[i]] = torch.maximum(limits.to("cpu", torch.long), q_pos[i, : q_lens[i]])
            bidirectional = True
    mask = None
    if bidirectional or not (b == 1 and q_lens[0] == ctx_lens[0] and q_lens[0] > 1):
        keys = torch.arange(n_blocks * block_size)
        mask = _visible(keys, q_limits, ctx).unsqueeze(1).to(device)                # [B, 1, Q, S]
    one_runs = [_one_run(t, ctx_lens[0], block_size) if b == 1 else None for t in tables]
    in_order = all(q == max_q for q in q_lens) and all(o == q_offsets[0] + i * max_q for i, o in enumerate(q_offsets))
    return AttentionGroup(
        q_index=q_index.to(device), q_valid=q_valid.to(device), out_index=q_index[q_valid].to(device),
        tables=[t.to(device) for t in tables], ctx_lens=ctx.to(device), q_starts=q_starts.to(device), mask=mask,
        q_positions=q_pos.to(device), q_limits=q_limits.to(device), max_ctx=max_ctx, block_size=block_size, bidirectional=bidirectional, one_runs=one_runs,
        out_rows=(q_offsets[0], q_offsets[0] + b * max_q) if in_order else None,
    )


def build_groups(q_offsets: Sequence[int], q_lens: Sequence[int], ctx_lens: Sequence[int],
                 block_tables: Sequence[Sequence[int]], block_size: int, device: torch.device,
                 key_limits: Sequence[torch.Tensor | None] | None = None,
                 rings: Sequence[Sequence[Sequence[int]]] | None = None) -> list[AttentionGroup]:
    """The decodes (q_len 1) as one group and the prompt chunks as another; empty groups left out."""
    groups = []
    limits = list(key_limits) if key_limits is not None else [None] * len(q_lens)
    for want_decode in (True, False):
        idx = [i for i, q in enumerate(q_lens) if (q == 1) == want_decode]
        if idx:
            groups.append(build_group([q_offsets[i] for i in idx], [q_lens[i] for i in idx], [ctx_lens[i] for i in idx],
                                      [block_tables[i] for i in idx], block_size, device, [limits[i] for i in idx],
                                      [rings[i] for i in idx] if rings else None))
    return groups
