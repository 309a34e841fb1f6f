"""The simulator's prediction for a real run, next to what the bench measures, in one run.

    python -m bench.sim_vs_real [--placements disaggregated,colocated] [--requests 300] [--loads 0.3,0.5]

For each placement:

1. start ``epd serve --placement P`` on the demo model (1 encoder, 1 decode, and 1 prefill
   worker unless colocated, which gets none: the simulator's colocated pool is the decode
   workers);
2. ``epd profile`` against it: the service-time file ``simulate``/``plan`` read;
3. idle probe: ``--idle-requests`` requests one at a time (fresh images), for the fixed
   per-request cost the simulator does not model (below); one non-streaming request
   reads the prompt's token count from ``usage.prompt_tokens``;
4. capacity: closed loop, 16 in flight, fresh images; then, for each of ``--loads``,
   ``--requests`` Poisson arrivals at that fraction of capacity from an image pool of
   ``--image-pool`` (the stack's CPU seconds by role are read around each load);
5. simulate the same run: the profiled service times, the same placement and worker
   counts, the load's own send times, prompt tokens, decode steps and encoder-cache hits
   (trace replay); also a plain Poisson run at the same rate, mix and pool-implied hit
   ratio (``sim_poisson``), to show the arrival draw's share of the difference;
6. print predicted vs measured (TTFT p50/p90, ITL p50, E2E p50) and write
   ``bench/results/sim_vs_real.json``.

Each placement's measured run (its service-time file, every request's record, the host's load)
is saved as ``run-PLACEMENT.json`` in the printed logs folder; ``--replay LOGDIR`` runs step 5
and 6 again on those runs, without a stack, so a change to the simulator is judged on the same
measurements (on this shared box two runs of one load differ by more than the target).

Mapping of the real run onto the simulator's request shape, stated once:

- prompt tokens: ``usage.prompt_tokens`` (image tokens included, so ``image_tokens=0``);
- output tokens: the tokens the model sampled, the EOS included when the answer stopped
  before ``max_tokens`` (the EOS step holds the batch like any other; the client never
  sees it as a token);
- cache hits: per request, ``images_cache_hit`` of epd's TTFT breakdown;
- the host: ``epd profile`` records this machine's core count (``host_cores``), the gateway's
  CPU per request (``gateway_request_ms`` before the pipeline, ``gateway_finish_ms`` after it)
  and what each worker spends per request beyond its timed compute (``encode_request_ms``,
  ``prefill_request_ms``, ``decode_request_ms``), so the simulator runs the gateway as a
  stage and every stage's work shares the host's cores, as here (``sim/shared_host.py``). The
  other work on the host during each load (its busy cores from ``/proc/stat`` less the
  stack's CPU; the load generator is part of it) is that load's ``host_background_cores``.
  ``sim_own_cores`` is the same run with a processor per worker (``host_cores = 0``), to show
  what sharing adds;
- fixed per-request term: the latency that is no stage's work (HTTP and SSE, the RPC and
  thread hand-offs between the processes). It is measured on the idle stack in the same run:
  idle client TTFT p50 minus the simulated TTFT p50 of those same idle requests. The prediction
  runs it as the simulator's ``hop_ms``: a wait as each request arrives that, on the shared
  host, stretches as the cores fill (each hand-off needs a core) but adds no work. The raw
  prediction (stages only, no term) is printed next to it. ITL gets no term.

The CPU each role used during a load, the load average and the TTFT growth from idle (split
into the modelled stages and the gateway/HTTP rest) are recorded to tell the parts apart.

A measurement, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.harness.servers import ROOT, Process, StartError, epd_serve, free_port, wait_http
from bench.harness.usage import cpu_seconds
from bench.loadgen import BenchConfig, arun_bench
from bench.record import RequestRecord
from bench.workload import QUESTION, make_image_pool, make_messages
from gateway.settings import GatewaySettings
from runtime.policy import service_times as st
from runtime.policy.cost_model import CostModel
from runtime.policy.service_times import ServiceTimes
from sim.config import SimConfig
from sim.distributions import fixed, parse_distribution
from sim.metrics import HIST_PER_MS, hist_percentile, percentile
from bench.profile_cli import busy_cores, host_busy, profile
from sim.report import summarize as sim_summary
from sim.simulator import Simulator
from sim.workload import Arrival, RequestMix, Workload

RESULTS = ROOT / "bench" / "results"
TARGET = 0.25  # |predicted / measured - 1| allowed
METRICS = ("ttft_ms_p50", "ttft_ms_p90", "itl_ms_p50", "tpot_ms_p50", "e2e_ms_p50")
CAPACITY_CONCURRENCY = 16


# ---------------------------------------------------------------- measured -> simulator


def sampled_tokens(completion_tokens: int, max_tokens: int) -> int:
    """Decode work of one answer: its tokens, plus the EOS step when it stopped early."""
    return completion_tokens + (1 if completion_tokens < max_tokens else 0)


def cache_hits(record: RequestRecord, seen_before: bool) -> int:
    """Images the encoder cache already held, from epd's breakdown (else: was the image sent before)."""
    breakdown = json.loads(record.ttft_breakdown) if record.ttft_breakdown else {}
    hit = breakdown.get("images_cache_hit")
    return int(hit) if hit is not None else int(seen_before)


