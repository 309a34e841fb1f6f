"""Counters and gauges from a Prometheus ``/metrics`` page, and their change over a run."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import httpx


def parse_prometheus(text: str, prefix: str = "epd:") -> dict[str, float]:
    """``'name{labels}' -> value`` for the samples whose name starts with ``prefix``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[name] = float(value)
    return out


def scrape_counters(base: str, prefix: str = "epd:") -> dict[str, float]:
    """``parse_prometheus`` of ``{base}/metrics`` (empty when the page cannot be read)."""
    try:
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            text = client.get(f"{base}/metrics").text
    except httpx.HTTPError:
        return {}
    return parse_prometheus(text, prefix)


def counter_delta(before: Mapping[str, float], after: Mapping[str, float], prefix: str) -> dict[str, float]:
    """``after - before`` for the series whose name starts with ``prefix`` (non-zero ones only)."""
    keys = {k for k in after if k.startswith(prefix)}
    return {k: after[k] - before.get(k, 0.0) for k in sorted(keys) if after[k] - before.get(k, 0.0)}
