"""``compare_servers --peer vllm``: epd vs vLLM's CPU build on the issue's loads, side by side.

For each model the loads need, both servers are started from their own environments (vLLM
from the venv of ``bench/vllm_setup.sh``, on a converted copy of the checkpoint; see
``bench.harness.vllm_peer``), vLLM first and epd once vLLM serves (its engine binds a dozen ephemeral
ports as it starts: a port picked for epd before that could be taken), and warmed up; each load first runs once on each server unmeasured
(``--load-warmup``, its own images: on one host vLLM's first loaded demo-c16 round served 98-119
req/s against 127-151 in its second, and the worse-round ratios followed the order); then every
load runs ``--rounds`` times on each, one server under load at a time, alternating which goes
first (round ``r``'s seed is the same on both, so both see the same requests and images; every
round's images are new to epd's encoder cache). Each round starts on a quiet host: it waits until
both servers together use under 5% of a core (``quiet_wait_s``; vLLM's CPU engine spins a core for
about a second after its load ends, which took half the host from epd's demo rounds before this
wait). While one server is measured, the other's CPU seconds are read too (``idle_peer_cpu_s``): an
idle server that spins would tax the measured one.

``--blocks N`` splits every round into N blocks per server, the servers taking turns block by block
(the first server alternating, so a round runs A B B A A B ...; still one server under load at a
time, a quiet wait before each block, each block its own new images). A round's numbers pool its
blocks, so a slow stretch of the host lands on both servers rather than on one server's round.
Blocks suit the one-at-a-time loads: a closed loop of 16 ramps up and down at every block's ends.
So demo-c1 runs in 8 blocks unless ``--blocks`` says otherwise: in one piece, a round lasts ~5 s
per server and each server's TTFT p50 moved up to 36% between its own two rounds minutes apart (vLLM
16.9 then 12.4 ms), far more than the servers differ; in blocks, the same hour's rounds agreed
(bench/RESULTS.md, "demo-c1 in blocks"). Each block's own ratio is reported too (``block_targets``).

Reported per load, pooled over the rounds and per round, with ``vllm bench serve``'s
definitions (``bench.metrics``): requests/s, output tokens/s, TTFT, TPOT, ITL and E2E
percentiles, goodput under the load's stated SLOs (TTFT and worst gap), and the ratio
epd / vLLM of each. The issue's targets are judged on the WORSE of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.harness.report import fmt, markdown_table, ratio
from bench.harness.runs import Run, cpu_per_request, error_samples, pooled, run_load
from bench.harness.servers import epd_serve, free_port, wait_http
from bench.harness.usage import cpu_seconds, wait_quiet
from bench.harness.vllm_peer import vllm_serve
from launcher.processes import stop_group


@dataclass(frozen=True)
class Load:
    name: str
    model: str                 # demo | bench
    requests: int
    concurrency: int
    max_tokens: int
    ttft_slo_ms: float
    itl_slo_ms: float
    long_fraction: float = 0.0
    long_prompt_words: int = 400
    blocks: int = 1            # each round in this many blocks per server, taking turns (``--blocks`` overrides)
    # (metric key, "max" ratio or "min" ratio, bound): the target for this load
    targets: tuple[tuple[str, str, float], ...] = ()


# The demo rounds last a few seconds each (~2.5 s for demo-c16, ~5 s for demo-c1 on a 2-vCPU host): at
# 96 and 64 requests a round lasted about a second, and one server's rounds in a run differed by up
# to 20% (vLLM's demo-c1 TTFT p50 13.8 then 11.6 ms), more than the two servers differ.
LOADS: dict[str, Load] = {l.name: l for l in (
    Load("demo-c16", "demo", 384, 16, 16, 1000, 200, targets=(("req_per_s", "min", 1.0),)),
    Load("demo-c1", "demo", 256, 1, 16, 200, 50, blocks=8, targets=(("ttft_ms_p50", "max", 1.0),)),
    Load("bench-short", "bench", 48, 16, 32, 2000, 500,
         targets=(("req_per_s", "min", 1.0), ("itl_ms_p99", "max", 1.0))),
    Load("bench-long", "bench", 32, 16, 32, 20000, 2000, long_fraction=0.5, long_prompt_words=400,
         targets=(("ttft_ms_p50", "max", 0.5), ("itl_ms_p99", "max", 0.5), ("goodput_req_per_s", "min", 1.5))),
)}

ROWS = (("requests/s", "req_per_s"), ("output tokens/s", "output_tok_per_s"), ("goodput req/s", "goodput_req_per_s"),
        ("TTFT p50 (ms)", "ttft_ms_p50"), ("TTFT p90 (ms)", "ttft_ms_p90"), ("TTFT p99 (ms)", "ttft_ms_p99"),
        ("TPOT p50 (ms)", "tpot_ms_p50"), ("TPOT p99 (ms)", "tpot_ms_p99"),
        ("ITL p50 (ms)", "itl_ms_p50"), ("ITL p99 (ms)", "itl_ms_p99"),
        ("E2E p50 (ms)", "e2e_ms_p50"), ("E2E p99 (ms)", "e2e_ms_p99"))

SERVERS = ("vllm", "epd")
BLOCK_SEEDS = 10_000   # block seeds start here (round r, block b: + 100 r + b), apart from the rounds' and warm-ups'


def compare_vllm(args: argparse.Namespace) -> list[dict[str, Any]]:
    loads = [LOADS[n] for n in args.load_list]
    results = []
    for kind in dict.fromkeys(l.model for l in loads):
        results.extend(_model_loads(args, kind, [l for l in loads if l.model == kind]))
    return results


def _model_loads(args: argparse.Namespace, kind: str, loads: list[Load]) -> list[dict[str, Any]]:
    from bench.compare_servers import model_path, require_model

    path = model_path(args, kind)
    require_model(path, kind)
    v_port = free_port()
    procs = {"vllm": vllm_serve(path, v_port, args.logs, kind, args.vllm_threads)}
    bases = {"vllm": f"http://127.0.0.1:{v_port}"}
    out = []
    started = time.monotonic()
    try:
        # vLLM first: its engine binds a dozen ephemeral ports as it starts, and a port picked for
        # epd beforehand (gateway or worker) could be one of them
        procs["vllm"].start()
        wait_http(f"{bases['vllm']}/v1/models", [procs["vllm"]], timeout_s=600)
        e_port = free_port()
        procs["epd"] = epd_serve(path, e_port, args.logs, kind, args.epd_args.split())
        bases["epd"] = f"http://127.0.0.1:{e_port}"
        procs["epd"].start()
        wait_http(f"{bases['epd']}/health", [procs["epd"]])
        print(f"[{kind}] vllm and epd up after {time.monotonic() - started:.0f} s", file=sys.stderr)
        for name in SERVERS:
            if args.warmup:
                run_load(bases[name], kind, requests=args.warmup, concurrency=args.warmup, image_pool=args.warmup,
                         max_tokens=16, check_answers=False, timeout_s=args.timeout, seed=args.seed + 999)
        for load in loads:
            out.append(_one_load(args, load, procs, bases))
    finally:
        stop_group(list(procs.values()))
    return out


def _one_load(args, load: Load, procs, bases) -> dict[str, Any]:
    check = load.model == "demo"
    runs: dict[str, list[Run]] = {n: [] for n in SERVERS}
    idle_cpu: dict[str, list[float]] = {n: [] for n in SERVERS}
    quiet_wait: dict[str, list[float]] = {n: [] for n in SERVERS}
    common = dict(requests=load.requests, concurrency=load.concurrency, image_pool=load.requests,
                  max_tokens=load.max_tokens, check_answers=check, timeout_s=args.timeout,
                  long_fraction=load.long_fraction, long_prompt_words=load.long_prompt_words,
                  ttft_slo_ms=load.ttft_slo_ms, itl_slo_ms=load.itl_slo_ms, slo_headers=args.slo_headers,
                  max_retries=args.max_retries)
    if args.load_warmup:   # unmeasured, its own seed: no measured image is in either server's cache
        for name in SERVERS:
            wait_quiet(list(procs.values()))
            run_load(bases[name], load.model, seed=args.seed + 500, **{**common, "check_answers": False})
    sizes = block_sizes(load.requests, load.blocks if args.blocks is None else args.blocks)
    blocks: dict[str, list[Run]] = {n: [] for n in SERVERS}   # every block of every round, in order
    for rnd in range(args.rounds):
        parts = _one_round(args, load, procs, bases, rnd, sizes, common, idle_cpu, quiet_wait)
        for name in SERVERS:
            blocks[name] += parts[name]
            runs[name].append(joined(parts[name], name, load.ttft_slo_ms, load.itl_slo_ms, check))
    reports = {n: pooled(rs, load.ttft_slo_ms, load.itl_slo_ms, check) for n, rs in runs.items()}
    for n, rs in runs.items():
        reports[n]["server_cpu_ms_per_request"] = cpu_per_request(rs)
    per_round = {n: [pooled([r], load.ttft_slo_ms, load.itl_slo_ms, check) for r in rs] for n, rs in runs.items()}
    per_block = ({n: [pooled([b], load.ttft_slo_ms, load.itl_slo_ms, check) for b in bs] for n, bs in blocks.items()}
                 if len(sizes) > 1 else None)
    return {
        "load": asdict(load), "model": load.model, "reports": reports, "rounds": per_round, "blocks": sizes,
        "idle_peer_cpu_s": idle_cpu,
        "quiet_wait_s": quiet_wait,
        "table": table_rows(reports["vllm"], reports["epd"]),
        "targets": judge_targets(load, per_round),
        "block_targets": judge_targets(load, per_block) if per_block else [],
        "errors": {n: error_samples(r for run in rs for r in run.records) for n, rs in runs.items()},
        "commands": {n: p.cmd for n, p in procs.items()},
    }


def _one_round(args, load: Load, procs, bases, rnd: int, sizes: list[int], common: dict[str, Any],
               idle_cpu: dict[str, list[float]], quiet_wait: dict[str, list[float]]) -> dict[str, list[Run]]:
    """Round ``rnd`` of ``load``: each server's runs, one per block, the servers taking turns."""
    parts: dict[str, list[Run]] = {n: [] for n in SERVERS}
    for block, size in enumerate(sizes):
        first = sum(sizes[:block])   # a round's requests are numbered through its blocks
        # one block: the round's own seed, as before blocks existed; else each block its own new images
        seed = args.seed + rnd if len(sizes) == 1 else args.seed + BLOCK_SEEDS + 100 * rnd + block
        order = list(SERVERS) if (rnd + block) % 2 == 0 else list(reversed(SERVERS))
        for name in order:
            other = next(n for n in SERVERS if n != name)
            quiet_wait[name].append(round(wait_quiet(list(procs.values())), 2))
            if args.run_warmup and block == 0:   # unmeasured, its own seed: none of the measured images
                run_load(bases[name], load.model, seed=args.seed + 700 + rnd,
                         **{**common, "requests": args.run_warmup, "image_pool": args.run_warmup,
                            "concurrency": min(args.run_warmup, load.concurrency), "check_answers": False})
            before = sum(cpu_seconds(procs[other]).values())
            run = run_load(bases[name], load.model, procs[name], seed=seed, **{**common, "requests": size, "image_pool": size})
            idle_cpu[other].append(sum(cpu_seconds(procs[other]).values()) - before)
            for record in run.records:
                record.index += first
            parts[name].append(run)
            rep = run.report
            where = f"round {rnd}" + (f" block {block}" if len(sizes) > 1 else "")
            print(f"[{load.name}] {where} {name:<5} {rep['req_per_s']:.2f} req/s  TTFT p50 "
                  f"{fmt(rep['ttft_ms_p50'])} ms  ITL p99 {fmt(rep['itl_ms_p99'])} ms  ok {rep['ok']}/{rep['requests']}",
                  file=sys.stderr)
            for err in error_samples(run.records, 2):
                print(f"[{load.name}]   failed: {err}", file=sys.stderr)
    return parts


