"""Getting image embeddings by cache key, for whichever stage runs the prompt.

Order: the embedding inline in the ref (``ImageRef.embedding``: the gateway hands on a small
one its Encode reply carried) -> the shared encoder cache (Redis, when configured) -> the encoder
named in the image ref, asked by key alone to return the tensor from its cache. Whichever way it
came, an embedding passes the same checks. Refs carry
no image bytes (they travel once, gateway to encoder, in ``Encode``), so an entry
the encoder no longer holds (evicted, or the encoder restarted, between the
gateway's Encode and this fetch) is an ``EmbeddingFetchError``: the request ends
with a clean 503 that names the fetch, and the client may retry (its retry
re-sends the bytes). Chosen over a transparent re-encode, which would need the
bytes to ride along on every Prefill and Generate for a rare miss.

A fetched entry must also be this request's image as this model stores it
(``checked_embeddings``): the model's storage layout (``EmbeddingFormatError``) and,
for M-RoPE families, the grid the gateway put in the ref (``ImageRef.grid_thw``, the
processor's ``image_grid_thw`` row). Anything else is a stale or foreign cache entry,
the same failure as a missing one (``StaleEmbeddingError``), never the client's 400.

``store`` goes the other way: embeddings a decode worker computed itself from a colocated
request's bytes (``decode_svc/local_encode.py``) handed to the encoder a ref names, for its cache.

An encoder named in a ref is dialled only when discovery lists it (``runtime/worker/peers.py``);
every named address is checked before anything else, so a request naming an unknown
encoder fails the same way whether or not its embeddings happen to be cached.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import grpc
import torch
from pydantic import SecretStr

from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc

from runtime.model.families import EmbeddingFormatError, ImageEmbedding
from runtime.model.tensor_bytes import TensorFormatError
from runtime.worker.internal_auth import open_channel
from runtime.worker.peers import PeerDirectory, PeerRole, UnknownPeerError
from runtime.worker.wire import ref_grids, tensor_from_pb

log = logging.getLogger("epd.embeddings")


class EmbeddingFetchError(RuntimeError):
    pass


class UnknownEncoderError(EmbeddingFetchError):
    """A ref named an encoder discovery does not list: the request's fault, nothing was dialled."""


class StaleEmbeddingError(EmbeddingFetchError):
    """A fetched entry is not the ref's image as this model stores it (another layout or grid)."""


def checked_embeddings(decode: Callable[[Sequence[torch.Tensor]], list[ImageEmbedding]],
                       refs: Sequence[pb.ImageRef], tensors: Sequence[torch.Tensor]) -> list[ImageEmbedding]:
    """``tensors`` (fetched for ``refs``, in order) as the model's records (``decode``: the adapter's
    ``embeddings``), each with the grid its ref names; ``StaleEmbeddingError`` otherwise."""
    try:
        records = decode(tensors)
    except EmbeddingFormatError as exc:
        raise StaleEmbeddingError(f"a fetched embedding is not this model's: {exc}") from exc
    for ref, grid, record in zip(refs, ref_grids(refs), records):
        if grid != record.grid:
            raise StaleEmbeddingError(f"embedding {ref.cache_key} has grid {record.grid}, the request's image {grid}")
    return records


def _inline(images: Sequence[pb.ImageRef]) -> dict[int, torch.Tensor]:
    """The embeddings that came inline with the request, by index; a malformed one is a stale entry."""
    found = {}
    for i, ref in enumerate(images):
        if ref.HasField("embedding"):
            try:
                found[i] = tensor_from_pb(ref.embedding)
            except TensorFormatError as exc:
                raise StaleEmbeddingError(f"inline embedding {ref.cache_key}: {exc}") from exc
    return found


class EmbeddingFetcher:
    """Owns its encoder channels and its worker's peer directory (others may borrow it; ``close``
    ends both)."""

    def __init__(self, cache=None, *, peers: PeerDirectory, token: SecretStr | None = None):
        self.cache = cache   # object with ``async get(key) -> Tensor | None`` and ``close()``, or None
        self.peers = peers
        self._token = token
        self._channels: dict[str, grpc.aio.Channel] = {}

    @classmethod
    def for_settings(cls, settings) -> "EmbeddingFetcher":
        """Read the shared (Redis) encoder cache when configured; otherwise always ask the encoder.

        There is no point in a private in-process cache here: only the encoder fills it.
        """
        cache = None
        if settings.redis_url:
            from cache import open_encoder_cache_for_settings

            cache = open_encoder_cache_for_settings(settings)
        return cls(cache, peers=PeerDirectory.for_settings(settings), token=settings.internal_token)

    def _stub(self, address: str) -> pb_grpc.EncoderStub:
        if address not in self._channels:
            self._channels[address] = open_channel(address, self._token)
        return pb_grpc.EncoderStub(self._channels[address])

    async def require_encoders(self, images: Sequence[pb.ImageRef]) -> None:
        """Raise ``UnknownPeerError`` unless every encoder the refs name is a discovered one."""
        for address in sorted({im.encoder_address for im in images if im.encoder_address}):
            await self.peers.require(PeerRole.ENCODER, address)

    async def fetch(self, request_id: str, images: Sequence[pb.ImageRef], timeout_s: float) -> list[torch.Tensor]:
        try:
            await self.require_encoders(images)
        except UnknownPeerError as exc:
            raise UnknownEncoderError(str(exc)) from exc
        found = _inline(images)
        if self.cache is not None:
            for i, ref in enumerate(images):
                if i in found:
                    continue
                try:
                    t = await self.cache.get(ref.cache_key)
                except Exception as exc:  # cache trouble degrades to asking the encoder
                    log.warning("encoder cache get failed: %s", exc)
                    t = None
                if t is not None:
                    found[i] = t
        missing = [i for i in range(len(images)) if i not in found]
        by_encoder: dict[str, list[int]] = {}
        for i in missing:
            if not images[i].encoder_address:
                raise EmbeddingFetchError(f"embedding {images[i].cache_key} not cached and no encoder named")
            by_encoder.setdefault(images[i].encoder_address, []).append(i)
        for address, idx in by_encoder.items():
            req = pb.EncodeRequest(request_id=request_id, images=[pb.EncodeImage(ref=images[i]) for i in idx],
                                   return_embeddings=True)
            try:
                resp = await self._stub(address).Encode(req, timeout=max(0.05, timeout_s))
            except grpc.aio.AioRpcError as exc:
                raise EmbeddingFetchError(f"encoder {address}: {exc.code().name}: {exc.details()}") from exc
            for i, enc in zip(idx, resp.images):
                found[i] = tensor_from_pb(enc.embedding)
        return [found[i] for i in range(len(images))]

    async def store(self, address: str, embeddings: Sequence[pb.StoredEmbedding], timeout_s: float) -> int:
        """Hand ``embeddings`` (computed by this worker from a request's bytes) to the encoder at
        ``address`` for its cache; how many it kept. The address must be a discovered encoder."""
        await self.peers.require(PeerRole.ENCODER, address)
        resp = await self._stub(address).Store(pb.StoreRequest(embeddings=embeddings), timeout=timeout_s)
        return resp.stored

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        if self.cache is not None:
            await self.cache.close()
        await self.peers.close()
