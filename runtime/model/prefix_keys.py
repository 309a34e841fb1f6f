"""Prefix-cache block keys: what a block of cached KV is, so only the same prompt reuses it.

A prompt of ``T`` tokens has ``T // block_size`` full blocks; block ``i`` covers positions
``i*bs .. (i+1)*bs``. Its key chains::

    key[-1] = H("epd-prefix-v1", model fingerprint, block size, cache_salt)
    key[i]  = H(key[i-1], token ids of block i,
                for every image whose placeholders block i covers: its content key, its index
                among the prompt's images, where its placeholders start, and its grid,
                the block's M-RoPE positions (``[3, bs]``; nothing for 1-D families))

so a block's key names everything before it too (its parent's key), never token ids alone:
the same text with another image, another tenant's salt, another model or another position
layout gives another key. The gateway computes the keys to route (longest cached prefix) and
sends them in ``Reserve``; the decode worker recomputes them from the request before it
reuses or caches a block (``decode_svc/prefix_match.py``). Both call this one function.

Keys are 16-byte blake3 digests; ``summary_id`` is the 64-bit prefix a decode worker reports
to the gateway in its ``Stats`` (a compact summary: a collision only misroutes, the worker
matches full keys).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import torch

KEY_BYTES = 16


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """One image of a prompt as the keys see it: its content key (salted, model-specific),
    its placeholders' first position and count, and its grid (M-RoPE families; else None)."""

    key: str
    start: int
    tokens: int
    grid: tuple[int, ...] | None = None

    @property
    def end(self) -> int:
        return self.start + self.tokens


def image_spans(token_ids: Sequence[int], image_token_id: int, keys: Sequence[str], counts: Sequence[int],
                grids: Sequence[Sequence[int] | None] = ()) -> list[ImageSpan]:
    """Each image's placeholder span: the ``k``-th image takes the next ``counts[k]`` placeholder
    tokens in order. ``ValueError`` when the counts do not add up to the prompt's placeholders."""
    if len(counts) != len(keys) or (grids and len(grids) != len(keys)):
        raise ValueError(f"{len(keys)} image keys, {len(counts)} placeholder counts, {len(grids)} grids")
    positions = [p for p, t in enumerate(token_ids) if t == image_token_id]
    if len(positions) != sum(counts):
        raise ValueError(f"prompt has {len(positions)} image placeholders, the images {sum(counts)}")
    spans, at = [], 0
    for k, (key, n) in enumerate(zip(keys, counts)):
        if n < 1:
            raise ValueError(f"image {k} has {n} placeholder tokens")
        grid = tuple(int(g) for g in grids[k]) if grids and grids[k] else None
        spans.append(ImageSpan(key, positions[at], int(n), grid))
        at += n
    return spans


def root_key(model_fingerprint: str, block_size: int, cache_salt: str) -> bytes:
    h = blake3.blake3(b"epd-prefix-v1")
    for part in (model_fingerprint, str(block_size), cache_salt):
        h.update(len(part).to_bytes(4, "little") + part.encode())
    return h.digest(KEY_BYTES)


def block_keys(token_ids: Sequence[int], images: Sequence[ImageSpan], *, block_size: int, model_fingerprint: str,
               cache_salt: str, positions: torch.Tensor | None = None, limit: int | None = None) -> list[bytes]:
    """Keys of the prompt's full blocks (at most ``limit``), each chaining its parent's.

    ``positions``: the family's ``[3, T]`` M-RoPE positions (``None`` for 1-D families).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    full = len(token_ids) // block_size
    if limit is not None:
        full = min(full, limit)
    ids = array("q", [int(t) for t in token_ids[: full * block_size]])   # int64 in machine order, as torch's bytes
    parent = root_key(model_fingerprint, block_size, cache_salt)
    keys: list[bytes] = []
    for i in range(full):
        start, end = i * block_size, (i + 1) * block_size
        h = blake3.blake3(parent)
        h.update(ids[start:end].tobytes())
        for k, span in enumerate(images):
            if span.start < end and span.end > start:
                h.update(f"|img{k}:{span.key}@{span.start}+{span.tokens}#{span.grid}".encode())
        if positions is not None:
            h.update(b"|pos" + positions[:, start:end].to(torch.int64).contiguous().numpy().tobytes())
        parent = h.digest(KEY_BYTES)
        keys.append(parent)
    return keys


def summary_id(key: bytes) -> int:
    """The 64-bit id of a key in a worker's summary (``WorkerStats.prefix_summary``)."""
    return int.from_bytes(key[:8], "little")


def cached_prefix_blocks(keys: Sequence[bytes], summary: set[int] | frozenset[int]) -> int:
    """How many leading blocks of ``keys`` a worker whose summary is ``summary`` holds."""
    n = 0
    for key in keys:
        if summary_id(key) not in summary:
            break
        n += 1
    return n
