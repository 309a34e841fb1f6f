"""The Encoder gRPC service: image bytes in, embeddings into the encoder cache.

A request names each image by its content key (computed by the gateway from the
decoded pixels, the model fingerprint, the preprocessing digest and the ref's
``cache_salt``, the tenant's namespace, and its ``layout_variant``: the form the family
encodes it in for its prompt's image count, ``""`` for most). Per image of an ``Encode``:

* bytes and a key (the gateway): the key is looked up first; only on a miss are the
  bytes decoded, the key re-derived from them, the salt and the variant, and the image
  encoded in that variant. It must match before
  anything is written, so a wrong key can never poison the shared cache, nor file an
  image under another tenant's namespace.
* a key alone (a prefill or decode worker fetching an embedding): a lookup, nothing
  else; NOT_FOUND when this encoder's cache no longer holds the entry (the bytes are
  not here to re-encode from: the request fails with a 503, see ``cache/embedding_fetch.py``).

The reply carries each embedding when asked (``return_embeddings``: a worker's fetch) or when it
is at most ``inline_up_to_bytes`` (the gateway's Encode: it hands small embeddings on inline in the
Generate or Prefill that follows, so that worker does not fetch them again). It goes back as soon
as the embeddings are computed: a miss's Redis write (and the release of its single-flight lock)
follows in the background (``write_behind``), and the gateway's miss is not read from Redis a second
time (``missed``), two to three Redis round trips off every new image's first token.

``Store`` keeps embeddings a decode worker computed itself from a colocated request's bytes
(``decode_svc/local_encode.py``, which re-derived each key from the bytes as ``Encode`` does): a
repeat of that image is then a hit here. ``stored`` counts them.

``cache_hits`` counts client images (bytes sent) that did not need encoding; a
worker's lookup by key is no hit: one new image shows 1 compute and 0 hits.
Concurrent misses for one key are merged into one encode (single-flight, across
replicas when the cache is Redis).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import torch
from PIL import Image

from cache.encoder_cache import EncoderCache, check_key, tensor_nbytes
from cache.keys import decode_with_key, preprocess_digest
from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.model.errors import InvalidImage
from runtime.model.families import EmbeddingFormatError
from runtime.model.tensor_bytes import TensorFormatError
from runtime.model.model_adapter import VLMAdapter
from runtime.worker.serving_state import ServingState
from runtime.worker.tracing import span
from runtime.worker.wire import tensor_from_pb, tensor_to_pb

from .batcher import EncodeBatcher


class EncoderServicer(pb_grpc.EncoderServicer):
    def __init__(self, adapter: VLMAdapter, cache: EncoderCache, batcher: EncodeBatcher, *, stall_ms: float = 0.0):
        self.adapter = adapter
        self.cache = cache
        self.batcher = batcher
        self.preprocess_digest = preprocess_digest(adapter.processor.image_processor.to_dict())
        self.state = ServingState("encoder", batcher.timings, adapter.model_fingerprint,
                                  linear_kernel=adapter.linear_kernel, device_type=adapter.device.type)
        self.in_flight = 0
        self.cache_hits = 0      # client images (bytes sent) that did not need encoding
        self.stored = 0          # embeddings decode workers computed and handed here (``Store``)
        self.stall_s = stall_ms / 1000   # fault injection (``stall_encoder_ms``): every Encode waits first

    def _decode_image(self, data: bytes, cache_salt: str, layout_variant: str) -> tuple[Image.Image, str]:
        """The validated RGB image and its content key (hashed as decoded, before any conversion)."""
        try:
            image, key = decode_with_key(data, self.adapter.model_fingerprint, self.preprocess_digest, cache_salt,
                                         layout_variant)
        except ValueError as exc:
            raise InvalidImage(str(exc)) from exc
        return self.adapter.validate_image(image), key

    async def Encode(self, request: pb.EncodeRequest, context) -> pb.EncodeResponse:
        started = time.perf_counter()
        self.in_flight += 1
        try:
            if self.stall_s:
                await asyncio.sleep(self.stall_s)
            out = []
            for image in request.images:
                key, tensor, hit = await self._embedding(image, context, request.request_id)
                (record,) = self.adapter.embeddings([tensor])   # the stored layout read back (checked)
                item = pb.EncodedImage(cache_key=key, cache_hit=hit, tokens=record.tokens, grid_thw=record.grid or (),
                                       layout_variant=image.ref.layout_variant)
                if request.return_embeddings or tensor_nbytes(tensor) <= request.inline_up_to_bytes:
                    item.embedding.CopyFrom(tensor_to_pb(tensor))
                out.append(item)
            return pb.EncodeResponse(images=out, encode_ms=(time.perf_counter() - started) * 1000)
        finally:
            self.in_flight -= 1

    async def _embedding(self, image: pb.EncodeImage, context, request_id: str = "") -> tuple[str, torch.Tensor, bool]:
        """``(key, embedding, cache_hit)`` for one image: by key first, bytes decoded only on a miss."""
        ref = image.ref
        try:
            self.adapter.check_variant(ref.layout_variant)
        except InvalidImage as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if ref.cache_key:
            with span("encoder.cache_check", **{"epd.request_id": request_id}) as s:
                tensor = await self.cache.get(ref.cache_key)
                if s is not None:
                    s.set_attribute("epd.cache_hit", tensor is not None)
            if tensor is not None:
                self.cache_hits += bool(image.data)
                return ref.cache_key, tensor, True
            if not image.data:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"embedding {ref.cache_key} is not cached here")
        try:
            decoded, key = self._decode_image(image.data, ref.cache_salt, ref.layout_variant)
        except InvalidImage as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if ref.cache_key and ref.cache_key != key:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "cache key does not match the image content")
        with span("encoder.encode", **{"epd.request_id": request_id}) as s:
            # the reply need not wait for the shared tier's write: the embedding goes back inline, or a
            # worker that misses it in Redis asks this encoder, whose LRU holds it (cache/embedding_fetch.py)
            tensor, hit = await self.cache.get_or_compute(
                key, lambda: self.batcher.encode(decoded, ref.layout_variant, ref.placeholder_tokens),
                missed=bool(ref.cache_key), write_behind=True)
            if s is not None:
                s.set_attribute("epd.cache_hit", bool(hit))
        self.cache_hits += hit
        return key, tensor, hit

    async def Store(self, request: pb.StoreRequest, context) -> pb.StoreResponse:
        """Keep embeddings a decode worker computed from a colocated request's bytes (it re-derived
        each key from them), as if encoded here; one not in this model's stored layout refuses the call."""
        checked = []
        for item in request.embeddings:
            try:
                tensor = tensor_from_pb(item.embedding)
                self.adapter.embeddings([tensor])   # the stored layout read back (checked)
                checked.append((check_key(item.cache_key), tensor))
            except (ValueError, TensorFormatError, EmbeddingFormatError) as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"embedding {item.cache_key[:12]}: {exc}")
        for key, tensor in checked:
            await self.cache.put(key, tensor)
        self.stored += len(checked)
        return pb.StoreResponse(stored=len(checked))

    async def Cached(self, request: pb.CachedRequest, context) -> pb.CachedResponse:
        return pb.CachedResponse(cached=await self.cache.contains_many(list(request.cache_keys)))

    def busy(self) -> bool:
        return self.in_flight > 0

    async def close(self) -> None:
        await self.batcher.stop()
        await self.cache.close()

    def local_stats(self) -> dict[str, int]:
        return {"queue_depth": self.batcher.queue_depth, "in_flight": self.in_flight,
                "single_flight_in_flight": self.cache.in_flight, "encoder_computes_total": self.batcher.computes,
                "encoder_cache_hits_total": self.cache_hits}

    async def Stats(self, request: pb.StatsRequest, context) -> pb.WorkerStats:
        return self.state.stats(
            request, queue_depth=self.batcher.queue_depth, queued_image_tokens=self.batcher.queued_image_tokens,
            in_flight=self.in_flight, computes=self.batcher.computes, cache_hits=self.cache_hits,
            max_batch=self.batcher.max_observed_batch, preprocess_digest=self.preprocess_digest,
            single_flight_in_flight=self.cache.in_flight,
        )
