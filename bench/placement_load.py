"""``placement_comparison``'s load: the scenarios (short chats with long-prompt bursts, or a low
rate), the warm-up that calibrates the gateway's cost model, and the TTFT-breakdown probe."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass

import httpx

from bench.client import TTFT_BREAKDOWN_HEADER, chat_body
from bench.harness.scrape import counter_delta, scrape_counters
from bench.loadgen import BenchConfig, arun_bench
from bench.placement_stack import Stack
from bench.record import RequestRecord
from bench.workload import build_workload

SCENARIOS = ("mixed", "low")


@dataclass
class ScenarioRun:
    short: list[RequestRecord]
    long: list[RequestRecord]
    duration_s: float
    placements: dict[str, float]


def short_config(args: argparse.Namespace, base: str, scenario: str, seed: int) -> BenchConfig:
    rate = args.short_rate if scenario == "mixed" else args.low_rate
    n = args.short_requests if scenario == "mixed" else args.low_requests
    return BenchConfig(base=base, model="bench", requests=n, rate=rate, image_pool=args.image_pool,
                       max_tokens=args.short_max_tokens, seed=seed, check_answers=False,
                       timeout_s=args.timeout, progress=False)


def long_config(args: argparse.Namespace, base: str, seed: int) -> BenchConfig:
    return BenchConfig(base=base, model="bench", requests=args.burst_size, image_pool=args.image_pool,
                       max_tokens=args.long_max_tokens, long_fraction=1.0, long_prompt_words=args.long_words,
                       seed=seed, check_answers=False, timeout_s=args.timeout, progress=False)


async def _scenario(args: argparse.Namespace, base: str, scenario: str) -> tuple[list, list, float]:
    start = time.perf_counter()

    async def burst(at_s: float, seed: int) -> list[RequestRecord]:
        await asyncio.sleep(at_s)
        offset = time.perf_counter() - start
        _, records = await arun_bench(long_config(args, base, seed))
        for r in records:
            r.start_s += offset
        return records

    tasks = [arun_bench(short_config(args, base, scenario, args.seed))]
    if scenario == "mixed":
        tasks += [burst(at, args.seed + 100 + i) for i, at in enumerate(args.burst_at_list)]
    results = await asyncio.gather(*tasks)
    short = results[0].records
    long = [r for group in results[1:] for r in group]
    return short, long, time.perf_counter() - start


def run_scenario(args: argparse.Namespace, stack: Stack, scenario: str) -> ScenarioRun:
    before = scrape_counters(stack.base)
    short, long, duration = asyncio.run(_scenario(args, stack.base, scenario))
    placements = counter_delta(before, scrape_counters(stack.base), "epd:placement_total")
    return ScenarioRun(short, long, duration, placements)


def warm_up(args: argparse.Namespace, stack: Stack) -> None:
    """Calibrate the gateway's cost model (short and long prompts, batches) before measuring."""
    base = dict(base=stack.base, model="bench", check_answers=False, timeout_s=args.timeout, progress=False,
                image_pool=args.image_pool, seed=args.seed + 900)
    asyncio.run(arun_bench(BenchConfig(requests=6, concurrency=3, max_tokens=8, **base)))
    if args.warmup_long:
        asyncio.run(arun_bench(BenchConfig(requests=1, max_tokens=4, long_fraction=1.0,
                                           long_prompt_words=args.long_words, **base)))
        asyncio.run(arun_bench(BenchConfig(requests=4, concurrency=2, max_tokens=8, **base)))


def probe_breakdown(args: argparse.Namespace, base: str) -> dict[str, float]:
    """``--probe`` short chats one at a time, non-streaming with ``max_tokens`` 1 (so the
    reply time is the TTFT): mean reply time and mean of each ``x-epd-ttft-breakdown`` entry."""
    sums: dict[str, float] = {}
    n = 0
    workload = build_workload(args.probe, args.image_pool, args.seed)  # the short chats' images: cached
    with httpx.Client(trust_env=False, timeout=args.timeout) as client:
        for spec in workload.requests:
            body = chat_body(spec, "bench", 1)
            body["stream"] = False
            body.pop("stream_options", None)
            t0 = time.perf_counter()
            try:
                response = client.post(f"{base}/v1/chat/completions", json=body)
            except httpx.HTTPError:
                continue
            elapsed_ms = (time.perf_counter() - t0) * 1e3
            if response.status_code != 200:
                continue
            try:
                entries = json.loads(response.headers.get(TTFT_BREAKDOWN_HEADER) or "{}")
            except ValueError:
                entries = {}
            n += 1
            sums["reply_ms"] = sums.get("reply_ms", 0.0) + elapsed_ms
            for key, value in entries.items():
                if isinstance(value, (int, float)):
                    sums[key] = sums.get(key, 0.0) + float(value)
    return {k: v / n for k, v in sorted(sums.items())} if n else {}
