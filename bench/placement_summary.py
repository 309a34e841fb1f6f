"""``placement_comparison``'s verdicts: each placement x scenario's metrics, the tables with the
best value marked, and the design chapter's claims checked on them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench.harness.report import fmt, ratio
from bench.harness.runs import error_samples, failures_by_status
from bench.metrics import meets_slo, percentile
from bench.placement_load import ScenarioRun


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
        "failed_by_status": failures_by_status(run.short + run.long),
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
