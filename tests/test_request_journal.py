"""One log line per finished request, the dashboard's data, its key rule, the last-minute arithmetic.

The app runs on the in-process backend (the real model); the line is read from the
``epd.gateway.requests`` logger through the real formatters (``runtime/worker/log_format.py``).
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from fastapi.testclient import TestClient
from inprocess_backend import InProcessBackend, demo_model_path

from gateway.app import create_app
from gateway.chat_backend import AdmissionRefused
from gateway.live_window import CounterHistory, TimedSamples, percentile
from gateway.settings import GatewaySettings
from runtime.worker.log_format import JsonFormatter, TextFormatter

KEY = "sk-journal"


class Lines(logging.Handler):
    def __init__(self, formatter: logging.Formatter):
        super().__init__()
        self.setFormatter(formatter)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "epd.gateway.requests":
            self.lines.append(self.format(record))


@pytest.fixture
def captured():
    json_lines, text_lines = Lines(JsonFormatter()), Lines(TextFormatter())
    logger = logging.getLogger("epd.gateway.requests")
    logger.addHandler(json_lines)
    logger.addHandler(text_lines)
    logger.setLevel(logging.INFO)
    try:
        yield json_lines, text_lines
    finally:
        logger.removeHandler(json_lines)
        logger.removeHandler(text_lines)


@pytest.fixture
def client(model, prompts):
    backend = InProcessBackend(model[0])
    app = create_app(GatewaySettings(model=str(demo_model_path()[0]), api_key=[KEY]), backend, prompt_builder=prompts)
    with TestClient(app) as c:
        c.backend = backend
        yield c


def chat(client: TestClient, **extra) -> httpx.Response:
    return client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "demo-vlm", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
                             "temperature": 0, **extra})


def test_every_finished_request_logs_one_structured_line(client, captured):
    json_lines, text_lines = captured
    ok = chat(client)
    assert ok.status_code == 200
    streamed = chat(client, stream=True)
    assert streamed.status_code == 200 and "[DONE]" in streamed.text
    bad = chat(client, max_tokens=-1)
    assert bad.status_code == 400
    terms = {"estimated_ttft_ms": 109.0, "backlog_ms": 1083.333, "overrun_ms": 254.9, "remaining_ms": 1990.5}
    client.backend.refuse = AdmissionRefused(429, "request refused at admission: test", 1.0, terms)
    refused = chat(client)
    assert refused.status_code == 429

    lines = [json.loads(line) for line in json_lines.lines]
    assert [line["request_id"] for line in lines] == [
        ok.headers["x-request-id"], streamed.headers["x-request-id"], bad.headers["x-request-id"],
        refused.headers["x-request-id"]]
    done, stream, client_error, refusal = lines
    assert done["outcome"] in ("stop", "length") and done["status"] == 200 and done["level"] == "INFO"
    assert done["event"] == "request_finished" and done["logger"] == "epd.gateway.requests"
    assert done["completion_tokens"] == ok.json()["usage"]["completion_tokens"]
    assert done["prompt_tokens"] == ok.json()["usage"]["prompt_tokens"]
    assert done["breakdown"] == json.loads(ok.headers["x-epd-ttft-breakdown"])
    assert done["ttft_ms"] == done["breakdown"]["ttft_ms"] > 0
    assert stream["outcome"] in ("stop", "length") and stream["ttft_ms"] > 0
    assert (client_error["outcome"], client_error["status"], client_error["ttft_ms"]) == ("client_error", 400, None)
    assert (refusal["outcome"], refusal["status"]) == ("refused", 429)
    assert refusal["breakdown"] == terms   # what admission weighed, to tell a refusal storm's cause
    assert len(text_lines.lines) == 4
    assert f"request {ok.headers['x-request-id']} {done['outcome']}:" in text_lines.lines[0]
    assert "breakdown={" in text_lines.lines[0]


def test_dashboard_page_is_open_and_its_data_needs_the_key(client):
    page = client.get("/dashboard")
    assert page.status_code == 200 and "dashboard.js" in page.text
    assert client.get("/dashboard/static/dashboard.js").status_code == 200
    assert client.get("/dashboard/static/dashboard.css").status_code == 200
    assert client.get("/dashboard/static/secret.py").status_code == 404
    assert client.get("/dashboard/data").status_code == 401
    assert client.get("/dashboard/data", headers={"Authorization": "Bearer nope"}).status_code == 401
    chat(client)
    data = client.get("/dashboard/data", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert set(data["stages"]) == {"encoder", "prefill", "decode"}
    assert all(s["state"] == "none" for s in data["stages"].values())   # the in-process backend has no workers
    assert [r["status"] for r in data["recent"]] == [200]
    assert data["window"]["ttft_ms"]["samples"] == 1 and data["window"]["ttft_ms"]["slo"] == 5000.0


def test_percentiles_and_rates_over_the_window():
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert percentile(list(map(float, range(1, 101))), 0.99) == 99.0
    samples = TimedSamples(window_s=60)
    samples.add(1.0, now=0.0)
    samples.add(2.0, count=2, now=30.0)
    assert samples.values(now=59.0) == [1.0, 2.0, 2.0]
    assert samples.values(now=61.0) == [2.0, 2.0]
    value = {"c": 0.0}
    history = CounterHistory(lambda: dict(value), window_s=60)
    for t in range(0, 121, 10):
        value["c"] = float(t * 2)   # 2 per second throughout
        history.sample(now=float(t))
    span, rates = history.rates()
    assert 60 <= span <= 70 and rates["c"] == pytest.approx(2.0)
