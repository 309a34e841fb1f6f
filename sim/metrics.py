"""What a simulation run records, and the percentile helpers that summarize it.

TTFT is kept per request (a list of ms); ITL as a histogram of every
inter-token gap in units of 1/100 ms (``int(ms x 100 + 0.5) -> count``), because
a million requests make hundreds of millions of gaps. Queue depths are sampled
at fixed intervals.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

STAGES = ("encoder", "prefill", "kv_reservation", "link", "decode_join", "local_prefill", "decode_running")
# keys of Metrics.wait_sum_ms / wait_n (a stage without waits keeps n = 0); "host_core" is, per piece
# of work on a shared host, the time it took beyond its idle service time (its wait for the CPU)
WAITS = (*STAGES, "link_queue", "gateway", "host_core")


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated ``q``-th percentile (0..100) of an ascending list; nan if empty."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


HIST_PER_MS = 100  # histogram keys are gaps in 1/100 ms


def hist_percentile(hist: dict[int, int], q: float) -> float:
    """Nearest-rank ``q``-th percentile, in ms, of a gap histogram; nan if empty."""
    total = sum(hist.values())
    if not total:
        return math.nan
    rank = max(1, math.ceil(total * q / 100.0))
    seen = 0
    for key in sorted(hist):
        seen += hist[key]
        if seen >= rank:
            return key / HIST_PER_MS
    return max(hist) / HIST_PER_MS


@dataclass(slots=True)
class Metrics:
    ttft_ms: list[float] = field(default_factory=list)
    itl_hist: dict[int, int] = field(default_factory=dict)  # gap in 1/100 ms -> count
    arrived: int = 0
    completed: int = 0
    good: int = 0
    ttft_ok: int = 0
    itl_ok: int = 0
    rejected: int = 0
    failed: int = 0
    transfers: int = 0  # completed transfer attempts (successful or failed)
    transfer_failures: int = 0
    placements: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    rejections: Counter[str] = field(default_factory=Counter)
    failure_actions: Counter[str] = field(default_factory=Counter)
    cleanups: Counter[str] = field(default_factory=Counter)
    # one wait of ms in stage: wait_sum_ms[stage] += ms; wait_n[stage] += 1 (every stage of WAITS
    # preset: plain dicts, several updates per request)
    wait_sum_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(WAITS, 0.0))
    wait_n: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WAITS, 0))
    sample_t_ms: list[float] = field(default_factory=list)
    samples: dict[str, list[int]] = field(default_factory=lambda: {s: [] for s in STAGES})

    def mean_waits(self) -> dict[str, float]:
        return {stage: self.wait_sum_ms[stage] / n for stage, n in sorted(self.wait_n.items()) if n}

    def queue_summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for stage, values in self.samples.items():
            if values:
                out[stage] = {"mean": sum(values) / len(values), "max": float(max(values))}
        return out
