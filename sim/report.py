"""Turn a ``SimResult`` into the report dict (``--json``) and a text table.

Report keys (all times in ms, rates per second):
``ttft_ms_p50/p90/p99/mean``, ``itl_ms_p50/p90/p99`` (over every inter-token
gap), ``goodput_rps`` (requests meeting both the TTFT and the ITL SLO, per second
of simulated time), ``throughput_rps``, ``transferred_bytes``, transfer
failures / actions / cleanups, ``idle_fraction`` per pool, mean ``stage_wait_ms``,
and ``queue_depth`` per stage (mean, max and the sampled series).
"""

from __future__ import annotations

import math
from typing import Any

from sim.metrics import HIST_PER_MS, hist_percentile, percentile
from sim.simulator import SimResult


def _num(x: float, digits: int = 3) -> float | None:
    return None if math.isnan(x) else round(x, digits)


def summarize(result: SimResult, *, series: bool = True) -> dict[str, Any]:
    m, cfg = result.metrics, result.config
    seconds = result.horizon_ms / 1000.0 if result.horizon_ms > 0 else math.nan
    ttft = sorted(m.ttft_ms)
    idle = {
        pool: _num(1.0 - result.busy_ms[pool] / (n * result.horizon_ms)) if n and result.horizon_ms > 0 else None
        for pool, n in result.pool_sizes.items()
    }
    queue = m.queue_summary()
    if series:
        for stage, summary in queue.items():
            summary["series"] = [[round(t / 1000.0, 3), v] for t, v in zip(m.sample_t_ms, m.samples[stage])]
    finished = m.completed
    return {
        "placement": cfg.placement,
        "transfer": cfg.transfer,
        "workers": {k: result.pool_sizes[k] for k in ("encoder", "prefill", "decode")},
        "requests": m.arrived,
        "completed": finished,
        "rejected": m.rejected,
        "failed": m.failed,
        "horizon_s": _num(seconds),
        "throughput_rps": _num(finished / seconds) if finished else 0.0,
        "goodput_rps": _num(m.good / seconds) if m.good else 0.0,
        "goodput_fraction": _num(m.good / m.arrived) if m.arrived else None,
        "ttft_slo_met_fraction": _num(m.ttft_ok / finished) if finished else None,
        "itl_slo_met_fraction": _num(m.itl_ok / finished) if finished else None,
        "ttft_ms_p50": _num(percentile(ttft, 50)),
        "ttft_ms_p90": _num(percentile(ttft, 90)),
        "ttft_ms_p99": _num(percentile(ttft, 99)),
        "ttft_ms_mean": _num(sum(ttft) / len(ttft)) if ttft else None,
        "itl_ms_p50": _num(hist_percentile(m.itl_hist, 50)),
        "itl_ms_p90": _num(hist_percentile(m.itl_hist, 90)),
        "itl_ms_p99": _num(hist_percentile(m.itl_hist, 99)),
        "itl_ms_max": max(m.itl_hist) / HIST_PER_MS if m.itl_hist else None,
        "transferred_bytes": int(result.transferred_bytes),
        "transfers": m.transfers,
        "transfer_failures": m.transfer_failures,
        "failure_actions": dict(sorted(m.failure_actions.items())),
        "cleanups": dict(sorted(m.cleanups.items())),
        "cleanups_total": sum(m.cleanups.values()),
        "placements": dict(sorted(m.placements.items())),
        "placement_reasons": dict(sorted(m.reasons.items())),
        "rejections": dict(sorted(m.rejections.items())),
        "idle_fraction": idle,
        "stage_wait_ms": {k: round(v, 3) for k, v in m.mean_waits().items()},
        "queue_depth": queue,
        "events": result.events,
    }


def format_table(reports: list[dict[str, Any]]) -> str:
    """One column per placement; rows are the headline metrics."""
    rows: list[tuple[str, Any]] = [
        ("requests", lambda r: r["requests"]),
        ("completed / rejected / failed", lambda r: f"{r['completed']} / {r['rejected']} / {r['failed']}"),
        ("TTFT p50 / p99 (ms)", lambda r: f"{_fmt(r['ttft_ms_p50'])} / {_fmt(r['ttft_ms_p99'])}"),
        ("ITL p50 / p99 (ms)", lambda r: f"{_fmt(r['itl_ms_p50'])} / {_fmt(r['itl_ms_p99'])}"),
        ("goodput (req/s)", lambda r: _fmt(r["goodput_rps"], 3)),
        ("throughput (req/s)", lambda r: _fmt(r["throughput_rps"], 3)),
        ("goodput fraction", lambda r: _fmt(r["goodput_fraction"], 3)),
        ("transferred (GiB)", lambda r: _fmt(r["transferred_bytes"] / 2**30, 2)),
        ("transfer failures", lambda r: r["transfer_failures"]),
        ("cleanups", lambda r: r["cleanups_total"]),
        ("placements", lambda r: " ".join(f"{k}={v}" for k, v in r["placements"].items()) or "-"),
    ]
    for pool in ("encoder", "prefill", "decode", "link"):
        rows.append((f"idle {pool}", lambda r, p=pool: _fmt(r["idle_fraction"].get(p), 3)))
    stages = sorted({s for r in reports for s in r["queue_depth"]})
    for stage in stages:
        rows.append((f"queue {stage} mean/max", lambda r, s=stage: _queue(r, s)))
    waits = sorted({s for r in reports for s in r["stage_wait_ms"]})
    for stage in waits:
        rows.append((f"wait {stage} (ms)", lambda r, s=stage: _fmt(r["stage_wait_ms"].get(s))))
    header = ["metric"] + [_label(r) for r in reports]
    body = [[name] + [str(fn(r)) for r in reports] for name, fn in rows]
    widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in [header] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _label(report: dict[str, Any]) -> str:
    chunked = report["transfer"] == "chunked" and report["placement"] != "colocated"
    return report["placement"] + ("/chunked" if chunked else "")


def _queue(report: dict[str, Any], stage: str) -> str:
    q = report["queue_depth"].get(stage)
    return f"{q['mean']:.2f} / {q['max']:.0f}" if q else "-"


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"
