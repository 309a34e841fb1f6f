"""The simulator's side of bench/sim_vs_real.py: a measured run turned into a simulator run.

A saved run (``run-PLACEMENT.json``: the service-time file, every request's record, the host's
load) becomes a trace replay and a Poisson run through ``sim.simulator``; ``predict`` returns the
predicted metrics beside the measured ones, and ``within`` says whether a ratio meets the
target. No stack is started here (``--replay`` uses only this).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any


from bench.record import RequestRecord
from gateway.settings import GatewaySettings
from runtime.policy import service_times as st
from runtime.policy.cost_model import CostModel
from runtime.policy.service_times import ServiceTimes
from sim.config import SimConfig
from sim.distributions import fixed, parse_distribution
from sim.metrics import HIST_PER_MS, hist_percentile, percentile
from sim.report import summarize as sim_summary
from sim.simulator import Simulator
from sim.workload import Arrival, RequestMix, Workload


TARGET = 0.25  # |predicted / measured - 1| allowed
METRICS = ("ttft_ms_p50", "ttft_ms_p90", "itl_ms_p50", "tpot_ms_p50", "e2e_ms_p50")
def sampled_tokens(completion_tokens: int, max_tokens: int) -> int:
    """Decode work of one answer: its tokens, plus the EOS step when it stopped early."""
    return completion_tokens + (1 if completion_tokens < max_tokens else 0)


def cache_hits(record: RequestRecord, seen_before: bool) -> int:
    """Images the encoder cache already held, from epd's breakdown (else: was the image sent before)."""
    breakdown = json.loads(record.ttft_breakdown) if record.ttft_breakdown else {}
    hit = breakdown.get("images_cache_hit")
    return int(hit) if hit is not None else int(seen_before)


def trace_from_records(records: list[RequestRecord], prompt_tokens: int, max_tokens: int,
                       image_tokens: int) -> tuple[Arrival, ...]:
    """The answered requests as simulator arrivals, at their real send times (one image each, of
    ``image_tokens`` placeholder tokens, already counted in ``prompt_tokens``)."""
    rows, seen = [], set()
    for r in sorted(records, key=lambda r: r.start_s):
        if r.ok:
            rows.append((r.start_s * 1000.0, prompt_tokens, sampled_tokens(r.output_tokens, max_tokens), 1,
                         cache_hits(r, r.image_index in seen), image_tokens))
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
                     seed: int, image_tokens: int) -> Workload:
    """Poisson at ``rate`` with the measured output-token mix and a pool-implied cache hit ratio; each
    prompt of ``prompt_tokens``, of them one image's ``image_tokens``."""
    counts = Counter(outputs)
    spec = "mix:" + ",".join(f"{v}@{n}" for v, n in sorted(counts.items()))
    mix = RequestMix(prompt_tokens=fixed(prompt_tokens - image_tokens), output_tokens=parse_distribution(spec),
                     images=fixed(1, minimum=0), image_tokens=image_tokens, cache_hit_ratio=hit_ratio)
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
    image_tokens = run["image_tokens"]
    idle_trace = Workload(trace=trace_from_records(idle, prompt, mt, image_tokens))  # fresh images: every request a miss
    idle_sim = simulate_run(config, idle_trace)
    idle_stages = breakdown_p50(idle)
    # what a miss costs the real request beyond the simulated encode (batching window, RPC, cache write)
    miss_ms = max(0.0, idle_stages.get("encode_ms", 0.0) - CostModel(service).encode_ms(image_tokens)
                  - service.encode_request_ms)
    fixed_ms = idle_measured["ttft_ms_p50"] - idle_sim["ttft_ms_p50"] - miss_ms
    idle_doc = {"measured": idle_measured, "sim": idle_sim, "breakdown_p50": idle_stages}
    points = {load: _predict_load(point, run, config, idle_doc, fixed_ms, miss_ms) for load, point in run["loads"].items()}
    idle_doc["predicted"] = _predict(config, idle_trace, fixed_ms, miss_ms)
    return {
        "placement": placement, "service_times_file": run["service_times_file"], "service_times": service.to_dict(),
        "profile_tables": content.tables.to_dict(),
        "prompt_tokens": prompt, "image_tokens": image_tokens, "capacity_req_per_s": run["capacity_req_per_s"],
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
    trace = Workload(trace=trace_from_records(records, prompt, mt, run["image_tokens"]))
    raw = simulate_run(config, trace)
    # the stack's CPU per request, measured and as the simulator charges it (on a shared host)
    measured_cpu = sum(v for k, v in point["cpu_cores_used"].items() if k != "load_generator") \
        * point["report"]["duration_s"] * 1000.0 / max(n, 1)
    predicted = _predict(config, trace, fixed_ms, miss_ms)
    own_cores = _predict(config.with_(service=config.service.replace(host_cores=0)), trace, fixed_ms, miss_ms)
    outputs = [sampled_tokens(r.output_tokens, mt) for r in records if r.ok]
    pool_hit_ratio = 1.0 - min(pool, n) / n
    poisson = _predict(config, poisson_workload(rate, n, prompt, outputs, pool_hit_ratio, point["seed"],
                                                run["image_tokens"]), fixed_ms, miss_ms)
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




def within(ratio: float | None) -> bool:
    return ratio is not None and abs(ratio - 1.0) <= TARGET
