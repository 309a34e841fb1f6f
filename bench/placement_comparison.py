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
import asyncio
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.compare_servers import (
    RESULTS,
    Proc,
    StartError,
    counter_delta,
    error_samples,
    fmt,
    free_port,
    host_info,
    markdown_table,
    plot_cdfs,
    ratio,
    scrape_counters,
    wait_http,
)
import httpx

from bench.client import TTFT_BREAKDOWN_HEADER, chat_body
from bench.loadgen import BenchConfig, arun_bench
from bench.metrics import meets_slo, percentile
from bench.record import RequestRecord
from bench.workload import build_workload

PLACEMENTS = ("colocated", "disaggregated", "conditional")
SCENARIOS = ("mixed", "low")
DEFAULT_MODEL = Path("/tmp/epd-bench-vlm")


# ---------------------------------------------------------------- topology


def topology(placement: str, cores: Sequence[int]) -> list[tuple[str, int]]:
    """(role, core) of each pinned model worker for a placement."""
    a, b = cores
    if placement == "colocated":
        return [("decode", a), ("decode", b)]
    if placement in ("disaggregated", "conditional"):
        return [("prefill", a), ("decode", b)]
    raise ValueError(f"unknown placement {placement!r}")


def worker_cmd(role: str, model: Path, port: int, cores: str | None, extra: Sequence[str] = ()) -> list[str]:
    pin = ["taskset", "-c", cores] if cores else []
    return [*pin, sys.executable, "-m", "launcher.cli", role, "--model", str(model.resolve()), "--host", "127.0.0.1",
            "--port", str(port), *extra]


@dataclass
class Stack:
    """The processes of one placement configuration."""

    placement: str
    procs: list[Proc]
    base: str

    def stop(self) -> None:
        gateway = [p for p in self.procs if p.name == "gateway"]
        for p in gateway + [p for p in self.procs if p.name != "gateway"]:
            p.stop()


def start_stack(args: argparse.Namespace, placement: str) -> Stack:
    from launcher.serve import _serving  # grpc health check; imports grpc only

    logs = args.logs / placement
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs: list[Proc] = []
    addrs: dict[str, list[str]] = {"encoder": [], "prefill": [], "decode": []}
    all_cores = ",".join(str(c) for c in args.core_list)
    workers = [("encoder", None), *topology(placement, args.core_list)]
    kv = ["--kv-memory-mb", str(args.kv_memory_mb)]
    ports = [free_port() for _ in workers]
    for (role, _), port in zip(workers, ports):
        addrs[role].append(f"127.0.0.1:{port}")
    # workers dial only the peers they are told about (runtime/peers.py)
    peers = ["--encoder-addrs", ",".join(addrs["encoder"])]
    if addrs["decode"]:
        peers += ["--decode-addrs", ",".join(addrs["decode"])]
    for i, ((role, core), port) in enumerate(zip(workers, ports)):
        extra = [*(kv if role == "decode" else []), *(peers if role != "encoder" else [])]
        cores = all_cores if core is None else str(core)
        procs.append(Proc(f"{role}@{cores}", worker_cmd(role, args.model, port, cores, extra),
                          logs / f"{i}-{role}-{port}.log", env).start())
    stack = Stack(placement, procs, "")
    try:
        end = time.monotonic() + 300
        for proc, (role, _) in zip(procs, workers):
            port = proc.cmd[proc.cmd.index("--port") + 1]
            while not _serving(f"127.0.0.1:{port}"):
                if not proc.alive() or time.monotonic() > end:
                    raise StartError(f"{proc.name} did not start:\n{proc.tail()}")
                time.sleep(0.3)
        gw_port = free_port()
        gw = [sys.executable, "-m", "launcher.cli", "gateway", "--model", str(args.model.resolve()),
              "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(gw_port),
              "--placement", placement, "--encoder-addrs", ",".join(addrs["encoder"]),
              "--decode-addrs", ",".join(addrs["decode"]),
              "--ttft-slo-ms", str(args.gateway_ttft_slo_ms), "--itl-slo-ms", str(args.itl_slo_ms)]
        if addrs["prefill"]:
            gw += ["--prefill-addrs", ",".join(addrs["prefill"])]
        gateway = Proc("gateway", ["taskset", "-c", all_cores, *gw], logs / f"gateway-{gw_port}.log", env).start()
        procs.append(gateway)
        stack.base = f"http://127.0.0.1:{gw_port}"
        wait_http(f"{stack.base}/health", procs)
    except BaseException:
        stack.stop()
        raise
    return stack


