"""One streaming chat request against an OpenAI-compatible server, timed.

Timing follows ``vllm bench serve`` with one difference, kept on purpose: only
chunks that carry content count. TTFT runs from sending the request to the first
chunk whose ``delta`` has non-empty ``content`` (or ``reasoning_content``), so a
server's role-only first chunk does not count as a token. ITL is the list of gaps
between consecutive content chunks (a chunk with several tokens is one gap).

Retries (``max_retries``) are the official ``openai`` client's: a reply refused before
its stream starts with 408, 409, 429 or 5xx (unless the server says ``x-should-retry:
false``; always when it says ``true``) is sent again, up to ``max_retries`` times, after
the server's ``retry-after-ms`` / ``Retry-After`` when it names 0-120 s, else after 0.5 s
doubling per retry (at most 8 s, less up to a quarter of jitter). TTFT and E2E run from
the first send, so a retried request's wait counts against its SLO. 0 is ``vllm bench
serve``'s behaviour: a closed-loop client then answers a refusal with its next request at
once, and one slot refused in a loop can spend a run's remaining requests in a second.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
from typing import Any

import httpx

from .record import ERROR, RequestRecord
from .workload import RequestSpec

TTFT_BREAKDOWN_HEADER = "x-epd-ttft-breakdown"
_MAX_ERROR_CHARS = 2000


def chat_body(spec: RequestSpec, model: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": spec.messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _delta_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    delta = choices[0].get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or ""


# the openai client's retry schedule (its defaults: 2 retries, 0.5 s doubling to 8 s, Retry-After up to 120 s)
OPENAI_MAX_RETRIES = 2
_INITIAL_RETRY_DELAY_S, _MAX_RETRY_DELAY_S, _MAX_RETRY_AFTER_S = 0.5, 8.0, 120.0


def retry_delay_s(headers: httpx.Headers, retries_done: int, rng: random.Random) -> float | None:
    """How long to wait before retrying a refused reply as the openai client would; None: no retry
    (the server said ``x-should-retry: false``, or asked for more than 120 s)."""
    if headers.get("x-should-retry") == "false":
        return None
    asked = _retry_after_s(headers)
    if asked is not None and asked > _MAX_RETRY_AFTER_S:
        return None
    if asked is not None and asked > 0:
        return asked
    return min(_INITIAL_RETRY_DELAY_S * 2.0 ** retries_done, _MAX_RETRY_DELAY_S) * (1 - 0.25 * rng.random())


def _retry_after_s(headers: httpx.Headers) -> float | None:
    try:
        return float(headers["retry-after-ms"]) / 1000
    except (KeyError, ValueError):
        pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        when = email.utils.parsedate_tz(value)
        return None if when is None else email.utils.mktime_tz(when) - time.time()


def _retryable(response: httpx.Response) -> bool:
    if response.headers.get("x-should-retry") == "true":
        return True
    return response.status_code in (408, 409, 429) or response.status_code >= 500


async def send_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], record: RequestRecord, timeout_s: float,
    max_retries: int = 0,
) -> RequestRecord:
    """Send one streaming request and fill ``record`` in; never raises for server faults.

    ``timeout_s`` bounds the whole request, retries and stream included; running past it
    is a failure with status ``ERROR``. ``max_retries``: as the openai client (module doc).
    """
    rng = random.Random(record.index)   # the jitter, reproducible per request
    try:
        async with asyncio.timeout(timeout_s):
            start = time.perf_counter()
            while True:
                delay = await _stream_chat(client, url, body, record, start, rng)
                if delay is None or record.retries >= max_retries:
                    return record
                record.retries += 1
                await asyncio.sleep(delay)
    except TimeoutError:
        record.status = ERROR
        record.error = f"timeout: no complete reply within {timeout_s:g} s"
        return record


async def _stream_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], record: RequestRecord, start: float,
    rng: random.Random,
) -> float | None:
    """One attempt, timed from ``start`` (the first send); the delay before a retry if the reply
    was refused retryably before its stream started, else None (``record`` is filled in)."""
    record.error = None   # an earlier attempt's refusal is not this one's
    last: float | None = None
    chunks = 0
    usage_tokens: int | None = None
    pieces: list[str] = []
    try:
        async with client.stream("POST", url, json=body) as response:
            record.status = response.status_code
            record.ttft_breakdown = response.headers.get(TTFT_BREAKDOWN_HEADER)
            if response.status_code != 200:
                record.error = (await response.aread()).decode("utf-8", "replace")[:_MAX_ERROR_CHARS]
                return retry_delay_s(response.headers, record.retries, rng) if _retryable(response) else None
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event: lines
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(payload)
                if not isinstance(chunk, dict):
                    continue
                if "error" in chunk:
                    record.status = ERROR
                    record.error = json.dumps(chunk["error"])[:_MAX_ERROR_CHARS]
                    return None
                if text := _delta_text(chunk):
                    if last is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    chunks += 1
                    pieces.append(text)
                if usage := chunk.get("usage"):
                    usage_tokens = usage.get("completion_tokens")
                if (breakdown := chunk.get("epd_ttft_breakdown")) is not None and record.ttft_breakdown is None:
                    record.ttft_breakdown = json.dumps(breakdown)   # epd streams it on the final chunk
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        record.status = ERROR
        record.error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
        return None
    record.e2e_s = time.perf_counter() - start
    record.text = "".join(pieces)
    record.output_tokens = usage_tokens if usage_tokens is not None else chunks
    record.ok = True
    return None
