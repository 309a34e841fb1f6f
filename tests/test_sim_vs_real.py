"""The pieces of bench/sim_vs_real.py that turn a measured run into a simulator run (no stack started:
bench/sim_prediction.py), and its command line."""

from __future__ import annotations

import json

import pytest

from bench.record import RequestRecord
from bench.sim_prediction import (
    drift,
    measured_metrics,
    poisson_workload,
    ratios,
    sampled_tokens,
    sim_config,
    simulate_run,
    ttft_p50_by_cache,
    trace_from_records,
    with_terms,
)
from bench.sim_vs_real import parse_args
from runtime.policy.service_times import ServiceTimes
from sim.workload import Workload


def record(index: int, image: int, start_s: float, tokens: int = 3, hits: float | None = None, ok: bool = True,
           ttft_s: float = 0.05, itl_s: tuple[float, ...] = (0.01, 0.02)) -> RequestRecord:
    r = RequestRecord(index, image, False, "a red circle", start_s=start_s, ok=ok, ttft_s=ttft_s, itl_s=list(itl_s),
                      e2e_s=ttft_s + sum(itl_s), output_tokens=tokens)
    if hits is not None:
        r.ttft_breakdown = json.dumps({"images_cache_hit": hits, "encode_ms": 0.0})
    return r


def test_sampled_tokens_count_the_eos_step_only_when_the_answer_stopped_early():
    assert sampled_tokens(3, 8) == 4
    assert sampled_tokens(8, 8) == 8


def test_trace_keeps_answered_requests_in_send_order_with_measured_cache_hits():
    records = [
        record(1, image=0, start_s=0.20, hits=1.0),
        record(0, image=0, start_s=0.10),  # no breakdown: first sight of image 0 is a miss
        record(2, image=1, start_s=0.30, ok=False),
        record(3, image=1, start_s=0.40),  # no breakdown, image 1 was sent (by the failed one): a hit
    ]
    trace = trace_from_records(records, prompt_tokens=26, max_tokens=8, image_tokens=16)
    assert trace == ((100.0, 26, 4, 1, 0, 16), (200.0, 26, 4, 1, 1, 16), (400.0, 26, 4, 1, 1, 16))


@pytest.mark.parametrize("placement, prefill_workers", [("disaggregated", 1), ("colocated", 0)])
def test_sim_config_matches_what_epd_serve_starts(placement, prefill_workers):
    service = ServiceTimes(decode_step_base_ms=7.0)
    config = sim_config(placement, service)
    assert (config.placement, config.prefill_workers, config.decode_workers, config.encoder_workers) == (
        placement, prefill_workers, 1, 1)
    assert config.transfer == "chunked" and config.chunked_prefill
    assert config.chunk_tokens == config.local_chunk_tokens == 256  # the gateway's prefill_chunk_tokens default
    assert config.ttft_slo_ms == 5000.0 and config.service is service


def test_poisson_workload_uses_the_measured_mix_and_the_pool_hit_ratio():
    w = poisson_workload(12.5, 40, 26, [4, 4, 5], 0.75, seed=3, image_tokens=16)
    assert (w.rate, w.total, w.mix.image_tokens, w.mix.cache_hit_ratio) == (12.5, 40, 16, 0.75)
    arrivals = list(w.arrivals())
    assert {a[1] for a in arrivals} == {26} and {a[2] for a in arrivals} <= {4, 5} and {a[3] for a in arrivals} == {1}


def test_measured_metrics_terms_and_ratios():
    records = [record(i, i, i * 0.1, ttft_s=0.01 * (i + 1)) for i in range(5)] + [record(9, 9, 1.0, ok=False)]
    m = measured_metrics(records, max_tokens=8)
    assert m["ttft_ms_p50"] == pytest.approx(30.0)
    assert m["itl_ms_p50"] == pytest.approx(10.0)
    assert m["tpot_ms_p50"] == pytest.approx(30.0 / 3)  # 3 tokens and the EOS step: 3 gaps over 30 ms
    predicted = {"ttft_ms_p50": 30.0, "ttft_ms_p90": 50.0, "itl_ms_p50": 5.0, "e2e_ms_p50": 60.0}
    assert ratios(predicted, m)["ttft_ms_p50"] == pytest.approx(1.0)
    assert ratios(predicted, m)["itl_ms_p50"] == pytest.approx(0.5)


def test_terms_add_the_miss_cost_only_to_requests_that_missed_the_cache():
    assert with_terms([(10.0, True), (5.0, False), (1.0, True)], 2.0, 3.0) == [6.0, 7.0, 15.0]


def test_simulated_idle_request_is_the_sum_of_its_stages():
    service = ServiceTimes(encode_base_ms=4.0, encode_ms_per_token=1 / 16, prefill_base_ms=10.0, prefill_ms_per_token=0.0,
                           decode_step_base_ms=5.0, link_setup_ms=1.0, kv_bytes_per_token=1)
    trace = ((0.0, 26, 4, 1, 0, 16), (1000.0, 26, 4, 1, 0, 16))
    out = simulate_run(sim_config("disaggregated", service), Workload(trace=trace))
    with_terms_ = simulate_run(sim_config("disaggregated", service), Workload(trace=trace), 3.0, 2.0)
    assert with_terms_["ttft_ms_p50"] == pytest.approx(16.0 + 3.0 + 2.0, abs=0.1)  # both missed the cache
    assert with_terms_["itl_ms_p50"] == out["itl_ms_p50"]
    # encode 5 + prefill 10 + link 1 (the prefill's token goes out as the KV lands); then 3 steps of 5 ms
    assert out["ttft_ms_p50"] == pytest.approx(16.0, abs=0.1)
    assert out["e2e_ms_p50"] == pytest.approx(31.0, abs=0.1)
    assert out["itl_ms_p50"] == pytest.approx(5.0)


def test_drift_compares_the_last_third_of_the_run_with_the_first():
    steady = [record(i, i, i * 0.1, ttft_s=0.05) for i in range(9)]
    growing = [record(i, i, i * 0.1, ttft_s=0.05 * (i + 1)) for i in range(9)]
    assert drift(steady) == pytest.approx(1.0)
    assert drift(growing) == pytest.approx(8 / 2)
    assert drift(steady[:5]) is None


def test_arguments():
    args = parse_args([])
    assert (args.placement_list, args.load_list, args.requests) == (["disaggregated", "colocated"], [0.3, 0.5], 300)
    for bad in (["--placements", "split"], ["--loads", "1.5"], ["--loads", "x"], ["--requests", "1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_ttft_split_by_cache_hit():
    records = [record(0, 0, 0.0, hits=1.0, ttft_s=0.01), record(1, 1, 0.1, hits=0.0, ttft_s=0.03),
               record(2, 2, 0.2, hits=0.0, ttft_s=0.05), record(3, 3, 0.3, ttft_s=0.9)]  # no breakdown: left out
    assert ttft_p50_by_cache(records) == {"hit": pytest.approx(10.0), "miss": pytest.approx(40.0)}
    service = ServiceTimes(encode_base_ms=4.0, encode_ms_per_token=1 / 16, encode_cache_hit_ms=0.0)
    out = simulate_run(sim_config("colocated", service),
                       Workload(trace=((0.0, 26, 2, 1, 0, 16), (500.0, 26, 2, 1, 1, 16))))
    assert out["ttft_ms_p50_by_cache"]["miss"] - out["ttft_ms_p50_by_cache"]["hit"] == pytest.approx(5.0)
