"""A request's images up to the encoder cache: content keys, which are cached, encoding the rest.

``plan`` (before admission) picks the least loaded encoder, computes each image's
salted content key in its layout variant (``ChatJob.image_variants``; and names its grid,
``ChatJob.image_grids``) and asks that encoder which are cached — only for keys this
gateway has sent before (``seen_images``); a never-seen image counts as a miss until
``Encode`` reports. ``encode`` (after admission) sends the images with their bytes
to that encoder unless every one is known cached; the encoder computes only the misses,
and each image's grid and layout variant as the encoder made them must be the gateway's (else the
two processors' settings differ, or the encoder ignores variants: a 503 before anything is reserved).

The bytes travel once, here. What Prefill and Generate carry is ``ImagePlan.refs``:
key, salt, layout variant and encoder address, no bytes; the worker fetches the embedding by key,
unless the ref carries it: an embedding of at most ``inline_up_to_bytes`` (``EPD_INLINE_EMBEDDING_BYTES``)
comes back with ``Encode`` and rides inline on the ref (one fetch RPC less on the first token's path).
A colocated request whose images are all new may skip the encoder: ``encode_on_decode`` (its
estimated encode, plus what is left of the encodes sent to that decode worker before it, within
``colocated_encode_max_ms``, ``EPD_COLOCATED_ENCODE_MAX_MS``) sends
each image's bytes on the ``Generate`` instead (``ImageRef.image_data``), and the decode worker
encodes them and stores the embeddings with ``plan.encoder`` (``decode_svc/local_encode.py``).
Salted keys everywhere (seen_images, Cached, Encode, the breakdown's hit count): a
request learns about cached images only within its own salt, never another tenant's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cache.keys import image_content_key
from proto.epd.v1 import epd_pb2 as pb
from runtime.policy.cost_model import CostModel

from . import offload
from . import pipeline_metrics as m
from .chat_backend import AdmissionRefused, BackendFailure, ChatJob
from .seen_images import SeenImages
from .worker_rpc import WorkerRpc
from .worker_registry import WorkerHandle, WorkerRegistry


@dataclass(slots=True)
class ImagePlan:
    """One request's images as the pipeline sees them (all lists in the request's image order)."""

    keys: list[str] = field(default_factory=list)        # salted content keys
    refs: list[pb.ImageRef] = field(default_factory=list)  # what Prefill and Generate carry: no bytes (key, grid)
    checked: list[bool] = field(default_factory=list)    # asked with Cached (seen before); else Encode tells
    cached: list[bool] = field(default_factory=list)     # known cached before Encode
    encoder: WorkerHandle | None = None                  # None: no images

    @property
    def n_cached(self) -> int:
        return sum(self.cached)

    @property
    def image_tokens(self) -> list[int]:
        """Each image's placeholder tokens (at least one: the unit an encode is priced in)."""
        return [max(1, r.placeholder_tokens) for r in self.refs]

    @property
    def cached_tokens(self) -> int:
        """The placeholder tokens of the images known cached."""
        return sum(t for t, c in zip(self.image_tokens, self.cached) if c)

    @property
    def needs_encode(self) -> bool:
        return self.encoder is not None and self.n_cached < len(self.refs)