def block_sizes(requests: int, blocks: int) -> list[int]:
    """A round's requests split into ``blocks`` parts (at most one per request), sizes differing by at most one."""
    blocks = max(1, min(blocks, requests))
    return [requests // blocks + (1 if b < requests % blocks else 0) for b in range(blocks)]


def joined(parts: list[Run], server: str, ttft_slo_ms: float, itl_slo_ms: float, check: bool) -> Run:
    """One server's blocks of a round as one run: every record, durations, CPU seconds added."""
    if len(parts) == 1:
        parts[0].server = server
        return parts[0]
    cpu: dict[str, float] = {}
    for part in parts:
        for role, sec in part.cpu_s.items():
            cpu[role] = cpu.get(role, 0.0) + sec
    return Run(server, pooled(parts, ttft_slo_ms, itl_slo_ms, check), [r for p in parts for r in p.records], cpu,
               sum(p.client_cpu_s for p in parts))


def table_rows(vllm: Mapping[str, Any], epd: Mapping[str, Any]) -> list[list[str]]:
    rows = [[label, fmt(vllm.get(k)), fmt(epd.get(k)), fmt(ratio(epd.get(k), vllm.get(k)))] for label, k in ROWS]
    v_cpu = (vllm.get("server_cpu_ms_per_request") or {}).get("total")
    e_cpu = (epd.get("server_cpu_ms_per_request") or {}).get("total")
    rows.append(["server CPU ms / request", fmt(v_cpu), fmt(e_cpu), fmt(ratio(e_cpu, v_cpu))])
    rows.append(["ok / requests", f"{vllm['ok']}/{vllm['requests']}", f"{epd['ok']}/{epd['requests']}", ""])
    # tokens but no text (a server that drops undecodable bytes): such a request has no TTFT, so the
    # TTFT percentiles leave it out while a server that sends the bytes as U+FFFD counts its TTFT
    rows.append(["ok with no text", str(vllm.get("ok_without_text", 0)), str(epd.get("ok_without_text", 0)), ""])
    # refused, then sent again after the server's Retry-After (bench/client.py): their wait is in their TTFT
    rows.append(["retried after a refusal", str(vllm.get("retried", 0)), str(epd.get("retried", 0)), ""])
    return rows


def judge_targets(load: Load, per_round: Mapping[str, list[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Each target on the worse of the rounds' epd/vLLM ratios (round r of one against round r of the other).
    A floor (``min``) on a round where vLLM scored 0 and epd more (goodput: vLLM met no SLO) is met
    there, its ratio ``"inf"`` (JSON has no infinity); a round where neither scored has no ratio."""
    out = []
    for key, kind, bound in load.targets:
        ratios = [math.inf if kind == "min" and v.get(key) == 0 and (e.get(key) or 0) > 0 else ratio(e.get(key), v.get(key))
                  for e, v in zip(per_round["epd"], per_round["vllm"])]
        known = [r for r in ratios if r is not None]
        worst = (min(known) if kind == "min" else max(known)) if known else None
        met = worst is not None and (worst >= bound if kind == "min" else worst <= bound)
        within = sum(1 for r in known if (r >= bound if kind == "min" else r <= bound))
        ratios = ["inf" if r == math.inf else r for r in ratios]
        worst = "inf" if worst == math.inf else worst
        out.append({"metric": key, "rounds": ratios, "worst": worst,
                    "target": f"{'>=' if kind == 'min' else '<='} {bound}", "met": met, "within": within})
    return out


def print_load(result: Mapping[str, Any]) -> None:
    load = result["load"]
    print(f"\n## {load['name']}: {load['model']} model, {load['requests']} requests, {load['concurrency']} concurrent, "
          f"{load['max_tokens']} tokens" + (f", {load['long_fraction']:.0%} with ~{load['long_prompt_words']}-word prompts"
                                             if load["long_fraction"] else "")
          + f"; SLOs TTFT <= {load['ttft_slo_ms']:.0f} ms, worst gap <= {load['itl_slo_ms']:.0f} ms\n")
    print(markdown_table(["metric", "vLLM-CPU", "epd", "epd / vLLM"], result["table"]))
    for t in result["targets"]:
        print(f"target {t['metric']} {t['target']}: worse round {fmt(t['worst'])} "
              f"(rounds {', '.join(fmt(r) for r in t['rounds'])}) -> {'met' if t['met'] else 'MISSED'}")
    for t in result.get("block_targets", []):   # blocks: how many of them, each on its own, met the target
        finite = [r for r in t["rounds"] if isinstance(r, float)]
        spread = f"ratios {fmt(min(finite))} to {fmt(max(finite))}, " if finite else ""
        print(f"  {t['metric']} per block ({len(result['blocks'])} a round): {spread}"
              f"{t['within']} of {len(t['rounds'])} blocks {t['target']}")
    idle = result["idle_peer_cpu_s"]
    print("idle server's CPU s while the other ran: " + ", ".join(f"{n} {fmt(sum(v))}" for n, v in idle.items()))
