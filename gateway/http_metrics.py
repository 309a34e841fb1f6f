"""The gateway's HTTP-level Prometheus metrics: what clients saw (TTFT, ITL, end to end, outcomes).

All live in one ``CollectorRegistry`` owned by the app (no module globals), so
several apps — tests — can coexist. ``/metrics`` renders that registry and
then the ``extra`` registries — by default prometheus_client's process-wide
``REGISTRY``, which holds the pipeline's metrics (``gateway.pipeline_metrics``:
``epd:queue_depth`` ...) and the process collectors.

=====================================================  =========  ============================
name                                                   kind       labels
=====================================================  =========  ============================
``epd:time_to_first_token_seconds``                    histogram  arrival -> first token
``epd:inter_token_latency_seconds``                    histogram  gap between tokens (per token)
``epd:e2e_request_latency_seconds``                    histogram  arrival -> last token
``epd:request_success_total``                          counter    ``finished_reason`` (stop|length)
``epd:request_failure_total``                          counter    ``reason`` (client_error, refused,
                                                                  deadline, backend, cancelled, internal)
``epd:prompt_tokens_total``                            counter
``epd:generation_tokens_total``                        counter
=====================================================  =========  ============================
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, REGISTRY, generate_latest

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

from .live_window import TimedSamples

FAILURE_REASONS = ("client_error", "refused", "deadline", "backend", "cancelled", "internal")


class HttpMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, extra: Sequence[CollectorRegistry] = (REGISTRY,)):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.extra = [r for r in extra if r is not self.registry]
        r = self.registry
        self.ttft = Histogram("epd:time_to_first_token_seconds", "Time from request arrival to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("epd:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("epd:e2e_request_latency_seconds", "Time from request arrival to its last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.success = Counter("epd:request_success", "Requests that finished, by finish reason.",
                               ["finished_reason"], registry=r)
        self.failure = Counter("epd:request_failure", "Chat requests that did not finish, by reason.",
                               ["reason"], registry=r)
        self.prompt_tokens = Counter("epd:prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("epd:generation_tokens", "Tokens generated.", registry=r)
        self.loop_lag = Gauge("epd:gateway_event_loop_lag_seconds",
                              "How late the gateway's event loop ran its last probe (see loop_lag.py).", registry=r)
        # the last minute's raw values, for /dashboard's percentiles (gateway.live_window)
        self.recent_ttft = TimedSamples()
        self.recent_itl = TimedSamples()
        for reason in ("stop", "length"):
            self.success.labels(finished_reason=reason)
        for reason in FAILURE_REASONS:
            self.failure.labels(reason=reason)

    def observe_ttft(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        self.recent_ttft.add(ttft_s)

    def observe_tokens(self, gap_s: float, count: int) -> None:
        """An event of ``count`` tokens arrived ``gap_s`` after the previous one: ``count`` ITL samples."""
        if count <= 0:
            return
        per_token = gap_s / count
        for _ in range(count):
            self.itl.observe(per_token)
        self.recent_itl.add(per_token, count)
        self.generation_tokens.inc(count)

    def render(self) -> tuple[bytes, str]:
        """Prometheus text format of the gateway's registry and the extra ones (metric names are disjoint)."""
        return b"".join(generate_latest(r) for r in (self.registry, *self.extra)), CONTENT_TYPE_LATEST
