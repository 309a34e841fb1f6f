"""Bounded soak: overload the real stack at twice its measured capacity and check it sheds early.

    python -m bench.soak [--requests 2000] [--overload 2.0] [--ttft-slo-ms 1500]

1. start ``epd serve`` on the demo model (the gateway's TTFT SLO set by ``EPD_TTFT_SLO_MS``);
2. measure capacity: closed loop, 64 concurrent image requests (enough that the stack's
   throughput, not one request's latency, is the limit);
3. soak: ``--requests`` Poisson arrivals at ``--overload`` x capacity;
4. report: how many were refused early (429 with Retry-After) vs failed late (504/5xx),
   the admitted requests' TTFT/ITL and goodput against the SLOs, the stack's resident
   memory before and after, and ``/status`` leak counters (reservations, pending chunks).

By default the load generator runs on core 0 and the stack on the other cores (``--no-pin``
to share them), and capacity is measured under that same split. TTFT is reported twice. ``admitted_ttft_ms_*`` is what the load generator saw.
``server_ttft_ms_*`` is the gateway's own figure (the ``ttft_ms`` of epd's TTFT
breakdown: from the request's arrival, less the gateway's measured event-loop lag,
to its first token). On one small box the load generator shares the cores with the
stack; ``client_loop_lag_ms_*`` shows how late the generator's own event loop ran,
which is time the gateway never sees.

Writes ``bench/results/soak.json``. A measurement, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from bench.harness.report import write_json
from bench.harness.servers import RESULTS, ROOT, epd_serve, free_port, wait_http
from bench.harness.usage import tree_rss_mib
from bench.loadgen import BenchConfig, BenchResult, arun_bench, run_bench
from bench.metrics import percentile as linear_percentile


def leak_counters(base: str, settle_s: float = 15.0) -> dict[str, float]:
    """Poll ``/status`` until every counter is back to 0, for at most ``settle_s`` (a release
    still in flight, or a lease the reaper has yet to expire, is not a leak; a count that never
    returns is). ``settled_after_s`` is how long that took (None: it never did)."""
    started = time.monotonic()
    while True:
        time.sleep(1.0)  # the gateway polls worker stats every 0.5 s
        status = httpx.get(f"{base}/status", timeout=10, trust_env=False).json()
        counters = {
            "reservations_active": sum(w.get("reservations_active", 0) for w in status["decode"]),
            "pending_chunks": sum(w.get("pending_chunks", 0) for w in status["decode"]),
            "gateway_inflight": sum(w.get("inflight_from_gateway", 0) for role in ("encoder", "prefill", "decode")
                                    for w in status[role]),
        }
        waited = time.monotonic() - started
        if not any(counters.values()):
            return {**counters, "settled_after_s": round(waited, 1)}
        if waited > settle_s:
            return {**counters, "settled_after_s": None}


def pin_apart(stack_pid: int) -> dict[str, list[int]] | None:
    """Give this process (the load generator) core 0 and the whole stack the other cores, so
    the generator's own stalls do not show up as the stack's latency. None on one core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    root = psutil.Process(stack_pid)
    for proc in [root, *root.children(recursive=True)]:
        proc.cpu_affinity(cores[1:])
    os.sched_setaffinity(0, cores[:1])
    return {"load_generator": cores[:1], "stack": cores[1:]}


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation, as everywhere in bench/; None below two samples."""
    return linear_percentile(values, q) if len(values) > 1 else None


async def bench_with_loop_probe(config: BenchConfig) -> tuple[BenchResult, list[float]]:
    """Run the load and sample how late this process's own event loop runs (every 50 ms)."""
    lags: list[float] = []

    async def probe() -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.05)
            lags.append((time.perf_counter() - before - 0.05) * 1000)

    task = asyncio.create_task(probe())
    try:
        return await arun_bench(config), lags
    finally:
        task.cancel()


