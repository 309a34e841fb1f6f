"""Two ``epd serve`` stacks at once, differing only in their environment: does a setting pay?

    python -m bench.epd_ab --b-env EPD_COLOCATED_ENCODE_MAX_MS=0 --rounds 6
    python -m bench.epd_ab --a-env EPD_CPU_BIND=none --b-env EPD_CPU_BIND=auto --concurrency 1
    git worktree add /tmp/epd-before HEAD~1 && python -m bench.epd_ab --a-root /tmp/epd-before   # two commits
    python -m bench.epd_ab --model /tmp/epd-bench-vlm --name bench --concurrency 16 --requests 32 --max-tokens 32 \
        --long-fraction 0.5 --ttft-slo-ms 20000 --itl-slo-ms 2000 --rounds 4   # compare_servers' bench-long load

Both stacks run this checkout's code on the same model, up together for the whole run, so a
change of the host between them (other tenants, a faster minute) reaches both. Each round runs
every concurrency on both stacks, one at a time, the order alternating round by round (which
stack goes first is itself worth a few percent on a small host), each after waiting for a
quiet host; every round has its own seed and every image is new (``image_pool`` = requests), so
no run is helped by the encoder cache. Reported per concurrency: each stack's median over rounds
of TTFT p50, req/s and ITL p99, and in how many rounds B beat A; the worse and better rounds are in the
JSON (``results/epd_ab-TAG.json``) with every round's report.

Meant for a change that a setting switches on or off (``EPD_*``, read by every process
``epd serve`` starts), or for two commits: ``--a-root`` / ``--b-root`` run that stack from another
checkout (its processes start there, so ``python -m`` imports that checkout's code; the venv is
this one's). The side-by-side against other servers is ``bench.compare_servers``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.client import OPENAI_MAX_RETRIES
from bench.harness.host import host_info
from bench.harness.paths import RESULTS, ROOT
from bench.harness.report import finish_results, fmt, markdown_table, results_header, settings_json
from bench.harness.runs import run_load
from bench.harness.scrape import counter_delta, scrape_counters
from bench.harness.servers import epd_serve, free_port, wait_http
from bench.harness.usage import wait_quiet
from launcher.processes import stop_group

STACKS = ("A", "B")


def env_item(item: str) -> tuple[str, str]:
    """One ``KEY=VALUE`` setting; a malformed one is argparse's error."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
    return key, value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.epd_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "demo-vlm")
    p.add_argument("--name", default="demo", help="served model name")
    p.add_argument("--a-env", action="append", type=env_item, default=[], metavar="KEY=VALUE",
                   help="stack A's settings (repeatable)")
    p.add_argument("--b-env", action="append", type=env_item, default=[], metavar="KEY=VALUE",
                   help="stack B's settings (repeatable)")
    p.add_argument("--a-root", type=Path, default=ROOT, help="the checkout stack A runs (default: this one)")
    p.add_argument("--b-root", type=Path, default=ROOT, help="the checkout stack B runs (default: this one)")
    p.add_argument("--concurrency", default="1,16", help="comma-separated concurrencies, each run every round")
    p.add_argument("--requests", default="128,192", help="requests per run, one per concurrency (or one for all)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--long-fraction", type=float, default=0.0,
                   help="share of requests with a long prompt (bench.compare_servers' bench-long: 0.5)")
    p.add_argument("--long-prompt-words", type=int, default=400)
    p.add_argument("--ttft-slo-ms", type=float, default=None,
                   help="sent as x-ttft-slo-ms (with --itl-slo-ms) and judged as goodput; default: the gateway's own")
    p.add_argument("--itl-slo-ms", type=float, default=None)
    p.add_argument("--max-retries", type=int, default=OPENAI_MAX_RETRIES,
                   help="a refused request sent again as the openai client does (bench/client.py); 0: never")
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--tag", default="", help="results/epd_ab-TAG.json")
    p.add_argument("--logs", type=Path, default=Path("/tmp/epd-ab-logs"))
    args = p.parse_args(argv)
    args.a_env, args.b_env = dict(args.a_env), dict(args.b_env)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.requests.split(",")]
    if len(counts) not in (1, len(args.concurrency)):
        p.error(f"--requests needs 1 or {len(args.concurrency)} values")
    args.requests = counts * len(args.concurrency) if len(counts) == 1 else counts
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def placements(delta: dict[str, float]) -> dict[str, int]:
    """``epd:placement_total``'s change over a run, per placement (colocated / disaggregated)."""
    out: dict[str, int] = {}
    for series, n in delta.items():
        found = re.search(r'placement="([^"]+)"', series)
        if found:
            out[found[1]] = out.get(found[1], 0) + int(n)
    return out


