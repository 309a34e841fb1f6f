"""``compare_servers``'s tables and verdicts: epd / transformers ratios, the issue's targets, the
encoder-cache run, and how they are printed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bench.harness.report import fmt, markdown_table, ratio

TARGET_THROUGHPUT_RATIO = 2.0
TARGET_TTFT_P50_RATIO = 0.5

# (label, report key, better): "higher" or "lower"
RATIO_ROWS: tuple[tuple[str, str, str], ...] = (
    ("requests/s", "req_per_s", "higher"),
    ("output tokens/s", "output_tok_per_s", "higher"),
    ("TTFT p50 (ms)", "ttft_ms_p50", "lower"),
    ("TTFT p90 (ms)", "ttft_ms_p90", "lower"),
    ("TTFT p99 (ms)", "ttft_ms_p99", "lower"),
    ("ITL p50 (ms)", "itl_ms_p50", "lower"),
    ("ITL p99 (ms)", "itl_ms_p99", "lower"),
    ("E2E p50 (ms)", "e2e_ms_p50", "lower"),
    ("E2E p99 (ms)", "e2e_ms_p99", "lower"),
)


def ratio_rows(base: Mapping[str, Any], epd: Mapping[str, Any]) -> list[list[str]]:
    """Rows ``metric | transformers | epd | epd/transformers`` (+ ok and answers rows)."""
    rows = [[label, fmt(base.get(key)), fmt(epd.get(key)), fmt(ratio(epd.get(key), base.get(key)))]
            for label, key, _ in RATIO_ROWS]
    b_cpu = (base.get("server_cpu_ms_per_request") or {}).get("total")
    e_cpu = (epd.get("server_cpu_ms_per_request") or {}).get("total")
    if b_cpu is not None or e_cpu is not None:
        rows.append(["server CPU ms / request", fmt(b_cpu), fmt(e_cpu), fmt(ratio(e_cpu, b_cpu))])
    rows.append(["ok / requests", f"{base['ok']}/{base['requests']}", f"{epd['ok']}/{epd['requests']}", ""])
    if base.get("answers_checked") or epd.get("answers_checked"):
        rows.append(["answers correct", f"{base['answers_correct']}/{base['answers_checked']}",
                     f"{epd['answers_correct']}/{epd['answers_checked']}", ""])
    return rows


def check_targets(base: Mapping[str, Any], epd: Mapping[str, Any],
                  identical: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The issue's targets (demo model): epd throughput >= 2x, TTFT p50 <= 0.5x, every answer correct.

    ``identical`` (``{"same", "compared"}``) adds whether every epd reply equals transformers'
    (the model's own ``generate()``): a wrong answer both give is the model's, not the server's.
    """
    tput = ratio(epd.get("req_per_s"), base.get("req_per_s"))
    ttft = ratio(epd.get("ttft_ms_p50"), base.get("ttft_ms_p50"))
    all_correct = epd["ok"] == epd["requests"] and epd["answers_checked"] == epd["ok"] == epd["answers_correct"]
    checks = {
        "throughput_ratio": tput,
        "throughput_ok": tput is not None and tput >= TARGET_THROUGHPUT_RATIO,
        "ttft_p50_ratio": ttft,
        "ttft_p50_ok": ttft is not None and ttft <= TARGET_TTFT_P50_RATIO,
        "epd_all_correct": all_correct,
    }
    checks["all_met"] = checks["throughput_ok"] and checks["ttft_p50_ok"] and all_correct
    if identical is not None:
        checks["epd_matches_transformers"] = identical["compared"] > 0 and identical["same"] == identical["compared"]
    return checks


def cache_rows(distinct: Mapping[str, Any], repeated: Mapping[str, Any]) -> list[list[str]]:
    """Rows ``metric | distinct images | repeated images | repeated/distinct`` for the cache run."""
    keys = (("TTFT p50 (ms)", "ttft_ms_p50"), ("TTFT p90 (ms)", "ttft_ms_p90"), ("mean TTFT (ms)", "mean_ttft_ms"),
            ("E2E p50 (ms)", "e2e_ms_p50"), ("requests/s", "req_per_s"))
    rows = [[label, fmt(distinct.get(k)), fmt(repeated.get(k)), fmt(ratio(repeated.get(k), distinct.get(k)))]
            for label, k in keys]
    dh, rh = distinct.get("cache_checks", {}), repeated.get("cache_checks", {})
    if dh or rh:
        rows.append(["images found cached / checked (gateway)", f"{dh.get('hit', 0):.0f}/{dh.get('checked', 0):.0f}",
                     f"{rh.get('hit', 0):.0f}/{rh.get('checked', 0):.0f}", ""])
    return rows


def print_model(result: Mapping[str, Any]) -> None:
    kind = result["model"]
    if "table" not in result:  # --cache-only
        print_cache(result)
        return
    print(f"\n## {kind} model: transformers serve vs epd serve\n")
    print(markdown_table(["metric", "transformers", "epd", "epd / transformers"], result["table"]))
    same = result["identical_text"]
    print(f"\nidentical replies across the two servers: {same['same']}/{same['compared']}")
    split = result["reports"]["epd"].get("server_cpu_ms_per_request") or {}
    if split:
        print("epd server CPU ms per request by process: "
              + ", ".join(f"{role} {fmt(ms)}" for role, ms in split.items() if role not in ("total", "load_generator"))
              + f"; load generator {fmt(split.get('load_generator'))}")
    if "targets" in result:
        t = result["targets"]
        print(f"targets: throughput {fmt(t['throughput_ratio'])}x (>= {TARGET_THROUGHPUT_RATIO}: "
              f"{'met' if t['throughput_ok'] else 'MISSED'}), TTFT p50 {fmt(t['ttft_p50_ratio'])}x "
              f"(<= {TARGET_TTFT_P50_RATIO}: {'met' if t['ttft_p50_ok'] else 'MISSED'}), "
              f"every epd answer correct: {'yes' if t['epd_all_correct'] else 'NO'}"
              + (f" (every epd reply identical to transformers': {'yes' if t['epd_matches_transformers'] else 'NO'})"
                 if "epd_matches_transformers" in t else ""))
    print_cache(result)


def print_cache(result: Mapping[str, Any]) -> None:
    if "cache" in result:
        print(f"\n## epd encoder cache ({result['model']} model)\n")
        print(markdown_table(["metric", "distinct images", "same images again", "again / distinct"],
                             result["cache"]["table"]))