# ---------------------------------------------------------------- load


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


# ---------------------------------------------------------------- metrics


def _ms(values: Sequence[float]) -> list[float]:
    return [v * 1e3 for v in values]


def summarize_run(run: ScenarioRun, short_ttft_slo_ms: float, long_ttft_slo_ms: float,
                  itl_slo_ms: float) -> dict[str, Any]:
    """The comparison's metrics for one placement x scenario."""
    ok_s = [r for r in run.short if r.ok]
    ok_l = [r for r in run.long if r.ok]
    good = (sum(meets_slo(r, short_ttft_slo_ms, itl_slo_ms) for r in ok_s)
            + sum(meets_slo(r, long_ttft_slo_ms, itl_slo_ms) for r in ok_l))
    short_itl = _ms([g for r in ok_s for g in r.itl_s])
    all_itl = short_itl + _ms([g for r in ok_l for g in r.itl_s])
    short_ttft = _ms([r.ttft_s for r in ok_s if r.ttft_s is not None])
    long_ttft = _ms([r.ttft_s for r in ok_l if r.ttft_s is not None])
    requests = len(run.short) + len(run.long)
    return {
        "requests": requests,
        "ok": len(ok_s) + len(ok_l),
        "failed_by_status": _failures(run.short + run.long),
        "duration_s": run.duration_s,
        "good": good,
        "goodput_req_per_s": good / run.duration_s,
        "goodput_fraction": good / requests if requests else None,
        "short_ttft_ms_p50": percentile(short_ttft, 50),
        "short_ttft_ms_p99": percentile(short_ttft, 99),
        "short_itl_ms_p50": percentile(short_itl, 50),
        "short_itl_ms_p99": percentile(short_itl, 99),
        "short_itl_ms_max": max(short_itl) if short_itl else None,
        "itl_ms_p99": percentile(all_itl, 99),
        "long_ttft_ms_p50": percentile(long_ttft, 50),
        "long_ttft_ms_p99": percentile(long_ttft, 99),
        "placements": run.placements,
        "errors": error_samples(run.short + run.long),
    }


def _failures(records: Sequence[RequestRecord]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        if not r.ok:
            out[str(r.status)] = out.get(str(r.status), 0) + 1
    return out


def decisions(placements: Mapping[str, float]) -> str:
    """``colocated 12, disaggregated 4`` from ``epd:placement_total{placement=..,reason=..}`` deltas."""
    counts: dict[str, float] = {}
    for key, value in placements.items():
        label = key.split('placement="', 1)[1].split('"', 1)[0] if 'placement="' in key else key
        counts[label] = counts.get(label, 0.0) + value
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(counts.items())) or "-"


# (label, key, better)
TABLE_ROWS: tuple[tuple[str, str, str], ...] = (
    ("short ITL p99 (ms)", "short_itl_ms_p99", "lower"),
    ("short ITL max (ms)", "short_itl_ms_max", "lower"),
    ("short TTFT p50 (ms)", "short_ttft_ms_p50", "lower"),
    ("short TTFT p99 (ms)", "short_ttft_ms_p99", "lower"),
    ("long TTFT p99 (ms)", "long_ttft_ms_p99", "lower"),
    ("goodput (req/s)", "goodput_req_per_s", "higher"),
)


