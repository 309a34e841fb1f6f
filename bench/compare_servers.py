"""Side by side, in one run: ``transformers serve`` vs ``epd serve`` on the same model and load.

    epd demo-model --bench --out /tmp/epd-bench-vlm          # once, for the bench model
    python -m bench.compare_servers                            # demo + bench model, defaults below
    python -m bench.compare_servers --models demo --requests 32 --concurrency 16 --rounds 2

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
(``compare_servers-cache.png``). Process helpers here are reused by
``bench/placement_comparison.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen import BenchConfig, arun_bench
from bench.metrics import summarize
from bench.record import RequestRecord

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DEFAULT_MODELS = {"demo": ROOT / "models" / "demo-vlm", "bench": Path("/tmp/epd-bench-vlm")}
TARGET_THROUGHPUT_RATIO = 2.0
TARGET_TTFT_P50_RATIO = 0.5

# ---------------------------------------------------------------- processes


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _bind_to_parent() -> None:
    """Children get SIGTERM when this script dies (Linux), so none is orphaned."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Proc:
    """One child process with its log file; stopped by its own pid only."""

    name: str
    cmd: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    def start(self) -> "Proc":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                                     preexec_fn=_bind_to_parent)
        log.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def cpu_seconds(self) -> dict[str, float]:
        """User+system CPU seconds used so far by this process and its children, by role.

        The role of an ``epd`` child is its subcommand (encoder, prefill, decode,
        gateway); anything else counts under this process's name. Processes that
        exited are not counted, so take differences over a run the servers survive.
        """
        import psutil

        out: dict[str, float] = {}
        if not self.alive():
            return out
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return out
        for proc in procs:
            try:
                t = proc.cpu_times()
                cmd = proc.cmdline()
            except psutil.Error:
                continue
            role = next((c for c in cmd if c in ("encoder", "prefill", "decode", "gateway")), self.name)
            out[role] = out.get(role, 0.0) + t.user + t.system
        return out

    def stop(self, grace_s: float = 20.0) -> None:
        if not self.alive():
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class StartError(RuntimeError):
    pass


