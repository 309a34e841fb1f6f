"""The internal token: what lets one epd process act on another (``EPD_INTERNAL_TOKEN``).

Every worker RPC must carry ``authorization: Bearer <token>`` metadata, except the
standard health service (Kubernetes ``grpc:`` probes and ``epd healthcheck`` cannot send
metadata). Clients never pass it by hand: ``open_channel`` gives a channel that adds it to every
call (``TokenChannel``). The bulk KV path (a raw TCP socket) starts with a fixed-size preamble
(``bulk_preamble``) that the receiver checks before it reads anything else.

Every comparison is of two SHA-256 digests with ``hmac.compare_digest``, so its time
depends on neither the token's length nor where a guess first differs. The token itself
is a ``pydantic.SecretStr`` in settings and never appears in a log line or an error.

Secure by default: a worker bound to a non-loopback address without a token refuses to
start (``exposure_problem``) unless ``EPD_ALLOW_UNAUTHENTICATED=true``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import re
import time
from collections.abc import Callable

import grpc
from pydantic import SecretStr

log = logging.getLogger("epd.auth")

TOKEN_ENV = "EPD_INTERNAL_TOKEN"
METADATA_KEY = "authorization"
OPEN_SERVICES = ("/grpc.health.v1.Health/",)      # probes cannot send metadata
_TOKEN_SHAPE = re.compile(r"[\x21-\x7e]{16,}")   # printable ASCII: an HTTP/2 header value

BULK_MAGIC = b"EPDB"
BULK_VERSION = 1
_BULK_CONTEXT = b"epd bulk kv v1"
BULK_PREAMBLE_BYTES = len(BULK_MAGIC) + 1 + hashlib.sha256().digest_size


def validate_token(value: SecretStr | str | None) -> SecretStr | None:
    """Settings validator: empty means no token; anything else must be >= 16 printable ASCII."""
    if value is None:
        return None
    text = (value.get_secret_value() if isinstance(value, SecretStr) else str(value)).strip()
    if not text:
        return None
    if not _TOKEN_SHAPE.fullmatch(text):
        raise ValueError(f"{TOKEN_ENV} must be at least 16 printable ASCII characters without spaces "
                         "(e.g. `openssl rand -hex 32`)")
    return SecretStr(text)


def _secret(token: SecretStr | str | None) -> str | None:
    if token is None:
        return None
    text = token.get_secret_value() if isinstance(token, SecretStr) else token
    return text or None


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def token_from_env() -> SecretStr | None:
    """For tools that dial workers outside settings (bench, profile): the same variable."""
    return validate_token(os.environ.get(TOKEN_ENV))


# ------------------------------------------------------------------------------- exposure

def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False      # a hostname or "": may resolve to anything, so not loopback


def exposure_problem(host: str, token: SecretStr | None, allow_unauthenticated: bool) -> str | None:
    """Why a worker bound to ``host`` must not start (one line), or None.

    Without a token only loopback is allowed (a single-host test), unless the operator opted out.
    """
    if token is not None or allow_unauthenticated or is_loopback(host):
        return None
    return (f"refusing to listen on {host or '*'} without an internal token: set {TOKEN_ENV} "
            "(the same value on every worker and gateway), or EPD_ALLOW_UNAUTHENTICATED=true on a trusted network")


# ------------------------------------------------------------------------------- gRPC server

class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC but health without the right bearer token (UNAUTHENTICATED).

    A refused call never reaches the servicer and its request is never deserialized.
    """

    def __init__(self, token: SecretStr):
        self._expected = _digest(f"Bearer {token.get_secret_value()}")
        self.refused = 0
        self._last_log = 0.0

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method.startswith(OPEN_SERVICES):
            return await continuation(details)
        sent = next((v for k, v in (details.invocation_metadata or ()) if k == METADATA_KEY), None)
        if isinstance(sent, str) and hmac.compare_digest(_digest(sent), self._expected):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:      # unknown method: let gRPC answer UNIMPLEMENTED as usual
            return None
        self._note_refusal(details.method)
        message = "no internal token" if sent is None else "wrong internal token"
        return _refusing_handler(handler, f"{message}: every epd worker RPC needs {TOKEN_ENV}")

    def _note_refusal(self, method: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._last_log >= 10.0:    # an unauthenticated flood must not flood the log
            self._last_log = now
            log.warning("refused %s without a valid internal token (%d refused so far)", method, self.refused)


def _refusing_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that aborts at once, reading nothing."""

    async def refuse(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    shape: dict[tuple[bool, bool], Callable] = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = shape[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=None, response_serializer=handler.response_serializer)


def server_interceptors(token: SecretStr | None) -> list[grpc.aio.ServerInterceptor]:
    return [TokenAuthInterceptor(token)] if token is not None else []


# ------------------------------------------------------------------------------- gRPC client

class _WithToken:
    """A multi-callable of a ``TokenChannel``: every call it makes carries the token, after the
    caller's own metadata."""

    __slots__ = ("_inner", "_pair")

    def __init__(self, inner, pair: tuple[str, str]):
        self._inner, self._pair = inner, pair

    def __call__(self, *args, metadata=None, **kwargs):
        return self._inner(*args, metadata=(*(metadata or ()), self._pair), **kwargs)


class TokenChannel:
    """An aio channel whose every call sends the token in its metadata; the rest is the channel's own.

    Not a client interceptor: with one, gRPC aio runs every call through extra tasks, and every
    write on a stream through a queue, a task and a wait (a request's hop on an open stream took
    0.53 ms with the interceptor against 0.44 ms with the metadata passed like this; a new call 1.25
    against 1.01 ms, ``bench/request_hop.py``).
    """

    def __init__(self, channel: grpc.aio.Channel, token: str):
        self._channel = channel
        self._pair = (METADATA_KEY, f"Bearer {token}")

    def unary_unary(self, *args, **kwargs) -> _WithToken:
        return _WithToken(self._channel.unary_unary(*args, **kwargs), self._pair)

    def unary_stream(self, *args, **kwargs) -> _WithToken:
        return _WithToken(self._channel.unary_stream(*args, **kwargs), self._pair)

    def stream_unary(self, *args, **kwargs) -> _WithToken:
        return _WithToken(self._channel.stream_unary(*args, **kwargs), self._pair)

    def stream_stream(self, *args, **kwargs) -> _WithToken:
        return _WithToken(self._channel.stream_stream(*args, **kwargs), self._pair)

    def __getattr__(self, name: str):   # close, channel_ready, get_state, ...
        return getattr(self._channel, name)

    async def __aenter__(self) -> TokenChannel:
        return self

    async def __aexit__(self, *exc) -> None:
        await self._channel.close(None)


def open_channel(address: str, token: SecretStr | str | None, *, options=None) -> grpc.aio.Channel | TokenChannel:
    """The one way epd dials a worker: an aio channel that sends the token on every call (``TokenChannel``).

    ``options`` default to ``runtime.worker.wire.GRPC_OPTIONS`` (imported here: that module loads torch).
    """
    if options is None:
        from runtime.worker.wire import GRPC_OPTIONS

        options = GRPC_OPTIONS
    channel = grpc.aio.insecure_channel(address, options=options)
    secret = _secret(token)
    return TokenChannel(channel, secret) if secret else channel


# ------------------------------------------------------------------------------- bulk KV path

def bulk_preamble(token: SecretStr | str | None) -> bytes:
    """``magic | version | HMAC-SHA256(token, context)``: fixed size, sent before the first frame.

    The HMAC, not the token, goes on this socket: what it shows a reader of the bulk
    stream is no bearer token for the gRPC services.
    """
    key = (_secret(token) or "").encode()
    return BULK_MAGIC + bytes([BULK_VERSION]) + hmac.new(key, _BULK_CONTEXT, hashlib.sha256).digest()


def bulk_preamble_ok(received: bytes, token: SecretStr | None) -> bool:
    """Magic and version must match; with a token, the HMAC too (constant time)."""
    head = len(BULK_MAGIC) + 1
    if len(received) != BULK_PREAMBLE_BYTES or received[:head] != BULK_MAGIC + bytes([BULK_VERSION]):
        return False
    if token is None:
        return True
    return hmac.compare_digest(received, bulk_preamble(token))
