"""A prompt made ready for chunked prefill, once, where it is prepared.

``VLMAdapter.prepare(token_ids, images)`` checks the prompt, splices the image
features into the token embeddings and asks the family for the positions.
Any chunking then slices it: ``item(start, end, blocks)`` is the ``PackedItem``
of positions ``start..end``, carrying that chunk's M-RoPE positions and its
share of the DeepStack features (the image tokens that fall in the chunk), so
chunks that split an image give the same KV as one pass. ``rope_delta`` is the
per-sequence metadata decode needs after the prompt (0 for 1-D families).

``image_spans`` (families whose image tokens attend bidirectionally, Gemma 3) are
the ``(start, end)`` runs of image placeholders: each image token sees every token
of its own run, so a chunk must never cut one. ``chunk_end(start, limit)`` is the
one chunking rule every prefill loop uses (prefill worker, colocated prefill on
decode, ``VLMAdapter.prefill``): the boundary ``start + limit`` moves back to the
start of a span it would cut, or, when that span began at or before ``start`` (a
span longer than the chunk size), forward to its end, so the chunk holds the
whole span. Without spans it is ``min(len, start + limit)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.model.families.base import PositionPlan
from runtime.model.packed_batch import DeepStackShare, PackedItem


@dataclass(slots=True, eq=False)
class PreparedPrompt:
    embeds: torch.Tensor                 # [T, hidden]: token embeddings, image features spliced in
    plan: PositionPlan                   # positions [3, T] (M-RoPE) or None (1-D), and the rope delta
    image_mask: torch.Tensor | None = None   # [T] bool: image placeholder positions (when DeepStack is used)
    deepstack: torch.Tensor | None = None    # [levels, image tokens, hidden], in prompt order
    image_spans: tuple[tuple[int, int], ...] = ()   # bidirectional image runs (never cut by a chunk)
    token_ids: torch.Tensor | None = None    # [T]: for per-layer input embeddings (Gemma 4), image positions as pad
    _images_before: torch.Tensor | None = field(default=None, init=False, repr=False)
    _key_limits: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.deepstack is not None:
            counts = self.image_mask.to(torch.long).cumsum(0)
            self._images_before = torch.cat([counts.new_zeros(1), counts])   # [T + 1]
        if self.image_spans:
            limits = torch.arange(len(self))
            for start, end in self.image_spans:
                limits[start:end] = end - 1
            self._key_limits = limits

    def chunk_end(self, start: int, limit: int) -> int:
        """Where the chunk starting at ``start`` of at most ``limit`` tokens ends (see the module doc)."""
        if limit < 1:
            raise ValueError(f"a chunk holds at least one token, got a limit of {limit}")
        end = min(len(self), start + limit)
        for s, e in self.image_spans:
            if s < end < e:
                return s if s > start else e
        return end

    def __len__(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def rope_delta(self) -> int:
        return self.plan.rope_delta

    @property
    def longest_image_span(self) -> int:
        """The longest bidirectional image span (0 without): a chunk can grow to it (``chunk_end``)."""
        return max((e - s for s, e in self.image_spans), default=0)

    def item(self, start: int, end: int, blocks: list[int], want_logits: bool | None = None,
             rings: list[list[int]] | None = None) -> PackedItem:
        """The chunk ``start..end`` as one packed item (logits wanted for the last chunk by default)."""
        if not 0 <= start < end <= len(self):
            raise IndexError(f"chunk {start}..{end} outside the prompt of {len(self)} tokens")
        positions = None if self.plan.positions is None else self.plan.positions[:, start:end]
        share = None
        if self.deepstack is not None:
            first, last = int(self._images_before[start]), int(self._images_before[end])
            if last > first:
                share = DeepStackShare(self.image_mask[start:end], self.deepstack[:, first:last])
        limits = None
        if self._key_limits is not None:
            # a chunk may start inside a span (after a cached prefix: the span's earlier KV is final), never end in one
            if any(s < end < e for s, e in self.image_spans):
                raise ValueError(f"chunk {start}..{end} cuts a bidirectional image span (use chunk_end)")
            if any(s < end and e > start for s, e in self.image_spans):
                limits = self._key_limits[start:end]
        return PackedItem(self.embeds[start:end], start, blocks, end == len(self) if want_logits is None else want_logits,
                          positions=positions, deepstack=share, key_limits=limits, rings=rings,
                          token_ids=None if self.token_ids is None else self.token_ids[start:end])