def wait_http(url: str, procs: Sequence[Proc], timeout_s: float = 300.0) -> None:
    """Poll ``url`` until it answers 200; fail early when one of ``procs`` exits."""
    end = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while True:
            for p in procs:
                if not p.alive():
                    raise StartError(f"{p.name} exited with {p.proc.returncode if p.proc else '?'}:\n{p.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url).status_code == 200:
                    return
            if time.monotonic() > end:
                raise StartError(f"{url} not healthy after {timeout_s:.0f} s")
            time.sleep(0.3)


def venv_tool(name: str) -> str:
    """A console script next to this interpreter (``.venv/bin/transformers``)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def transformers_serve(model: Path, port: int, logs: Path, threads: int | None = None) -> Proc:
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    else:
        env["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)  # torch's default, explicit against an inherited value
    cmd = [venv_tool("transformers"), "serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
           "--log-level", "warning", str(model.resolve())]
    return Proc("transformers serve", cmd, logs / f"transformers-serve-{port}.log", env)


def epd_serve(model: Path, port: int, logs: Path, name: str, extra: Sequence[str] = ()) -> Proc:
    cmd = [sys.executable, "-m", "launcher.cli", "serve", "--model", str(model.resolve()), "--port", str(port),
           "--served-model-name", name, *extra]
    return Proc("epd serve", cmd, logs / f"epd-serve-{port}.log")


# ---------------------------------------------------------------- load


@dataclass
class Run:
    """One load run against one server: the loadgen report and its records."""

    server: str
    report: dict[str, Any]
    records: list[RequestRecord]
    cpu_s: dict[str, float] = field(default_factory=dict)  # server CPU seconds over the run, by role
    client_cpu_s: float = 0.0  # this process (the load generator) over the run


def run_load(base: str, model_name: str, proc: Proc | None = None, **config: Any) -> Run:
    """One loadgen run; with ``proc``, also the server's CPU seconds spent during it."""
    cfg = BenchConfig(base=base, model=model_name, progress=False, **config)
    before = proc.cpu_seconds() if proc else {}
    client0 = time.process_time()
    report, records = asyncio.run(arun_bench(cfg))
    client = time.process_time() - client0
    after = proc.cpu_seconds() if proc else {}
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


def scrape_counters(base: str, prefix: str = "epd:") -> dict[str, float]:
    """Counters/gauges of a Prometheus ``/metrics`` page whose name starts with ``prefix``:
    ``'name{labels}' -> value`` (empty when the page cannot be read)."""
    try:
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            text = client.get(f"{base}/metrics").text
    except httpx.HTTPError:
        return {}
    return parse_prometheus(text, prefix)


def parse_prometheus(text: str, prefix: str = "epd:") -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[name] = float(value)
    return out


def counter_delta(before: Mapping[str, float], after: Mapping[str, float], prefix: str) -> dict[str, float]:
    """``after - before`` for the series whose name starts with ``prefix`` (non-zero ones only)."""
    keys = {k for k in after if k.startswith(prefix)}
    return {k: after[k] - before.get(k, 0.0) for k in sorted(keys) if after[k] - before.get(k, 0.0)}


# ---------------------------------------------------------------- tables

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


def ratio(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or old == 0:
        return None
    return new / old


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.{digits}f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


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


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


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


# ---------------------------------------------------------------- plots


def plot_cdfs(series: Mapping[str, Sequence[RequestRecord]], path: Path, title: str) -> None:
    """Three panels, one line per labelled series (small PNG): the empirical CDFs of TTFT and
    ITL, and the ITL tail (fraction of gaps above x, log-log), where a stall shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for i, (label, records) in enumerate(series.items()):
        color = f"C{i}"
        ok = [r for r in records if r.ok]
        ttft = np.sort([r.ttft_s * 1e3 for r in ok if r.ttft_s is not None])
        itl = np.sort([g * 1e3 for r in ok for g in r.itl_s])
        for ax, xs in ((axes[0], ttft), (axes[1], itl)):
            if len(xs):
                ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", color=color,
                        label=f"{label} (n={len(xs)})")
        if len(itl):
            axes[2].step(itl, (len(itl) - np.arange(len(itl))) / len(itl), where="post", color=color, label=label)
    for ax, name, ylabel in zip(axes, ("TTFT CDF", "ITL CDF", "ITL tail"),
                                ("fraction", "fraction", "fraction of gaps >= x (log)")):
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("ms (log)", fontsize=8)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[2].set_yscale("log")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=70)
    plt.close(fig)


# ---------------------------------------------------------------- host


def host_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()}
    with contextlib.suppress(OSError):
        info["load_avg"] = list(os.getloadavg())
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "CPU(s)", "Thread(s) per core", "Hypervisor vendor"):
                info[key.strip()] = value.strip()
    with contextlib.suppress(Exception):
        import importlib.metadata as md

        info["versions"] = {p: md.version(p) for p in ("torch", "transformers", "accelerate", "fastapi", "uvicorn")}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout  # noqa: E731
        info["git_commit"] = git("rev-parse", "--short", "HEAD").strip()
        info["git_dirty_files"] = len(git("status", "--short").splitlines())
        import hashlib

        info["git_diff_sha1"] = hashlib.sha1(git("diff", "HEAD").encode()).hexdigest()[:12]
    return info


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.compare_servers", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default="demo,bench", help="comma-separated: demo, bench")
    p.add_argument("--demo-model", type=Path, default=DEFAULT_MODELS["demo"])
    p.add_argument("--bench-model", type=Path, default=DEFAULT_MODELS["bench"],
                   help="built by `epd demo-model --bench --out DIR`")
    p.add_argument("--requests", type=int, default=64, help="requests per server per round, demo model")
    p.add_argument("--bench-requests", type=int, default=24, help="requests per server per round, bench model")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="runs per server, alternating which goes first")
    p.add_argument("--max-tokens", type=int, default=16,
                   help="max_tokens (the demo model stops after its 3-word answer)")
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests per server")
    p.add_argument("--seed", type=int, default=100)
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
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON + PNGs go here")
    p.add_argument("--tag", default="", help="suffix of the output files: compare_servers-TAG.json ...")
    p.add_argument("--logs", type=Path, default=Path("/tmp/epd-compare-logs"))
    args = p.parse_args(argv)
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
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
    if args.tag and not args.tag.replace("-", "").replace("_", "").isalnum():
        p.error("--tag: letters, digits, - and _ only")
    if args.cache_only and args.cache_model == "none":
        p.error("--cache-only needs a --cache-model")
    return args


def stem(args: argparse.Namespace) -> str:
    """Output file stem: ``compare_servers`` or ``compare_servers-TAG``."""
    return "compare_servers" + (f"-{args.tag}" if args.tag else "")


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
        for proc, _, _ in servers.values():
            proc.stop()
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
    args.out.mkdir(parents=True, exist_ok=True)
    plot_cdfs({name: [r for run in rs for r in run.records] for name, rs in runs.items()},
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
    plot_cdfs({"distinct images (miss)": [r for run in distinct for r in run.records],
               "same images again (hit)": [r for run in repeated for r in run.records]},
              args.out / f"{stem(args)}-cache.png",
              f"epd, {kind} model: encoder cache, {args.cache_requests} req, concurrency {args.cache_concurrency}")
    return out


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


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    t0 = time.monotonic()
    host = host_info()
    results = []
    try:
        if args.cache_only:
            results.append(cache_only(args, args.cache_model))
        for kind in [] if args.cache_only else args.model_list:
            results.append(compare_model(args, kind))
    except StartError as exc:
        print(f"compare_servers: {exc}", file=sys.stderr)
        return 1
    for result in results:
        print_model(result)
    host_end = host_info().get("load_avg")
    payload = {"benchmark": "compare_servers", "started": started, "wall_s": time.monotonic() - t0,
               "command": "python -m bench.compare_servers " + " ".join(argv if argv is not None else sys.argv[1:]),
               "host": {**host, "load_avg_end": host_end},
               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"{stem(args)}{'-cache' if args.cache_only else ''}.json"
    (args.out / name).write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
    print(f"\nwritten: {args.out / name} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
