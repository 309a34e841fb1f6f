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

- prompt tokens: ``usage.prompt_tokens`` (image tokens included), and the image's placeholder tokens
  (the unit an encode is priced in) as what the question alone lacks;
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
from pathlib import Path
from typing import Any

import httpx

from bench.harness.servers import ROOT, Process, StartError, epd_serve, free_port, wait_http
from bench.harness.usage import cpu_seconds
from bench.loadgen import BenchConfig, arun_bench
from bench.record import RequestRecord
from bench.sim_prediction import (  # noqa: F401  (the names tests and callers import from here)
    TARGET, METRICS, sampled_tokens, cache_hits, trace_from_records, sim_config, poisson_workload, with_terms, simulate_run, measured_metrics, ttft_p50_by_cache, drift, breakdown_p50, growth, ratios, records_from, predict, within)
from bench.workload import QUESTION, make_image_pool, make_messages
from runtime.policy import service_times as st
from bench.profile_cli import busy_cores, host_busy, profile

RESULTS = ROOT / "bench" / "results"
CAPACITY_CONCURRENCY = 16




async def prompt_token_count(base: str, seed: int) -> tuple[int, int]:
    """``usage.prompt_tokens`` of one bench-shaped request (an image and the question), and of them the
    image's placeholder tokens: what the same question without the image lacks (the demo family's
    template adds nothing around an image but its placeholders)."""
    image = make_image_pool(1, seed)[0]
    counts = []
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        for messages in (make_messages(image, QUESTION), [{"role": "user", "content": QUESTION}]):
            body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0.0}
            r = await client.post(f"{base}/v1/chat/completions", json=body)
            r.raise_for_status()
            counts.append(int(r.json()["usage"]["prompt_tokens"]))
    return counts[0], counts[0] - counts[1]


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
    prompt, image_tokens = await prompt_token_count(base, args.seed + 200)
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
        "prompt_tokens": prompt, "image_tokens": image_tokens, "capacity_req_per_s": cap["req_per_s"],
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
