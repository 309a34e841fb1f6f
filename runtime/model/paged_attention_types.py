"""What a paged forward carries to every attention layer (``paged_attention``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.model.attention_groups import AttentionGroup
from runtime.model.kv_layout import PageGroups


@dataclass(slots=True)
class SequenceSpan:
    q_offset: int            # first of this sequence's new tokens in the packed row
    q_len: int               # number of new tokens
    context_runs: list[tuple[int, int]]  # (first slot, length) covering positions 0..ctx_len-1 in order (reference loop only)
    key_limit: torch.Tensor | None = None  # [q_len]: last key position each new token sees (None: causal)
    ring_runs: list[list[tuple[int, int]]] = field(default_factory=list)  # per ring group, as context_runs


@dataclass(slots=True)
class PagedBatch:
    layer_kv: list[torch.Tensor]  # per KV layer [2, num_blocks, block_size, kv_heads, head_dim] (KVBlockPool.layer_kv)
    slot_mapping: torch.Tensor   # [T] long: where each new token's K/V is written (page group 0)
    spans: list[SequenceSpan]
    groups: list[AttentionGroup] = field(default_factory=list)  # decodes, prompt chunks: one call each
    kernel: str = "sdpa_padded"  # attention_kernels.KERNELS, or attention_reference.KERNEL
    groups_of: PageGroups | None = None   # the pool's layer -> page group map (None: dense, one group)
    ring_slot_mappings: list[torch.Tensor] = field(default_factory=list)  # per ring group, as slot_mapping

    def group(self, layer: int) -> int:
        """The page group of KV layer ``layer`` (0 on a dense pool)."""
        return 0 if self.groups_of is None else self.groups_of.group_of[layer]

    def slot_mapping_of(self, group: int) -> torch.Tensor:
        return self.slot_mapping if group == 0 else self.ring_slot_mappings[group - 1]