def trace_from_records(records: list[RequestRecord], prompt_tokens: int, max_tokens: int) -> tuple[Arrival, ...]:
    """The answered requests as simulator arrivals, at their real send times (one image each)."""
    rows, seen = [], set()
    for r in sorted(records, key=lambda r: r.start_s):
        if r.ok:
            rows.append((r.start_s * 1000.0, prompt_tokens, sampled_tokens(r.output_tokens, max_tokens), 1,
                         cache_hits(r, r.image_index in seen)))
        seen.add(r.image_index)
    return tuple(rows)


def sim_config(placement: str, service: ServiceTimes) -> SimConfig:
    """The simulator set up as ``epd serve`` runs by default: 1 encoder, 1 decode and (unless
    colocated, where the decode worker prefills) 1 prefill worker; the gateway's default SLOs;
    KV sent chunk by chunk and colocated prompts prefilled in chunks of ``prefill_chunk_tokens``."""
    gw = GatewaySettings.model_construct()  # the defaults, without reading EPD_* from this environment
    return SimConfig(
        placement=placement, encoder_workers=1, decode_workers=1, prefill_workers=0 if placement == "colocated" else 1,
        transfer="chunked", chunk_tokens=gw.prefill_chunk_tokens, chunked_prefill=True,
        local_chunk_tokens=gw.prefill_chunk_tokens,
        link_concurrency=0,  # each transfer has its own stream; they share the loopback
        ttft_slo_ms=gw.ttft_slo_ms, itl_slo_ms=gw.itl_slo_ms, service=service,
    )


def poisson_workload(rate: float, requests: int, prompt_tokens: int, outputs: list[int], hit_ratio: float,
                     seed: int) -> Workload:
    """Poisson at ``rate`` with the measured output-token mix and a pool-implied cache hit ratio."""
    counts = Counter(outputs)
    spec = "mix:" + ",".join(f"{v}@{n}" for v, n in sorted(counts.items()))
    mix = RequestMix(prompt_tokens=fixed(prompt_tokens), output_tokens=parse_distribution(spec),
                     images=fixed(1, minimum=0), image_tokens=0, cache_hit_ratio=hit_ratio)
    return Workload(mix, rate=rate, requests=requests, seed=seed)


