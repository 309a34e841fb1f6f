"""Prometheus metrics of the pipeline behind the HTTP layer: admission, placement, KV handoffs,
failure actions, image cache checks, stage queue depths, decode prefix-cache lookups.

They live in prometheus_client's process-wide ``REGISTRY`` (one pipeline per gateway process),
which ``/metrics`` renders after the app's own HTTP metrics (``gateway.http_metrics``).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

PLACEMENT = Counter("epd:placement_total", "Placement decisions", ["placement", "reason"])
ADMISSION_REJECTED = Counter("epd:admission_rejected_total", "Requests refused at admission", ["reason"])
QUEUE_DEPTH = Gauge("epd:queue_depth", "Requests queued per stage (sum over healthy workers)", ["stage"])
KV_TRANSFER_BYTES = Counter("epd:kv_transfer_bytes_total", "KV bytes handed from prefill to decode")
KV_TRANSFER_LATENCY = Histogram("epd:kv_transfer_latency_seconds", "KV transfer latency (first chunk to verified)",
                                buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
KV_TRANSFER_FAILED = Counter("epd:kv_transfer_failed_total", "Failed KV transfer attempts")
FAILURE_ACTIONS = Counter("epd:transfer_failure_actions_total", "What the gateway did after a failed transfer", ["action"])
ENCODER_CACHE_CHECKS = Counter("epd:gateway_image_cache_checks_total", "Images checked against the encoder cache", ["cached"])
HEALTHY_WORKERS = Gauge("epd:healthy_workers", "Workers of each stage that answered their last poll serving", ["stage"])
COST_FIT_MS = Gauge("epd:cost_model_fit_ms", "The cost model's fit at the last minute's measured sizes, mean ms "
                    "(beside epd:cost_model_measured_ms)", ["kind"])
COST_MEASURED_MS = Gauge("epd:cost_model_measured_ms", "What the workers measured over the last minute, mean ms", ["kind"])
# in tokens, as each decode worker's Reserve reply reports them (vLLM's names; the workers count the same)
PREFIX_QUERIES = Counter("epd:prefix_cache_queries_total", "Prompt tokens looked up in a decode prefix cache", ["worker"])
PREFIX_HITS = Counter("epd:prefix_cache_hits_total", "Prompt tokens served from a decode prefix cache", ["worker"])
