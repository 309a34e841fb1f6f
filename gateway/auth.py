"""API keys, as vLLM users know them: ``--api-key KEY`` / ``EPD_API_KEY``, sent as ``Authorization: Bearer KEY``.

What needs a key, once at least one is configured (without keys everything is open):

===============================  ==============================================
``/v1/*``, ``/tokenize``,        always (tokenizing a chat fetches its images)
``/detokenize``
``/metrics``, ``/status``        unless ``open_metrics_and_status``
``/health``, docs, anything else open (probes must not need a secret)
===============================  ==============================================

The check is an ASGI middleware outside every other one, so an unauthenticated
request costs one header comparison: its body is never read, no admission
estimate runs. Refusals are 401 with an OpenAI error object
(``code: invalid_api_key``) and ``WWW-Authenticate: Bearer``, and are counted in
``epd:api_key_refused_total{reason="missing"|"invalid"}``.

Keys are compared in constant time: the presented key and every configured key
are hashed to equal-length digests and all of them are compared (no early exit),
so neither the position of a matching key nor a common prefix shows in the time.

Tenants: the matching key's **tenant id** (a keyed digest of the key, never the
key) is put in the request's ASGI state; ``effective_cache_salt`` turns it and
the request's ``cache_salt`` into the salt of the request's encoder-cache keys
(``cache.keys``), so with ``cache_salt_per_api_key`` two keys never share an
entry.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import blake3
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, Counter
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ApiError

_TENANT_CONTEXT = "epd api-key tenant v1"
_SALT_CONTEXT = "epd encoder-cache salt per api key v1"
TENANT_STATE = "api_key_tenant"          # key of the tenant id in the ASGI scope's "state"
SECURITY_SCHEME = "bearerAuth"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def tenant_id(key: str) -> str:
    """Stable, non-reversible name of an API key (what cache salts are derived from)."""
    return blake3.blake3(key.encode(), derive_key_context=_TENANT_CONTEXT).hexdigest()


class ApiKeys:
    """The configured keys. ``identify(header)`` -> the tenant id of the key presented, or ``None``."""

    def __init__(self, keys: list[str]):
        if not keys:
            raise ValueError("ApiKeys needs at least one key")
        self._keys = [(_digest(k), tenant_id(k)) for k in keys]

    def identify(self, presented: str) -> str | None:
        digest = _digest(presented)
        match = None
        for known, tenant in self._keys:   # every key is compared, whatever matched before
            if hmac.compare_digest(digest, known) and match is None:
                match = tenant
        return match


def bearer_token(authorization: bytes | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header (scheme case-insensitive), else ``None``."""
    if not authorization:
        return None
    scheme, _, token = authorization.decode("latin-1").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def needs_key(path: str, open_metrics_and_status: bool) -> bool:
    if path == "/v1" or path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
        return True
    return path in ("/metrics", "/status") and not open_metrics_and_status


class ApiKeyMiddleware:
    """Refuses requests to protected paths without a valid key (401) before anything reads them."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, open_metrics_and_status: bool, registry: CollectorRegistry):
        self.app = app
        self.keys = keys
        self.open_metrics_and_status = open_metrics_and_status
        self.refused = Counter("epd:api_key_refused", "Requests refused for a missing or wrong API key.",
                               ["reason"], registry=registry)
        for reason in ("missing", "invalid"):
            self.refused.labels(reason)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not needs_key(scope["path"], self.open_metrics_and_status):
            await self.app(scope, receive, send)
            return
        token = bearer_token(dict(scope.get("headers") or []).get(b"authorization"))
        tenant = self.keys.identify(token) if token is not None else None
        if tenant is None:
            reason = "missing" if token is None else "invalid"
            self.refused.labels(reason).inc()
            await _unauthorized(reason).response()(scope, receive, send)
            return
        scope.setdefault("state", {})[TENANT_STATE] = tenant
        await self.app(scope, receive, send)


def _unauthorized(reason: str) -> ApiError:
    message = ("Missing API key: send it as 'Authorization: Bearer KEY'" if reason == "missing"
               else "Incorrect API key provided")
    return ApiError(401, message, "invalid_request_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


def request_tenant(request: Request) -> str | None:
    """The tenant id the middleware put on this request (``None`` without API keys)."""
    return getattr(request.state, TENANT_STATE, None)


def effective_cache_salt(cache_salt: str | None, tenant: str | None, per_key: bool) -> str:
    """The salt of a request's encoder-cache keys; ``""`` is the shared, unsalted namespace.

    Without per-key salting (or without keys) it is the request's ``cache_salt`` as sent, so
    clients that agree on a salt share entries. With it, the tenant id and the ``cache_salt``
    are hashed together (length-prefixed, domain-separated): another key never gets the same
    salt, whatever ``cache_salt`` it sends.
    """
    salt = cache_salt or ""
    if not per_key or tenant is None:
        return salt
    hasher = blake3.blake3(derive_key_context=_SALT_CONTEXT)
    for field in (tenant.encode(), salt.encode()):
        hasher.update(len(field).to_bytes(8, "little"))
        hasher.update(field)
    return hasher.hexdigest()


def install_api_keys(app: FastAPI, keys: list[str], open_metrics_and_status: bool, registry: CollectorRegistry) -> None:
    """Add the middleware (call last: it must be the outermost) and declare the scheme in the OpenAPI schema."""
    app.add_middleware(ApiKeyMiddleware, keys=ApiKeys(keys), open_metrics_and_status=open_metrics_and_status,
                       registry=registry)
    build_schema = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build_schema()
        schema.setdefault("components", {}).setdefault("securitySchemes", {})[SECURITY_SCHEME] = {
            "type": "http", "scheme": "bearer", "description": "one of the gateway's API keys (--api-key)"}
        for path, operations in schema.get("paths", {}).items():
            if needs_key(path, open_metrics_and_status):
                for operation in operations.values():
                    operation["security"] = [{SECURITY_SCHEME: []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
