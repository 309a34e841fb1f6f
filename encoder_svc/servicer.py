"""The Encoder gRPC service: image bytes in, embeddings into the encoder cache.

A request names each image by its content key (computed by the gateway from the
decoded pixels, the model fingerprint, the preprocessing digest and the ref's
``cache_salt``, the tenant's namespace). The key is re-derived here from the bytes
and the salt and must match, so a wrong key can never poison the shared cache, nor
file an image under another tenant's namespace.
Concurrent misses for one key are merged into one encode (single-flight, across
replicas when the cache is Redis).
"""

from __future__ import annotations

import io
import time

import grpc
from PIL import Image, UnidentifiedImageError

from cache.encoder_cache import EncoderCache
from cache.keys import image_content_key, preprocess_digest
from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.model.errors import InvalidImage
from runtime.model.model_adapter import VLMAdapter
from runtime.worker.serving_state import ServingState
from runtime.worker.wire import tensor_to_pb

from .batcher import EncodeBatcher


class EncoderServicer(pb_grpc.EncoderServicer):
    def __init__(self, adapter: VLMAdapter, cache: EncoderCache, batcher: EncodeBatcher):
        self.adapter = adapter
        self.cache = cache
        self.batcher = batcher
        self.preprocess_digest = preprocess_digest(adapter.processor.image_processor.to_dict())
        self.state = ServingState("encoder", batcher.timings, adapter.model_fingerprint)
        self.in_flight = 0
        self.cache_hits = 0

    def key_for(self, image: Image.Image, cache_salt: str = "") -> str:
        return image_content_key(image, self.adapter.model_fingerprint, self.preprocess_digest, cache_salt)

    def _decode_image(self, data: bytes, cache_salt: str) -> tuple[Image.Image, str]:
        """The validated RGB image and its content key (hashed as decoded, before any conversion)."""
        try:
            image = Image.open(io.BytesIO(data))
            image.load()
        except (UnidentifiedImageError, OSError, SyntaxError, Image.DecompressionBombError) as exc:
            raise InvalidImage(f"not a decodable image: {exc}") from exc
        key = self.key_for(image, cache_salt)
        return self.adapter.validate_image(image), key

    async def Encode(self, request: pb.EncodeRequest, context) -> pb.EncodeResponse:
        started = time.perf_counter()
        self.in_flight += 1
        try:
            out = []
            for ref in request.images:
                tensor, hit = None, False
                if not ref.data:
                    tensor = await self.cache.get(ref.cache_key)
                    if tensor is None:
                        await context.abort(grpc.StatusCode.NOT_FOUND, f"embedding {ref.cache_key} not cached and no bytes sent")
                    hit, ref_key = True, ref.cache_key
                else:
                    try:
                        image, key = self._decode_image(ref.data, ref.cache_salt)
                    except InvalidImage as exc:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                    if ref.cache_key and ref.cache_key != key:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "cache key does not match the image content")
                    tensor, hit = await self.cache.get_or_compute(key, lambda image=image: self.batcher.encode(image))
                    ref_key = key
                self.cache_hits += hit
                item = pb.EncodedImage(cache_key=ref.cache_key or ref_key, cache_hit=hit, tokens=int(tensor.shape[0]))
                if request.return_embeddings:
                    item.embedding.CopyFrom(tensor_to_pb(tensor))
                out.append(item)
            return pb.EncodeResponse(images=out, encode_ms=(time.perf_counter() - started) * 1000)
        finally:
            self.in_flight -= 1

    async def Cached(self, request: pb.CachedRequest, context) -> pb.CachedResponse:
        return pb.CachedResponse(cached=await self.cache.contains_many(list(request.cache_keys)))

    def busy(self) -> bool:
        return self.in_flight > 0

    async def close(self) -> None:
        await self.batcher.stop()
        await self.cache.close()

    def local_stats(self) -> dict[str, int]:
        return {"queue_depth": self.batcher.queue_depth, "in_flight": self.in_flight,
                "single_flight_in_flight": self.cache.in_flight}

    async def Stats(self, request: pb.StatsRequest, context) -> pb.WorkerStats:
        return self.state.stats(
            request, queue_depth=self.batcher.queue_depth,
            in_flight=self.in_flight, computes=self.batcher.computes, cache_hits=self.cache_hits,
            max_batch=self.batcher.max_observed_batch, preprocess_digest=self.preprocess_digest,
            single_flight_in_flight=self.cache.in_flight,
        )
