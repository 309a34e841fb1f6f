"""``GET /dashboard/data``: one JSON document with everything the dashboard page draws.

Built on each poll from what the gateway already owns, nothing fetched: the backend's
``status()`` (workers as the registry last polled them, the cost model's fit and the
measured timings, ``gateway.fit_check``), the HTTP metrics' last-minute samples and the
counter history (``gateway.live_window``), and the request journal. A stage's ``state`` is
``ok`` (a healthy worker), ``no_healthy_worker`` (workers known, none healthy: requests
needing it are refused) or ``none`` (no worker configured, e.g. prefill when every request
runs colocated).
"""

from __future__ import annotations

import time
from typing import Any

from ..http_metrics import HttpMetrics
from ..live_window import CounterHistory, percentile
from ..request_journal import RequestJournal
from ..settings import GatewaySettings

STAGES = ("encoder", "prefill", "decode")


def _label(key: str, name: str) -> str | None:
    """The value of label ``name`` in a ``read_counters`` key, or None."""
    marker = f'{name}="'
    if marker not in key:
        return None
    return key.split(marker, 1)[1].split('"', 1)[0]


def stage_view(workers: list[dict[str, Any]]) -> dict[str, Any]:
    healthy = sum(1 for w in workers if w.get("healthy"))
    state = "none" if not workers else ("ok" if healthy else "no_healthy_worker")
    return {"state": state, "healthy": healthy, "workers": workers}


def window_view(metrics: HttpMetrics, history: CounterHistory, settings: GatewaySettings) -> dict[str, Any]:
    span, rates = history.rates()

    def family(name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, rate in rates.items():
            if key.startswith(name + "{"):
                value = _label(key, label)
                if value is not None:
                    out[value] = round(rate, 4)
        return out

    ok = family("epd:request_success_total", "finished_reason")
    failed = family("epd:request_failure_total", "reason")
    checks = family("epd:gateway_image_cache_checks_total", "cached")
    checked = checks.get("true", 0.0) + checks.get("false", 0.0)
    ttft = [v * 1e3 for v in metrics.recent_ttft.values()]
    itl = [v * 1e3 for v in metrics.recent_itl.values()]

    def pct(values: list[float], q: float) -> float | None:
        p = percentile(values, q)
        return None if p is None else round(p, 2)

    return {
        "seconds": round(span, 1),
        "requests_per_s": round(sum(ok.values()) + sum(failed.values()), 4),
        "finished_per_s": ok,
        "failed_per_s": failed,
        "refusals_per_s": family("epd:admission_rejected_total", "reason"),
        "ttft_ms": {"p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99), "samples": len(ttft), "slo": settings.ttft_slo_ms},
        "itl_ms": {"p50": pct(itl, 0.5), "p99": pct(itl, 0.99), "samples": len(itl), "slo": settings.itl_slo_ms},
        "kv_transfer_gb_per_s": round(rates.get("epd:kv_transfer_bytes_total", 0.0) / 1e9, 6),
        "image_cache_hit_rate": None if checked <= 0 else round(checks.get("true", 0.0) / checked, 4),
    }


def dashboard_data(settings: GatewaySettings, status: dict[str, Any], metrics: HttpMetrics,
                   history: CounterHistory, journal: RequestJournal) -> dict[str, Any]:
    return {
        "time_unix": time.time(),
        "model": settings.served_model_name,
        "placement_mode": status.get("placement_mode", settings.placement),
        "waiting_first_token": status.get("waiting_first_token", 0),
        "stages": {role: stage_view(list(status.get(role, []))) for role in STAGES},
        "window": window_view(metrics, history, settings),
        "cost_model": {"fit": status.get("cost_model", {}), "measured": status.get("cost_model_vs_measured", {})},
        "recent": list(reversed(journal.recent())),
    }
