"""Attention over KV held in fixed-size blocks, plugged into transformers.

The model's own layers (projections, RoPE, MLP, norms) run unchanged; only the
attention call is ours. It is registered with transformers' attention and mask
interfaces under ``"epd_paged"``. A forward that passes ``epd_batch=PagedBatch``
uses the block pool; any other call (``generate()``, training) falls through to
the stock SDPA path, so one loaded model serves both.

Packed layout: all sequences' new tokens are concatenated into one row
``[1, T]``. ``slot_mapping[t]`` is the flat pool slot of new token ``t``;
``context_runs[i]`` (listed only for the reference loop) is sequence ``i``'s whole
context, ending with its new tokens, as runs of adjacent slots. Invariant: the new tokens are the last
``q_len`` of the context. On a windowed pool (``kv_pool``) a sliding layer's page
group has its own ``ring_slot_mappings`` entry and ``SequenceSpan.ring_runs``
(``PagedBatch.group(layer)`` says which); a layer that reads another layer's KV
(``epd_kv_reused``, Gemma 4) writes nothing.

Attention runs for many sequences in one call: ``PagedBatch.groups`` (built once per
forward by ``packed_batch.pack``) holds the decodes as one group and the prompt chunks
as another, and ``attention_kernels`` attends each group with one kernel call per layer
(the kernel chosen at start-up, ``PagedBatch.kernel``). The per-sequence loop of
``attention_reference`` runs only when a test or bench asks for it by name.
"""

from __future__ import annotations

import contextvars

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

from runtime.model import attention_kernels, attention_reference
from runtime.model.paged_attention_types import PagedBatch, SequenceSpan

__all__ = ["ATTN_IMPLEMENTATION", "PagedBatch", "SequenceSpan", "paged_forward", "register"]

ATTN_IMPLEMENTATION = "epd_paged"

_paged_forward_active: contextvars.ContextVar[bool] = contextvars.ContextVar("epd_paged_forward_active", default=False)


def _paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    batch: PagedBatch | None = kwargs.pop("epd_batch", None)
    window = kwargs.pop("sliding_window", None) if batch is not None else None   # a sliding layer's (Gemma 3)
    if batch is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    # query [1, H, T, D]; key/value [1, KVH, T, D] (RoPE already applied)
    layer = getattr(module, "epd_kv_layer", module.layer_idx)   # hybrid decoders: the pool holds attention layers only
    group = batch.group(layer)     # a windowed pool keeps sliding layers in ring pages (kv_pool)
    kv_heads, head_dim = key.shape[1], key.shape[3]
    k_blocks, v_blocks = batch.layer_kv[layer]       # [blocks, block_size, KVH, D] each
    k_pool = k_blocks.view(-1, kv_heads, head_dim)
    v_pool = v_blocks.view(-1, kv_heads, head_dim)
    if not getattr(module, "epd_kv_reused", False):   # a layer reading another's KV (Gemma 4) writes nothing
        slot_mapping = batch.slot_mapping_of(group)
        k_pool[slot_mapping] = key[0].transpose(0, 1).to(k_pool.dtype)
        v_pool[slot_mapping] = value[0].transpose(0, 1).to(v_pool.dtype)
    causal_only = getattr(module, "epd_causal_images", False)   # Gemma 4: images bidirectional on sliding layers only
    if batch.kernel == attention_reference.KERNEL:
        out = attention_reference.attend_loop(query, k_pool, v_pool, batch.spans, scaling, window, group, causal_only)
    else:
        out = attention_kernels.attend(batch.kernel, query, k_blocks, v_blocks, batch.groups, scaling, window, group,
                                       causal_only)
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
