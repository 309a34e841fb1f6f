"""Where epd's time goes on one load: server CPU per request by process, the TTFT breakdown per
hop, and the client-seen inter-token gap.

    python -m bench.where_time_goes [--model models/demo-vlm] [--requests 16] [--concurrency 1,16]

Starts ``epd serve`` (default placement) once, then per concurrency runs one load of new
images and prints: CPU ms per ok request of each process (encoder, prefill, decode, gateway;
psutil over the run), the median of every ``x-epd-ttft-breakdown`` entry (ms; the gateway's
own view of each hop: queueing, encode, prefill RPC, KV transfer, colocated prefill, the
pipeline) against the client's TTFT, and the client's ITL percentiles (to set beside the
in-process decode step of ``bench.decode_throughput``: the gap less the step is the work around
it). Results: printed and ``bench/results/where_time_goes.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.harness.host import host_info
from bench.harness.paths import RESULTS, ROOT
from bench.harness.report import finish_results, fmt, results_header
from bench.harness.runs import cpu_per_request, run_load
from bench.harness.servers import epd_serve, free_port, wait_http


def breakdown_medians(records) -> dict[str, float]:
    fields: dict[str, list[float]] = {}
    for r in records:
        if r.ok and r.ttft_breakdown:
            for k, v in json.loads(r.ttft_breakdown).items():
                if isinstance(v, (int, float)):
                    fields.setdefault(k, []).append(float(v))
    return {k: statistics.median(v) for k, v in sorted(fields.items())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.where_time_goes", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "demo-vlm")
    p.add_argument("--name", default="demo")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--epd-args", default="")
    p.add_argument("--seed", type=int, default=300)
    p.add_argument("--out", type=Path, default=RESULTS / "where_time_goes.json")
    args = p.parse_args(argv)
    port = free_port()
    epd = epd_serve(args.model, port, Path("/tmp/epd-where-logs"), args.name, args.epd_args.split())
    base = f"http://127.0.0.1:{port}"
    out = {**results_header("where_time_goes", argv), "host": host_info(), "model": str(args.model), "loads": []}
    try:
        epd.start()
        wait_http(f"{base}/health", [epd])
        run_load(base, args.name, requests=4, concurrency=4, image_pool=4, max_tokens=args.max_tokens,
                 check_answers=False, timeout_s=120, seed=args.seed + 999)
        for i, c in enumerate(int(x) for x in args.concurrency.split(",")):
            run = run_load(base, args.name, epd, requests=args.requests, concurrency=c, image_pool=args.requests,
                           max_tokens=args.max_tokens, check_answers=False, timeout_s=120, seed=args.seed + i)
            row = {"concurrency": c, "report": run.report, "cpu_ms_per_request": cpu_per_request([run]),
                   "ttft_breakdown_ms_p50": breakdown_medians(run.records)}
            out["loads"].append(row)
            rep = run.report
            print(f"\n## concurrency {c}: {rep['req_per_s']:.2f} req/s, TTFT p50 {fmt(rep['ttft_ms_p50'])} ms, "
                  f"ITL p50 {fmt(rep['itl_ms_p50'])} ms, p99 {fmt(rep['itl_ms_p99'])} ms")
            print("CPU ms / request: " + ", ".join(f"{k} {fmt(v)}" for k, v in row["cpu_ms_per_request"].items()))
            print("TTFT breakdown p50 (ms): " + ", ".join(f"{k} {fmt(v)}" for k, v in row["ttft_breakdown_ms_p50"].items()))
    finally:
        epd.stop()
    finish_results(args.out, out)
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