class _E2ESimulator(Simulator):
    """The simulator, also keeping each request's TTFT and arrival-to-last-step time with
    whether it missed the encoder cache (which decides the terms ``simulate_run`` adds)."""

    def __init__(self, config: SimConfig) -> None:
        super().__init__(config)
        self.ttft_rows: list[tuple[float, bool]] = []
        self.e2e_rows: list[tuple[float, bool]] = []
        self.tpot: list[float] = []

    def first_token(self, req: Any, t: float) -> None:
        super().first_token(req, t)
        self.ttft_rows.append((t - req.arrival, req.cached < req.images))

    def finished(self, req: Any, now: float, worker: Any) -> None:
        self.e2e_rows.append((now - req.arrival, req.cached < req.images))
        if req.output > 1:
            self.tpot.append((now - req.t_first) / (req.output - 1))
        super().finished(req, now, worker)


def with_terms(rows: list[tuple[float, bool]], fixed_ms: float, miss_ms: float) -> list[float]:
    """Each simulated time plus the fixed term, plus the miss term when the request missed the cache (sorted)."""
    return sorted(ms + fixed_ms + (miss_ms if missed else 0.0) for ms, missed in rows)


def simulate_run(config: SimConfig, workload: Workload, fixed_ms: float = 0.0, miss_ms: float = 0.0) -> dict[str, Any]:
    """TTFT p50/p90, ITL p50 and E2E p50 of one simulated run, with the per-request terms added
    to TTFT and E2E (ITL gets none)."""
    sim = _E2ESimulator(config)
    result = sim.run(workload)
    report = sim_summary(result, series=False)
    ttft, e2e = with_terms(sim.ttft_rows, fixed_ms, miss_ms), with_terms(sim.e2e_rows, fixed_ms, miss_ms)
    split = {kind: with_terms([r for r in sim.ttft_rows if r[1] == (kind == "miss")], fixed_ms, miss_ms)
             for kind in ("hit", "miss")}
    stack_ms = sim.cpu.work_ms if sim.cpu is not None else None
    return {
        "stack_cpu_ms_per_request": stack_ms / result.metrics.completed if stack_ms and result.metrics.completed else None,
        "ttft_ms_p50_by_cache": {k: percentile(v, 50) if v else None for k, v in split.items()},
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p90": percentile(ttft, 90),
        "itl_ms_p50": report["itl_ms_p50"], "tpot_ms_p50": percentile(sorted(sim.tpot), 50) if sim.tpot else None,
        "e2e_ms_p50": percentile(e2e, 50),
        "completed": report["completed"], "stage_wait_ms": report["stage_wait_ms"],
        "idle_fraction": report["idle_fraction"],
    }


def measured_metrics(records: list[RequestRecord], max_tokens: int) -> dict[str, float | None]:
    """Client-side figures, with the simulator's own percentile rules (ITL: nearest rank of every gap).

    ITL is the gap between content chunks as the client reads them: tokens that reach it
    together (the first one is held back by the response's start) make near-zero gaps, 30% of
    them under 2 ms even at idle here. TPOT, each request's ``(E2E - TTFT) / (sampled - 1)``
    (the EOS step included, as the stream ends after it), is the decode cadence that
    coalescing cannot move; the simulator computes it the same way.
    """
    ok = [r for r in records if r.ok]
    ttft = sorted(r.ttft_s * 1000 for r in ok if r.ttft_s is not None)
    gaps = Counter(int(g * 1000 * HIST_PER_MS + 0.5) for r in ok for g in r.itl_s)
    timed = [(r, sampled_tokens(r.output_tokens, max_tokens)) for r in ok if r.e2e_s is not None and r.ttft_s is not None]
    tpot = sorted((r.e2e_s - r.ttft_s) * 1000 / (n - 1) for r, n in timed if n > 1)  # type: ignore[operator]
    return {
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p90": percentile(ttft, 90),
        "itl_ms_p50": hist_percentile(dict(gaps), 50) if gaps else None,
        "tpot_ms_p50": percentile(tpot, 50) if tpot else None,
        "e2e_ms_p50": percentile(sorted(r.e2e_s * 1000 for r in ok if r.e2e_s is not None), 50),
    }


