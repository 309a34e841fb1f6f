"""Images from a chat request: ``data:`` URLs and http(s) URLs, checked before they cost anything.

Order of checks for one image (each failure is a 400 with ``param`` naming the part):

1. ``data:`` URL: media type ``image/*`` and ``;base64``; the encoded length
   bounds the byte size, so an oversized image is refused before decoding.
   http(s) URL: only when ``allow_remote_images``; ``Content-Length`` and then
   the streamed byte count are held to ``max_image_bytes``, the whole fetch to
   ``remote_image_timeout_s``.
2. base64 decoded strictly (malformed input is refused, not skipped).
3. Header only (``Image.open`` is lazy): the format must be PNG, JPEG or WebP
   and width x height within ``max_image_pixels`` and ``max_image_side`` —
   a decompression bomb is refused here, before a single pixel is decoded.
4. Full decode (in a worker thread); truncated or corrupt data is refused.

The decoded image is returned as decoded (not converted to RGB): encoder-cache
keys hash the picture exactly as decoded from the bytes (see ``cache.keys``).
Its mode must be one the model adapter accepts.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
from dataclasses import dataclass

import httpx
from PIL import Image, UnidentifiedImageError

from .chat_backend import PreparedImage
from .errors import ApiError

ALLOWED_FORMATS = frozenset({"PNG", "JPEG", "WEBP"})
# the modes runtime.model_adapter.VLMAdapter.validate_image converts to RGB
ACCEPTED_MODES = frozenset({"RGB", "RGBA", "L", "LA", "P", "CMYK", "YCbCr"})


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int
    max_side: int


def _bad(message: str, param: str | None, code: str = "invalid_image") -> ApiError:
    return ApiError.bad_request(message, param, code)


# -- bytes ------------------------------------------------------------------------
def decode_data_url(url: str, limits: ImageLimits, param: str | None = None) -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URL, refused early when too large or malformed."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise _bad("data URL has no ',' separating the header from the data", param, "invalid_data_url")
    media = header[len("data:"):].split(";")
    media_type, options = media[0].strip().lower(), [o.strip().lower() for o in media[1:]]
    if "base64" not in options:
        raise _bad("data URL must be base64-encoded (data:image/png;base64,...)", param, "invalid_data_url")
    if media_type and not media_type.startswith("image/"):
        raise _bad(f"data URL media type {media_type!r} is not an image", param, "invalid_image_format")
    payload = payload.strip()
    # 4 base64 chars carry 3 bytes: refuse before allocating the decoded copy
    if len(payload) // 4 * 3 > limits.max_bytes + 2:
        raise _bad(f"image is larger than the limit of {limits.max_bytes} bytes", param, "image_too_large")
    try:
        data = base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise _bad("image data is not valid base64", param, "invalid_base64") from None
    if not data:
        raise _bad("image data is empty", param, "invalid_image")
    if len(data) > limits.max_bytes:
        raise _bad(f"image is larger than the limit of {limits.max_bytes} bytes", param, "image_too_large")
    return data


class RemoteImageFetcher:
    """Fetches http(s) image URLs with a byte limit and a total time limit."""

    def __init__(self, client: httpx.AsyncClient, timeout_s: float, max_bytes: int):
        self.client = client
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes

    async def fetch(self, url: str, param: str | None = None) -> bytes:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._fetch(url, param)
        except TimeoutError:
            raise _bad(f"fetching the image took longer than {self.timeout_s:g} s", param, "image_fetch_timeout") from None
        except httpx.HTTPError as exc:
            raise _bad(f"could not fetch the image: {type(exc).__name__}", param, "image_fetch_failed") from None

    async def _fetch(self, url: str, param: str | None) -> bytes:
        too_large = _bad(f"image is larger than the limit of {self.max_bytes} bytes", param, "image_too_large")
        async with self.client.stream("GET", url, headers={"Accept": "image/*"}) as response:
            if response.status_code != 200:
                raise _bad(f"could not fetch the image: HTTP {response.status_code}", param, "image_fetch_failed")
            declared = response.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                raise too_large
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > self.max_bytes:
                    raise too_large
                chunks.append(chunk)
        return b"".join(chunks)


# -- pixels -----------------------------------------------------------------------
def open_image(data: bytes, limits: ImageLimits, param: str | None = None) -> Image.Image:
    """Check the header, then decode; raises a 400 ``ApiError`` for anything that is not a usable image."""
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only; Pillow's own bomb check may refuse here
    except Image.DecompressionBombError:
        raise _bad("image dimensions are too large", param, "image_too_large") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError):
        raise _bad("data is not a decodable image", param, "invalid_image") from None
    if image.format not in ALLOWED_FORMATS:
        raise _bad(f"image format {image.format} is not supported (use PNG, JPEG or WebP)", param, "invalid_image_format")
    width, height = image.size
    if width < 1 or height < 1:
        raise _bad(f"image has no pixels ({width}x{height})", param, "invalid_image")
    if width * height > limits.max_pixels or max(width, height) > limits.max_side:
        raise _bad(
            f"image of {width}x{height} pixels exceeds the limit of {limits.max_pixels} pixels "
            f"and {limits.max_side} per side",
            param,
            "image_too_large",
        )
    if image.mode not in ACCEPTED_MODES:
        raise _bad(f"image mode {image.mode} is not supported", param, "invalid_image")
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError):
        raise _bad("image data is corrupt or truncated", param, "invalid_image") from None
    return image


class ImageLoader:
    """Turns one ``image_url`` string into a ``PreparedImage``."""

    def __init__(self, limits: ImageLimits, fetcher: RemoteImageFetcher | None):
        self.limits = limits
        self.fetcher = fetcher   # None: remote images are refused

    async def load_bytes(self, url: str, param: str | None = None) -> bytes:
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return decode_data_url(url, self.limits, param)
        if scheme in ("http", "https"):
            if self.fetcher is None:
                raise _bad("remote image URLs are disabled on this server; send a data: URL", param, "remote_images_disabled")
            return await self.fetcher.fetch(url, param)
        raise _bad("image_url must be a data: URL or an http(s) URL", param, "invalid_image_url")

    async def load(self, url: str, param: str | None = None) -> PreparedImage:
        data = await self.load_bytes(url, param)
        image = await asyncio.to_thread(open_image, data, self.limits, param)
        return PreparedImage(data=data, image=image)