def server_side(result: BenchResult, ttft_slo_ms: float, itl_slo_ms: float) -> dict[str, float | None]:
    """The admitted requests' TTFT as the gateway measured it, and the share within both SLOs."""
    ttfts, within = [], 0
    for r in result.records:
        if not r.ok or not r.ttft_breakdown:
            continue
        ttft = json.loads(r.ttft_breakdown).get("ttft_ms")
        if ttft is None:
            continue
        ttfts.append(ttft)
        within += ttft <= ttft_slo_ms and max(r.itl_s, default=0.0) * 1000 <= itl_slo_ms
    return {"server_ttft_ms_p50": percentile(ttfts, 50), "server_ttft_ms_p99": percentile(ttfts, 99),
            "server_admitted_meeting_slos": within / len(ttfts) if ttfts else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--overload", type=float, default=2.0)
    p.add_argument("--ttft-slo-ms", type=float, default=1500.0)
    p.add_argument("--itl-slo-ms", type=float, default=500.0)
    p.add_argument("--model", type=Path, default=ROOT / "models" / "demo-vlm")
    p.add_argument("--capacity-concurrency", type=int, default=64,
                   help="requests in flight while measuring capacity (closed loop)")
    p.add_argument("--no-pin", action="store_true",
                   help="let the load generator share cores with the stack (default: it gets core 0 to itself)")
    args = p.parse_args(argv)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    logs = Path(tempfile.mkdtemp(prefix="epd-soak-"))
    server = epd_serve(args.model, port, logs, "epd", env={"EPD_TTFT_SLO_MS": str(args.ttft_slo_ms)})
    server.start()
    try:
        wait_http(f"{base}/health", [server])
        pinned = None if args.no_pin else pin_apart(server.pid)
        run_bench(BenchConfig(base=base, requests=32, concurrency=8, progress=False))  # warm-up
        # enough in flight that throughput, not one request's latency, is the limit
        capacity = run_bench(BenchConfig(base=base, requests=args.capacity_concurrency * 8,
                                         concurrency=args.capacity_concurrency, image_pool=160, max_tokens=8,
                                         progress=False))
        rate = capacity["req_per_s"] * args.overload
        rss_before = tree_rss_mib(server.pid)
        result, lags = asyncio.run(bench_with_loop_probe(BenchConfig(
            base=base, requests=args.requests, rate=rate, image_pool=64, max_tokens=8,
            ttft_slo_ms=args.ttft_slo_ms, itl_slo_ms=args.itl_slo_ms, seed=7)))
        soak = result.report
        rss_after = tree_rss_mib(server.pid)
        leaks = leak_counters(base)
    finally:
        server.stop()
    refused = soak["failed_by_status"].get("429", 0) + soak["failed_by_status"].get("503", 0)
    late = sum(v for k, v in soak["failed_by_status"].items() if k not in ("429", "503"))
    admitted_goodput_share = soak["goodput_req_per_s"] / soak["req_per_s"] if soak["req_per_s"] else None
    report = {
        "capacity_req_per_s": capacity["req_per_s"], "offered_req_per_s": rate, "requests": args.requests,
        "ok": soak["ok"], "refused_early": refused, "failed_late": late, "failed_by_status": soak["failed_by_status"],
        "admitted_ttft_ms_p50": soak["ttft_ms_p50"], "admitted_ttft_ms_p99": soak["ttft_ms_p99"],
        "admitted_itl_ms_p99": soak["itl_ms_p99"], "goodput_req_per_s": soak["goodput_req_per_s"],
        "admitted_meeting_slos": admitted_goodput_share,
        **server_side(result, args.ttft_slo_ms, args.itl_slo_ms),
        "client_loop_lag_ms_p50": percentile(lags, 50), "client_loop_lag_ms_p99": percentile(lags, 99),
        "client_loop_lag_ms_max": max(lags, default=None), "answers_correct": soak["answers_correct"],
        "answers_checked": soak["answers_checked"], "rss_mib_before": rss_before, "rss_mib_after": rss_after,
        "leaks_after": leaks, "cores": pinned or "shared", "ttft_slo_ms": args.ttft_slo_ms, "itl_slo_ms": args.itl_slo_ms,
    }
    write_json(RESULTS / "soak.json", report, indent=2, allow_nan=True)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