def ttft_p50_by_cache(records: list[RequestRecord]) -> dict[str, float | None]:
    """Client TTFT p50 of the answered requests that hit the encoder cache, and of those that missed."""
    split: dict[str, list[float]] = {"hit": [], "miss": []}
    for r in records:
        if r.ok and r.ttft_s is not None and r.ttft_breakdown:
            split["hit" if cache_hits(r, False) else "miss"].append(r.ttft_s * 1000)
    return {k: percentile(sorted(v), 50) if v else None for k, v in split.items()}


def drift(records: list[RequestRecord]) -> float | None:
    """TTFT p50 of the last third of the sends over that of the first third: far above 1, the
    queue grew through the run (the stack was past its capacity at this rate)."""
    ttft = [r.ttft_s for r in sorted(records, key=lambda r: r.start_s) if r.ok and r.ttft_s is not None]
    third = len(ttft) // 3
    if third < 2:
        return None
    return percentile(sorted(ttft[-third:]), 50) / percentile(sorted(ttft[:third]), 50)


def breakdown_p50(records: list[RequestRecord]) -> dict[str, float]:
    """Median of each ``*_ms`` stage of epd's TTFT breakdown; of encode + pipeline (the stages the
    simulator models, as the gateway times them); and of client TTFT less those (gateway and HTTP)."""
    stages: dict[str, list[float]] = {}
    for r in records:
        if not (r.ok and r.ttft_breakdown):
            continue
        b = json.loads(r.ttft_breakdown)
        for k, v in b.items():
            if k.endswith("_ms"):
                stages.setdefault(k, []).append(v)
        if r.ttft_s is not None and "pipeline_ms" in b:
            worker_side = b.get("encode_ms", 0.0) + b["pipeline_ms"]
            stages.setdefault("encode_plus_pipeline_ms", []).append(worker_side)
            stages.setdefault("client_minus_stages_ms", []).append(r.ttft_s * 1000 - worker_side)
    return {k: round(percentile(sorted(v), 50), 3) for k, v in sorted(stages.items())}


def growth(idle: dict[str, Any], measured: dict[str, Any], stages: dict[str, float],
           raw: dict[str, Any]) -> dict[str, float | None]:
    """How TTFT p50 grew from the idle probe to the load: measured (split by the breakdown's
    medians into the modelled stages and the gateway/HTTP rest) and simulated."""
    base = idle["breakdown_p50"]

    def delta(key: str) -> float | None:
        return stages[key] - base[key] if key in stages and key in base else None

    return {"measured": measured["ttft_ms_p50"] - idle["measured"]["ttft_ms_p50"],
            "measured_encode_plus_pipeline": delta("encode_plus_pipeline_ms"),
            "measured_gateway_http": delta("client_minus_stages_ms"),
            "simulated": raw["ttft_ms_p50"] - idle["sim"]["ttft_ms_p50"]}


def ratios(predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, float | None]:
    return {k: (predicted[k] / measured[k] if predicted.get(k) is not None and measured.get(k) else None)
            for k in METRICS}


# ---------------------------------------------------------------- the real stack


async def prompt_token_count(base: str, seed: int) -> int:
    """``usage.prompt_tokens`` of one bench-shaped request (an image and the question)."""
    image = make_image_pool(1, seed)[0]
    body = {"messages": make_messages(image, QUESTION), "max_tokens": 1, "temperature": 0.0}
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        body["model"] = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        r = await client.post(f"{base}/v1/chat/completions", json=body)
        r.raise_for_status()
        return int(r.json()["usage"]["prompt_tokens"])


async def bench(base: str, **config: Any) -> tuple[dict[str, Any], list[RequestRecord]]:
    return await arun_bench(BenchConfig(base=base, progress=False, **config))


