"""``epd simulate``: compare placements of the E/P/D pipeline by discrete-event simulation.

Examples::

    epd simulate --worked-example --json
    epd simulate --placement all --rate 3 --requests 2000
    epd simulate --placement conditional --prompt-tokens mix:500@0.8,6000@0.2 \\
        --burst 60:40:6000:50 --json

JSON: ``{"config": ..., "results": [report, ...]}``; with a single placement the
report's fields are also at the top level (``ttft_ms_p50``, ``goodput_rps``, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from typing import Any

from runtime.policy.placement_policy import MODES
from runtime.policy.service_times import ServiceTimesError
from sim.cli_args import add_mix_args, add_service_args, mix_from_args, service_from_args
from sim.config import TRANSFERS, ConfigError, SimConfig
from sim.distributions import DistributionError
from sim.report import format_table, summarize
from sim.simulator import SimResult, simulate
from sim.workload import Burst, Workload, WorkloadError, load_trace
from sim.worked_example import worked_example


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="epd simulate", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--worked-example", action="store_true", help="print the design chapter's worked example, computed")
    p.add_argument("--placement", default="all", help=f"one or more of {', '.join(MODES)} (comma-separated), or all")
    p.add_argument("--transfer", choices=TRANSFERS, default="serial", help="send KV after prefill, or each chunk when ready")
    p.add_argument("--chunk-tokens", type=int, default=2000, help="transfer chunk size (default 2000)")
    p.add_argument("--chunked-prefill", action="store_true", help="colocated prefill interleaves chunks with decode steps")
    p.add_argument("--local-chunk-tokens", type=int, default=512, help="chunk size of --chunked-prefill (default 512)")
    load = p.add_argument_group("arrivals")
    load.add_argument("--rate", type=float, default=3.0, help="Poisson arrivals per second (default 3)")
    load.add_argument("--requests", type=int, default=1000, help="Poisson requests (default 1000)")
    load.add_argument(
        "--burst", action="append", default=[], metavar="AT_S:COUNT[:PROMPT[:OUTPUT[:SPREAD_S]]]",
        help="extra requests at a time (repeatable)",
    )
    load.add_argument(
        "--trace", metavar="FILE",
        help="replay a trace instead (JSON lines: t_s, prompt_tokens, output_tokens[, images, cached_images, image_tokens])",
    )
    add_mix_args(p)
    pools = p.add_argument_group("pools (colocated runs prefill + decode workers that do both)")
    pools.add_argument("--prefill-workers", type=int, default=1)
    pools.add_argument("--decode-workers", type=int, default=2)
    pools.add_argument("--encoder-workers", type=int, default=1)
    pools.add_argument("--kv-links", type=int, default=1, help="independent KV link pipes (default 1)")
    pools.add_argument(
        "--link-concurrency", type=int, default=1,
        help="transfers moving at once per pipe, the rest queue FIFO; 0: all share the bandwidth (default 1)",
    )
    pools.add_argument("--decode-kv-tokens", type=int, help="KV capacity per decode worker in tokens (default: slots only)")
    slo = p.add_argument_group("SLOs, admission and failures")
    slo.add_argument("--ttft-slo-ms", type=float, default=600.0)
    slo.add_argument("--itl-slo-ms", type=float, default=150.0)
    slo.add_argument("--admission", action="store_true", help="refuse requests predicted to miss the TTFT deadline")
    slo.add_argument("--failure-prob", type=float, default=0.0, help="probability that a transfer attempt fails")
    slo.add_argument("--max-transfer-attempts", type=int, default=3)
    slo.add_argument("--release-on-failure", action="store_true", help="a failed transfer releases its decode reservation")
    add_service_args(p)
    out = p.add_argument_group("output")
    out.add_argument("--seed", type=int, default=0)
    out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    out.add_argument("--no-series", action="store_true", help="leave the queue-depth time series out of the JSON")
    out.add_argument("--samples", type=int, default=200, help="queue-depth samples over the run (default 200)")
    return p


def _placements(spec: str) -> list[str]:
    names = list(MODES) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in MODES]
    if unknown or not names:
        raise ConfigError(f"--placement: unknown {unknown or spec!r}; expected {', '.join(MODES)} or all")
    return names


def _configs(args: argparse.Namespace) -> list[SimConfig]:
    service = service_from_args(args)
    return [
        SimConfig(
            placement=name, prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
            encoder_workers=args.encoder_workers, kv_links=args.kv_links, link_concurrency=args.link_concurrency,
            transfer=args.transfer,
            chunk_tokens=args.chunk_tokens, chunked_prefill=args.chunked_prefill, local_chunk_tokens=args.local_chunk_tokens,
            ttft_slo_ms=args.ttft_slo_ms, itl_slo_ms=args.itl_slo_ms, failure_prob=args.failure_prob,
            max_transfer_attempts=args.max_transfer_attempts, reservation_held_on_failure=not args.release_on_failure,
            admission=args.admission, decode_kv_tokens=args.decode_kv_tokens, samples=args.samples, seed=args.seed,
            service=service,
        )
        for name in _placements(args.placement)
    ]


def _workload(args: argparse.Namespace) -> Workload:
    mix = mix_from_args(args)
    trace = load_trace(args.trace, mix.image_tokens) if args.trace else None
    bursts = tuple(Burst.parse(b) for b in args.burst)
    return Workload(mix, rate=args.rate, requests=args.requests, bursts=bursts, trace=trace, seed=args.seed)


def _config_summary(config: SimConfig, workload: Workload) -> dict[str, Any]:
    """The run's settings: every ``SimConfig`` field but the placement (one per result) and the workload's."""
    summary = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in ("placement", "service")}
    return {**summary, "rate": workload.rate, "requests": workload.total, "prompt_tokens": workload.mix.prompt_tokens.spec,
            "output_tokens": workload.mix.output_tokens.spec, "service": config.service.to_dict()}


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.worked_example:
            example = worked_example(
                service_from_args(args), chunk_tokens=args.chunk_tokens, ttft_budget_ms=args.ttft_slo_ms,
                itl_slo_ms=args.itl_slo_ms,
            )
            print(json.dumps(example, indent=2) if args.json else "\n".join(f"{k:45s} {v}" for k, v in example.items()))
            return 0
        configs, workload = _configs(args), _workload(args)
    except (ConfigError, WorkloadError, DistributionError, ServiceTimesError, ValueError) as exc:
        print(f"epd simulate: {exc}", file=sys.stderr)
        return 2
    results: list[SimResult] = [simulate(config, workload) for config in configs]
    reports = [summarize(r, series=not args.no_series) for r in results]
    if args.json:
        doc: dict[str, Any] = {"config": _config_summary(configs[0], workload), "results": reports}
        if len(reports) == 1:
            doc = {**reports[0], **doc}
        print(json.dumps(doc, indent=2))
    else:
        print(format_table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
