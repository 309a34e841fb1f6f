"""What one hand-off to a worker's model thread and back costs: ``runtime.worker.torch_thread.run``
against the same call through a one-thread executor (``loop.run_in_executor``, how the thread was
reached before), the loop and the thread on one core as in the demo model's decode worker.

    python -m bench.torch_handoff [--calls 2000] [--gap-ms 5] [--core 0]

The two kinds take turns call by call, ``--gap-ms`` apart (a worker one request at a time is idle
between its calls), each call an empty function, so what is timed is the hand-off there and back.
Printed: each kind's median and p90 microseconds and the executor's over the pipes. Results:
``bench/results/torch_handoff.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.harness.host import host_info
from bench.harness.paths import RESULTS
from bench.harness.report import finish_results, markdown_table, results_header, settings_json
from runtime.worker import torch_thread
from runtime.worker.runner import run_event_loop

KINDS = ("torch_thread", "executor")


def _nothing() -> None:
    return None


async def measure(calls: int, warmup: int, gap_s: float, samples: dict[str, list[float]]) -> None:
    """Into ``samples``, per kind, each call's round trip in seconds."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-executor")
    loop = asyncio.get_running_loop()
    kinds = {"torch_thread": lambda: torch_thread.run(_nothing),
             "executor": lambda: loop.run_in_executor(executor, _nothing)}
    try:
        for i in range(warmup + calls):
            for kind in KINDS:
                await asyncio.sleep(gap_s)
                t0 = time.perf_counter()
                await kinds[kind]()
                if i >= warmup:
                    samples[kind].append(time.perf_counter() - t0)
    finally:
        executor.shutdown()


def summarise(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    out = {}
    for kind, values in samples.items():
        us = sorted(v * 1e6 for v in values)
        out[kind] = {"us_p50": statistics.median(us), "us_p90": us[int(0.9 * (len(us) - 1))]}
    for row in out.values():
        row["over_torch_thread"] = row["us_p50"] / out["torch_thread"]["us_p50"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="measured calls of each kind")
    ap.add_argument("--warmup", type=int, default=100, help="unmeasured calls of each kind first")
    ap.add_argument("--gap-ms", type=float, default=5.0, help="pause before each call")
    ap.add_argument("--core", default="0", help="the one core the loop and both threads run on ('' = unbound)")
    ap.add_argument("--json", type=Path, default=RESULTS / "torch_handoff.json")
    args = ap.parse_args(argv)
    if args.core != "":
        os.sched_setaffinity(0, {int(args.core)})   # before any thread starts: both threads inherit it
    started = time.monotonic()
    samples: dict[str, list[float]] = {k: [] for k in KINDS}
    run_event_loop(measure(args.calls, args.warmup, args.gap_ms / 1000, samples))
    summary = summarise(samples)
    print(f"## a model-thread hand-off and back, {args.calls} calls of each kind, {args.gap_ms} ms apart, "
          f"core {args.core or 'any'} ({time.monotonic() - started:.0f} s)\n")
    print(markdown_table(["kind", "p50 us", "p90 us", "/ torch_thread"],
                         [[k, f"{r['us_p50']:.1f}", f"{r['us_p90']:.1f}", f"{r['over_torch_thread']:.2f}"]
                          for k, r in summary.items()]))
    out = {**results_header("torch_handoff", argv), "host": host_info(), "settings": settings_json(vars(args)),
           "summary": summary}
    finish_results(args.json, out)
    print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
