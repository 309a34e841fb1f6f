"""`epd bench` (bench/): arrival process, metrics, workload, and the tool end to end.

The end-to-end tests run the load generator against a tiny OpenAI-style SSE server
started here (FastAPI + uvicorn on 127.0.0.1). That server tests the load
generator, not epd: it answers each image correctly from a lookup table, streams
word by word, and can be told to return 429 or to break its stream.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench.arrivals import send_offsets
from bench.loadgen import BenchConfig, main, run_bench
from bench.metrics import meets_slo, percentile, summarize
from bench.record import ERROR, RequestRecord
from bench.workload import FILLER_WORDS, QUESTION, build_workload, make_image_pool

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------ arrivals


def test_send_offsets_are_seeded_and_start_at_zero() -> None:
    a = send_offsets(100, rate=5.0, burstiness=1.0, seed=3)
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
    np.testing.assert_array_equal(a, send_offsets(100, rate=5.0, burstiness=1.0, seed=3))
    assert not np.array_equal(a, send_offsets(100, rate=5.0, burstiness=1.0, seed=4))


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_interarrival_gaps_have_mean_one_over_rate_and_gamma_cv(burstiness: float) -> None:
    rate = 10.0
    gaps = np.diff(send_offsets(40_001, rate=rate, burstiness=burstiness, seed=0))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # gamma(shape=k): coefficient of variation 1/sqrt(k); 1 for Poisson
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_everything_at_once() -> None:
    np.testing.assert_array_equal(send_offsets(7, math.inf, 1.0, seed=0), np.zeros(7))


@pytest.mark.parametrize(("rate", "burstiness"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, math.inf)])
def test_send_offsets_rejects_bad_parameters(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        send_offsets(3, rate, burstiness, seed=0)


# ------------------------------------------------------------------- metrics


def _record(i: int, *, ok: bool = True, status: int | str = 200, ttft: float | None = 0.1,
            itl: list[float] | None = None, e2e: float = 0.5, tokens: int = 4, text: str = "a red circle",
            answer: str = "a red circle") -> RequestRecord:
    return RequestRecord(i, 0, False, answer, status=status, ok=ok, ttft_s=ttft, itl_s=itl or [],
                         e2e_s=e2e if ok else None, output_tokens=tokens if ok else 0, text=text if ok else "")


def test_percentile_is_numpys_linear_and_none_when_empty() -> None:
    values = [5.0, 1.0, 3.0, 10.0]
    for q in (50, 90, 99):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None


def test_goodput_needs_every_slo_and_uses_the_worst_gap() -> None:
    fast = _record(0, ttft=0.05, itl=[0.01, 0.02])
    assert meets_slo(fast, ttft_slo_ms=100, itl_slo_ms=20)
    assert not meets_slo(fast, ttft_slo_ms=40, itl_slo_ms=None)  # TTFT 50 ms > 40
    assert not meets_slo(fast, ttft_slo_ms=None, itl_slo_ms=15)  # worst gap 20 ms > 15
    assert meets_slo(_record(1, itl=[]), ttft_slo_ms=None, itl_slo_ms=1)  # one chunk: no gap
    assert not meets_slo(_record(2, ttft=None), ttft_slo_ms=1000, itl_slo_ms=None)  # never produced content
    assert not meets_slo(_record(3, ok=False, status=429), ttft_slo_ms=None, itl_slo_ms=None)
    assert meets_slo(_record(4), ttft_slo_ms=None, itl_slo_ms=None)  # no SLO: every ok request is good


def test_summarize_counts_rates_percentiles_and_goodput() -> None:
    records = [
        _record(0, ttft=0.010, itl=[0.001, 0.0036], tokens=3),  # worst gap 3.6 ms
        _record(1, ttft=0.020, itl=[0.002], tokens=5, text=" A Red Circle "),
        _record(2, ttft=0.200, itl=[0.004], tokens=7, text="a blue square"),
        _record(3, ok=False, status=429),
        _record(4, ok=False, status=ERROR),
        _record(5, ok=False, status=429),
    ]
    report = summarize(records, duration_s=2.0, ttft_slo_ms=50, itl_slo_ms=3.5)
    assert (report["requests"], report["ok"], report["failed"]) == (6, 3, 3)
    assert report["failed_by_status"] == {"429": 2, "error": 1}
    assert report["req_per_s"] == pytest.approx(1.5)
    assert report["output_tok_per_s"] == pytest.approx(15 / 2)
    assert report["goodput_req_per_s"] == pytest.approx(1 / 2)  # #0 misses the ITL SLO, #2 the TTFT SLO
    assert report["ttft_ms_p50"] == pytest.approx(20.0)
    assert report["mean_ttft_ms"] == pytest.approx(230 / 3)
    itl_ms = [1.0, 3.6, 2.0, 4.0]  # every gap of every ok request
    for q in (50, 90, 99):
        assert report[f"itl_ms_p{q}"] == pytest.approx(float(np.percentile(itl_ms, q)))
    assert report["e2e_ms_p99"] == pytest.approx(500.0)
    tpot = [(r.e2e_s - r.ttft_s) * 1e3 / (r.output_tokens - 1) for r in records[:3]]   # vllm bench serve's TPOT
    assert report["tpot_ms_p50"] == pytest.approx(float(np.percentile(tpot, 50)))
    assert (report["answers_correct"], report["answers_checked"]) == (2, 3)
    assert summarize(records, 2.0, check_answers=False)["answers_checked"] == 0
    assert summarize(records, 2.0)["goodput_req_per_s"] == report["req_per_s"]


def test_summarize_counts_answers_without_text_apart() -> None:
    """A request that streamed tokens but no text (a server that drops undecodable bytes) has no TTFT:
    it is left out of the TTFT percentiles, and the report says how many were."""
    records = [_record(0, ttft=0.010), _record(1, ttft=None, itl=[]), _record(2, ok=False, status=429)]
    report = summarize(records, duration_s=1.0)
    assert report["ok_without_text"] == 1
    assert report["ttft_ms_p99"] == pytest.approx(10.0)


def test_summarize_with_no_successes_reports_nulls() -> None:
    report = summarize([_record(0, ok=False, status=503)], duration_s=1.0)
    assert report["ok"] == 0 and report["ttft_ms_p50"] is None and report["mean_ttft_ms"] is None


# ------------------------------------------------------------------ workload


def test_image_pool_is_distinct_deterministic_and_prefix_stable() -> None:
    pool = make_image_pool(16, seed=1)
    assert len({im.sha256 for im in pool}) == 16
    assert all(im.data_url.startswith("data:image/png;base64,") for im in pool)
    assert all(im.answer.split()[0] == "a" and len(im.answer.split()) == 3 for im in pool)
    assert [im.sha256 for im in make_image_pool(16, seed=1)] == [im.sha256 for im in pool]
    assert [im.sha256 for im in make_image_pool(4, seed=1)] == [im.sha256 for im in pool[:4]]
    assert [im.sha256 for im in make_image_pool(4, seed=2)] != [im.sha256 for im in pool[:4]]


def test_workload_reuse_ratio_and_long_fraction() -> None:
    w = build_workload(requests=20, image_pool=5, seed=0, long_fraction=0.25, long_prompt_words=30)
    assert w.summary() == {"distinct_images": 5, "image_reuse_ratio": pytest.approx(0.75), "long_requests": 5}
    for spec in w.requests:
        image_part, text_part = spec.messages[0]["content"]
        assert image_part["type"] == "image_url" and text_part["type"] == "text"
        assert image_part["image_url"]["url"] == w.images[spec.image_index].data_url
        assert spec.answer == w.images[spec.image_index].answer
        words = text_part["text"].removesuffix(QUESTION).split()
        assert text_part["text"].endswith(QUESTION) and len(words) == (30 if spec.long else 0)
        assert set(words) <= set(FILLER_WORDS)
    again = build_workload(requests=20, image_pool=5, seed=0, long_fraction=0.25, long_prompt_words=30)
    assert [s.messages for s in again.requests] == [s.messages for s in w.requests]


def test_filler_words_are_in_the_demo_models_vocabulary() -> None:
    from runtime.demo_model.vocabulary import WORDS

    assert set(FILLER_WORDS) <= set(WORDS)
    assert set(QUESTION.replace("?", " ?").split()) <= set(WORDS)


def test_config_validates_and_echoes_safely() -> None:
    config = BenchConfig(base="http://h:1/v1/", rate="inf", api_key="secret")  # type: ignore[arg-type]
    assert config.base == "http://h:1" and math.isinf(config.rate)
    echo = config.to_json()
    assert echo["rate"] == "inf" and echo["api_key"] == "<set>"
    json.dumps(echo, allow_nan=False)
    for bad in ({"requests": 0}, {"concurrency": 0}, {"rate": 0}, {"burstiness": -1}, {"image_pool": 0},
                {"long_fraction": 1.5}, {"ttft_slo_ms": 0}, {"base": "h:1"}):
        with pytest.raises(ValueError):
            BenchConfig(**bad)  # type: ignore[arg-type]


def test_importing_bench_does_not_import_torch() -> None:
    code = "import sys, bench.loadgen, bench.plot; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


# ------------------------------------------------- the tool against a fake server


@dataclass
class FakeServer:
    """State of the tiny SSE server: how it behaves and what it saw."""

    answers: dict[str, str] = field(default_factory=dict)  # image data URL -> answer
    fail_every: int = 0  # every n-th request gets 429
    refusal_headers: dict[str, str] = field(default_factory=dict)  # on each 429 (retry-after-ms, x-should-retry)
    break_stream: bool = False  # send an error event instead of the answer
    chunk_delay_s: float = 0.003
    seen: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def reset(self) -> None:
        """Back to defaults in place (the running app holds this object)."""
        self.__dict__.update(FakeServer().__dict__)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _chunk(content: str | None = None, role: str | None = None) -> dict[str, Any]:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def _fake_app(state: FakeServer) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-vlm", "object": "model"}]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        state.bodies.append(body)
        state.seen += 1
        if state.fail_every and state.seen % state.fail_every == 0:
            return JSONResponse({"error": {"message": "slow down", "type": "rate_limit"}}, status_code=429,
                                headers=state.refusal_headers)
        url = body["messages"][0]["content"][0]["image_url"]["url"]
        words = state.answers.get(url, "a red circle").split()
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)

        async def events():  # noqa: ANN202
            try:
                yield _sse(_chunk(role="assistant", content=""))  # role-only: not a token
                if state.break_stream:
                    yield _sse({"error": {"message": "decode worker lost", "code": 500}})
                    return
                for i, word in enumerate(words):
                    await asyncio.sleep(state.chunk_delay_s)
                    yield _sse(_chunk(word if i == 0 else " " + word))
                yield _sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                yield _sse({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": len(words) + 1}})
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"x-epd-ttft-breakdown": "queue=0.1;encode=1.2;prefill=3.4"})

    return app


@pytest.fixture(scope="module")
def fake_server() -> Any:
    state = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_fake_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield state, f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def fake(fake_server: Any) -> Any:
    state, base = fake_server
    state.reset()
    return state, base


def test_bench_end_to_end_with_429s(fake: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state, base = fake
    state.fail_every = 5
    state.answers = {im.data_url: im.answer for im in make_image_pool(3, seed=7)}
    out, dump = tmp_path / "report.json", tmp_path / "requests.jsonl"
    rc = main(["--base", base, "--requests", "10", "--concurrency", "3", "--rate", "500", "--burstiness", "0.5",
               "--image-pool", "3", "--seed", "7", "--long-fraction", "0.3", "--long-prompt-words", "50",
               "--ttft-slo-ms", "10000", "--itl-slo-ms", "10000", "--json", str(out), "--dump-requests", str(dump),
               "--max-retries", "0"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert (report["requests"], report["ok"], report["failed"], report["retried"]) == (10, 8, 2, 0)
    assert report["failed_by_status"] == {"429": 2}
    for key in ("duration_s", "req_per_s", "output_tok_per_s", "goodput_req_per_s", "mean_ttft_ms",
                *(f"{m}_ms_p{q}" for m in ("ttft", "itl", "e2e") for q in (50, 90, 99))):
        assert isinstance(report[key], float) and report[key] > 0, key
    assert report["req_per_s"] == pytest.approx(8 / report["duration_s"])
    assert report["goodput_req_per_s"] == pytest.approx(report["req_per_s"])  # generous SLOs
    assert report["output_tok_per_s"] == pytest.approx(8 * 4 / report["duration_s"])  # usage: 3 words + EOS
    assert report["ttft_ms_p50"] <= report["ttft_ms_p90"] <= report["ttft_ms_p99"] <= report["e2e_ms_p99"]
    assert (report["answers_correct"], report["answers_checked"]) == (8, 8)
    assert report["workload"] == {"model": "fake-vlm", "distinct_images": 3,
                                  "image_reuse_ratio": pytest.approx(0.7), "long_requests": 3}
    assert report["config"]["requests"] == 10 and report["config"]["concurrency"] == 3
    assert state.max_in_flight <= 3
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    assert sorted(r["status"] for r in rows) == [200] * 8 + [429] * 2
    assert all(r["ttft_breakdown"] == "queue=0.1;encode=1.2;prefill=3.4" for r in rows if r["ok"])
    assert all(len(r["itl_s"]) == 2 and r["output_tokens"] == 4 for r in rows if r["ok"])
    assert all("slow down" in r["error"] for r in rows if not r["ok"])
    body = state.bodies[0]
    assert body["model"] == "fake-vlm" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 32
    captured = capsys.readouterr()
    assert "10/10 done, 8 ok, 2 failed" in captured.err  # the progress line
    assert "goodput requests/s" in captured.out  # the printed summary


def test_a_refused_request_is_sent_again_as_the_openai_client_would(fake: Any, tmp_path: Path) -> None:
    """After the server's retry-after-ms, up to --max-retries times (the openai client's 2 by
    default), with TTFT from the first send; never when the server says x-should-retry: false."""
    state, base = fake
    state.fail_every, state.refusal_headers = 2, {"retry-after-ms": "150"}
    out, dump = tmp_path / "r.json", tmp_path / "requests.jsonl"
    assert main(["--base", base, "--model", "m", "--requests", "4", "--concurrency", "1", "--no-progress",
                 "--no-check-answers", "--json", str(out), "--dump-requests", str(dump)]) == 0
    report = json.loads(out.read_text())
    assert (report["ok"], report["failed"], report["retried"], state.seen) == (4, 0, 3, 7)
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    retried = [r for r in rows if r["retries"]]
    assert [r["retries"] for r in retried] == [1, 1, 1] and all(r["error"] is None for r in retried)
    assert all(r["ttft_s"] >= 0.15 for r in retried)       # the wait counts against the request
    assert all(r["ttft_s"] < 0.15 for r in rows if not r["retries"])

    state.reset()
    state.fail_every, state.refusal_headers = 1, {"retry-after-ms": "10"}   # refused every time
    assert main(["--base", base, "--model", "m", "--requests", "1", "--no-progress", "--json", str(out)]) == 1
    assert json.loads(out.read_text())["failed_by_status"] == {"429": 1} and state.seen == 3   # 1 + 2 retries

    state.reset()
    state.fail_every, state.refusal_headers = 1, {"retry-after-ms": "10", "x-should-retry": "false"}
    assert main(["--base", base, "--model", "m", "--requests", "1", "--no-progress", "--json", str(out)]) == 1
    assert state.seen == 1


def test_json_to_stdout_plot_and_library_call(fake: Any, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    state, base = fake
    plot = tmp_path / "cdf.png"
    rc = main(["--base", base + "/v1", "--model", "other", "--requests", "4", "--no-progress",
               "--no-check-answers", "--ttft-slo-ms", "0.001", "--json", "-", "--plot", str(plot)])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)  # stdout is the JSON alone
    assert report["ok"] == 4 and report["answers_checked"] == 0
    assert report["goodput_req_per_s"] == 0.0  # nobody beats a 1 us TTFT
    assert plot.stat().st_size > 0
    assert state.bodies[0]["model"] == "other"

    report = run_bench({"base": base, "requests": 3, "rate": 1000.0, "progress": False, "max_tokens": 8})
    assert report["ok"] == 3 and report["config"]["max_tokens"] == 8


def test_broken_stream_counts_as_error(fake: Any, tmp_path: Path) -> None:
    state, base = fake
    state.break_stream = True
    out = tmp_path / "r.json"
    assert main(["--base", base, "--model", "m", "--requests", "2", "--no-progress", "--json", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["failed_by_status"] == {"error": 2} and report["ok"] == 0


def test_unreachable_server_counts_connection_errors(tmp_path: Path) -> None:
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        base = f"http://127.0.0.1:{closed.getsockname()[1]}"
        out = tmp_path / "r.json"
        rc = main(["--base", base, "--model", "m", "--requests", "3", "--no-progress", "--json", str(out)])
    assert rc == 1
    assert json.loads(out.read_text())["failed_by_status"] == {"error": 3}
    assert main(["--base", base, "--requests", "1", "--no-progress"]) == 2  # no --model and no /v1/models


def test_bad_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--requests", "0"]) == 2
    assert "requests must be >= 1" in capsys.readouterr().err
