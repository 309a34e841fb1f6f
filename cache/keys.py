"""Encoder-cache keys: what an embedding depends on, hashed with blake3.

An embedding is a function of three things, and the key names all three:

1. the decoded picture: mode, size, raw pixel bytes, plus the few pieces of
   metadata that change what a later conversion produces (the palette of a
   ``P``/``PA`` image, the ``transparency`` entry, the EXIF orientation tag);
2. the model that encoded it (``model_fingerprint``: id and revision, chosen
   by the caller);
3. the preprocessing that turned pixels into model input
   (``preprocess_digest`` of the processor config);

and, optionally, a **cache salt**: the tenant's namespace (the request's
``cache_salt``, combined by the gateway with its API key's digest; see
``gateway.auth``). Two requests share an entry only when they share the salt.
And the image's **layout variant** (``runtime.model.families.base``: the form a
family encodes an image in for its prompt's image count, e.g. LLaVA-OneVision's
one square tile per image of a multi-image prompt): one picture in two variants
is two entries.

Invariants:

* The same picture re-saved with other metadata (comments, timestamps, ICC
  profile) or another PNG compression level gives the same key: only the
  decoded pixels and the fields in (1) are hashed, never the file's bytes.
* A change to any of (1)-(3) gives another key. Orientation is hashed even
  though most processors ignore it, because a pipeline that does apply
  ``exif_transpose`` would otherwise return the embedding of the unrotated
  picture; a needless miss is cheaper than a wrong embedding.
* Both sides must hash the image *as decoded from the bytes*, before any
  transform (``convert``, ``exif_transpose``, resize): the gateway and the
  encoder then compute the same key. ``image_content_key_from_bytes`` does
  exactly that for both.
* Fields are length-prefixed and the hasher is domain-separated
  (``derive_key_context``), so no two different inputs share a hash stream.
* An empty salt gives exactly the unsalted key of earlier versions (same
  context, same fields), so existing cache entries stay valid. A salted key
  is hashed under its own context with the salt as one more field: it can
  never equal an unsalted key, nor the key of another salt.
* Likewise the empty layout variant (every image of most families) gives the
  key of earlier versions; a non-empty variant is hashed under a context of its
  own, with the salt (empty or not) and the variant as two more fields, so it
  never equals a key of another variant, salt, or of no variant.

Lossy formats are decoded by the local Pillow/libjpeg; two hosts with
different decoder builds may get different pixels, hence different keys: a
miss, never a wrong hit.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any

import blake3
from PIL import Image, UnidentifiedImageError

_IMAGE_CONTEXT = "epd encoder-cache image digest v1"
_KEY_CONTEXT = "epd encoder-cache key v1"
_SALTED_KEY_CONTEXT = "epd encoder-cache salted key v1"
_VARIANT_KEY_CONTEXT = "epd encoder-cache layout-variant key v1"
_PREPROCESS_CONTEXT = "epd encoder-cache preprocess config v1"
_EXIF_ORIENTATION = 0x0112
_PARALLEL_HASH_BYTES = 1 << 22  # above this, let blake3 use its thread pool


def _field(hasher: Any, data: bytes) -> None:
    hasher.update(len(data).to_bytes(8, "little"))
    hasher.update(data)


def image_digest(image: Image.Image) -> str:
    """Hex blake3 digest of a decoded image's pixels, independent of any model.

    Hashes mode, size, palette (palette modes), the ``transparency`` info entry,
    the EXIF orientation tag and the raw pixel bytes of the current frame.
    """
    pixels = image.tobytes()  # loads lazily opened images
    threads = blake3.blake3.AUTO if len(pixels) >= _PARALLEL_HASH_BYTES else 1
    hasher = blake3.blake3(derive_key_context=_IMAGE_CONTEXT, max_threads=threads)
    width, height = image.size
    _field(hasher, image.mode.encode())
    _field(hasher, f"{width}x{height}".encode())
    palette = image.getpalette(rawmode=None) if image.mode in ("P", "PA") else None
    palette_mode = image.palette.mode if palette is not None and image.palette is not None else ""
    _field(hasher, palette_mode.encode() + b":" + (bytes(palette) if palette else b""))
    _field(hasher, repr(image.info.get("transparency")).encode())
    _field(hasher, str(image.getexif().get(_EXIF_ORIENTATION, 1)).encode())
    _field(hasher, pixels)
    return hasher.hexdigest()


def content_key(image_hash: str, model_fingerprint: str, preprocess_digest: str, cache_salt: str = "",
                layout_variant: str = "") -> str:
    """Key from an ``image_digest``, the two identity strings, the salt and the layout variant (64 hex chars).

    ``cache_salt=""`` is the unsalted key (unchanged from before salts existed); ``layout_variant=""``
    the key of an image's only form (unchanged from before variants existed).
    """
    for name, value in (
        ("image_hash", image_hash),
        ("model_fingerprint", model_fingerprint),
        ("preprocess_digest", preprocess_digest),
    ):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    for name, value in (("cache_salt", cache_salt), ("layout_variant", layout_variant)):
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    context = _VARIANT_KEY_CONTEXT if layout_variant else _SALTED_KEY_CONTEXT if cache_salt else _KEY_CONTEXT
    hasher = blake3.blake3(derive_key_context=context)
    _field(hasher, model_fingerprint.encode())
    _field(hasher, preprocess_digest.encode())
    _field(hasher, image_hash.encode())
    if cache_salt or layout_variant:
        _field(hasher, cache_salt.encode())
    if layout_variant:
        _field(hasher, layout_variant.encode())
    return hasher.hexdigest()


def image_content_key(image: Image.Image, model_fingerprint: str, preprocess_digest: str, cache_salt: str = "",
                      layout_variant: str = "") -> str:
    """The cache key of ``image`` encoded by ``model_fingerprint`` after ``preprocess_digest`` in ``layout_variant``,
    in ``cache_salt``'s namespace.

    ``image`` must be the picture as decoded from its bytes (see module docstring).
    """
    return content_key(image_digest(image), model_fingerprint, preprocess_digest, cache_salt, layout_variant)


def image_content_key_from_bytes(data: bytes, model_fingerprint: str, preprocess_digest: str, cache_salt: str = "",
                                 layout_variant: str = "") -> str:
    """Same key as ``image_content_key`` for the image file ``data`` (what the gateway receives).

    Raises ``ValueError`` when ``data`` is not an image Pillow can decode.
    """
    image, key = decode_with_key(data, model_fingerprint, preprocess_digest, cache_salt, layout_variant)
    image.close()
    return key


def decode_with_key(data: bytes, model_fingerprint: str, preprocess_digest: str, cache_salt: str = "",
                    layout_variant: str = "") -> tuple[Image.Image, str]:
    """The image file ``data`` as decoded (loaded, not converted) and its ``image_content_key``: what a
    stage that encodes from bytes checks a ref's key against. ``ValueError`` when ``data`` is not an
    image Pillow can decode (a decompression bomb included)."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ValueError(f"not a decodable image: {exc}") from exc
    return image, image_content_key(image, model_fingerprint, preprocess_digest, cache_salt, layout_variant)


def _reject(value: object) -> object:
    raise TypeError(
        f"preprocess config holds a {type(value).__name__}, which has no stable JSON form; "
        "pass plain dict/list/str/int/float/bool/None values (e.g. processor.to_dict())"
    )


def preprocess_digest(config: Mapping[str, Any]) -> str:
    """Stable hex blake3 digest of a processor config.

    The config is serialized as canonical JSON (sorted keys, no whitespace,
    tuples as lists), so two dicts that compare equal after a JSON round trip
    have the same digest regardless of key order. Values without a JSON form
    raise ``TypeError`` instead of being hashed through an unstable ``repr``.
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"preprocess config must be a mapping, got {type(config).__name__}")
    canonical = json.dumps(
        dict(config), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True, default=_reject
    )
    return blake3.blake3(canonical.encode(), derive_key_context=_PREPROCESS_CONTEXT).hexdigest()
