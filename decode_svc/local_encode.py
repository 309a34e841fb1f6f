"""A colocated request's images encoded on this decode worker, from the bytes its refs carry.

The gateway puts each image's bytes in ``ImageRef.image_data`` on a colocated ``Generate`` when
the tower's estimated time, with the encodes it sent there before still ahead, is within its
``colocated_encode_max_ms`` (``gateway/encoder_step.py``): the first token then skips a hop through
the encoder and back. Per image, on the torch thread: decode the bytes, re-derive the salted content
key from them in the ref's layout variant (a ref whose key is not its content's is refused before
anything is encoded: ``LocalImageError``, like the encoder's own check), encode, and check the grid
against the ref's; ``encode_then`` also prepares the prompt in that same call.

The embeddings then go to the encoder each ref names (``Encoder.Store``), in the background, so a
repeat of the image is a cache hit there. A store starts once its request's first token is out
(``start_stores``, called by ``Generate`` after its first event and when it ends): serializing the
embedding and the call run on this process's cores, which on a small host are the cores the
request's own prompt step needs (the demo worker runs on one; its first token came 1-2 ms later
with the store beside the step). A failed store only loses that cache entry (logged and counted in
``store_failures``): the next request with the image is encoded again; so does a repeat that
arrives before the store lands, which costs that one encode.

Stores to one encoder ride together: each encoder has at most one ``Store`` call in flight, and the
embeddings whose stores start meanwhile wait in its outbox for the next call, which takes them all
(up to ``STORE_BATCH_BYTES``). A lone request's store goes at once; a burst's first tokens, which
one step makes together, become one or two calls instead of one each (a call costs the encoder and
this worker about as much CPU as the embeddings it carries on the demo model: storing nothing at
all served 11% more demo requests/s, ``bench/RESULTS.md``).

Encodes that wait for the model thread together run as one batch through the tower (``_drain``: each
turn takes every encode waiting, no window, so a lone request never waits for company; a burst's
images are encoded in one call, as the encoder's batcher does); a member whose bytes, key, mode or
size fail its checks fails alone.

Lifecycle: ``_waiting`` holds encodes until the drain task (``_drainer``, alive while any wait) takes
them; ``_pending`` holds each request's stores from its encode until ``start_stores``, which moves
them to their encoder's ``_outbox``; that encoder's sender task (``_senders``, alive while its outbox
holds any) sends them; ``close`` gives the senders ``STORE_CLOSE_WAIT_S`` to finish, then cancels
them (what is still pending or in an outbox is dropped).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import TypeVar

from PIL import Image

from cache.embedding_fetch import EmbeddingFetcher, UnknownEncoderError
from cache.keys import decode_with_key, preprocess_digest
from proto.epd.v1 import epd_pb2 as pb
from runtime.model.errors import AdapterInputError
from runtime.model.families import ImageEmbedding
from runtime.model.model_adapter import VLMAdapter
from runtime.worker import torch_thread
from runtime.worker.peers import UnknownPeerError
from runtime.worker.wire import ref_grids, tensor_to_pb

log = logging.getLogger("epd.decode")

T = TypeVar("T")

STORE_TIMEOUT_S = 10.0      # one Store call to an encoder
STORE_CLOSE_WAIT_S = 2.0    # what ``close`` gives the stores still in flight
STORE_BATCH_BYTES = 64 << 20   # one Store call carries at most this much embedding data (at least one embedding)


@dataclass(slots=True)
class _Store:
    """One embedding on its way to an encoder's cache, and the request it came from (for the log)."""

    request_id: str
    key: str
    record: ImageEmbedding

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.record.features, self.record.deepstack) if t is not None)


@dataclass(slots=True)
class _Waiting:
    """One request's encode waiting for the model thread; ``done`` gets ``(records, then(records))`` or
    the request's own error."""

    refs: Sequence[pb.ImageRef]
    then: Callable | None
    done: asyncio.Future


def _settle(batch: list[_Waiting], outcomes: list[object]) -> None:
    for w, outcome in zip(batch, outcomes):
        if w.done.done():   # its request went away meanwhile
            continue
        if isinstance(outcome, BaseException):
            w.done.set_exception(outcome)
        else:
            w.done.set_result(outcome)


