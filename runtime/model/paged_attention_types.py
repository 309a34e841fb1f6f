"""What a paged forward carries to every attention layer (``paged_attention``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.model.attention_groups import AttentionGroup


@dataclass(slots=True)
class SequenceSpan:
    q_offset: int            # first of this sequence's new tokens in the packed row
    q_len: int               # number of new tokens
    context_runs: list[tuple[int, int]]  # (first slot, length) covering positions 0..ctx_len-1 in order
    key_limit: torch.Tensor | None = None  # [q_len]: last key position each new token sees (None: causal)


@dataclass(slots=True)
class PagedBatch:
    kv: torch.Tensor             # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor   # [T] long: where each new token's K/V is written
    spans: list[SequenceSpan]
    groups: list[AttentionGroup] = field(default_factory=list)  # decodes, prompt chunks: one call each
    kernel: str = "sdpa_padded"  # attention_kernels.KERNELS, or attention_reference.KERNEL
