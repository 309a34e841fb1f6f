"""Images from a chat request: ``data:`` URLs and http(s) URLs, checked before they cost anything.

Order of checks for one image (each failure is a 400 with ``param`` naming the part):

1. ``data:`` URL: media type ``image/*`` and ``;base64``; the encoded length
   bounds the byte size, so an oversized image is refused before decoding.
   http(s) URL: only when ``allow_remote_images``, and only where the media
   URL policy allows (``gateway.media_policy``: public addresses, checked at
   connect time after every redirect; ``allowed_media_domains``); else 400
   ``media_url_not_allowed``. ``Content-Length`` and then the streamed byte
   count are held to ``max_image_bytes``, the whole fetch (redirects included)
   to ``remote_image_timeout_s``.
2. base64 decoded strictly (malformed input is refused, not skipped).
3. Header only (``read_header``; ``Image.open`` is lazy): the format must be PNG, JPEG or WebP
   and width x height within ``max_image_pixels`` and ``max_image_side`` —
   a decompression bomb is refused here, before a single pixel is decoded.
4. Full decode (``decode_pixels``: on the event loop for a small image, else in a worker
   thread, see ``gateway.offload``); truncated or corrupt data is refused.

The decoded image is returned as decoded (not converted to RGB): encoder-cache
keys hash the picture exactly as decoded from the bytes (see ``cache.keys``).
Its mode must be one the model adapter accepts.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import logging
from dataclasses import dataclass

import httpx
from PIL import Image, UnidentifiedImageError

from . import offload
from .chat_backend import PreparedImage
from .errors import ApiError
from .media_policy import GuardedTransport, MediaNetwork, MediaUrlPolicy, MediaUrlRefused
from .settings import GatewaySettings

log = logging.getLogger("epd.gateway")

ALLOWED_FORMATS = frozenset({"PNG", "JPEG", "WEBP"})
# the modes runtime.model.model_adapter.VLMAdapter.validate_image converts to RGB
ACCEPTED_MODES = frozenset({"RGB", "RGBA", "L", "LA", "P", "CMYK", "YCbCr"})
_FETCH_HEADERS = {"Accept": "image/*", "Accept-Encoding": "identity"}
_READ_CHUNK = 64 * 1024


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
    """Fetches http(s) image URLs within the media URL policy, a byte limit and a total time limit.

    Redirects are followed here (at most ``max_redirects``), so the policy's URL check sees every
    target; the address check runs wherever a socket is opened (``gateway.media_policy``). The body
    is read raw (``Accept-Encoding: identity``; a content-encoded answer is refused, so no
    decompressor can inflate a small body) and counted as it streams: a chunk that would pass
    ``max_bytes`` ends the fetch before it is kept.

    What a client is told: "not allowed" for anything the policy refuses (never the address, port
    or reason); for an allowed host, that the fetch failed, with the HTTP status when there was one
    (the host is public, or private by the operator's opt-in), never the network error's detail.

    Lifecycle: ``open`` builds the HTTP client it owns; ``aclose`` closes it (the app's lifespan).
    """

    def __init__(self, client: httpx.AsyncClient, policy: MediaUrlPolicy, timeout_s: float, max_bytes: int,
                 max_redirects: int = 3):
        self.client = client
        self.policy = policy
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.max_redirects = max_redirects

    @classmethod
    def open(cls, settings: GatewaySettings, network: MediaNetwork | None = None) -> "RemoteImageFetcher":
        policy = MediaUrlPolicy.from_settings(settings.allowed_media_domains, settings.allow_private_media_urls)
        client = httpx.AsyncClient(transport=GuardedTransport(policy, network or MediaNetwork()), trust_env=False,
                                   timeout=httpx.Timeout(settings.remote_image_timeout_s), follow_redirects=False)
        return cls(client, policy, settings.remote_image_timeout_s, settings.max_image_bytes)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def fetch(self, url: str, param: str | None = None) -> bytes:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._fetch(url, param)
        except (TimeoutError, httpx.TimeoutException):
            raise _bad(f"fetching the image took longer than {self.timeout_s:g} s", param, "image_fetch_timeout") from None
        except MediaUrlRefused as exc:
            log.info("media URL refused: %s", exc)   # the reason stays in the log
            raise _bad("image URL is not allowed by this server's media URL policy", param, "media_url_not_allowed") from None
        except httpx.InvalidURL:
            raise _bad("image_url is not a valid URL", param, "invalid_image_url") from None
        except httpx.HTTPError:
            raise _bad("could not fetch the image", param, "image_fetch_failed") from None

    async def _fetch(self, url: str, param: str | None) -> bytes:
        target = httpx.URL(url)
        for _ in range(self.max_redirects + 1):
            self.policy.check_url(target)
            async with self.client.stream("GET", target, headers=_FETCH_HEADERS) as response:
                if response.has_redirect_location:
                    target = target.join(response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise _bad(f"could not fetch the image: HTTP {response.status_code}", param, "image_fetch_failed")
                if response.headers.get("content-encoding", "identity").strip().lower() != "identity":
                    raise _bad("could not fetch the image: the server sent a content-encoded body", param,
                               "image_fetch_failed")
                return await self._read_limited(response, param)
        raise _bad("could not fetch the image: too many redirects", param, "image_fetch_failed")

    async def _read_limited(self, response: httpx.Response, param: str | None) -> bytes:
        too_large = _bad(f"image is larger than the limit of {self.max_bytes} bytes", param, "image_too_large")
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            raise too_large
        chunks, size = [], 0
        async for chunk in response.aiter_raw(_READ_CHUNK):
            size += len(chunk)
            if size > self.max_bytes:
                raise too_large   # the over-limit chunk is dropped, the connection closed unread
            chunks.append(chunk)
        return b"".join(chunks)


# -- pixels -----------------------------------------------------------------------
def read_header(data: bytes, limits: ImageLimits, param: str | None = None) -> Image.Image:
    """The image, its header checked and nothing decoded yet; a 400 ``ApiError`` for anything that is not a
    usable image. Cheap at any size (Pillow reads the header only)."""
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
    return image


def decode_pixels(image: Image.Image, param: str | None = None) -> Image.Image:
    """``image`` (from ``read_header``) with its pixels decoded; a 400 ``ApiError`` when they are corrupt."""
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError):
        raise _bad("image data is corrupt or truncated", param, "invalid_image") from None
    return image


def open_image(data: bytes, limits: ImageLimits, param: str | None = None) -> Image.Image:
    """Check the header, then decode; raises a 400 ``ApiError`` for anything that is not a usable image."""
    return decode_pixels(read_header(data, limits, param), param)


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

    async def load(self, url: str, param: str | None = None, inline_pixels: int | None = None) -> PreparedImage:
        """The image at ``url``, decoded on the loop when it has at most ``inline_pixels`` pixels (default:
        ``offload.INLINE_MAX_PIXELS``), else in a thread."""
        data = await self.load_bytes(url, param)
        image = read_header(data, self.limits, param)
        image = await offload.run(offload.small_images([image.size], inline_pixels), decode_pixels, image, param)
        return PreparedImage(data=data, image=image)
