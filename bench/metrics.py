"""Aggregate request records into the report, with ``vllm bench serve``'s definitions.

- ``req_per_s`` = ok requests / duration; ``output_tok_per_s`` = output tokens of
  ok requests / duration. Duration runs from the first send to the last reply.
- TTFT and E2E percentiles are over ok requests; ITL percentiles are over every
  gap of every ok request (a long answer weighs more, as in vLLM).
- TPOT (time per output token) is per ok request with more than one output token:
  ``(e2e - ttft) / (output_tokens - 1)``, as ``vllm bench serve`` computes it.
- Percentiles are numpy's linear interpolation; a metric with no samples is
  ``None`` (``null`` in JSON).
- ``goodput_req_per_s`` = ok requests that meet every SLO that was given, per
  second. A request meets the TTFT SLO when its TTFT <= ``ttft_slo_ms``, and the
  ITL SLO when its *worst* gap <= ``itl_slo_ms`` (a one-chunk answer has no gap
  and meets it). vLLM bounds the per-request mean time per output token instead;
  the worst gap is stricter and is what a user watching the stream notices.
  With no SLO given every ok request is good, so goodput equals ``req_per_s``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .record import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def meets_slo(record: RequestRecord, ttft_slo_ms: float | None, itl_slo_ms: float | None) -> bool:
    if not record.ok:
        return False
    if ttft_slo_ms is not None and (record.ttft_s is None or record.ttft_s * 1e3 > ttft_slo_ms):
        return False
    if itl_slo_ms is not None and record.itl_s and max(record.itl_s) * 1e3 > itl_slo_ms:
        return False
    return True


def _percentile_fields(name: str, values_ms: Sequence[float]) -> dict[str, float | None]:
    return {f"{name}_ms_p{q}": percentile(values_ms, q) for q in PERCENTILES}


def summarize(
    records: Iterable[RequestRecord],
    duration_s: float,
    ttft_slo_ms: float | None = None,
    itl_slo_ms: float | None = None,
    check_answers: bool = True,
) -> dict[str, Any]:
    records = list(records)
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.ok]
    failed = Counter(str(r.status) for r in records if not r.ok)
    ttft_ms = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    itl_ms = [gap * 1e3 for r in ok for gap in r.itl_s]
    e2e_ms = [r.e2e_s * 1e3 for r in ok if r.e2e_s is not None]
    tpot_ms = [(r.e2e_s - r.ttft_s) * 1e3 / (r.output_tokens - 1) for r in ok
               if r.e2e_s is not None and r.ttft_s is not None and r.output_tokens > 1]
    good = sum(meets_slo(r, ttft_slo_ms, itl_slo_ms) for r in ok)
    return {
        "requests": len(records),
        "ok": len(ok),
        "ok_without_text": sum(r.ttft_s is None for r in ok),   # no TTFT: out of the TTFT and ITL percentiles
        "failed": len(records) - len(ok),
        "failed_by_status": dict(sorted(failed.items())),
        "retried": sum(r.retries > 0 for r in records),   # sent again after a refusal (``client.send_chat``)
        "duration_s": duration_s,
        "req_per_s": len(ok) / duration_s,
        "output_tok_per_s": sum(r.output_tokens for r in ok) / duration_s,
        "goodput_req_per_s": good / duration_s,
        **_percentile_fields("ttft", ttft_ms),
        **_percentile_fields("tpot", tpot_ms),
        **_percentile_fields("itl", itl_ms),
        **_percentile_fields("e2e", e2e_ms),
        "mean_ttft_ms": float(np.mean(ttft_ms)) if ttft_ms else None,
        "answers_correct": sum(r.correct for r in ok) if check_answers else 0,
        "answers_checked": len(ok) if check_answers else 0,
    }
