"""The side-by-side benchmark scripts (bench/compare_servers.py, bench/placement_comparison.py) and
the harness they share (bench/harness/).

Only argument parsing and the table / report building, on tiny fake reports and
records: no server is started and nothing is timed. The measured numbers live in
bench/RESULTS.md, never in tests.
"""

from __future__ import annotations

import json
import math

from pathlib import Path

import pytest

from bench import (
    compare_report,
    compare_servers,
    placement_comparison,
    placement_load,
    placement_stack,
    placement_summary,
)
from bench.harness import report, runs, scrape, servers
from bench.plot import plot_series_cdfs
from bench.record import RequestRecord


def fake_report(**overrides) -> dict:
    report = {
        "requests": 16, "ok": 16, "failed": 0, "failed_by_status": {}, "duration_s": 2.0,
        "req_per_s": 8.0, "output_tok_per_s": 32.0, "goodput_req_per_s": 8.0,
        "ttft_ms_p50": 400.0, "ttft_ms_p90": 500.0, "ttft_ms_p99": 600.0, "mean_ttft_ms": 410.0,
        "itl_ms_p50": 5.0, "itl_ms_p90": 8.0, "itl_ms_p99": 10.0,
        "e2e_ms_p50": 420.0, "e2e_ms_p90": 520.0, "e2e_ms_p99": 620.0,
        "answers_correct": 16, "answers_checked": 16,
    }
    report.update(overrides)
    return report


def record(index: int, ttft: float | None = 0.1, gaps: tuple[float, ...] = (0.01,), ok: bool = True,
           text: str = "a red circle", long: bool = False) -> RequestRecord:
    return RequestRecord(index, index, long, "a red circle", status=200 if ok else 503, ok=ok, ttft_s=ttft,
                         itl_s=list(gaps), e2e_s=(ttft or 0) + sum(gaps), output_tokens=len(gaps) + 1, text=text)


# ------------------------------------------------------------------ compare_servers: arguments


def test_compare_defaults() -> None:
    args = compare_servers.parse_args([])
    assert args.model_list == ["demo", "bench"]
    assert (args.requests, args.concurrency, args.rounds) == (64, 16, 2)
    assert args.transformers_threads == 1
    assert args.cache_model == "demo" and not args.cache_only
    assert args.run_warmup == 0
    assert compare_servers.stem(args) == "compare_servers"


def test_compare_options() -> None:
    args = compare_servers.parse_args(["--models", "bench", "--requests", "8", "--concurrency", "4", "--rounds", "1",
                          "--cache-model", "none", "--tag", "threads-2", "--epd-args", "--placement colocated"])
    assert args.model_list == ["bench"]
    assert (args.requests, args.concurrency, args.rounds) == (8, 4, 1)
    assert compare_servers.stem(args) == "compare_servers-threads-2"
    assert args.epd_args.split() == ["--placement", "colocated"]


@pytest.mark.parametrize("argv", [
    ["--models", "llama"],
    ["--requests", "0"],
    ["--concurrency", "0"],
    ["--cache-model", "other"],
    ["--cache-only", "--cache-model", "none"],
    ["--tag", "a/b"],
    ["--warmup", "-1"],
    ["--run-warmup", "-1"],
])
def test_compare_rejects_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        compare_servers.parse_args(argv)


# ------------------------------------------------------------------ compare_servers: tables


def test_ratio_rows_and_markdown() -> None:
    base = fake_report(server_cpu_ms_per_request={"total": 20.0})
    epd = fake_report(req_per_s=24.0, ttft_ms_p50=100.0, server_cpu_ms_per_request={"total": 10.0})
    rows = compare_report.ratio_rows(base, epd)
    by_label = {row[0]: row for row in rows}
    assert by_label["requests/s"][1:] == ["8.00", "24.00", "3.00"]
    assert by_label["TTFT p50 (ms)"][3] == "0.25"
    assert by_label["server CPU ms / request"][3] == "0.50"
    assert by_label["ok / requests"][1:3] == ["16/16", "16/16"]
    assert by_label["answers correct"][2] == "16/16"
    table = report.markdown_table(["metric", "transformers", "epd", "epd / transformers"], rows).splitlines()
    assert table[0].startswith("| metric") and set(table[1]) <= {"|", "-"}
    assert len(table) == len(rows) + 2
    assert len({len(line) for line in table}) == 1  # columns aligned


