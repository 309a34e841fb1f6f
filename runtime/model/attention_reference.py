"""The per-sequence reference: one SDPA call per sequence per layer, over views of the pool.

Never selected by a server (``attention_kernels.select_kernel`` does not offer it): tests
compare the batched kernels against it, and ``bench.decode_throughput`` times it beside them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model.paged_attention_types import SequenceSpan

KERNEL = "reference_loop"


def _context(pool: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    """``[ctx, KVH, D]`` of one sequence: a view when the context is one run, else a copy."""
    if len(runs) == 1:
        slot, length = runs[0]
        return pool[slot: slot + length]
    return torch.cat([pool[slot: slot + length] for slot, length in runs])


def attend_loop(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, spans: list[SequenceSpan],
                scaling: float | None, window: int | None = None, group: int = 0,
                causal_only: bool = False) -> torch.Tensor:
    """``[T, H, D]``; ``k_pool``/``v_pool`` are flat ``[slots, KVH, D]``. A query at position ``p``
    sees key ``s`` when ``s <= p`` (or ``s <= key_limit``, a bidirectional image span) and, on a
    sliding layer (``window``), ``s > p - window``. ``group``: the layer's page group (0, or a ring
    group of a windowed pool, whose runs repeat pages the window mask then hides)."""
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, H, D]
    for span in spans:
        q = query[:, :, span.q_offset: span.q_offset + span.q_len]          # [1, H, q, D]
        runs = span.context_runs if group == 0 else span.ring_runs[group - 1]
        key_limit = None if causal_only else span.key_limit
        k = _context(k_pool, runs).transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, KVH, ctx, D]
        v = _context(v_pool, runs).transpose(0, 1).unsqueeze(0).to(q.dtype)
        ctx_len = k.shape[2]
        windowed = window is not None and ctx_len > window
        if key_limit is None and not windowed and span.q_len == 1:
            o = F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=True)
        elif key_limit is None and not windowed and span.q_len == ctx_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            q_pos = torch.arange(ctx_len - span.q_len, ctx_len, device=q.device)
            limit = q_pos if key_limit is None else torch.maximum(key_limit.to(q.device), q_pos)
            keys = torch.arange(ctx_len, device=q.device)[None, :]
            mask = keys <= limit[:, None]
            if windowed:
                mask &= keys > (q_pos - window)[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        out[span.q_offset: span.q_offset + span.q_len] = o[0].transpose(0, 1)
    return out