def measure(placement: str, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """Steps 1-4 for one placement: the run, as ``predict`` reads it (also saved under ``logs``
    for ``--replay``); the stack is stopped before this returns."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    prefills = 0 if placement == "colocated" else 1
    server = epd_serve(args.model, port, logs / placement, "epd", ["--placement", placement, "--prefills", str(prefills)])
    server.start()
    try:
        wait_http(f"{base}/health", [server])
        run = asyncio.run(_measure_async(placement, args, base, server, logs / f"service-times-{placement}.json"))
    finally:
        server.stop()
    (logs / f"run-{placement}.json").write_text(json.dumps(run) + "\n")
    return run


async def _measure_async(placement: str, args: argparse.Namespace, base: str, server: Process,
                         out_file: Path) -> dict[str, Any]:
    mt = args.max_tokens
    await bench(base, requests=16, concurrency=4, image_pool=16, max_tokens=mt, seed=args.seed + 100)  # warm-up
    st.save(out_file, await profile(base, [0, 100, 400, 1000], [1, 4, 8], 2))
    prompt = await prompt_token_count(base, args.seed + 200)
    _, idle = await bench(base, requests=args.idle_requests, concurrency=1, image_pool=args.idle_requests,
                          max_tokens=mt, seed=args.seed + 300)
    cap, _ = await bench(base, requests=160, concurrency=CAPACITY_CONCURRENCY, image_pool=160, max_tokens=mt,
                         seed=args.seed + 400)
    loads = {}
    for i, load in enumerate(args.load_list):  # a seed per load: its own images, none cached before
        loads[str(load)] = await _load_point(args, base, server, load * cap["req_per_s"], args.seed + i)
    return {
        "placement": placement, "max_tokens": mt, "image_pool": args.image_pool,
        "service_times_file": str(out_file), "service_times_content": st.load(out_file).to_dict(),
        "prompt_tokens": prompt, "capacity_req_per_s": cap["req_per_s"],
        "idle_records": [r.to_json() for r in idle], "loads": loads,
    }


async def _load_point(args: argparse.Namespace, base: str, server: Process, rate: float, seed: int) -> dict[str, Any]:
    """One Poisson load on the stack: its records and what the host did meanwhile."""
    n = args.requests
    load_before, cpu_before, client_before = os.getloadavg()[0], cpu_seconds(server), time.process_time()
    host_before, wall = host_busy(), time.monotonic()
    report, records = await bench(base, requests=n, rate=rate, image_pool=args.image_pool, max_tokens=args.max_tokens,
                                  seed=seed)
    wall, host_after = time.monotonic() - wall, host_busy()
    cpu = {k: v - cpu_before.get(k, 0.0) for k, v in cpu_seconds(server).items()}
    stack_cores = sum(cpu.values()) / wall
    cpu["load_generator"] = time.process_time() - client_before
    # the host's other work during this load (the load generator included): its busy cores less the stack's
    background = max(0.0, busy_cores(os.cpu_count() or 1, host_before, host_after) - stack_cores)
    return {
        "rate_req_per_s": rate, "seed": seed, "records": [r.to_json() for r in records],
        "report": {k: report[k] for k in ("ok", "duration_s", "failed_by_status", "answers_correct")},
        "cpu_cores_used": {k: round(v / report["duration_s"], 3) for k, v in sorted(cpu.items())},
        "host_background_cores": round(background, 3),
        "loadavg_1m_before_after": [load_before, os.getloadavg()[0]],
    }


def records_from(rows: list[dict[str, Any]]) -> list[RequestRecord]:
    return [RequestRecord(**row) for row in rows]


def predict(run: dict[str, Any]) -> dict[str, Any]:
    """Step 5 for one measured run: the simulator's prediction of each load, next to the measurement."""
    placement, mt, prompt = run["placement"], run["max_tokens"], run["prompt_tokens"]
    content = st.parse(run["service_times_content"])
    service = CostModel.from_tables(content.params, content.tables).service_times()  # as ``epd simulate`` reads it
    config = sim_config(placement, service)
    idle = records_from(run["idle_records"])
    idle_measured = measured_metrics(idle, mt)
    idle_trace = Workload(trace=trace_from_records(idle, prompt, mt))  # fresh images: every request a miss
    idle_sim = simulate_run(config, idle_trace)
    idle_stages = breakdown_p50(idle)
    # what a miss costs the real request beyond the simulated encode (batching window, RPC, cache write)
    miss_ms = max(0.0, idle_stages.get("encode_ms", 0.0) - CostModel(service).encode_ms(1) - service.encode_request_ms)
    fixed_ms = idle_measured["ttft_ms_p50"] - idle_sim["ttft_ms_p50"] - miss_ms
    idle_doc = {"measured": idle_measured, "sim": idle_sim, "breakdown_p50": idle_stages}
    points = {load: _predict_load(point, run, config, idle_doc, fixed_ms, miss_ms) for load, point in run["loads"].items()}
    idle_doc["predicted"] = _predict(config, idle_trace, fixed_ms, miss_ms)
    return {
        "placement": placement, "service_times_file": run["service_times_file"], "service_times": service.to_dict(),
        "profile_tables": content.tables.to_dict(),
        "prompt_tokens": prompt, "capacity_req_per_s": run["capacity_req_per_s"],
        "idle": idle_doc, "fixed_term_ms": fixed_ms, "miss_term_ms": miss_ms, "loads": points,
    }


def _predict(config: SimConfig, workload: Workload, fixed_ms: float, miss_ms: float) -> dict[str, Any]:
    """``simulate_run`` with the fixed term as the simulator's ``hop_ms`` (hand-offs that wait for
    the host's cores); a negative one (the stages alone already over-predict the idle run) stays
    a constant term."""
    hops = max(0.0, fixed_ms)
    return simulate_run(config.with_(service=config.service.replace(hop_ms=hops)), workload, fixed_ms - hops, miss_ms)


def _predict_load(point: dict[str, Any], run: dict[str, Any], config: SimConfig, idle: dict[str, Any],
                  fixed_ms: float, miss_ms: float) -> dict[str, Any]:
    mt, prompt, pool = run["max_tokens"], run["prompt_tokens"], run["image_pool"]
    records = records_from(point["records"])
    n, rate = len(records), point["rate_req_per_s"]
    if config.service.host_cores:
        config = config.with_(service=config.service.replace(host_background_cores=point["host_background_cores"]))
    measured = measured_metrics(records, mt)
    trace = Workload(trace=trace_from_records(records, prompt, mt))
    raw = simulate_run(config, trace)
    # the stack's CPU per request, measured and as the simulator charges it (on a shared host)
    measured_cpu = sum(v for k, v in point["cpu_cores_used"].items() if k != "load_generator") \
        * point["report"]["duration_s"] * 1000.0 / max(n, 1)
    predicted = _predict(config, trace, fixed_ms, miss_ms)
    own_cores = _predict(config.with_(service=config.service.replace(host_cores=0)), trace, fixed_ms, miss_ms)
    outputs = [sampled_tokens(r.output_tokens, mt) for r in records if r.ok]
    pool_hit_ratio = 1.0 - min(pool, n) / n
    poisson = _predict(config, poisson_workload(rate, n, prompt, outputs, pool_hit_ratio, point["seed"]), fixed_ms,
                       miss_ms)
    hits = [cache_hits(r, False) for r in records if r.ok and r.ttft_breakdown]
    stages = breakdown_p50(records)
    ratio = ratios(predicted, measured)
    return {
        "rate_req_per_s": rate, "requests": n, **point["report"],
        "sampled_tokens_mix": dict(Counter(outputs)), "image_pool": pool,
        "cache_hit_ratio_pool": pool_hit_ratio, "cache_hit_ratio_measured": sum(hits) / len(hits) if hits else None,
        "measured": measured, "measured_ttft_ms_p50_by_cache": ttft_p50_by_cache(records),
        "measured_breakdown_p50": stages, "ttft_p50_last_over_first_third": drift(records),
        "ttft_p50_growth_from_idle_ms": growth(idle, measured, stages, raw),
        "sim_raw": raw, "predicted": predicted, "ratio": ratio,
        "within_target": {k: within(v) for k, v in ratio.items()}, "ratio_raw": ratios(raw, measured),
        "sim_poisson": poisson, "ratio_poisson": ratios(poisson, measured),
        "sim_own_cores": own_cores, "ratio_own_cores": ratios(own_cores, measured),
        "cpu_cores_used": point["cpu_cores_used"], "host_background_cores": point["host_background_cores"],
        "stack_cpu_ms_per_request": {"measured": measured_cpu, "simulated": raw["stack_cpu_ms_per_request"]},
        "loadavg_1m_before_after": point["loadavg_1m_before_after"],
    }


# ---------------------------------------------------------------- report


def within(ratio: float | None) -> bool:
    return ratio is not None and abs(ratio - 1.0) <= TARGET


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(result: dict[str, Any]) -> str:
    idle = result["idle"]
    lines = [
        f"[{result['placement']}] prompt {result['prompt_tokens']} tokens; closed-loop capacity "
        f"{result['capacity_req_per_s']:.1f} req/s; host cores {result['service_times']['host_cores']}, gateway "
        f"{result['service_times']['gateway_request_ms']:.1f} + {result['service_times']['gateway_finish_ms']:.1f} ms/request, "
        f"encoder {result['service_times']['encode_request_ms']:.1f}, prefill "
        f"{result['service_times']['prefill_request_ms']:.1f} and decode {result['service_times']['decode_request_ms']:.1f} "
        f"ms/request beyond their timed work",
        f"  terms: miss {result['miss_term_ms']:.1f} ms = idle encode p50 (breakdown) - simulated encode of a miss; fixed "
        f"{result['fixed_term_ms']:.1f} ms = idle TTFT p50 {idle['measured']['ttft_ms_p50']:.1f} - simulated idle TTFT p50 "
        f"{idle['sim']['ttft_ms_p50']:.1f} - miss term (idle breakdown: client TTFT - encode - pipeline = "
        f"{_f(idle['breakdown_p50'].get('client_minus_stages_ms'))} ms)",
    ]
    for load, point in result["loads"].items():
        cores = point["cpu_cores_used"]
        lines += [
            f"  load {float(load):.2f} x capacity = {point['rate_req_per_s']:.1f} req/s: {point['ok']}/{point['requests']} ok, "
            f"sampled tokens {point['sampled_tokens_mix']}, cache hits {_f(point['cache_hit_ratio_measured'], 2)} "
            f"(pool implies {_f(point['cache_hit_ratio_pool'], 2)}), load avg {point['loadavg_1m_before_after'][0]:.1f}"
            f" -> {point['loadavg_1m_before_after'][1]:.1f}; TTFT p50 last/first third of the run "
            f"{_f(point['ttft_p50_last_over_first_third'], 2)}"
            + (" (the queue grew: past capacity)" if (point["ttft_p50_last_over_first_third"] or 0) > 2 else ""),
            "  CPU cores used: " + ", ".join(f"{k} {v:.2f}" for k, v in cores.items() if v >= 0.005)
            + f" (total {sum(cores.values()):.2f} of {os.cpu_count()}); host busy with other work (load generator "
            f"included) {point['host_background_cores']:.2f} cores: the simulated host's background for this load; "
            f"stack CPU per request measured {_f(point['stack_cpu_ms_per_request']['measured'])} ms, simulated "
            f"{_f(point['stack_cpu_ms_per_request']['simulated'])} ms",
            f"  {'metric':<12}{'measured':>10}{'predicted':>11}{'ratio':>7}{'<=25%':>7}{'sim raw':>10}{'ratio':>7}"
            f"{'poisson':>10}{'ratio':>7}{'own cores':>10}{'ratio':>7}",
        ]
        for k in METRICS:
            ratio = point["ratio"][k]
            lines.append(
                f"  {k:<12}{_f(point['measured'][k]):>10}{_f(point['predicted'][k]):>11}{_f(ratio, 2):>7}"
                f"{('yes' if within(ratio) else 'no'):>7}{_f(point['sim_raw'][k]):>10}{_f(point['ratio_raw'][k], 2):>7}"
                f"{_f(point['sim_poisson'][k]):>10}{_f(point['ratio_poisson'][k], 2):>7}"
                f"{_f(point['sim_own_cores'][k]):>10}{_f(point['ratio_own_cores'][k], 2):>7}")
        hm, hp = point["measured_ttft_ms_p50_by_cache"], point["predicted"]["ttft_ms_p50_by_cache"]
        lines.append(f"  TTFT p50 of cache hits / misses: measured {_f(hm['hit'])} / {_f(hm['miss'])} ms, predicted "
                     f"{_f(hp['hit'])} / {_f(hp['miss'])} ms")
        g = point["ttft_p50_growth_from_idle_ms"]
        lines.append(f"  TTFT p50 growth from idle: measured {_f(g['measured'])} ms (medians: encode + pipeline "
                     f"{_f(g['measured_encode_plus_pipeline'])}, gateway/HTTP {_f(g['measured_gateway_http'])}); "
                     f"simulated {_f(g['simulated'])} ms")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.sim_vs_real", description=__doc__.splitlines()[0])
    p.add_argument("--placements", default="disaggregated,colocated")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--loads", default="0.3,0.5", help="offered rates as fractions of closed-loop capacity (comma-separated)")
    p.add_argument("--image-pool", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--idle-requests", type=int, default=30)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--model", type=Path, default=ROOT / "models" / "demo-vlm")
    p.add_argument("--out", type=Path, default=RESULTS / "sim_vs_real.json")
    p.add_argument("--replay", type=Path, metavar="LOGDIR",
                   help="simulate again the runs an earlier invocation saved in LOGDIR (its printed logs folder)")
    args = p.parse_args(argv)
    args.placement_list = [s.strip() for s in args.placements.split(",") if s.strip()]
    bad = [s for s in args.placement_list if s not in ("disaggregated", "colocated", "conditional")]
    if bad or not args.placement_list:
        p.error(f"--placements: unknown {bad or args.placements!r}")
    try:
        args.load_list = [float(x) for x in args.loads.split(",") if x.strip()]
    except ValueError:
        p.error("--loads takes comma-separated numbers")
    if args.requests < 2 or args.idle_requests < 2 or not args.load_list or not all(0 < x < 1 for x in args.load_list):
        p.error("need --requests >= 2, --idle-requests >= 2 and every load in (0, 1)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs = args.replay or Path(tempfile.mkdtemp(prefix="epd-sim-vs-real-"))
    started, t0, load_start = time.strftime("%Y-%m-%dT%H:%M:%S"), time.monotonic(), os.getloadavg()
    results = []
    if args.replay:  # the saved runs of an earlier invocation, simulated again (no stack started)
        logs = args.replay
        runs = [json.loads(path.read_text()) for path in sorted(logs.glob("run-*.json"))]
        if not runs:
            print(f"sim_vs_real: no run-*.json in {logs}", file=sys.stderr)
            return 1
    else:
        runs = []
        for placement in args.placement_list:
            try:
                runs.append(measure(placement, args, logs))
            except StartError as exc:
                print(f"sim_vs_real: {placement}: {exc}", file=sys.stderr)
                return 1
    for run in runs:
        result = predict(run)
        print(table(result) + "\n", flush=True)
        results.append(result)
    met = all(within(point["ratio"][k]) for res in results for point in res["loads"].values() for k in METRICS)
    doc = {
        "command": "python -m bench.sim_vs_real " + " ".join(sys.argv[1:] if argv is None else argv),
        "started": started, "wall_s": round(time.monotonic() - t0, 1), "cpus": os.cpu_count(),
        "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
        "target": f"|predicted / measured - 1| <= {TARGET}", "target_met": met, "logs": str(logs),
        "results": {res["placement"]: res for res in results},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"target (every metric within {TARGET:.0%}): {'met' if met else 'not met'}; wrote {args.out} "
          f"in {doc['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