def scenario_rows(results: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    """One row per metric, one column per placement (in the order given), ``*`` on the best."""
    names = list(results)
    rows = []
    for label, key, better in TABLE_ROWS:
        values = {n: results[n].get(key) for n in names}
        present = [v for v in values.values() if v is not None]
        if not present:
            continue
        best = min(present) if better == "lower" else max(present)
        rows.append([label, *(fmt(values[n]) + (" *" if values[n] == best and len(present) > 1 else "")
                              for n in names)])
    rows.append(["good / requests", *(f"{results[n]['good']}/{results[n]['requests']}" for n in names)])
    rows.append(["placements chosen", *(decisions(results[n].get("placements", {})) for n in names)])
    return rows


PROBE_KEYS = ("reply_ms", "gateway_queue_ms", "encode_ms", "prefill_ms", "transfer_ms", "colocated_prefill_ms",
              "decode_wait_ms", "pipeline_ms")


def probe_rows(probes: Mapping[str, Mapping[str, float]]) -> list[list[str]]:
    """One row per placement: the mean breakdown entries (``-`` where a placement has none)."""
    return [[placement, *(fmt(entries.get(k)) for k in PROBE_KEYS)] for placement, entries in probes.items()]


def claims(results: Mapping[str, Mapping[str, Mapping[str, Any]]], tolerance: float = 0.2,
           probes: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, Any]:
    """The design chapter's claims checked on ``results[scenario][placement]``.

    ``tolerance``: "close to best" means within this fraction of the best value.
    ``probes`` (``probe_breakdown`` per placement): the idle case, one request at a time.
    """
    out: dict[str, Any] = {}
    probes = probes or {}
    if {"colocated", "disaggregated"} <= set(probes):
        col, dis = probes["colocated"].get("reply_ms"), probes["disaggregated"].get("reply_ms")
        out["idle_ttft_colocated_over_disaggregated"] = ratio(col, dis)
        out["idle_colocated_wins_ttft"] = col is not None and dis is not None and col < dis
        if "conditional" in probes and probes["conditional"].get("reply_ms") is not None and col and dis:
            mine = probes["conditional"]["reply_ms"]
            out["idle_conditional_best_or_close"] = mine <= min(col, dis) * (1 + tolerance)
    mixed, low = results.get("mixed", {}), results.get("low", {})

    def get(res: Mapping[str, Mapping[str, Any]], placement: str, key: str) -> float | None:
        return res.get(placement, {}).get(key)

    if {"colocated", "disaggregated"} <= set(mixed):
        col, dis = get(mixed, "colocated", "short_itl_ms_p99"), get(mixed, "disaggregated", "short_itl_ms_p99")
        out["mixed_itl_p99_colocated_over_disaggregated"] = ratio(col, dis)
        out["long_prompt_breaks_colocated_itl"] = col is not None and dis is not None and col > dis
    if {"colocated", "disaggregated"} <= set(low):
        col, dis = get(low, "colocated", "short_ttft_ms_p50"), get(low, "disaggregated", "short_ttft_ms_p50")
        out["low_ttft_p50_colocated_over_disaggregated"] = ratio(col, dis)
        out["low_load_colocated_wins_ttft"] = col is not None and dis is not None and col < dis
    if "conditional" in mixed or "conditional" in low:
        verdicts = {}
        for scen_name, res, key, better in (("mixed", mixed, "short_itl_ms_p99", "lower"),
                                            ("mixed", mixed, "goodput_req_per_s", "higher"),
                                            ("low", low, "short_ttft_ms_p50", "lower"),
                                            ("low", low, "goodput_req_per_s", "higher")):
            values = {p: get(res, p, key) for p in res}
            values = {p: v for p, v in values.items() if v is not None}
            if "conditional" not in values:
                continue
            best = min(values.values()) if better == "lower" else max(values.values())
            mine = values["conditional"]
            close = mine <= best * (1 + tolerance) if better == "lower" else mine >= best * (1 - tolerance)
            verdicts[f"{scen_name}:{key}"] = {"conditional": mine, "best": best, "best_or_close": close}
        out["conditional"] = verdicts
        out["conditional_best_or_close"] = all(v["best_or_close"] for v in verdicts.values()) if verdicts else None
    return out


# ---------------------------------------------------------------- main


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
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
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
    args.out.mkdir(parents=True, exist_ok=True)
    for scenario in args.scenario_list:
        print(f"\n## scenario {scenario}\n")
        print(markdown_table(["metric", *results[scenario]], scenario_rows(results[scenario])))
        plot_cdfs(records[scenario], args.out / f"{stem(args)}-{scenario}.png",
                  f"bench model, scenario {scenario}: TTFT (all requests) and ITL per placement")
    if probes:
        print("\n## TTFT breakdown, one short chat at a time (mean ms; x-epd-ttft-breakdown)\n")
        print(markdown_table(["placement", *PROBE_KEYS], probe_rows(probes)))
    print("\nclaims:", json.dumps(checked, indent=1))
    payload = {"benchmark": "placement_comparison", "started": started, "wall_s": time.monotonic() - t0,
               "command": "python -m bench.placement_comparison " + " ".join(argv if argv is not None else sys.argv[1:]),
               "host": {**host, "load_avg_end": host_info().get("load_avg")},
               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "results": results, "claims": checked, "probe_breakdown": probes,
               "tables": {s: scenario_rows(results[s]) for s in args.scenario_list}}
    path = args.out / f"{stem(args)}.json"
    path.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
    print(f"\nwritten: {path} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
