"""``epd plan``: size the encoder, prefill and decode pools for a load and SLOs.

1. Analytic first guess from Little's law, Q = lambda x W, per stage: busy
   encoders = lambda x E[encode], busy prefill workers = lambda x E[prefill],
   occupied decode slots = lambda x E[output] x step. Encoder and prefill pools
   are sized as M/M/c queues (Erlang C) so the mean queue wait stays within a
   share of the TTFT budget left after the idle pipeline; decode is sized to a
   target slot occupancy.
2. Confirmation by simulation (disaggregated placement): while the goodput
   fraction is below target, add one worker to the stage with the largest mean
   wait; then try removing one worker per pool while the target still holds.
3. The conditional split threshold at the planned load (``split_threshold``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from runtime.policy.cost_model import CostModel
from runtime.policy.service_times import ServiceTimes
from sim.config import SimConfig
from sim.report import summarize
from sim.simulator import simulate
from sim.split_threshold import split_threshold
from sim.workload import RequestMix, Workload

TARGET_UTILIZATION = 0.8  # encoder / prefill pools, before the wait check
DECODE_OCCUPANCY = 0.85  # target share of decode slots occupied
WAIT_SHARE = 0.25  # share of the spare TTFT budget each queue may use on average


@dataclass(slots=True, frozen=True)
class PlanInput:
    mix: RequestMix
    rate: float  # requests per second
    ttft_slo_ms: float = 600.0
    itl_slo_ms: float = 150.0
    service: ServiceTimes = field(default_factory=ServiceTimes)
    transfer: str = "serial"
    chunk_tokens: int = 2000
    goodput_target: float = 0.95  # fraction of requests meeting both SLOs
    sim_requests: int = 2000
    max_rounds: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if not 0 < self.goodput_target <= 1:
            raise ValueError(f"goodput_target must be in (0, 1], got {self.goodput_target}")
        if self.sim_requests < 0 or self.max_rounds < 1:
            raise ValueError("sim_requests must be >= 0 and max_rounds >= 1")


@dataclass(slots=True, frozen=True)
class MixStats:
    """Means over a sample of the request mix."""

    tokens: float
    tokens_p90: float
    output: float
    images_encoded: float  # cache misses per request
    encode_ms: float
    prefill_ms: float
    transfer_ms: float


def mix_stats(inp: PlanInput, samples: int = 20000) -> MixStats:
    cm = CostModel(inp.service)
    workload = Workload(inp.mix, rate=1.0, requests=samples, seed=inp.seed)
    rows = list(workload.arrivals())
    tokens = sorted(r[1] for r in rows)
    n = len(rows)
    return MixStats(
        tokens=sum(tokens) / n,
        tokens_p90=tokens[int(0.9 * (n - 1))],
        output=sum(r[2] for r in rows) / n,
        images_encoded=sum(r[3] - r[4] for r in rows) / n,
        encode_ms=sum(cm.encode_ms((r[3] - r[4]) * r[5], r[4]) for r in rows) / n,
        prefill_ms=sum(cm.prefill_ms(r[1]) for r in rows) / n,
        transfer_ms=sum(cm.transfer_ms(cm.kv_bytes(r[1])) for r in rows) / n,
    )


def erlang_c_wait_ms(servers: int, rate_per_s: float, service_ms: float) -> float:
    """Mean queue wait of an M/M/c queue (inf when it is unstable)."""
    if service_ms <= 0 or rate_per_s <= 0:
        return 0.0
    a = rate_per_s * service_ms / 1000.0  # offered load in busy servers
    if a >= servers:
        return math.inf
    term, total = 1.0, 1.0
    for k in range(1, servers):
        term *= a / k
        total += term
    top = term * a / servers / (1 - a / servers)
    p_wait = top / (total + top)
    return p_wait * service_ms / (servers - a)


def _pool_size(rate: float, service_ms: float, wait_budget_ms: float) -> int:
    if service_ms <= 0:
        return 0
    c = max(1, math.ceil(rate * service_ms / 1000.0 / TARGET_UTILIZATION))
    while erlang_c_wait_ms(c, rate, service_ms) > wait_budget_ms and c < 10_000:
        c += 1
    return c


def analytic(inp: PlanInput, stats: MixStats) -> dict[str, Any]:
    cm = CostModel(inp.service)
    chunk = inp.chunk_tokens if inp.transfer == "chunked" else None
    idle_ttft = stats.encode_ms + cm.remote_ttft_ms(int(stats.tokens_p90), chunk)
    spare = max(0.0, inp.ttft_slo_ms - idle_ttft)
    slots = inp.service.decode_slots
    residency_s = stats.output * cm.decode_step_ms(slots) / 1000.0
    occupied = inp.rate * residency_s  # Q = lambda W
    link_busy = inp.rate * stats.transfer_ms / 1000.0
    return {
        "encoder_workers": _pool_size(inp.rate, stats.encode_ms, WAIT_SHARE * spare) if stats.images_encoded else 0,
        "prefill_workers": _pool_size(inp.rate, stats.prefill_ms, WAIT_SHARE * spare),
        "decode_workers": max(1, math.ceil(occupied / (slots * DECODE_OCCUPANCY))),
        "kv_links": max(1, math.ceil(link_busy / TARGET_UTILIZATION)),
        "busy_encoders": inp.rate * stats.encode_ms / 1000.0,
        "busy_prefill_workers": inp.rate * stats.prefill_ms / 1000.0,
        "occupied_decode_slots": occupied,
        "link_utilization": link_busy,
        "idle_pipeline_ttft_ms_p90": idle_ttft,
        "spare_ttft_budget_ms": spare,
    }


# the pool that relieves a stage's queue
_STAGE_POOL = {
    "encoder": "encoder_workers",
    "prefill": "prefill_workers",
    "kv_reservation": "decode_workers",
    "link_queue": "kv_links",
}


def _run(inp: PlanInput, sizes: dict[str, int]) -> dict[str, Any]:
    config = SimConfig(
        placement="disaggregated", prefill_workers=sizes["prefill_workers"], decode_workers=sizes["decode_workers"],
        encoder_workers=sizes["encoder_workers"], kv_links=sizes["kv_links"], transfer=inp.transfer,
        chunk_tokens=inp.chunk_tokens, ttft_slo_ms=inp.ttft_slo_ms, itl_slo_ms=inp.itl_slo_ms, seed=inp.seed,
        service=inp.service, samples=50,
    )
    workload = Workload(inp.mix, rate=inp.rate, requests=inp.sim_requests, seed=inp.seed)
    return summarize(simulate(config, workload), series=False)


def _ok(inp: PlanInput, report: dict[str, Any]) -> bool:
    return (report["goodput_fraction"] or 0.0) >= inp.goodput_target


def _bottleneck(report: dict[str, Any], sizes: dict[str, int]) -> str:
    waits = {s: w for s, w in report["stage_wait_ms"].items() if s in _STAGE_POOL}
    if (report["itl_slo_met_fraction"] or 1.0) < (report["ttft_slo_met_fraction"] or 1.0) or not waits:
        return "decode_workers"  # slow steps: more decode workers make smaller batches
    return _STAGE_POOL[max(waits, key=lambda s: waits[s])]


_SIM_KEYS = ("goodput_fraction", "goodput_rps", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p99", "idle_fraction", "stage_wait_ms")


def _round(sizes: dict[str, int], report: dict[str, Any]) -> dict[str, Any]:
    return {**sizes, "goodput_fraction": report["goodput_fraction"], "ttft_ms_p99": report["ttft_ms_p99"]}


def plan(inp: PlanInput) -> dict[str, Any]:
    """The recommendation, the analytic numbers, every simulation round and the split threshold."""
    stats = mix_stats(inp)
    first = analytic(inp, stats)
    sizes = {k: first[k] for k in ("encoder_workers", "prefill_workers", "decode_workers", "kv_links")}
    if stats.images_encoded == 0:
        sizes["encoder_workers"] = 0
    rounds: list[dict[str, Any]] = []
    report = None
    if inp.sim_requests:
        for _ in range(inp.max_rounds):
            report = _run(inp, sizes)
            rounds.append(_round(sizes, report))
            if _ok(inp, report):
                break
            sizes[_bottleneck(report, sizes)] += 1
        if report is not None and _ok(inp, report):
            for pool in ("decode_workers", "prefill_workers", "encoder_workers", "kv_links"):
                floor = 1 if pool != "encoder_workers" else 0
                while sizes[pool] > floor:
                    trial = {**sizes, pool: sizes[pool] - 1}
                    trial_report = _run(inp, trial)
                    rounds.append(_round(trial, trial_report))
                    if not _ok(inp, trial_report):
                        break
                    sizes, report = trial, trial_report
    cm = CostModel(inp.service)
    neighbours = min(inp.service.decode_slots - 1, round(first["occupied_decode_slots"] / max(1, sizes["decode_workers"])))
    prefill_wait = report["stage_wait_ms"].get("prefill", 0.0) if report else 0.0
    threshold = split_threshold(
        cm, neighbours=neighbours, output_tokens=max(1, round(stats.output)), ttft_slo_ms=inp.ttft_slo_ms,
        itl_slo_ms=inp.itl_slo_ms, prefill_wait_ms=prefill_wait,
        transfer_chunk_tokens=inp.chunk_tokens if inp.transfer == "chunked" else None,
    )
    confirmed = report is not None and _ok(inp, report)
    return {
        "rate": inp.rate,
        "recommended": sizes,
        "confirmed_by_simulation": confirmed,
        "goodput_target": inp.goodput_target,
        "simulated": {k: report[k] for k in _SIM_KEYS} if report else None,
        "split_threshold_tokens": threshold,
        "split_threshold_at": {"neighbours_per_decode_worker": neighbours, "prefill_wait_ms": round(prefill_wait, 3)},
        "analytic": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in first.items()},
        "mix": {
            "mean_prompt_tokens": round(stats.tokens, 1),
            "mean_output_tokens": round(stats.output, 1),
            "mean_images_encoded": round(stats.images_encoded, 3),
        },
        "rounds": rounds,
    }