def _median(values) -> float | None:
    """The median of the rounds that have the metric (a round that served nothing has no TTFT)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _lower(b: float | None, a: float | None) -> bool:
    """B's latency is lower than A's; none at all (nothing served) is the highest."""
    return b is not None and (a is None or b < a)


def summarize(reports: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One concurrency's rounds: each stack's medians, and how often B beat A (lower TTFT, more req/s,
    more goodput)."""
    out: dict[str, Any] = {}
    for name in STACKS:
        out[name] = {"ttft_ms_p50": _median(r["ttft_ms_p50"] for r in reports[name]),
                     "req_per_s": statistics.median(r["req_per_s"] for r in reports[name]),
                     "goodput_req_per_s": statistics.median(r["goodput_req_per_s"] for r in reports[name]),
                     "itl_ms_p99": _median(r["itl_ms_p99"] for r in reports[name]),
                     "failed": sum(r["failed"] for r in reports[name])}
    pairs = list(zip(reports["A"], reports["B"]))
    out["b_lower_ttft_rounds"] = sum(_lower(b["ttft_ms_p50"], a["ttft_ms_p50"]) for a, b in pairs)
    out["b_more_req_per_s_rounds"] = sum(b["req_per_s"] > a["req_per_s"] for a, b in pairs)
    out["b_more_goodput_rounds"] = sum(b["goodput_req_per_s"] > a["goodput_req_per_s"] for a, b in pairs)
    out["rounds"] = len(pairs)
    return out


def table(summary: dict[int, dict[str, Any]]) -> str:
    rows = []
    for c, s in summary.items():
        rows.append([str(c), fmt(s["A"]["ttft_ms_p50"]), fmt(s["B"]["ttft_ms_p50"]),
                     f"{s['b_lower_ttft_rounds']}/{s['rounds']}", fmt(s["A"]["req_per_s"], 1),
                     fmt(s["B"]["req_per_s"], 1), f"{s['b_more_req_per_s_rounds']}/{s['rounds']}",
                     fmt(s["A"]["goodput_req_per_s"]), fmt(s["B"]["goodput_req_per_s"]),
                     f"{s['b_more_goodput_rounds']}/{s['rounds']}",
                     fmt(s["A"]["itl_ms_p99"]), fmt(s["B"]["itl_ms_p99"]), str(s["A"]["failed"]), str(s["B"]["failed"])])
    return markdown_table(["concurrency", "A TTFT p50 ms", "B TTFT p50 ms", "B lower", "A req/s", "B req/s",
                           "B more", "A goodput", "B goodput", "B more", "A ITL p99 ms", "B ITL p99 ms",
                           "A failed", "B failed"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ports = {name: free_port() for name in STACKS}
    envs = {"A": {**os.environ, **args.a_env}, "B": {**os.environ, **args.b_env}}
    roots = {"A": args.a_root.resolve(), "B": args.b_root.resolve()}
    procs = {name: epd_serve(args.model, ports[name], args.logs, args.name, env=envs[name], root=roots[name]).start()
             for name in STACKS}
    bases = {name: f"http://127.0.0.1:{ports[name]}" for name in STACKS}
    reports: dict[int, dict[str, list[dict[str, Any]]]] = {c: {n: [] for n in STACKS} for c in args.concurrency}
    try:
        for name in STACKS:
            wait_http(f"{bases[name]}/health", [procs[name]])
        for name in STACKS:   # unmeasured, its own seed
            run_load(bases[name], args.name, requests=32, concurrency=4, image_pool=32, max_tokens=args.max_tokens,
                     seed=args.seed - 1, check_answers=False)
        for rnd in range(args.rounds):
            order = STACKS if rnd % 2 == 0 else STACKS[::-1]
            for c, n in zip(args.concurrency, args.requests):
                for name in order:
                    wait_quiet(list(procs.values()))
                    before = scrape_counters(bases[name])
                    run = run_load(bases[name], args.name, requests=n, concurrency=c, image_pool=n,
                                   max_tokens=args.max_tokens, seed=args.seed + 100 * rnd + c,
                                   long_fraction=args.long_fraction, long_prompt_words=args.long_prompt_words,
                                   ttft_slo_ms=args.ttft_slo_ms, itl_slo_ms=args.itl_slo_ms,
                                   max_retries=args.max_retries)
                    placed = placements(counter_delta(before, scrape_counters(bases[name]), "epd:placement_total"))
                    reports[c][name].append({**run.report, "placements": placed})
                    print(f"round {rnd} c{c} {name}: TTFT p50 {fmt(run.report['ttft_ms_p50'])} ms, "
                          f"{run.report['req_per_s']:.1f} req/s, goodput {run.report['goodput_req_per_s']:.2f}, "
                          f"failed {run.report['failed']}, placed {placed}", file=sys.stderr)
    finally:
        stop_group(list(procs.values()))
    summary = {c: summarize(reports[c]) for c in args.concurrency}
    print(f"A: {args.a_root} {args.a_env or ''}  B: {args.b_root} {args.b_env or ''}\n" + table(summary))
    path = RESULTS / (f"epd_ab-{args.tag}.json" if args.tag else "epd_ab.json")
    finish_results(path, {**results_header("epd_ab", argv), "host": host_info(),
                          "settings": settings_json({k: v for k, v in vars(args).items() if k != "logs"}),
                          "summary": {str(c): s for c, s in summary.items()},
                          "rounds": {str(c): reports[c] for c in args.concurrency}})
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