def test_ratio_and_fmt_edge_cases() -> None:
    assert report.ratio(None, 1.0) is None and report.ratio(1.0, 0.0) is None and report.ratio(3.0, 2.0) == 1.5
    assert report.fmt(None) == "-" and report.fmt(1.234) == "1.23" and report.fmt(12345.6) == "12346"
    assert report.fmt(3) == "3"
    rows = compare_report.ratio_rows(fake_report(ttft_ms_p50=None, answers_checked=0),
                         fake_report(answers_checked=0))
    labels = [r[0] for r in rows]
    assert "answers correct" not in labels and "server CPU ms / request" not in labels
    assert dict((r[0], r[3]) for r in rows)["TTFT p50 (ms)"] == "-"


def test_check_targets() -> None:
    base = fake_report()
    good = compare_report.check_targets(base, fake_report(req_per_s=16.0, ttft_ms_p50=200.0),
                                        {"same": 16, "compared": 16})
    assert good["throughput_ok"] and good["ttft_p50_ok"] and good["epd_all_correct"] and good["all_met"]
    assert good["epd_matches_transformers"]
    slow = compare_report.check_targets(base, fake_report(req_per_s=12.0, ttft_ms_p50=300.0, answers_correct=15))
    assert slow["throughput_ratio"] == 1.5 and not slow["throughput_ok"]
    assert not slow["ttft_p50_ok"] and not slow["epd_all_correct"] and not slow["all_met"]
    assert "epd_matches_transformers" not in slow
    failed = compare_report.check_targets(base, fake_report(req_per_s=20.0, ttft_ms_p50=100.0, ok=15))
    assert not failed["epd_all_correct"]


def test_cache_rows() -> None:
    distinct = fake_report(cache_checks={"hit": 0.0, "checked": 32.0})
    repeated = fake_report(ttft_ms_p50=300.0, cache_checks={"hit": 32.0, "checked": 32.0})
    rows = {r[0]: r for r in compare_report.cache_rows(distinct, repeated)}
    assert rows["TTFT p50 (ms)"][1:] == ["400.00", "300.00", "0.75"]
    assert rows["images found cached / checked (gateway)"][1:3] == ["0/32", "32/32"]


def test_pooled_same_text_and_errors() -> None:
    a = runs.Run("t", {"duration_s": 1.0}, [record(0, 0.1), record(1, 0.3), record(2, ok=False)])
    b = runs.Run("t", {"duration_s": 3.0}, [record(0, 0.2, text="a blue square"), record(1, 0.2)])
    pooled = runs.pooled([a, b])
    assert pooled["requests"] == 5 and pooled["ok"] == 4 and pooled["duration_s"] == 4.0
    assert pooled["req_per_s"] == 1.0
    assert pooled["ttft_ms_p50"] == pytest.approx(200.0)
    assert pooled["answers_correct"] == 3
    assert runs.same_text(a.records, b.records) == (1, 2)
    errors = runs.error_samples(a.records + [record(3, ok=False)])
    assert errors == ["503: "]


def test_cpu_per_request() -> None:
    pair = [runs.Run("x", {"ok": 10}, [], {"gateway": 0.1, "decode": 0.2}, 0.05),
            runs.Run("x", {"ok": 10}, [], {"gateway": 0.1, "decode": 0.0}, 0.05)]
    cpu = runs.cpu_per_request(pair)
    assert cpu["gateway"] == pytest.approx(10.0) and cpu["decode"] == pytest.approx(10.0)
    assert cpu["total"] == pytest.approx(20.0) and cpu["load_generator"] == pytest.approx(5.0)
    assert runs.cpu_per_request([runs.Run("x", {"ok": 0}, [], {"gateway": 1.0})]) == {}


