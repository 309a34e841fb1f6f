"""``epd bench``: load generator for any OpenAI-compatible chat server.

A run, in order:

1. build the workload from the seed (``workload.py``: image pool, prompt mix);
2. draw send times (``arrivals.py``: Poisson / gamma at ``rate``, or all at once);
3. at each send time start a task; a ``concurrency`` semaphore caps requests in
   flight, so a task may wait for a slot before it sends (timing starts at send);
4. each task streams one chat completion and fills a ``RequestRecord``
   (``client.py``), and the progress line moves; requests are spread over
   several HTTP clients, at most ``CONNECTIONS_PER_CLIENT`` connections each
   (httpx's pool does work in proportion to its connections on every request
   event, so one client with hundreds of open streams stalls the generator's
   event loop for seconds, and sends go out late and in bursts);
5. aggregate the records into the report (``metrics.py``) and print / write it.

Library use: ``run_bench(BenchConfig(...)) -> dict`` (the report), or
``await arun_bench(config)`` for the report and the per-request records.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import httpx

from .arrivals import send_offsets
from .client import OPENAI_MAX_RETRIES, chat_body, send_chat
from .metrics import PERCENTILES, summarize
from .record import RequestRecord
from .workload import Workload, build_workload


class BenchError(Exception):
    """The run could not start (bad configuration, no model to name)."""


@dataclass(slots=True)
class BenchConfig:
    base: str = "http://127.0.0.1:8000"  # server root; a trailing /v1 is accepted
    model: str | None = None  # None: the first id from GET {base}/v1/models
    requests: int = 100
    concurrency: int | None = None  # max requests in flight; None: no cap
    rate: float = math.inf  # requests per second; inf: all at time 0
    burstiness: float = 1.0  # gamma shape of the interarrival gaps; 1 = Poisson
    image_pool: int = 8  # distinct images; fewer than requests means reuse
    image_size: int | None = None  # square side in pixels; None: the demo's mixed sizes
    max_tokens: int = 32
    long_fraction: float = 0.0  # share of requests that are long documents
    long_prompt_words: int = 1000  # filler words before the question in a long request
    ttft_slo_ms: float | None = None
    itl_slo_ms: float | None = None  # bounds each request's worst inter-chunk gap
    slo_headers: bool = True  # send the SLOs as x-ttft-slo-ms / x-itl-slo-ms: epd aims at what goodput counts
    seed: int = 0
    check_answers: bool = True
    timeout_s: float = 300.0  # per request, retries and stream included
    max_retries: int = OPENAI_MAX_RETRIES  # a refused request sent again as the openai client does (0: never)
    api_key: str | None = None  # sent as a Bearer token; never echoed
    progress: bool = True  # the updating line on stderr

    def __post_init__(self) -> None:
        self.base = self.base.rstrip("/").removesuffix("/v1")
        self.rate = float(self.rate)  # "inf" from JSON or the command line
        if not self.base.startswith(("http://", "https://")):
            raise ValueError(f"base must be an http(s) URL, got {self.base!r}")
        _require(self.requests >= 1, f"requests must be >= 1, got {self.requests}")
        _require(self.concurrency is None or self.concurrency >= 1,
                 f"concurrency must be >= 1 (omit it for no cap), got {self.concurrency}")
        _require(self.rate > 0, f"rate must be > 0 (inf for all at once), got {self.rate}")
        _require(0 < self.burstiness < math.inf, f"burstiness must be a finite number > 0, got {self.burstiness}")
        _require(self.image_pool >= 1, f"image_pool must be >= 1, got {self.image_pool}")
        _require(self.image_size is None or self.image_size >= 8, f"image_size must be >= 8, got {self.image_size}")
        _require(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _require(0.0 <= self.long_fraction <= 1.0, f"long_fraction must be in [0, 1], got {self.long_fraction}")
        _require(self.long_prompt_words >= 1, f"long_prompt_words must be >= 1, got {self.long_prompt_words}")
        for name in ("ttft_slo_ms", "itl_slo_ms"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"{name} must be > 0, got {value}")
        _require(self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}")
        _require(self.max_retries >= 0, f"max_retries must be >= 0, got {self.max_retries}")

    def to_json(self) -> dict[str, Any]:
        """The config as echoed in the report: JSON-safe, the API key left out."""
        echo = asdict(self)
        echo["rate"] = "inf" if math.isinf(self.rate) else self.rate
        echo["api_key"] = "<set>" if self.api_key else None
        return echo


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


class BenchResult(NamedTuple):
    report: dict[str, Any]
    records: list[RequestRecord]


class Progress:
    """One line on a stream, rewritten in place: done/total, ok, failed."""

    def __init__(self, total: int, stream: TextIO | None, min_interval_s: float = 0.1) -> None:
        self.total, self.stream, self.min_interval_s = total, stream, min_interval_s
        self.done = self.ok = 0
        self._start = time.perf_counter()
        self._drawn_at = -math.inf
        self._width = 0

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.ok += record.ok
        if time.perf_counter() - self._drawn_at >= self.min_interval_s:
            self._draw()

    def close(self) -> None:
        self._draw()
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self) -> None:
        if self.stream is None:
            return
        self._drawn_at = now = time.perf_counter()
        line = (f"[epd bench] {self.done}/{self.total} done, {self.ok} ok, "
                f"{self.done - self.ok} failed, {now - self._start:.1f} s")
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)


async def resolve_model(client: httpx.AsyncClient, base: str) -> str:
    """The first model id the server lists, as ``vllm bench serve`` does without --model."""
    try:
        response = await client.get(f"{base}/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchError(f"no --model given and GET {base}/v1/models named none ({exc})") from exc


CONNECTIONS_PER_CLIENT = 32


async def _run_requests(
    config: BenchConfig, workload: Workload, clients: list[httpx.AsyncClient], model: str,
    on_done: Callable[[RequestRecord], None],
) -> tuple[list[RequestRecord], float]:
    offsets = send_offsets(config.requests, config.rate, config.burstiness, config.seed)
    slots = asyncio.Semaphore(config.concurrency) if config.concurrency else contextlib.nullcontext()
    url = f"{config.base}/v1/chat/completions"
    start = time.perf_counter()

    async def one(index: int) -> RequestRecord:
        spec = workload.requests[index]
        record = RequestRecord(spec.index, spec.image_index, spec.long, spec.answer)
        async with slots:
            record.start_s = time.perf_counter() - start
            client = clients[index % len(clients)]
            await send_chat(client, url, chat_body(spec, model, config.max_tokens), record, config.timeout_s,
                            config.max_retries)
        on_done(record)
        return record

    tasks = []
    for index, offset in enumerate(offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(index)))
    records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - start


async def arun_bench(config: BenchConfig | Mapping[str, Any]) -> BenchResult:
    """Run the benchmark; the report plus every request's record."""
    config = config if isinstance(config, BenchConfig) else BenchConfig(**config)
    workload = build_workload(config.requests, config.image_pool, config.seed, config.long_fraction,
                              config.long_prompt_words, config.image_size)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    if config.slo_headers:   # a server that reads them (epd) targets the SLOs the report judges; others ignore them
        headers.update({name: f"{value:g}" for name, value in
                        (("x-ttft-slo-ms", config.ttft_slo_ms), ("x-itl-slo-ms", config.itl_slo_ms)) if value})
    # a capped run needs concurrency / 32 clients; an open-loop one as many as its requests could
    in_flight = config.concurrency or config.requests
    n_clients = max(1, min(64, -(-in_flight // CONNECTIONS_PER_CLIENT)))
    # no cap per client (the semaphore or the arrival rate is the cap): a request never waits for a connection
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=-(-in_flight // n_clients))
    async with contextlib.AsyncExitStack() as stack:
        # trust_env=False: no proxy from the environment between the client and the server measured.
        clients = [await stack.enter_async_context(httpx.AsyncClient(
            timeout=httpx.Timeout(config.timeout_s), limits=limits, headers=headers, trust_env=False))
            for _ in range(n_clients)]
        model = config.model or await resolve_model(clients[0], config.base)
        progress = Progress(config.requests, sys.stderr if config.progress else None)
        try:
            records, duration_s = await _run_requests(config, workload, clients, model, progress.update)
        finally:
            progress.close()
    report = summarize(records, duration_s, config.ttft_slo_ms, config.itl_slo_ms, config.check_answers)
    report["workload"] = {"model": model, **workload.summary()}
    report["config"] = config.to_json()
    return BenchResult(report, records)


def run_bench(config: BenchConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Run the benchmark from synchronous code and return the report (see README)."""
    return asyncio.run(arun_bench(config)).report


# ---------------------------------------------------------------- command line


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (inf for all at once), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    d = BenchConfig()
    p = argparse.ArgumentParser(
        prog="epd bench",
        description="Load generator for any OpenAI-compatible chat server: streaming chat requests with images.",
        epilog="Metric definitions: bench/README.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--base", default=d.base, help="server root URL (a trailing /v1 is accepted)")
    p.add_argument("--model", default=d.model, help="model name; None = first id of GET /v1/models")
    p.add_argument("--api-key", default=d.api_key, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--requests", type=int, default=d.requests, help="requests to send")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="max requests in flight; None = no cap")
    p.add_argument("--rate", type=_rate, default=d.rate, help="arrival rate in requests/s; inf = all at once")
    p.add_argument("--burstiness", type=float, default=d.burstiness,
                   help="gamma shape of interarrival gaps: 1 = Poisson, <1 burstier, >1 smoother")
    p.add_argument("--image-pool", type=int, default=d.image_pool,
                   help="distinct images; reuse ratio = 1 - min(pool, requests) / requests")
    p.add_argument("--image-size", type=int, default=d.image_size, help="image side in px; None = mixed sizes")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="max output tokens per request")
    p.add_argument("--long-fraction", type=float, default=d.long_fraction, help="share of long-document requests")
    p.add_argument("--long-prompt-words", type=int, default=d.long_prompt_words, help="words of a long document")
    p.add_argument("--ttft-slo-ms", type=float, default=d.ttft_slo_ms, help="TTFT SLO for goodput")
    p.add_argument("--itl-slo-ms", type=float, default=d.itl_slo_ms, help="worst inter-chunk gap SLO for goodput")
    p.add_argument("--slo-headers", action=argparse.BooleanOptionalAction, default=d.slo_headers,
                   help="send the SLOs as x-ttft-slo-ms / x-itl-slo-ms (epd targets them; other servers ignore them)")
    p.add_argument("--seed", type=int, default=d.seed, help="fixes images, prompt mix and arrival times")
    p.add_argument("--check-answers", action=argparse.BooleanOptionalAction, default=d.check_answers,
                   help="count replies equal to the image's 'a <colour> <shape>'")
    p.add_argument("--timeout", dest="timeout_s", type=float, default=d.timeout_s, help="per-request timeout, s")
    p.add_argument("--max-retries", type=int, default=d.max_retries,
                   help="send a request refused with 408/409/429/5xx again, as the openai client does (its default "
                        "2, after the server's Retry-After); 0: never, as vllm bench serve")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=d.progress,
                   help="show the progress line on stderr")
    p.add_argument("--json", metavar="PATH", help="write the JSON report to PATH ('-' for stdout)")
    p.add_argument("--plot", metavar="PATH.png", help="write CDFs of TTFT and ITL")
    p.add_argument("--dump-requests", metavar="PATH.jsonl", help="write one JSON line per request")
    return p


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def format_report(report: Mapping[str, Any]) -> str:
    failed = ", ".join(f"{status}: {n}" for status, n in report["failed_by_status"].items()) or "none"
    rows = [
        ("requests", f"{report['requests']} ({report['ok']} ok, {report['failed']} failed)"),
        ("failed by status", failed),
        ("duration (s)", _fmt(report["duration_s"])),
        ("requests/s", _fmt(report["req_per_s"])),
        ("output tokens/s", _fmt(report["output_tok_per_s"])),
        ("goodput requests/s", _fmt(report["goodput_req_per_s"])),
        ("mean TTFT (ms)", _fmt(report["mean_ttft_ms"])),
    ]
    for metric in ("ttft", "itl", "e2e"):
        values = " / ".join(_fmt(report[f"{metric}_ms_p{q}"]) for q in PERCENTILES)
        rows.append((f"{metric.upper()} p50/p90/p99 (ms)", values))
    if report["answers_checked"]:
        rows.append(("answers correct", f"{report['answers_correct']}/{report['answers_checked']}"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(["=" * 16 + " epd bench " + "=" * 16, *(f"{n.ljust(width)}  {v}" for n, v in rows)])


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when the run finished with at least one ok request, 1 when none was ok, 2 on bad input."""
    args = vars(build_parser().parse_args(argv))
    json_path, plot_path, dump_path = args.pop("json"), args.pop("plot"), args.pop("dump_requests")
    try:
        config = BenchConfig(**args)
    except ValueError as exc:
        print(f"epd bench: {exc}", file=sys.stderr)
        return 2
    try:
        report, records = asyncio.run(arun_bench(config))
    except BenchError as exc:
        print(f"epd bench: {exc}", file=sys.stderr)
        return 2
    print(format_report(report), file=sys.stderr if json_path == "-" else sys.stdout)
    text = json.dumps(report, indent=2, allow_nan=False)
    if json_path == "-":
        print(text)
    elif json_path:
        Path(json_path).write_text(text + "\n")
    if dump_path:
        Path(dump_path).write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
    if plot_path:
        from .plot import plot_cdfs

        plot_cdfs(records, plot_path, config.ttft_slo_ms, config.itl_slo_ms)
    return 0 if report["ok"] else 1
