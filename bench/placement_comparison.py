"""Placement comparison on the bench model, workers pinned so that stages do not share cores.

    epd demo-model --bench --out /tmp/epd-bench-vlm          # once
    python -m bench.placement_comparison                       # all three placements, both scenarios
    python -m bench.placement_comparison --placements colocated,conditional --cores 0,1

Topologies (``--cores A,B``; every model worker runs under ``taskset -c <core>`` with
``OMP_NUM_THREADS=1``):

==============  =====================================  ======================
placement       core A                                 core B
==============  =====================================  ======================
colocated       decode worker (prefills its own)       decode worker (same)
disaggregated   prefill worker                         decode worker
conditional     prefill worker                         decode worker; the gateway
                                                       picks per request
==============  =====================================  ======================

The encoder worker, the gateway and this load generator are not pinned (they may
run on either core) and are the same in every configuration. The gateway runs
with ``--itl-slo-ms`` = the benchmark's ITL SLO (conditional placement weighs the
stall a local prefill inflicts against that SLO) and a large ``--ttft-slo-ms``
so that admission never refuses a request: this compares latency, not admission.

Scenarios, each run against every placement in turn (same seeds):

- ``mixed``: short image chats, Poisson arrivals (``--short-rate``), answers of
  ``--short-max-tokens``; plus bursts of ``--burst-size`` long-prompt requests
  (``--long-words`` filler words) sent at once at each ``--burst-at`` offset. The
  claim to reproduce: a long prompt beside active decoders breaks their ITL when
  colocated, not when disaggregated.
- ``low``: short chats only at a low rate. The claim: colocated wins on TTFT
  (no transfer, no hop).

Reported per placement and scenario: ITL p99 and TTFT p99 of the short chats,
TTFT p99 of the long prompts, goodput (requests/s meeting the SLOs: TTFT <=
``--short-ttft-slo-ms`` for short chats, <= ``--long-ttft-slo-ms`` for long ones,
and every gap <= ``--itl-slo-ms``), and the gateway's placement decisions (the
``epd:placement_total`` counter). Results: printed, ``bench/results/
placement_comparison.json`` and one PNG of TTFT / ITL CDFs per scenario.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness.host import host_info
from bench.harness.report import fmt, finish_results, markdown_table, results_header, settings_json
from bench.harness.servers import RESULTS, StartError
from bench.placement_load import SCENARIOS, probe_breakdown, run_scenario, warm_up
from bench.placement_stack import PLACEMENTS, start_stack
from bench.placement_summary import PROBE_KEYS, claims, decisions, probe_rows, scenario_rows, summarize_run
from bench.plot import plot_series_cdfs
from bench.record import RequestRecord

DEFAULT_MODEL = Path("/tmp/epd-bench-vlm")


def stem(args: argparse.Namespace) -> str:
    """Output file stem: ``placement_comparison`` or ``placement_comparison-TAG``."""
    return "placement_comparison" + (f"-{args.tag}" if args.tag else "")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.placement_comparison", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="built by `epd demo-model --bench --out DIR`")
    p.add_argument("--placements", default=",".join(PLACEMENTS))
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--cores", default="0,1", help="two CPU ids: A,B (see the table above)")
    p.add_argument("--short-requests", type=int, default=24)
    p.add_argument("--short-rate", type=float, default=0.8, help="short chats per second (mixed)")
    p.add_argument("--short-max-tokens", type=int, default=24)
    p.add_argument("--burst-at", default="4,14", help="seconds after the start of each long-prompt burst (mixed)")
    p.add_argument("--burst-size", type=int, default=2, help="long prompts per burst, sent at once")
    p.add_argument("--long-words", type=int, default=500)
    p.add_argument("--long-max-tokens", type=int, default=4)
    p.add_argument("--low-requests", type=int, default=16)
    p.add_argument("--low-rate", type=float, default=0.6, help="short chats per second (low)")
    p.add_argument("--image-pool", type=int, default=4)
    p.add_argument("--short-ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--long-ttft-slo-ms", type=float, default=15000.0)
    p.add_argument("--itl-slo-ms", type=float, default=1000.0, help="worst gap; also the gateway's ITL SLO")
    p.add_argument("--gateway-ttft-slo-ms", type=float, default=120000.0,
                   help="the gateway's TTFT deadline: large so that admission refuses nothing")
    p.add_argument("--kv-memory-mb", type=int, default=512)
    p.add_argument("--warmup-long", action=argparse.BooleanOptionalAction, default=True,
                   help="include a long prompt in the warm-up (calibrates the cost model's prefill slope)")
    p.add_argument("--probe", type=int, default=8,
                   help="after the scenarios: this many short chats alone, non-streaming, for the TTFT breakdown")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--tag", default="", help="suffix of the output files: placement_comparison-TAG.json ...")
    p.add_argument("--logs", type=Path, default=Path("/tmp/epd-placement-logs"))
    args = p.parse_args(argv)
    args.placement_list = [x.strip() for x in args.placements.split(",") if x.strip()]
    args.scenario_list = [x.strip() for x in args.scenarios.split(",") if x.strip()]
    for x in args.placement_list:
        if x not in PLACEMENTS:
            p.error(f"--placements: unknown {x!r} (one of {', '.join(PLACEMENTS)})")
    for x in args.scenario_list:
        if x not in SCENARIOS:
            p.error(f"--scenarios: unknown {x!r} (one of {', '.join(SCENARIOS)})")
    try:
        args.core_list = [int(c) for c in args.cores.split(",")]
        args.burst_at_list = [float(t) for t in args.burst_at.split(",") if t.strip()]
    except ValueError:
        p.error("--cores and --burst-at take comma-separated numbers")
    if len(args.core_list) != 2 or len(set(args.core_list)) != 2:
        p.error("--cores takes two different CPU ids, e.g. 0,1")
    if any(t < 0 for t in args.burst_at_list):
        p.error("--burst-at offsets must be >= 0")
    if args.tag and not args.tag.replace("-", "").replace("_", "").isalnum():
        p.error("--tag: letters, digits, - and _ only")
    if args.probe < 0:
        p.error("--probe must be >= 0")
    for name in ("short_requests", "short_max_tokens", "burst_size", "long_words", "long_max_tokens",
                 "low_requests", "image_pool", "kv_memory_mb"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("short_rate", "low_rate", "short_ttft_slo_ms", "long_ttft_slo_ms", "itl_slo_ms",
                 "gateway_ttft_slo_ms", "timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not (args.model / "config.json").exists():
        print(f"placement_comparison: no model at {args.model} (build it: epd demo-model --bench --out DIR)",
              file=sys.stderr)
        return 1
    header = results_header("placement_comparison", argv)
    t0 = time.monotonic()
    host = host_info()
    results: dict[str, dict[str, Any]] = {s: {} for s in args.scenario_list}
    records: dict[str, dict[str, list[RequestRecord]]] = {s: {} for s in args.scenario_list}
    probes: dict[str, dict[str, float]] = {}
    for placement in args.placement_list:
        try:
            stack = start_stack(args, placement)
        except StartError as exc:
            print(f"placement_comparison: {placement}: {exc}", file=sys.stderr)
            return 1
        try:
            warm_up(args, stack)
            for scenario in args.scenario_list:
                run = run_scenario(args, stack, scenario)
                summary = summarize_run(run, args.short_ttft_slo_ms, args.long_ttft_slo_ms, args.itl_slo_ms)
                results[scenario][placement] = summary
                records[scenario][placement] = run.short + run.long
                print(f"[{placement}] {scenario}: short ITL p99 {fmt(summary['short_itl_ms_p99'])} ms, "
                      f"short TTFT p99 {fmt(summary['short_ttft_ms_p99'])} ms, long TTFT p99 "
                      f"{fmt(summary['long_ttft_ms_p99'])} ms, goodput {fmt(summary['goodput_req_per_s'])} req/s, "
                      f"ok {summary['ok']}/{summary['requests']}, {decisions(summary['placements'])}",
                      file=sys.stderr)
                for err in summary["errors"]:
                    print(f"[{placement}]   failed: {err}", file=sys.stderr)
            if args.probe:
                probes[placement] = probe_breakdown(args, stack.base)
        finally:
            stack.stop()
    checked = claims(results, probes=probes)
    for scenario in args.scenario_list:
        print(f"\n## scenario {scenario}\n")
        print(markdown_table(["metric", *results[scenario]], scenario_rows(results[scenario])))
        plot_series_cdfs(records[scenario], args.out / f"{stem(args)}-{scenario}.png",
                         f"bench model, scenario {scenario}: TTFT (all requests) and ITL per placement")
    if probes:
        print("\n## TTFT breakdown, one short chat at a time (mean ms; x-epd-ttft-breakdown)\n")
        print(markdown_table(["placement", *PROBE_KEYS], probe_rows(probes)))
    print("\nclaims:", json.dumps(checked, indent=1))
    payload = {**header, "wall_s": time.monotonic() - t0, "host": host, "settings": settings_json(vars(args)),
               "results": results, "claims": checked, "probe_breakdown": probes,
               "tables": {s: scenario_rows(results[s]) for s in args.scenario_list}}
    path = args.out / f"{stem(args)}.json"
    finish_results(path, payload)
    print(f"\nwritten: {path} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
