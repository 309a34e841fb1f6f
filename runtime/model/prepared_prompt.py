"""A prompt made ready for chunked prefill, once, where it is prepared.

``VLMAdapter.prepare(token_ids, images)`` checks the prompt, splices the image
features into the token embeddings and asks the family for the positions.
Any chunking then slices it: ``item(start, end, blocks)`` is the ``PackedItem``
of positions ``start..end``, carrying that chunk's M-RoPE positions and its
share of the DeepStack features (the image tokens that fall in the chunk), so
chunks that split an image give the same KV as one pass. ``rope_delta`` is the
per-sequence metadata decode needs after the prompt (0 for 1-D families).
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
    _images_before: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.deepstack is not None:
            counts = self.image_mask.to(torch.long).cumsum(0)
            self._images_before = torch.cat([counts.new_zeros(1), counts])   # [T + 1]

    def __len__(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def rope_delta(self) -> int:
        return self.plan.rope_delta

    def item(self, start: int, end: int, blocks: list[int], want_logits: bool | None = None) -> PackedItem:
        """The chunk ``start..end`` as one packed item (logits wanted for the last chunk by default)."""
        if not 0 <= start < end <= len(self):
            raise IndexError(f"chunk {start}..{end} outside the prompt of {len(self)} tokens")
        positions = None if self.plan.positions is None else self.plan.positions[:, start:end]
        share = None
        if self.deepstack is not None:
            first, last = int(self._images_before[start]), int(self._images_before[end])
            if last > first:
                share = DeepStackShare(self.image_mask[start:end], self.deepstack[:, first:last])
        return PackedItem(self.embeds[start:end], start, blocks, end == len(self) if want_logits is None else want_logits,
                          positions=positions, deepstack=share)