def test_prometheus_parsing_and_deltas() -> None:
    text = "\n".join([
        "# HELP epd:gateway_image_cache_checks_total Images checked",
        "# TYPE epd:gateway_image_cache_checks_total counter",
        'epd:gateway_image_cache_checks_total{cached="true"} 5.0',
        'epd:gateway_image_cache_checks_total{cached="false"} 3.0',
        'epd:placement_total{placement="colocated",reason="forced"} 7.0',
        "process_cpu_seconds_total 12.0",
    ])
    after = scrape.parse_prometheus(text)
    assert "process_cpu_seconds_total" not in after
    before = {'epd:gateway_image_cache_checks_total{cached="true"}': 1.0,
              'epd:gateway_image_cache_checks_total{cached="false"}': 3.0}
    delta = scrape.counter_delta(before, after, "epd:gateway_image_cache_checks_total")
    assert delta == {'epd:gateway_image_cache_checks_total{cached="true"}': 4.0}


def test_plot_cdfs_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "cdf.png"
    plot_series_cdfs({"a": [record(0), record(1, 0.2, (0.02, 0.03))], "b": [record(2, ok=False)]}, path, "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ placement_comparison


def test_placement_defaults_and_topology() -> None:
    args = placement_comparison.parse_args([])
    assert args.placement_list == list(placement_stack.PLACEMENTS)
    assert args.scenario_list == list(placement_load.SCENARIOS)
    assert args.core_list == [0, 1] and args.burst_at_list == [4.0, 14.0]
    assert placement_stack.topology("colocated", [0, 1]) == [("decode", 0), ("decode", 1)]
    assert placement_stack.topology("disaggregated", [3, 5]) == [("prefill", 3), ("decode", 5)]
    assert placement_stack.topology("conditional", [0, 1]) == [("prefill", 0), ("decode", 1)]
    with pytest.raises(ValueError):
        placement_stack.topology("mixed", [0, 1])
    cmd = servers.worker_cmd("decode", Path("/m"), 5000, "1", ["--kv-memory-mb", "64"])
    assert cmd[:3] == ["taskset", "-c", "1"] and cmd[-2:] == ["--kv-memory-mb", "64"]
    assert servers.worker_cmd("encoder", Path("/m"), 5000, None)[0] != "taskset"


@pytest.mark.parametrize("argv", [
    ["--placements", "colocated,split"],
    ["--scenarios", "burst"],
    ["--cores", "0"],
    ["--cores", "1,1"],
    ["--cores", "a,b"],
    ["--burst-at", "-1"],
    ["--short-rate", "0"],
    ["--burst-size", "0"],
])
def test_placement_rejects_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        placement_comparison.parse_args(argv)


def test_summarize_run_uses_class_slos() -> None:
    short = [record(0, 0.5, (0.1, 0.2)), record(1, 3.0, (0.1,)), record(2, 0.5, (1.5,)), record(3, ok=False)]
    long = [record(4, 8.0, (0.1,), long=True)]
    run = placement_load.ScenarioRun(short, long, 10.0,
                                     {'epd:placement_total{placement="colocated",reason="forced"}': 5.0})
    s = placement_summary.summarize_run(run, short_ttft_slo_ms=2000, long_ttft_slo_ms=10000, itl_slo_ms=1000)
    # good: short 0 and the long one; short 1 misses TTFT, short 2 misses ITL, short 3 failed
    assert s["good"] == 2 and s["goodput_req_per_s"] == pytest.approx(0.2)
    assert (s["requests"], s["ok"]) == (5, 4) and s["failed_by_status"] == {"503": 1}
    assert s["short_itl_ms_max"] == pytest.approx(1500.0)
    assert s["long_ttft_ms_p99"] == pytest.approx(8000.0)
    assert placement_summary.decisions(s["placements"]) == "colocated 5"


def summary(**overrides) -> dict:
    base = {"short_itl_ms_p99": 200.0, "short_itl_ms_max": 250.0, "short_ttft_ms_p50": 300.0,
            "short_ttft_ms_p99": 600.0, "long_ttft_ms_p99": 5000.0, "goodput_req_per_s": 0.5,
            "good": 10, "requests": 12, "placements": {}}
    base.update(overrides)
    return base


def test_scenario_rows_mark_the_best() -> None:
    results = {"colocated": summary(short_itl_ms_p99=2000.0, goodput_req_per_s=0.4),
               "disaggregated": summary(short_itl_ms_p99=300.0, goodput_req_per_s=0.3),
               "conditional": summary(short_itl_ms_p99=350.0, goodput_req_per_s=0.5,
                                      placements={'epd:placement_total{placement="colocated",reason="x"}': 3.0,
                                                  'epd:placement_total{placement="disaggregated",reason="y"}': 2.0,
                                                  'epd:placement_total{placement="colocated",reason="z"}': 1.0})}
    rows = {r[0]: r for r in placement_summary.scenario_rows(results)}
    assert rows["short ITL p99 (ms)"][1:] == ["2000", "300.00 *", "350.00"]
    assert rows["goodput (req/s)"][3] == "0.50 *"
    assert rows["good / requests"][1] == "10/12"
    assert rows["placements chosen"][3] == "colocated 4, disaggregated 2"
    no_long = {"colocated": summary(long_ttft_ms_p99=None), "conditional": summary(long_ttft_ms_p99=None)}
    assert "long TTFT p99 (ms)" not in {r[0] for r in placement_summary.scenario_rows(no_long)}


def test_claims() -> None:
    results = {
        "mixed": {"colocated": summary(short_itl_ms_p99=2000.0, goodput_req_per_s=0.4),
                  "disaggregated": summary(short_itl_ms_p99=300.0, goodput_req_per_s=0.3),
                  "conditional": summary(short_itl_ms_p99=330.0, goodput_req_per_s=0.45)},
        "low": {"colocated": summary(short_ttft_ms_p50=200.0),
                "disaggregated": summary(short_ttft_ms_p50=260.0),
                "conditional": summary(short_ttft_ms_p50=300.0)},
    }
    c = placement_summary.claims(results)
    assert c["long_prompt_breaks_colocated_itl"]
    assert c["mixed_itl_p99_colocated_over_disaggregated"] == pytest.approx(2000 / 300)
    assert c["low_load_colocated_wins_ttft"]
    assert c["conditional"]["mixed:short_itl_ms_p99"]["best_or_close"]       # 330 <= 300 * 1.2
    assert not c["conditional"]["low:short_ttft_ms_p50"]["best_or_close"]     # 300 > 200 * 1.2
    assert c["conditional_best_or_close"] is False
    assert placement_summary.claims({"mixed": {"colocated": summary()}}) == {}


def test_probe_rows() -> None:
    rows = placement_summary.probe_rows({"colocated": {"reply_ms": 120.0, "colocated_prefill_ms": 80.0},
                          "disaggregated": {"reply_ms": 150.0, "prefill_ms": 60.0, "transfer_ms": 20.0}})
    assert rows[0][0] == "colocated" and len(rows[0]) == len(placement_summary.PROBE_KEYS) + 1
    col = dict(zip(placement_summary.PROBE_KEYS, rows[0][1:]))
    dis = dict(zip(placement_summary.PROBE_KEYS, rows[1][1:]))
    assert col["reply_ms"] == "120.00" and col["prefill_ms"] == "-" and col["colocated_prefill_ms"] == "80.00"
    assert dis["transfer_ms"] == "20.00"
    assert placement_comparison.parse_args(["--probe", "0"]).probe == 0
    with pytest.raises(SystemExit):
        placement_comparison.parse_args(["--probe", "-1"])


def test_claims_idle_from_probes() -> None:
    probes = {"colocated": {"reply_ms": 150.0}, "disaggregated": {"reply_ms": 200.0},
              "conditional": {"reply_ms": 170.0}}
    c = placement_summary.claims({}, probes=probes)
    assert c["idle_colocated_wins_ttft"] and c["idle_ttft_colocated_over_disaggregated"] == pytest.approx(0.75)
    assert c["idle_conditional_best_or_close"]
    late = placement_summary.claims({}, probes={**probes, "conditional": {"reply_ms": 190.0}})
    assert not late["idle_conditional_best_or_close"]


# ------------------------------------------------------------------ in-process benchmarks: they still run


def test_kv_handoff_frames_chunks_and_times_the_receiver_stages() -> None:
    """Framing and the in-process stage breakdown of ``bench.kv_handoff`` on a tiny transfer
    (the pool's write API is the product's, owner token included)."""
    import torch

    from bench import kv_handoff
    from runtime.model.kv_pool import KVLayout

    layout = KVLayout(2, 2, 8, torch.float32)
    kv = torch.randn((layout.layers, 2, 40, layout.kv_heads, layout.head_dim))
    msgs, checksum_s, frame_s = kv_handoff.frame_chunks(kv, 16, layout, "fp")
    assert [(m.token_start, m.token_end) for m in msgs] == [(0, 16), (16, 32), (32, 40)]
    assert msgs[-1].last and msgs[-1].total_chunks == 3 and msgs[-1].model_fingerprint == "fp"
    assert checksum_s >= 0 and frame_s >= 0
    stages = kv_handoff.breakdown(kv, msgs, layout, reps=1)
    assert "receiver: pool.write (slots() + indexed copy)" in stages
    assert all(v >= 0 for v in stages.values())


def test_decode_throughput_steps_a_batch_on_the_demo_model() -> None:
    import torch

    from bench.decode_throughput import Batch
    from runtime.model.model_adapter import VLMAdapter

    torch.set_grad_enabled(False)
    adapter = VLMAdapter.load(Path(__file__).resolve().parents[1] / "models" / "demo-vlm")
    batch = Batch(adapter, 2, context=8, max_steps=3, block_size=16)
    batch.step(timed=False)
    batch.step()
    batch.step()
    row = batch.result()
    assert (row["batch"], row["context"], row["steps"]) == (2, 8, 2)
    assert row["linear_kernel"] == "torch"   # the demo model's layers are all below oneDNN's threshold
    assert [s.position for s in batch.seqs] == [11, 11]


# ------------------------------------------------------------------ compare_servers --peer vllm
def test_peer_vllm_arguments_and_stem() -> None:
    args = compare_servers.parse_args(["--peer", "vllm", "--loads", "demo-c1,bench-short"])
    assert args.load_list == ["demo-c1", "bench-short"] and compare_servers.stem(args) == "compare_servers-vllm"
    assert args.slo_headers and not compare_servers.parse_args(["--peer", "vllm", "--no-slo-headers"]).slo_headers
    with pytest.raises(SystemExit):
        compare_servers.parse_args(["--peer", "vllm", "--loads", "nope"])


def test_peer_targets_take_the_worse_round() -> None:
    from bench.peer_compare import LOADS, judge_targets

    load = LOADS["bench-short"]   # throughput >= 1.0x and ITL p99 <= 1.0x
    rounds = {"vllm": [{"req_per_s": 2.0, "itl_ms_p99": 100.0}, {"req_per_s": 2.0, "itl_ms_p99": 100.0}],
              "epd": [{"req_per_s": 2.4, "itl_ms_p99": 90.0}, {"req_per_s": 1.8, "itl_ms_p99": 120.0}]}
    tput, itl = judge_targets(load, rounds)
    assert tput["worst"] == pytest.approx(0.9) and not tput["met"]
    assert itl["worst"] == pytest.approx(1.2) and not itl["met"]
    rounds["epd"][1] = {"req_per_s": 2.2, "itl_ms_p99": 95.0}
    assert all(t["met"] for t in judge_targets(load, rounds))
    # goodput where vLLM met no SLO in a round: epd's is infinitely more there, not unknown
    long = LOADS["bench-long"]
    rounds = {"vllm": [{"goodput_req_per_s": 0.0}, {"goodput_req_per_s": 0.5}],
              "epd": [{"goodput_req_per_s": 0.9}, {"goodput_req_per_s": 0.9}]}
    goodput = next(t for t in judge_targets(long, rounds) if t["metric"] == "goodput_req_per_s")
    assert goodput["rounds"] == ["inf", pytest.approx(1.8)] and goodput["worst"] == pytest.approx(1.8) and goodput["met"]
    rounds["vllm"][1]["goodput_req_per_s"] = 0.0
    goodput = next(t for t in judge_targets(long, rounds) if t["metric"] == "goodput_req_per_s")
    assert goodput["worst"] == "inf" and goodput["met"] and json.dumps(goodput)
    rounds["epd"][0]["goodput_req_per_s"] = 0.0
    goodput = next(t for t in judge_targets(long, rounds) if t["metric"] == "goodput_req_per_s")
    assert goodput["rounds"][0] is None and goodput["met"] and goodput["within"] == 1


def test_peer_blocks_split_a_round_and_pool_it_back() -> None:
    from bench.harness.runs import Run
    from bench.peer_compare import LOADS, block_sizes, joined

    assert block_sizes(256, 1) == [256] and block_sizes(10, 4) == [3, 3, 2, 2] and block_sizes(3, 8) == [1, 1, 1]
    assert compare_servers.parse_args(["--peer", "vllm"]).blocks is None   # each load's own
    assert LOADS["demo-c1"].blocks == 8 and LOADS["demo-c16"].blocks == 1
    assert compare_servers.parse_args(["--peer", "vllm", "--blocks", "8"]).blocks == 8

    def part(ttfts: list[float], duration: float, cpu: float) -> Run:
        records = [RequestRecord(i, i, False, "a red circle", status=200, ok=True, ttft_s=t, e2e_s=t + 0.01,
                                 output_tokens=2, text="a red circle", itl_s=[0.001]) for i, t in enumerate(ttfts)]
        return Run("base", {"duration_s": duration, "ok": len(records)}, records, {"decode": cpu}, cpu / 2)

    fast, slow = part([0.010, 0.012], 1.0, 0.5), part([0.020, 0.030, 0.040], 2.0, 1.0)
    run = joined([fast, slow], "epd", 200, 50, True)
    assert run.server == "epd" and len(run.records) == 5 and run.cpu_s == {"decode": 1.5}
    assert run.report["duration_s"] == 3.0 and run.report["req_per_s"] == pytest.approx(5 / 3)
    assert run.report["ttft_ms_p50"] == pytest.approx(20.0)   # the median of all five, not of the blocks'
    one = part([0.010], 1.0, 0.1)
    assert joined([one], "vllm", 200, 50, True) is one and one.server == "vllm"


def test_peer_table_shows_answers_without_text() -> None:
    from bench.peer_compare import table_rows

    vllm = {"req_per_s": 2.0, "ok": 48, "requests": 48, "ok_without_text": 1}
    epd = {"req_per_s": 1.8, "ok": 48, "requests": 48, "ok_without_text": 0}
    by_label = {row[0]: row for row in table_rows(vllm, epd)}
    assert by_label["ok with no text"][1:3] == ["1", "0"]
    assert by_label["requests/s"][3] == "0.90"


def test_peer_checkpoint_renames_only_the_vision_tower(tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from bench.harness.vllm_peer import peer_checkpoint, rename_key

    src = tmp_path / "ckpt"
    src.mkdir()
    save_file({"vision_tower.embeddings.w": torch.ones(2), "language_model.lm_head.weight": torch.zeros(3)},
              str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    out = peer_checkpoint(src, tmp_path / "peer")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["language_model.lm_head.weight", "vision_tower.vision_model.embeddings.w"]
    assert (out / "config.json").read_text() == "{}"
    assert peer_checkpoint(src, tmp_path / "peer") == out   # built once
    assert rename_key("vision_tower.vision_model.x") == "vision_tower.vision_model.x"


def test_prefix_cache_summary_reads_turns_two_on() -> None:
    from bench.prefix_cache import first_turn_text, summarize

    rows = [{"turn": 1, "ttft_s": 3.0, "cached_tokens": 0, "prompt_tokens": 100, "breakdown": {}},
            {"turn": 2, "ttft_s": 0.5, "cached_tokens": 96, "prompt_tokens": 120, "breakdown": {"colocated_prefill_ms": 1}},
            {"turn": 3, "ttft_s": 1.5, "cached_tokens": 0, "prompt_tokens": 140, "breakdown": {}}]
    s = summarize(rows)
    assert s["ttft_p50_turn1_ms"] == 3000 and s["ttft_p50_later_ms"] == 1000
    assert s["hit_rate_later"] == 96 / 260 and s["colocated_later"] == 1
    import random

    text = first_turn_text(300, random.Random(0), ["red", "circle"])
    assert len(text.split()) > 300 and set(text.split()[:300]) <= {"red", "circle"}


def test_sliding_window_handoff_frames_trimmed_chunks_that_decode_accepts() -> None:
    """``bench.sliding_window_handoff`` frames the same prompt dense and trimmed; the trimmed chunks
    carry the layout's bytes and land through the decode receiver (the bench's numbers are from its run)."""
    import time

    import torch

    from bench.sliding_window_handoff import frame
    from decode_svc.kv_receiver import ChunkOutcome, KVReceiver
    from decode_svc.reservations import ReservationTable
    from runtime.model.kv_pool import KVBlockPool, KVLayout
    from runtime.worker.transfer_state import TransferState

    layout = KVLayout(6, 1, 4, torch.float32, sliding_layers=(0, 1, 2, 3, 4), sliding_window=16)
    pool = KVBlockPool(layout, num_blocks=8, block_size=16)
    blocks = pool.allocate(100)
    dense, trimmed = (frame(pool, blocks, 100, 32, "fp", t) for t in (False, True))
    assert sum(len(m.payload) for m in dense) == 100 * layout.bytes_per_token
    assert sum(len(m.payload) for m in trimmed) == layout.wire_bytes(0, 100, 85) == (100 + 5 * 15) * layout.layer_token_bytes
    table = ReservationTable(KVBlockPool(layout, num_blocks=8, block_size=16))
    res = table.reserve("bench", 100, 1, time.monotonic() + 30, "bench-digest", "fp")
    receiver = KVReceiver(table, table.pool)
    for m in trimmed:
        m.reservation.reservation_id, m.reservation.generation = res.reservation_id, 1
        assert receiver.land(m).outcome == ChunkOutcome.ACCEPTED
    assert res.attempt.state == TransferState.SUCCESS
    table.release(res.reservation_id)


def test_rounds_wait_for_a_quiet_host() -> None:
    """A server still spinning after its load (vLLM's CPU engine, about a second) delays the next round."""
    import sys as _sys
    import time as _time

    from bench.harness.usage import wait_quiet
    from launcher.processes import Process, ProcessSpec, stop_group

    spin = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\ntime.sleep(60)"
    busy = Process(ProcessSpec("busy", [_sys.executable, "-c", spin.format(s=0.8)])).start()
    forever = Process(ProcessSpec("forever", [_sys.executable, "-c", spin.format(s=60)]))
    try:
        _time.sleep(0.1)
        waited = wait_quiet([busy])
        assert 0.4 <= waited < 5.0
        assert wait_quiet([busy]) < 0.5   # quiet now: one window
        forever.start()
        assert wait_quiet([busy, forever], timeout_s=0.6) >= 0.6   # never quiet: bounded by the timeout
    finally:
        stop_group([busy, forever])


def test_epd_ab_reads_each_stacks_settings_and_counts_the_rounds_b_won():
    from bench import epd_ab

    args = epd_ab.parse_args(["--b-env", "EPD_COLOCATED_ENCODE_MAX_MS=0", "--b-env", "EPD_CPU_BIND=none",
                              "--concurrency", "1,16", "--requests", "64"])
    assert args.a_env == {} and args.b_env == {"EPD_COLOCATED_ENCODE_MAX_MS": "0", "EPD_CPU_BIND": "none"}
    assert args.concurrency == [1, 16] and args.requests == [64, 64]
    with pytest.raises(SystemExit):
        epd_ab.parse_args(["--b-env", "no-equals-sign"])
    with pytest.raises(SystemExit):
        epd_ab.parse_args(["--concurrency", "1,4,16", "--requests", "8,8"])

    a = [fake_report(ttft_ms_p50=t, req_per_s=r) for t, r in ((10.0, 50.0), (12.0, 40.0), (11.0, 45.0))]
    b = [fake_report(ttft_ms_p50=t, req_per_s=r) for t, r in ((9.0, 55.0), (13.0, 39.0), (10.0, 46.0))]
    s = epd_ab.summarize({"A": a, "B": b})
    assert s["A"]["ttft_ms_p50"] == 11.0 and s["B"]["ttft_ms_p50"] == 10.0
    assert s["A"]["req_per_s"] == 45.0 and s["B"]["req_per_s"] == 46.0
    assert (s["b_lower_ttft_rounds"], s["b_more_req_per_s_rounds"], s["rounds"]) == (2, 2, 3)
    assert s["A"]["itl_ms_p99"] == s["B"]["itl_ms_p99"] == 10.0
    assert "| 1 " in epd_ab.table({1: s}) and "2/3" in epd_ab.table({1: s})
    # a round in which a stack served nothing has no TTFT: it loses that round, and the medians skip it
    a[1].update(ttft_ms_p50=None, itl_ms_p99=None, goodput_req_per_s=0.0, failed=16)
    s = epd_ab.summarize({"A": a, "B": b})
    assert s["A"]["ttft_ms_p50"] == 10.5 and s["A"]["failed"] == 16
    assert (s["b_lower_ttft_rounds"], s["b_more_goodput_rounds"]) == (3, 1)
    assert "| 16 " in epd_ab.table({1: s})
    long = epd_ab.parse_args(["--long-fraction", "0.5", "--ttft-slo-ms", "20000", "--itl-slo-ms", "2000"])
    assert (long.long_fraction, long.long_prompt_words, long.ttft_slo_ms, long.itl_slo_ms) == (0.5, 400, 20000.0, 2000.0)


def test_encode_pricing_compares_both_units_on_later_rounds() -> None:
    """On calls whose time is 2 ms plus 0.1 ms a token, the per-token fit predicts every size and the
    per-image fit (one level for all) over-prices the small image and under-prices the large one."""
    from bench.encode_pricing import compare

    rows = [(r, side, tokens, 2.0 + 0.1 * tokens) for r in range(4) for side, tokens in ((64, 16), (512, 1024))]
    out = compare(rows, rounds=4)
    assert out["64"]["per_token_over_measured"] == pytest.approx(1.0)
    assert out["512"]["per_token_over_measured"] == pytest.approx(1.0)
    assert out["64"]["per_image_over_measured"] > 10 and out["512"]["per_image_over_measured"] < 0.6
    assert out["fits"]["per_token_ms_per_token"] == pytest.approx(0.1)


def test_encode_pricing_builds_a_wider_tower_that_takes_large_images(tmp_path: Path) -> None:
    from bench.encode_pricing import build_model
    from runtime.model.model_adapter import VLMAdapter

    path = build_model(tmp_path / "qwen2-vl", width=128, depth=1)
    vision = json.loads((path / "config.json").read_text())["vision_config"]
    assert (vision["embed_dim"], vision["num_heads"], vision["depth"]) == (128, 2, 1)
    adapter = VLMAdapter.load(path)
    assert [adapter.image_tokens(s, s) for s in (64, 512)] == [16, 1024]   # the pixel cap raised to 512x512