class LocalImageError(AdapterInputError):
    """A ref's bytes are not an image, or not the image its cache key names."""

    code = "invalid_image"


class LocalEncoder:
    def __init__(self, adapter: VLMAdapter, fetcher: EmbeddingFetcher):
        self.adapter = adapter
        self.fetcher = fetcher   # borrowed: its encoder channels and peer directory
        self.digest = preprocess_digest(adapter.processor.image_processor.to_dict())
        self.encoded = 0          # images encoded here
        self.store_failures = 0   # embeddings that did not reach their encoder's cache
        self.store_calls = 0      # Store calls made (each carries every embedding its encoder's outbox held)
        self._outbox: dict[str, list[_Store]] = {}        # encoder address -> stores waiting for its next call
        self._senders: dict[str, asyncio.Task] = {}       # encoder address -> the task sending its outbox
        self._pending: dict[str, list[tuple[str, _Store]]] = {}   # request id -> (encoder address, store)
        self._waiting: list[_Waiting] = []          # encodes for the next model-thread call
        self._drainer: asyncio.Task | None = None   # runs them while any wait

    @staticmethod
    def carries_bytes(refs: Sequence[pb.ImageRef]) -> bool:
        """True when every ref carries its image's bytes (the gateway sends all or none)."""
        return bool(refs) and all(ref.image_data for ref in refs)

    async def encode(self, request_id: str, refs: Sequence[pb.ImageRef]) -> list[ImageEmbedding]:
        """The refs' embeddings, computed here; their store to the encoders waits for ``start_stores``.
        ``UnknownEncoderError`` (before any work) when a ref names an encoder discovery does not list."""
        records, _ = await self.encode_then(request_id, refs, None)
        return records

    async def encode_then(self, request_id: str, refs: Sequence[pb.ImageRef],
                          then: Callable[[list[ImageEmbedding]], T] | None) -> tuple[list[ImageEmbedding], T | None]:
        """``encode``, and ``then(embeddings)`` right after it in the same torch-thread call (the prompt's
        preparation: one hand-off to that thread instead of two on the first token's path). An error of
        ``then`` propagates; the images it leaves are not stored (their request fails)."""
        try:
            await self.fetcher.require_encoders(refs)
        except UnknownPeerError as exc:
            raise UnknownEncoderError(str(exc)) from exc
        waiting = _Waiting(refs, then, asyncio.get_running_loop().create_future())
        self._waiting.append(waiting)
        if self._drainer is None:
            self._drainer = asyncio.create_task(self._drain(), name="local-encode")
        records, after = await waiting.done
        self.encoded += len(records)
        self._hold_stores(request_id, refs, records)
        return records, after

    async def _drain(self) -> None:
        """Run the waiting encodes, all that wait at each turn in one model-thread call, until none wait."""
        try:
            while self._waiting:
                batch, self._waiting = [w for w in self._waiting if not w.done.done()], []
                if not batch:
                    continue
                try:
                    outcomes = await torch_thread.run(self._encode_batch, batch)
                except Exception as exc:   # the tower failed: every member with it
                    outcomes = [exc] * len(batch)
                except BaseException:      # cancelled (the worker stops): no member waits forever
                    _settle(batch, [RuntimeError("decode worker stopping")] * len(batch))
                    raise
                _settle(batch, outcomes)
        finally:
            self._drainer = None

    def _encode_batch(self, batch: list[_Waiting]) -> list[object]:
        """Each member's ``(records, then(records))`` or its own error: the images of every member whose
        bytes check out, through the tower as one batch (the encoder's batcher does the same); only the
        tower call itself is shared, so only its failure fails every member."""
        outcomes: list[object] = [None] * len(batch)
        images, variants, owner = [], [], []
        for i, w in enumerate(batch):
            try:   # this member's bytes, key, mode and size: its own error, not the batch's
                ims = [self.adapter.validate_image(self._image(ref)) for ref in w.refs]
                for ref in w.refs:
                    self.adapter.check_variant(ref.layout_variant)
            except Exception as exc:
                outcomes[i] = exc
                continue
            images += ims
            variants += [ref.layout_variant for ref in w.refs]
            owner += [i] * len(ims)
        records = self.adapter.encode_images(images, variants) if images else []
        mine: dict[int, list[ImageEmbedding]] = {}
        for i, record in zip(owner, records):
            mine.setdefault(i, []).append(record)
        for i, w in enumerate(batch):
            if outcomes[i] is not None:
                continue
            try:
                own = mine.get(i, [])
                for ref, grid, record in zip(w.refs, ref_grids(w.refs), own):
                    if grid != record.grid:
                        raise LocalImageError(f"image {ref.cache_key[:12]} has grid {record.grid} here, "
                                              f"{grid} in the request: the gateway's processor settings differ")
                outcomes[i] = (own, None if w.then is None else w.then(own))
            except Exception as exc:   # its grid or its prompt: this member's alone
                outcomes[i] = exc
        return outcomes

    def _image(self, ref: pb.ImageRef) -> Image.Image:
        """The ref's image as decoded, once its content key is the ref's."""
        try:
            image, key = decode_with_key(ref.image_data, self.adapter.model_fingerprint, self.digest, ref.cache_salt,
                                         ref.layout_variant)
        except ValueError as exc:
            raise LocalImageError(f"image {ref.cache_key[:12]}: {exc}") from exc
        if key != ref.cache_key:
            raise LocalImageError(f"image {ref.cache_key[:12]}: cache key does not match the image content")
        return image

    def _hold_stores(self, request_id: str, refs: Sequence[pb.ImageRef], records: list[ImageEmbedding]) -> None:
        held = [(ref.encoder_address, _Store(request_id, ref.cache_key, record))
                for ref, record in zip(refs, records) if ref.encoder_address]
        if held:
            self._pending.setdefault(request_id, []).extend(held)

    def start_stores(self, request_id: str) -> None:
        """Send the stores ``request_id``'s encodes left with their encoder's next call (none: nothing to
        do; a second call finds none)."""
        for address, store in self._pending.pop(request_id, ()):
            self._outbox.setdefault(address, []).append(store)
            if address not in self._senders:
                self._senders[address] = asyncio.create_task(self._send(address), name=f"store-{address}")

    async def _send(self, address: str) -> None:
        """One call at a time to ``address``, each with what its outbox holds then, until it holds none."""
        try:
            while batch := self._take(address):
                await self._store(address, batch)
        finally:
            self._senders.pop(address, None)

    def _take(self, address: str) -> list[_Store]:
        """The outbox's oldest stores, up to ``STORE_BATCH_BYTES`` (at least one); the rest wait."""
        outbox = self._outbox.get(address, [])
        size, n = 0, 0
        while n < len(outbox) and (n == 0 or size + outbox[n].nbytes <= STORE_BATCH_BYTES):
            size += outbox[n].nbytes
            n += 1
        batch, rest = outbox[:n], outbox[n:]
        if rest:
            self._outbox[address] = rest
        else:
            self._outbox.pop(address, None)
        return batch

    def _stored(self, batch: list[_Store]) -> list[pb.StoredEmbedding]:
        """The wire form, in the encoder cache's stored layout (off the event loop and the torch thread)."""
        return [pb.StoredEmbedding(cache_key=s.key, embedding=tensor_to_pb(self.adapter.family.to_tensor(s.record)))
                for s in batch]

    async def _store(self, address: str, batch: list[_Store]) -> None:
        self.store_calls += 1
        try:
            await self.fetcher.store(address, await asyncio.to_thread(self._stored, batch), STORE_TIMEOUT_S)
        except Exception as exc:   # the cache entries are lost, nothing else: the requests have their embeddings
            self.store_failures += len(batch)
            log.warning("storing %d embedding(s) of request(s) %s with encoder %s failed: %s", len(batch),
                        ", ".join(dict.fromkeys(s.request_id for s in batch)), address, exc)

    async def close(self) -> None:
        if self._drainer is not None:
            self._drainer.cancel()
        waiting, self._waiting = self._waiting, []
        _settle(waiting, [RuntimeError("decode worker stopping")] * len(waiting))
        senders = set(self._senders.values())
        if senders:
            await asyncio.wait(senders, timeout=STORE_CLOSE_WAIT_S)
        for task in senders:
            task.cancel()
        if senders:
            await asyncio.wait(senders)
        self._outbox.clear()
        self._pending.clear()
