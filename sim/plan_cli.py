"""``epd plan``: recommend encoder, prefill and decode worker counts for a load and SLOs.

Example::

    epd plan --rate 6 --prompt-tokens 6000 --output-tokens 400 --ttft-slo-ms 600 --itl-slo-ms 150 --json

Sizing starts from Q = lambda x W per stage, is confirmed (and corrected) by
simulation, and reports the conditional split threshold at that load.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from runtime.policy.service_times import ServiceTimesError
from sim.cli_args import add_mix_args, add_service_args, mix_from_args, service_from_args
from sim.config import TRANSFERS
from sim.distributions import DistributionError
from sim.planner import PlanInput, plan
from sim.workload import WorkloadError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="epd plan", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rate", type=float, required=True, help="arrivals per second")
    p.add_argument("--ttft-slo-ms", type=float, default=600.0)
    p.add_argument("--itl-slo-ms", type=float, default=150.0)
    p.add_argument("--goodput-target", type=float, default=0.95, help="share of requests meeting both SLOs (default 0.95)")
    p.add_argument("--transfer", choices=TRANSFERS, default="serial")
    p.add_argument("--chunk-tokens", type=int, default=2000)
    p.add_argument("--sim-requests", type=int, default=2000, help="requests per confirming simulation; 0: analytic only")
    p.add_argument("--max-rounds", type=int, default=16, help="simulation rounds to fix an under-sized plan (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    add_mix_args(p)
    add_service_args(p)
    return p


def _text(result: dict[str, Any]) -> str:
    rec = result["recommended"]
    lines = [
        f"rate {result['rate']:g} req/s -> encoder {rec['encoder_workers']}, prefill {rec['prefill_workers']}, "
        f"decode {rec['decode_workers']}, kv links {rec['kv_links']}",
        f"confirmed by simulation: {result['confirmed_by_simulation']} (goodput target {result['goodput_target']:g})",
    ]
    sim = result["simulated"]
    if sim:
        lines.append(
            f"simulated: goodput {sim['goodput_fraction']} of requests ({sim['goodput_rps']} req/s), "
            f"TTFT p50/p99 {sim['ttft_ms_p50']}/{sim['ttft_ms_p99']} ms, ITL p99 {sim['itl_ms_p99']} ms"
        )
    threshold = result["split_threshold_tokens"]
    at = result["split_threshold_at"]
    lines.append(
        f"conditional split threshold: {threshold if threshold is not None else 'none (colocated always wins)'} tokens "
        f"(at {at['neighbours_per_decode_worker']} running sequences per decode worker)"
    )
    a = result["analytic"]
    lines.append(
        f"Q = lambda W: {a['busy_prefill_workers']:.2f} busy prefill workers, "
        f"{a['occupied_decode_slots']:.1f} occupied decode slots, {a['busy_encoders']:.2f} busy encoders, "
        f"link {a['link_utilization']:.2f} utilized"
    )
    rounds = (
        f"E{r['encoder_workers']} P{r['prefill_workers']} D{r['decode_workers']} L{r['kv_links']} -> {r['goodput_fraction']}"
        for r in result["rounds"]
    )
    lines.append("simulation rounds: " + "; ".join(rounds))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        inp = PlanInput(
            mix=mix_from_args(args), rate=args.rate, ttft_slo_ms=args.ttft_slo_ms, itl_slo_ms=args.itl_slo_ms,
            service=service_from_args(args), transfer=args.transfer, chunk_tokens=args.chunk_tokens,
            goodput_target=args.goodput_target, sim_requests=args.sim_requests, max_rounds=args.max_rounds, seed=args.seed,
        )
    except (WorkloadError, DistributionError, ServiceTimesError, ValueError) as exc:
        print(f"epd plan: {exc}", file=sys.stderr)
        return 2
    result = plan(inp)
    print(json.dumps(result, indent=2) if args.json else _text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
