"""The batched attention kernels: one call per layer per ``AttentionGroup``, all sequences at once.

    sdpa_padded     every device: the group's context gathered block-wise from the pool into
                    ``[B, KVH, S, D]`` and one ``scaled_dot_product_attention`` under the
                    group's mask (a lone whole-prompt chunk: ``is_causal``, no mask; decodes:
                    each KV head's query heads as rows, so GQA needs no K/V expansion)
    flex_attention  CUDA, where ``torch.nn.attention.flex_attention`` imports: the same
                    gathered layout, masked by a block mask built once per forward from
                    ``ctx_lens`` / ``q_limits`` (fully masked tiles are skipped), compiled

Both honour a layer's sliding window (``window``: transformers passes the layer's
``sliding_window``, ``None`` for full attention) and bidirectional image spans (the
group's ``q_limits``), exactly as ``AttentionGroup.window_mask`` states the rule.

``select_kernel`` picks one at start-up (``auto``: flex_attention on CUDA when available,
else sdpa_padded); the worker reports the choice in its stats (``/status``). RoPE (1-D or
M-RoPE) is applied by the model's own layers before attention, so no kernel sees positions.
The per-sequence loop (``attention_reference``) is the reference in tests and bench only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from runtime.model.attention_groups import AttentionGroup

KERNELS = ("sdpa_padded", "flex_attention")


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def select_kernel(device: torch.device | str, requested: str = "auto") -> str:
    """The kernel this process uses; ``ValueError`` for an unknown or unavailable request."""
    device = torch.device(device)
    if requested == "auto":
        return "flex_attention" if device.type == "cuda" and flex_available() else "sdpa_padded"
    if requested not in KERNELS:
        raise ValueError(f"attention kernel {requested!r} is not one of auto, {', '.join(KERNELS)}")
    if requested == "flex_attention" and not flex_available():
        raise ValueError("attention kernel flex_attention: torch.nn.attention.flex_attention is not available")
    return requested


def gather_context(pool_blocks: torch.Tensor, group: AttentionGroup, dtype: torch.dtype, which: str,
                   table: int = 0) -> torch.Tensor:
    """``[B, KVH, S, D]``: each sequence's blocks of page group ``table`` laid end to end (one block-wise
    index copy into a buffer the group reuses for every layer of the forward: ``which`` is ``"k"`` or ``"v"``)."""
    b, n = group.tables[table].shape
    first = group.one_runs[table] if group.one_runs else None
    if first is not None:   # one sequence in adjacent blocks: a view of the pool, no copy
        ctx = pool_blocks[first: first + n].flatten(0, 1)[: group.max_ctx]
        return ctx.transpose(0, 1).unsqueeze(0).to(dtype)
    index = group.tables[table].view(-1)
    buf = group.kernel_state.get(which)   # one buffer per K / V: every group's tables have the same shape
    if buf is None:
        buf = group.kernel_state[which] = pool_blocks.new_empty((b * n, *pool_blocks.shape[1:]))
    ctx = torch.index_select(pool_blocks, 0, index, out=buf)       # [B*N, bs, KVH, D]
    ctx = ctx.view(b, n * group.block_size, *ctx.shape[2:])        # [B, S, KVH, D]
    if b == 1:
        ctx = ctx[:, : group.max_ctx]                             # nothing past the one context
    return ctx.transpose(1, 2).to(dtype)


def group_queries(query: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """``[B, H, Q, D]`` from the packed ``[1, H, T, D]``."""
    return query[0][:, group.q_index].transpose(0, 1)


def sdpa_padded(q, k, v, group: AttentionGroup, scaling: float | None, window: int | None = None,
                causal_only: bool = False) -> torch.Tensor:
    b, heads, q_len, dim = q.shape
    kv_heads = k.shape[1]
    full = group.window_mask(window, causal_only)
    if q_len == 1 and full is not None:
        # decodes: the G query heads sharing a KV head become G query rows of that head (one query
        # position, so one mask row serves them all); no K/V expansion for GQA
        qg = q.reshape(b, kv_heads, heads // kv_heads, dim)
        mask = full if b > 1 else full[..., : k.shape[2]]
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scaling).reshape(b, heads, 1, dim)
    if full is None:      # a lone causal chunk that is its whole context: the prompt's own causal call
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    mask = full if q.shape[0] > 1 else full[..., : k.shape[2]]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)


@functools.cache
def _compiled_flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=True)


def flex(q, k, v, group: AttentionGroup, scaling: float | None, window: int | None = None,
         causal_only: bool = False) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    window = None if window is None or group.max_ctx <= window else window
    key = ("block_mask", window, causal_only)
    block_mask = group.kernel_state.get(key)
    if block_mask is None or block_mask.shape[-1] != k.shape[2]:
        ctx_lens, q_limits, q_positions = group.ctx_lens, group.limits(causal_only), group.q_positions

        def visible(b, h, q_idx, kv_idx):
            seen = (kv_idx <= q_limits[b, q_idx]) & (kv_idx < ctx_lens[b])
            return seen if window is None else seen & (kv_idx > q_positions[b, q_idx] - window)

        block_mask = create_block_mask(visible, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
        group.kernel_state[key] = block_mask
    fn = _compiled_flex() if q.device.type == "cuda" else flex_attention
    return fn(q, k, v, block_mask=block_mask, scale=scaling, enable_gqa=True)


def attend(kernel: str, query: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
           groups: list[AttentionGroup], scaling: float | None, window: int | None = None, table: int = 0,
           causal_only: bool = False) -> torch.Tensor:
    """``[T, H, D]``: every group's queries attended in one call each, scattered back to packed rows
    (``window``: the layer's sliding window, ``None`` for full attention; ``table``: the layer's page group;
    ``causal_only``: image spans attend causally on this layer)."""
    fn = flex if kernel == "flex_attention" else sdpa_padded
    rows, heads, dim = query.shape[2], query.shape[1], query.shape[3]
    out = None
    for group in groups:
        q = group_queries(query, group)
        k = gather_context(k_blocks, group, q.dtype, "k", table)
        v = gather_context(v_blocks, group, q.dtype, "v", table)
        o = fn(q, k, v, group, scaling, window, causal_only).transpose(1, 2)            # [B, Q, H, D]
        if group.out_rows == (0, rows):    # one group holds every row, in order: its result is the output
            return o.reshape(rows, heads, dim)
        out = query.new_empty(rows, heads, dim) if out is None else out
        if group.out_rows is not None:
            out[group.out_rows[0]: group.out_rows[1]] = o.reshape(-1, heads, dim)
        else:
            out[group.out_index] = o[group.q_valid]
    return out if out is not None else query.new_empty(rows, heads, dim)
