"""OpenAI error objects and the exception handlers that produce them.

Every error the gateway returns has OpenAI's shape::

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

Status mapping (one place, here):

=========================================  ======  ==========================
cause                                      status  type
=========================================  ======  ==========================
client mistake (``ApiError.bad_request``,  400     invalid_request_error
FastAPI/pydantic validation, adapter
input errors)
body over ``max_body_bytes``               413     invalid_request_error
unknown route / method                     404/405 invalid_request_error
``AdmissionRefused``                       429/503 rate_limit_error / server_overloaded (+ Retry-After, retry-after-ms)
``DeadlineExceeded``                       504     timeout_error
``BackendFailure``                         502/503 server_error
anything else (a bug)                      500     server_error, no internals
=========================================  ======  ==========================

Validation messages name the offending field but never echo its value (it may be
a 10 MiB base64 string).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.model.errors import AdapterInputError

from .chat_backend import AdmissionRefused, BackendFailure, DeadlineExceeded

log = logging.getLogger("epd.gateway")


class ApiError(Exception):
    """An error with its HTTP status and OpenAI error fields; raise it anywhere in a request."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @classmethod
    def bad_request(cls, message: str, param: str | None = None, code: str | None = None) -> "ApiError":
        return cls(400, message, "invalid_request_error", param, code)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- mapping of the backend's exceptions -------------------------------------------
def retry_after_headers(seconds: float) -> dict[str, str]:
    """HTTP ``Retry-After`` is whole seconds: rounded up, never 0 (that invites a retry storm). The same
    wait in milliseconds goes in ``retry-after-ms``, which the OpenAI SDKs read first, so a queue that
    drains in 0.3 s is not waited out for a whole second."""
    return {"Retry-After": str(max(1, math.ceil(seconds))), "retry-after-ms": str(max(1, round(seconds * 1000)))}


def from_exception(exc: BaseException) -> ApiError | None:
    """The ``ApiError`` for a known exception, or ``None`` for an unexpected one (a 500)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, AdmissionRefused):
        kind = "rate_limit_error" if exc.status == 429 else "server_overloaded"
        return ApiError(
            exc.status, f"request refused: {exc.reason}", kind, None, "admission_refused",
            retry_after_headers(exc.retry_after_s),
        )
    if isinstance(exc, DeadlineExceeded):
        detail = f": {exc}" if str(exc) else ""
        return ApiError(504, f"time-to-first-token deadline exceeded{detail}", "timeout_error", None, "deadline_exceeded")
    if isinstance(exc, BackendFailure):
        return ApiError(exc.status, f"backend failure: {exc}", "server_error", None, "backend_failure")
    if isinstance(exc, AdapterInputError):
        return ApiError(400, str(exc), "invalid_request_error", None, exc.code)
    return None


def input_path(loc: Sequence[Any], document: Any = None) -> list[str]:
    """The part of a pydantic ``loc`` that names places in ``document`` (the parsed request).

    pydantic puts union tags into ``loc`` (``messages.0.content.<parts>.0.image_url.image_url.url``);
    walking the request's own JSON keeps only the keys and indexes the client
    wrote (``messages.0.content.0.image_url.url``). A key missing from the
    request (a required field) is kept and ends the walk.
    """
    if document is None:
        return [str(p) for p in loc]
    path: list[str] = []
    node, previous = document, None
    for i, part in enumerate(loc):
        if isinstance(node, dict) and isinstance(part, str):
            tag = part in (node.get("type"), node.get("role"))
            # a tag that is also a key (a tool's "function") is a tag only when the key follows it
            if isinstance(previous, int) and tag and (loc[i + 1: i + 2] == [part] or (part not in node and i + 1 < len(loc))):
                previous = part  # the discriminator tag of a content part (type) or a message (role)
                continue
            path.append(part)
            if part not in node:
                break
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path.append(str(part))
            node = node[part]
        elif isinstance(part, str) and part.startswith("<"):
            pass  # a union member tag such as <parts>
        else:
            path.append(str(part))
            break
        previous = part
    return path


# custom error types of the request schema's discriminated unions -> the field that chooses the member
DISCRIMINATOR_FIELDS = {"invalid_role": "role"}


def validation_message(errors: Sequence[Mapping[str, Any]], document: Any = None) -> tuple[str, str | None]:
    """One readable message and the dotted ``param`` of the first error; values are never echoed."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = list(first.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path", "header", "cookie"):  # FastAPI names the source first
        loc = loc[1:]
    if first.get("type") in DISCRIMINATOR_FIELDS:   # a union that could not pick a member: name the field that picks
        loc.append(DISCRIMINATOR_FIELDS[first["type"]])
    param = ".".join(input_path(loc, document)) or None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    text = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return text, param


def from_validation_error(exc: ValidationError | RequestValidationError, document: Any = None) -> ApiError:
    if isinstance(exc, ValidationError):
        errors = exc.errors(include_url=False, include_input=False)
    else:
        errors = list(exc.errors())
    message, param = validation_message(errors, document)
    return ApiError.bad_request(message, param, "invalid_value")


# -- handlers ---------------------------------------------------------------------
def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(exc.status_code, str(exc.detail), kind, None, code, exc.headers).response()

    async def on_known(request: Request, exc: Exception) -> JSONResponse:
        error = from_exception(exc)
        if error is None:  # pragma: no cover - only registered for known types
            return await on_unexpected(request, exc)
        return error.response()

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = getattr(request.state, "request_id", None)
        log.exception("unhandled error in %s %s (request %s)", request.method, request.url.path, request_id)
        return JSONResponse(internal_error_body(request_id), status_code=500)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    for known in (AdmissionRefused, DeadlineExceeded, BackendFailure, AdapterInputError):
        app.add_exception_handler(known, on_known)
    app.add_exception_handler(Exception, on_unexpected)


def internal_error_body(request_id: str | None) -> dict[str, Any]:
    suffix = f" (request {request_id})" if request_id else ""
    return error_body(f"internal server error{suffix}", "server_error", None, "internal_error")
