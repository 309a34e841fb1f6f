"""Simulator speed: simulate 1,000,000 requests and print the wall and CPU time.

    .venv/bin/python bench/sim_speed.py                      # disaggregated, 1M requests
    .venv/bin/python bench/sim_speed.py --placement conditional --requests 200000

The target is under 60 s on one core for 1M requests. The run is ``epd simulate``'s
defaults: the chapter's worked-example mix (6,000-token prompts, 400-token
outputs) at 3 req/s on 1 prefill + 2 decode workers, which keeps every stage busy
(decode slots ~84% occupied) but stable. Use ``--prefill-workers 2
--decode-workers 4 --rate 6`` for a bigger cluster. Not a timed test.

The machine's 1-minute load average is printed before and after the run: on a
shared machine a busy neighbour inflates the wall (and CPU) time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.policy.placement_policy import MODES  # noqa: E402
from sim.config import SimConfig  # noqa: E402
from sim.report import summarize  # noqa: E402
from sim.simulator import simulate  # noqa: E402
from sim.workload import Workload  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--rate", type=float, default=3.0)
    p.add_argument("--placement", choices=MODES, default="disaggregated")
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    config = SimConfig(
        placement=args.placement, prefill_workers=args.prefill_workers, decode_workers=args.decode_workers, seed=args.seed
    )
    workload = Workload(rate=args.rate, requests=args.requests, seed=args.seed)
    load_before = os.getloadavg()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    result = simulate(config, workload)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    load_after = os.getloadavg()[0]
    report = summarize(result, series=False)
    print(
        f"{args.requests:,} requests ({args.placement}) in {wall:.1f} s wall, {cpu:.1f} s CPU: "
        f"{args.requests / wall:,.0f} req/s, {result.events / wall:,.0f} events/s, "
        f"{result.horizon_ms / 1000:,.0f} simulated s"
    )
    print(
        f"ttft p50/p99 {report['ttft_ms_p50']}/{report['ttft_ms_p99']} ms, itl p99 {report['itl_ms_p99']} ms, "
        f"goodput {report['goodput_rps']} req/s ({report['goodput_fraction']} of requests)"
    )
    print(f"load average (1 min) {load_before:.2f} before, {load_after:.2f} after, {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
