"""How one embedding is laid out in Redis: a hash, index fields beside the payload.

Key ``{namespace}:e:{content_key}``, a Redis hash with fields:

    v      format version, b"1"
    dtype  tensor_bytes dtype name, e.g. b"float32"
    shape  comma-separated dims, e.g. b"576,1536" (b"" for a scalar)
    data   raw little-endian payload (``runtime.model.tensor_bytes``)

The index fields and the payload live in one key, written in one
transaction with one TTL, so Redis eviction or expiry removes them together.
The index fields can still be read alone (``HMGET key dtype shape``) without
moving the payload. Any other state (a missing field, a payload whose length
does not match dtype x shape, an unknown version) is ``EntryFormatError``: the
reader drops the entry and re-encodes.
"""

from __future__ import annotations

import torch

from runtime.model import tensor_bytes

FORMAT_VERSION = b"1"
FIELDS: tuple[str, ...] = ("v", "dtype", "shape", "data")


class EntryFormatError(ValueError):
    """A Redis hash that is not a complete, consistent encoder-cache entry."""


def entry_key(namespace: str, key: str) -> str:
    return f"{namespace}:e:{key}"


def to_fields(tensor: torch.Tensor) -> dict[str, bytes]:
    packed = tensor_bytes.encode(tensor)
    return {
        "v": FORMAT_VERSION,
        "dtype": packed.dtype.encode(),
        "shape": ",".join(str(d) for d in packed.shape).encode(),
        "data": packed.payload,
    }


def from_fields(values: list[bytes | None]) -> torch.Tensor:
    """Decode the values of ``HMGET key *FIELDS`` (in ``FIELDS`` order)."""
    if len(values) != len(FIELDS):
        raise EntryFormatError(f"expected {len(FIELDS)} fields, got {len(values)}")
    version, dtype, shape, data = values
    if version != FORMAT_VERSION or dtype is None or shape is None or data is None:
        missing = [name for name, value in zip(FIELDS, values) if value is None]
        raise EntryFormatError(f"incomplete or unknown entry (version {version!r}, missing {missing})")
    try:
        dims = tuple(int(d) for d in shape.decode().split(",")) if shape else ()
        return tensor_bytes.decode(dtype.decode(), dims, data)
    except (ValueError, UnicodeDecodeError) as exc:  # TensorFormatError is a ValueError
        raise EntryFormatError(str(exc)) from exc