class EncoderStep:
    def __init__(self, registry: WorkerRegistry, rpc: WorkerRpc, seen_images: SeenImages, inline_up_to_bytes: int = 0,
                 colocated_encode_max_ms: float = 0.0):
        self.registry = registry
        self.rpc = rpc
        self.seen_images = seen_images
        self.inline_up_to_bytes = inline_up_to_bytes
        self.colocated_encode_max_ms = colocated_encode_max_ms
        self._encodes_end: dict[str, float] = {}   # decode worker -> monotonic time the encodes sent there should end
        self._call_waiting: set[str] = set()        # decode workers where a tower call waits behind the running one

    def encode_on_decode(self, plan: ImagePlan, cost_model: CostModel, decode_worker: str) -> bool:
        """Whether a colocated request's images go to ``decode_worker`` as bytes, to be encoded there:
        none known cached (a hit is cheaper at the encoder), and the stall it may put on that worker's
        other sequences within ``colocated_encode_max_ms``: their estimated encode plus what is left of
        the encodes this gateway sent there before (they run on that worker's model thread, between its
        steps, so a burst's encodes add up to one gap). Each image sent there extends that worker's
        expected end of encodes by what it adds; the end passes with time.

        What an encode adds: the worker runs the first encode of a burst at once, alone, and takes every
        encode that arrives meanwhile in one tower call after it (``decode_svc/local_encode.py``). So the
        first request sent there while nothing is ahead adds a call (``CostModel.encode_ms``), the next
        one opens the call that waits behind it (another), and every later one while encodes are still
        ahead joins that call with its images' per-token time alone (``CostModel.encode_added_ms``). Priced as
        whole calls one after another, a demo-model burst of 16 (a call 3.6 ms plus 0.36 ms an image on
        a 2-core host) looked like 64 ms of encodes where two calls take ~13: two went to the decode
        worker and 14 to the encoder, three RPCs each on the gateway's loop instead of one, and the
        refill step waited for them (bench/RESULTS.md)."""
        if not plan.needs_encode or plan.n_cached or self.colocated_encode_max_ms <= 0:
            return False
        now = time.monotonic()
        for worker in [w for w, end in self._encodes_end.items() if end <= now]:   # passed: nothing left there
            del self._encodes_end[worker]
            self._call_waiting.discard(worker)
        ahead_ms = max(0.0, self._encodes_end.get(decode_worker, now) - now) * 1000
        tokens = sum(plan.image_tokens)
        joins = ahead_ms > 0 and decode_worker in self._call_waiting
        estimate = cost_model.encode_added_ms(tokens) if joins else cost_model.encode_ms(tokens)
        if ahead_ms + estimate > self.colocated_encode_max_ms:
            return False
        self._encodes_end[decode_worker] = now + (ahead_ms + estimate) / 1000
        if ahead_ms > 0:
            self._call_waiting.add(decode_worker)
        return True

    def sent_to_decode(self, plan: ImagePlan, breakdown: dict[str, float]) -> None:
        """The images went to the decode worker as bytes: it encodes them and hands the embeddings to
        ``plan.encoder``'s cache, so this gateway asks about them next time (a repeat arriving before
        that store lands misses, and is encoded again)."""
        breakdown["encode_ms"] = breakdown.get("encode_ms", 0.0)
        breakdown["images_cache_hit"] = breakdown.get("images_cache_hit", 0.0)
        breakdown["images_encoded_on_decode"] = breakdown.get("images_encoded_on_decode", 0.0) + len(plan.refs)
        self.seen_images.add(plan.keys)

    async def plan(self, job: ChatJob) -> ImagePlan:
        """Keys and cache knowledge for ``job``'s images; 503 when they have no encoder to go to."""
        if not job.images:
            return ImagePlan()
        encoders = self.registry.healthy("encoder")
        if not encoders:
            m.ADMISSION_REJECTED.labels("no_encoder_workers").inc()
            raise AdmissionRefused(503, "no healthy encoder worker", 1.0)
        encoder = min(encoders, key=lambda h: h.stats.queue_depth + h.inflight)
        fp, digest, salt = encoder.stats.model_fingerprint, encoder.stats.preprocess_digest, job.cache_salt
        variants = job.image_variants if len(job.image_variants) == len(job.images) else [""] * len(job.images)
        keys = await offload.run(offload.small_images(im.image.size for im in job.images),
                                 lambda: [image_content_key(im.image, fp, digest, salt, v)
                                          for im, v in zip(job.images, variants)])
        checked = [self.seen_images.seen(k) for k in keys]
        found = await self.rpc.cached(encoder, [k for k, c in zip(keys, checked) if c])
        for k, c in zip(keys, checked):
            if c:
                m.ENCODER_CACHE_CHECKS.labels(str(k in found).lower()).inc()
        grids = job.image_grids or [None] * len(keys)
        counts = job.image_tokens if len(job.image_tokens) == len(keys) else [0] * len(keys)
        refs = [pb.ImageRef(cache_key=k, encoder_address=encoder.address, cache_salt=salt, grid_thw=g or (),
                            placeholder_tokens=n, layout_variant=v)
                for k, g, n, v in zip(keys, grids, counts, variants)]
        return ImagePlan(keys, refs, checked, [k in found for k in keys], encoder)

    async def encode(self, job: ChatJob, plan: ImagePlan, breakdown: dict[str, float],
                     skip: frozenset[int] | set[int] = frozenset()) -> None:
        """Encode what is not known cached (the encoder writes the cache); record it in ``breakdown``.
        ``skip``: images a colocated decode worker holds as cached KV already (not encoded; counted
        as ``images_prefix_cached``)."""
        if not plan.refs:
            return
        if skip:
            breakdown["images_prefix_cached"] = breakdown.get("images_prefix_cached", 0.0) + len(skip)
        todo = [i for i in range(len(plan.refs)) if i not in skip]
        if not todo or all(plan.cached[i] for i in todo):
            breakdown["encode_ms"] = breakdown.get("encode_ms", 0.0)
            breakdown["images_cache_hit"] = breakdown.get("images_cache_hit", 0.0) + float(len(todo))
            return
        t0 = time.monotonic()
        refs = [plan.refs[i] for i in todo]
        images = [pb.EncodeImage(ref=plan.refs[i], data=job.images[i].data) for i in todo]
        resp = await self.rpc.encode(plan.encoder, job, images, self.inline_up_to_bytes)
        for ref, image in zip(refs, resp.images):
            if list(ref.grid_thw) != list(image.grid_thw):   # this gateway's processor is not the encoder's
                raise BackendFailure(f"encoder {plan.encoder.address} made image {ref.cache_key[:12]} a grid "
                                     f"{list(image.grid_thw)}, this gateway's processor {list(ref.grid_thw)}: "
                                     "their image processor settings differ", 503)
            if ref.layout_variant != image.layout_variant:   # an encoder that does not know layout variants
                raise BackendFailure(f"encoder {plan.encoder.address} encoded image {ref.cache_key[:12]} in layout "
                                     f"variant {image.layout_variant!r}, not the prompt's {ref.layout_variant!r}", 503)
            if image.HasField("embedding"):   # small enough to ride on the next RPC: its worker need not fetch it
                ref.embedding.CopyFrom(image.embedding)
        breakdown["encode_ms"] = breakdown.get("encode_ms", 0.0) + (time.monotonic() - t0) * 1000
        breakdown["images_cache_hit"] = breakdown.get("images_cache_hit", 0.0) + float(sum(i.cache_hit for i in resp.images))
        for i, image in zip(todo, resp.images):
            if not plan.checked[i]:
                m.ENCODER_CACHE_CHECKS.labels(str(bool(image.cache_hit)).lower()).inc()
        self.seen_images.add([plan.keys[i] for i in todo])
