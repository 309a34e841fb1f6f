"""Attention over KV held in fixed-size blocks, plugged into transformers.

The model's own layers (projections, RoPE, MLP, norms) run unchanged; only the
attention call is ours. It is registered with transformers' attention and mask
interfaces under ``"epd_paged"``. A forward that passes ``epd_batch=PagedBatch``
uses the block pool; any other call (``generate()``, training) falls through to
the stock SDPA path, so one loaded model serves both.

Packed layout: all sequences' new tokens are concatenated into one row
``[1, T]``. ``slot_mapping[t]`` is the flat pool slot of new token ``t``;
``context_runs[i]`` lists sequence ``i``'s whole context, ending with its new
tokens, as runs of adjacent slots. Invariant: the new tokens are the last
``q_len`` of the context. A context in one run (the usual case: blocks are
handed out in order) is attended as a view of the pool, with no gather copy.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

ATTN_IMPLEMENTATION = "epd_paged"

_paged_forward_active: contextvars.ContextVar[bool] = contextvars.ContextVar("epd_paged_forward_active", default=False)


@dataclass(slots=True)
class SequenceSpan:
    q_offset: int            # first of this sequence's new tokens in the packed row
    q_len: int               # number of new tokens
    context_runs: list[tuple[int, int]]  # (first slot, length) covering positions 0..ctx_len-1 in order


@dataclass(slots=True)
class PagedBatch:
    kv: torch.Tensor             # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor   # [T] long: where each new token's K/V is written
    spans: list[SequenceSpan]


def _context(pool: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    """``[ctx, KVH, D]`` of one sequence: a view when the context is one run, else a copy."""
    if len(runs) == 1:
        slot, length = runs[0]
        return pool[slot: slot + length]
    return torch.cat([pool[slot: slot + length] for slot, length in runs])


def _paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    batch: PagedBatch | None = kwargs.pop("epd_batch", None)
    if batch is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    # query [1, H, T, D]; key/value [1, KVH, T, D] (RoPE already applied)
    layer = module.layer_idx
    kv_heads, head_dim = key.shape[1], key.shape[3]
    k_pool = batch.kv[layer, 0].view(-1, kv_heads, head_dim)
    v_pool = batch.kv[layer, 1].view(-1, kv_heads, head_dim)
    k_pool[batch.slot_mapping] = key[0].transpose(0, 1).to(k_pool.dtype)
    v_pool[batch.slot_mapping] = value[0].transpose(0, 1).to(v_pool.dtype)

    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, H, D]
    for span in batch.spans:
        q = query[:, :, span.q_offset: span.q_offset + span.q_len]          # [1, H, q, D]
        k = _context(k_pool, span.context_runs).transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, KVH, ctx, D]
        v = _context(v_pool, span.context_runs).transpose(0, 1).unsqueeze(0).to(q.dtype)
        ctx_len = k.shape[2]
        if span.q_len == 1:
            o = F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=True)
        elif span.q_len == ctx_len:
            # whole context in one chunk: the same call transformers makes for a prompt
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            q_pos = torch.arange(ctx_len - span.q_len, ctx_len, device=q.device)
            mask = q_pos[:, None] >= torch.arange(ctx_len, device=q.device)[None, :]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        out[span.q_offset: span.q_offset + span.q_len] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _paged_mask(*args, **kwargs):
    if _paged_forward_active.get():
        return None  # the paged kernel builds per-sequence causal masks itself
    return sdpa_mask(*args, **kwargs)


class paged_forward:
    """Context manager marking a forward as paged (skips transformers' mask building)."""

    def __enter__(self):
        self._token = _paged_forward_active.set(True)

    def __exit__(self, *exc):
        _paged_forward_active.reset(self._token)


def register() -> None:
    """Idempotent: make ``"epd_paged"`` a valid ``attn_implementation``."""
    if ATTN_IMPLEMENTATION not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(ATTN_IMPLEMENTATION, _paged_attention)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _paged_mask)
