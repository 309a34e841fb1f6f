"""Why an RPC failed, when the status code alone would mislead: trailing metadata ``epd-failure``.

A gRPC status says *what kind* of failure happened; the caller also needs to know
*whose*. UNAVAILABLE means "this worker is gone" to the gateway, which then marks
the worker unhealthy and routes every request around it. A failure of something
the worker depends on for one request (its images' embeddings could not be
fetched) is not that: it comes back as FAILED_PRECONDITION with trailing metadata
``epd-failure: embedding_fetch``, and the gateway fails that request alone (503)
and keeps the worker. Only a worker that does not answer, or says UNAVAILABLE
without an ``epd-failure`` kind, is a lost worker.
"""

from __future__ import annotations

from enum import StrEnum

import grpc

FAILURE_METADATA_KEY = "epd-failure"


class FailureKind(StrEnum):
    EMBEDDING_FETCH = "embedding_fetch"   # the request's image embeddings could not be fetched


async def abort_with(context, kind: FailureKind, code: grpc.StatusCode, detail: str) -> None:
    """End the RPC with ``code`` and the ``epd-failure`` kind in its trailing metadata (raises)."""
    context.set_trailing_metadata(((FAILURE_METADATA_KEY, kind.value),))
    await context.abort(code, detail)


def failure_kind(exc: grpc.aio.AioRpcError) -> FailureKind | None:
    """The ``epd-failure`` kind a worker attached to ``exc``, if any (unknown kinds: ``None``)."""
    for key, value in exc.trailing_metadata() or ():
        if key == FAILURE_METADATA_KEY:
            try:
                return FailureKind(value)
            except ValueError:
                return None
    return None
