"""Load runs against one server, and the statistics over several: pooled report, CPU per request,
identical replies, error samples."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.loadgen import BenchConfig, arun_bench
from bench.metrics import summarize
from bench.record import RequestRecord
from launcher.processes import Process

from .usage import cpu_seconds


@dataclass
class Run:
    """One load run against one server: the loadgen report and its records."""

    server: str
    report: dict[str, Any]
    records: list[RequestRecord]
    cpu_s: dict[str, float] = field(default_factory=dict)  # server CPU seconds over the run, by role
    client_cpu_s: float = 0.0  # this process (the load generator) over the run


def run_load(base: str, model_name: str, proc: Process | None = None, **config: Any) -> Run:
    """One loadgen run; with ``proc``, also the server's CPU seconds spent during it."""
    cfg = BenchConfig(base=base, model=model_name, progress=False, **config)
    before = cpu_seconds(proc) if proc else {}
    client0 = time.process_time()
    report, records = asyncio.run(arun_bench(cfg))
    client = time.process_time() - client0
    after = cpu_seconds(proc) if proc else {}
    cpu = {k: after[k] - before.get(k, 0.0) for k in after}
    return Run(base, report, records, cpu, client)


def cpu_per_request(runs: Sequence[Run]) -> dict[str, float]:
    """Server CPU milliseconds per ok request, by role and ``total``, over runs."""
    ok = sum(run.report["ok"] for run in runs)
    totals: dict[str, float] = {}
    for run in runs:
        for role, sec in run.cpu_s.items():
            totals[role] = totals.get(role, 0.0) + sec
    if not ok or not totals:
        return {}
    out = {role: sec * 1e3 / ok for role, sec in sorted(totals.items())}
    out["total"] = sum(totals.values()) * 1e3 / ok
    out["load_generator"] = sum(run.client_cpu_s for run in runs) * 1e3 / ok
    return out


def pooled(runs: Sequence[Run], ttft_slo_ms: float | None = None, itl_slo_ms: float | None = None,
           check_answers: bool = True) -> dict[str, Any]:
    """One report over several runs: every record, durations added (runs were back to back)."""
    records = [r for run in runs for r in run.records]
    duration = sum(run.report["duration_s"] for run in runs)
    return summarize(records, duration, ttft_slo_ms, itl_slo_ms, check_answers)


def same_text(a: Sequence[RequestRecord], b: Sequence[RequestRecord]) -> tuple[int, int]:
    """Requests (matched by index) that both servers answered, and how many got identical text."""
    by_index = {r.index: r for r in b if r.ok}
    both = [(r, by_index[r.index]) for r in a if r.ok and r.index in by_index]
    return sum(x.text == y.text for x, y in both), len(both)


def error_samples(records: Iterable[RequestRecord], limit: int = 5) -> list[str]:
    """The first few distinct failure messages (status: error body), for the report."""
    seen: list[str] = []
    for r in records:
        if not r.ok:
            text = f"{r.status}: {(r.error or '')[:300]}"
            if text not in seen:
                seen.append(text)
            if len(seen) >= limit:
                break
    return seen


def failures_by_status(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Failed requests counted by status (as strings: ``"503"``, ``"error"``)."""
    out: dict[str, int] = {}
    for r in records:
        if not r.ok:
            out[str(r.status)] = out.get(str(r.status), 0) + 1
    return out
