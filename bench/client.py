"""One streaming chat request against an OpenAI-compatible server, timed.

Timing follows ``vllm bench serve`` with one difference, kept on purpose: only
chunks that carry content count. TTFT runs from sending the request to the first
chunk whose ``delta`` has non-empty ``content`` (or ``reasoning_content``), so a
server's role-only first chunk does not count as a token. ITL is the list of gaps
between consecutive content chunks (a chunk with several tokens is one gap).
"""

from __future__ import annotations

import asyncio
import json
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


async def send_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], record: RequestRecord, timeout_s: float
) -> RequestRecord:
    """Send one streaming request and fill ``record`` in; never raises for server faults.

    ``timeout_s`` bounds the whole request, stream included; running past it is a
    failure with status ``ERROR``.
    """
    try:
        async with asyncio.timeout(timeout_s):
            return await _stream_chat(client, url, body, record)
    except TimeoutError:
        record.status = ERROR
        record.error = f"timeout: no complete reply within {timeout_s:g} s"
        return record


async def _stream_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], record: RequestRecord
) -> RequestRecord:
    start = time.perf_counter()
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
                return record
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
                    return record
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
        return record
    record.e2e_s = time.perf_counter() - start
    record.text = "".join(pieces)
    record.output_tokens = usage_tokens if usage_tokens is not None else chunks
    record.ok = True
    return record
