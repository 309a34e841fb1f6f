"""The decode worker's side of the prefix cache: checking a request's keys, and a colocated
prompt whose prefix is cached.

- ``request_keys``: the prompt's block keys recomputed here (``runtime/model/prefix_keys.py``)
  from what ``Generate`` carries (token ids, image refs with their placeholder counts and
  grids, the cache salt) and this worker's own fingerprint and block size, with the family's
  M-RoPE positions. A reservation's keys (the gateway's) are trusted for nothing until these
  equal them: only then may its blocks be reused (already decided at ``Reserve``, refused
  otherwise before any forward) or cached.
- ``needed_images``: with ``cached`` prompt positions already in the pool, only the images
  whose placeholders reach past them are fetched; the others get ``stand_ins`` (zero
  features of their span's length and grid) so the prompt prepares as a whole. The stand-ins'
  positions are below ``cached``, so no forward reads them: the KV there is the cache's.
- ``PrefixCacheCounters``: ``epd:prefix_cache_queries_total`` and ``..._hits_total``, in tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from proto.epd.v1 import epd_pb2 as pb
from runtime.model.families import ImageEmbedding, PositionKind
from runtime.model.model_adapter import VLMAdapter
from runtime.model.prefix_keys import ImageSpan, block_keys, image_spans
from runtime.worker.wire import ref_grids


@dataclass(slots=True)
class PrefixCacheCounters:
    """Prompt tokens looked up at Reserve, and how many of them the cache served."""

    queries_total: int = 0
    hits_total: int = 0

    def count(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.queries_total += prompt_tokens
        self.hits_total += cached_tokens


def spans_of(adapter: VLMAdapter, token_ids: Sequence[int], refs: Sequence[pb.ImageRef]) -> list[ImageSpan]:
    """Each image's placeholder span as its ref declares it; ``ValueError`` when they do not add up."""
    return image_spans(token_ids, adapter.image_token_id, [r.cache_key for r in refs],
                       [r.placeholder_tokens for r in refs], ref_grids(refs) if any(r.grid_thw for r in refs) else ())


def request_keys(adapter: VLMAdapter, token_ids: Sequence[int], refs: Sequence[pb.ImageRef], cache_salt: str,
                 block_size: int) -> list[bytes]:
    """The prompt's block keys as this worker computes them (``ValueError`` on inconsistent refs)."""
    spans = spans_of(adapter, token_ids, refs)
    positions = None
    if adapter.family.position_kind is PositionKind.MROPE:
        positions = adapter.family.position_plan(token_ids, [s.grid for s in spans]).positions
    return block_keys(token_ids, spans, block_size=block_size, model_fingerprint=adapter.model_fingerprint,
                      cache_salt=cache_salt, positions=positions)


def needed_images(spans: Sequence[ImageSpan], cached: int) -> list[int]:
    """Indices of the images with placeholders at or after position ``cached``."""
    return [k for k, s in enumerate(spans) if s.end > cached]


def with_stand_ins(adapter: VLMAdapter, spans: Sequence[ImageSpan], fetched: dict[int, ImageEmbedding]) -> list[ImageEmbedding]:
    """One record per image: the fetched ones, and zero stand-ins (same span, grid and DeepStack
    levels as a fetched one has) for the images wholly inside the cached prefix."""
    levels = next((e.deepstack.shape[0] for e in fetched.values() if e.deepstack is not None), None)
    out = []
    for k, span in enumerate(spans):
        if k in fetched:
            out.append(fetched[k])
            continue
        features = torch.zeros(span.tokens, adapter.hidden_size, dtype=adapter.kv_layout.dtype, device=adapter.device)
        deepstack = None if levels is None else features.new_zeros(levels, span.tokens, adapter.hidden_size)
        out.append(ImageEmbedding(features, span.grid, deepstack))
    return out
