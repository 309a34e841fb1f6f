"""Routing by prefix: which decode worker already holds how much of a request's prompt as KV.

Each decode worker reports a summary of its prefix cache (the 64-bit ids of its cached block
keys, ``WorkerStats.prefix_summary``), sent again only when it changed (``WorkerHandle.
prefix_summary``, refreshed by the registry's poll; a worker that stops answering or restarts
has an empty one). Per request, ``PrefixView`` computes the prompt's block keys once per
(block size, fingerprint) the decode workers use (``runtime/model/prefix_keys.py``, the
function the decode worker recomputes them with) and reads, per worker, the longest leading
run of keys its summary holds: ``cached_tokens(address)``, what the placement policy receives
as ``cached_prefix_tokens``, and ``images_within``, the images whose placeholders lie wholly
in it (a colocated request there skips encoding them: their KV is there already).

A summary is a hint: ``Reserve`` reports what the worker really reused (``cached_tokens``),
and a request whose prefix was evicted meanwhile encodes what it then needs
(``gateway/handoff.py``). A job without placeholder counts for its images gets no keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.model.prefix_keys import ImageSpan, block_keys, cached_prefix_blocks, image_spans

from .chat_backend import ChatJob
from .worker_registry import WorkerHandle


@dataclass(slots=True)
class PrefixView:
    job: ChatJob
    spans: list[ImageSpan] | None                # None: no keys for this job
    _keys: dict[tuple[int, str], list[bytes]] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)   # decode address -> cached prompt tokens

    @classmethod
    def of(cls, job: ChatJob, image_keys: list[str], decode: list[WorkerHandle]) -> PrefixView:
        spans = None
        if len(job.image_tokens) == len(job.images) and (job.image_token_id >= 0 or not job.images):
            try:
                spans = image_spans(job.token_ids, job.image_token_id, image_keys, job.image_tokens,
                                    job.image_grids if any(job.image_grids) else ())
            except ValueError:
                spans = None
        view = cls(job, spans)
        for h in decode:
            if h.stats is not None and h.stats.prefix_cache and view.spans is not None:
                blocks = cached_prefix_blocks(view.keys_for(h), h.prefix_summary)
                view.cached[h.address] = min(blocks * h.stats.block_size, len(job.token_ids) - 1)
        return view

    def keys_for(self, h: WorkerHandle) -> list[bytes]:
        """The prompt's block keys as ``h`` computes them (its block size and fingerprint); [] without."""
        if self.spans is None or h.stats is None or not h.stats.prefix_cache:
            return []
        bs, fp = max(1, h.stats.block_size), h.stats.model_fingerprint
        keys = self._keys.get((bs, fp))
        if keys is None:
            keys = self._keys[(bs, fp)] = block_keys(
                self.job.token_ids, self.spans, block_size=bs, model_fingerprint=fp, cache_salt=self.job.cache_salt,
                positions=self.job.positions)
        return keys

    def cached_tokens(self, address: str) -> int:
        return max(0, self.cached.get(address, 0))

    def images_within(self, tokens: int) -> int:
        """How many images have every placeholder before position ``tokens``."""
        return sum(1 for s in self.spans or () if s.end <= tokens)

    def images_needed(self, tokens: int) -> list[int]:
        """Indices of the images with placeholders at or after position ``tokens``."""
        return [k for k, s in enumerate(self.spans or ()) if s.end > tokens]
