"""The official ``openai`` client against the gateway served by uvicorn on 127.0.0.1.

Also the one thing only a real socket shows: a client that disconnects
mid-request cancels its request in the backend, which releases what it held.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from inprocess_backend import InProcessBackend, data_url, demo_model_path, image_bytes, image_message, load_adapter, shape

from gateway.app import create_app
from gateway.chat_backend import AdmissionRefused
from gateway.settings import GatewaySettings
from runtime.worker.wire import sampling_from_pb, sampling_to_pb

MODEL = "demo-vlm"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    """``(base_url, backend, trained)``: the app under uvicorn in a background thread."""
    adapter, trained = load_adapter()
    backend = InProcessBackend(adapter)
    app = create_app(GatewaySettings(model=str(demo_model_path()[0])), backend)
    port = _free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", backend, trained
    uv.should_exit = True
    thread.join(timeout=10)
    assert backend.closed


@pytest.fixture
def backend(server) -> InProcessBackend:
    _, backend, _ = server
    backend.refuse, backend.token_delay_s, backend.ignore_eos, backend.hang_before_first = None, 0.0, False, False
    backend.refusals = None
    return backend


@pytest.fixture
def client(server) -> openai.OpenAI:
    base_url, _, _ = server
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_non_streaming_with_an_image(client, server):
    _, _, trained = server
    sample = shape(21)
    completion = client.chat.completions.create(
        model=MODEL, messages=image_message(data_url(image_bytes(sample.image))), temperature=0, max_tokens=16,
    )
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    if trained:
        assert choice.message.content == sample.answer and choice.finish_reason == "stop"
    assert completion.usage.completion_tokens >= 1
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    assert [m.id for m in client.models.list()] == [MODEL]


def test_streaming_with_an_image_and_usage(client, server):
    _, _, trained = server
    sample = shape(22)
    stream = client.chat.completions.create(
        model=MODEL, messages=image_message(data_url(image_bytes(sample.image))), temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and "ttft_ms" in finish[0].model_extra["epd_ttft_breakdown"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    if trained:
        assert text == sample.answer
        assert finish[0].choices[0].finish_reason == "stop"
        assert chunks[-1].usage.completion_tokens == len(text.split()) + 1  # one token per word, plus EOS


def test_ttft_breakdown_header_and_length_finish(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_completion_tokens=1, temperature=0,
    )
    breakdown = json.loads(raw.headers["x-epd-ttft-breakdown"])
    assert breakdown["ttft_ms"] > 0
    completion = raw.parse()
    assert completion.usage.completion_tokens == 1
    assert completion.choices[0].finish_reason in ("length", "stop")


def test_the_sdk_retries_a_refusal_after_the_servers_millisecond_wait(server, backend):
    """A refusal names its wait in ``retry-after-ms`` too: the SDK, retrying, waits that (0.3 s) rather
    than the whole second ``Retry-After`` rounds it up to, and the retry is served."""
    base_url, _, _ = server
    backend.refuse, backend.refusals = AdmissionRefused(429, "a queue that drains in 0.3 s", 0.3), 1
    jobs = len(backend.jobs)
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=1, timeout=30) as retrying:
        raw = retrying.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert raw.retries_taken == 1 and raw.parse().choices[0].finish_reason in ("length", "stop")
    refused, served = backend.jobs[jobs:]   # refused once, then served
    assert 0.3 <= served.arrival_s - refused.arrival_s < 0.9   # the 0.3 s asked for, not Retry-After's whole second


def test_client_errors_surface_as_openai_exceptions(client, backend):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="not-served", messages=[{"role": "user", "content": "hi"}])
    assert bad.value.code == "model_not_found" and bad.value.param == "model"
    backend.refuse = AdmissionRefused(429, "too many requests in flight", 0.4)
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
    assert limited.value.response.headers["retry-after"] == "1"
    assert limited.value.response.headers["retry-after-ms"] == "400"   # what the SDK waits, when it retries


def _wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_request(server, backend, stream):
    base_url, _, _ = server
    backend.ignore_eos, backend.token_delay_s = True, 0.05   # 200 tokens would take 10 s
    seen = len(backend.jobs)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 200, "stream": stream}
    with httpx.Client(base_url=base_url, timeout=httpx.Timeout(0.5)) as http:
        if stream:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                received = [line for _, line in zip(range(6), lines)]
                assert any('"content":' in line for line in received)
            # leaving the block closes the connection mid-stream
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/chat/completions", json=body)
    _wait_for(lambda: len(backend.jobs) > seen and backend.jobs[-1].request_id in backend.cancelled)
    _wait_for(lambda: backend.active == 0)
    assert backend.jobs[-1].request_id not in backend.finished
    assert backend.pool.free_blocks == backend.pool.num_blocks


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_while_waiting_for_the_first_token_cancels(server, backend, stream):
    base_url, _, _ = server
    backend.hang_before_first = True  # e.g. queued behind other requests
    seen = len(backend.jobs)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": stream}
    with httpx.Client(base_url=base_url, timeout=httpx.Timeout(0.3)) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json=body, headers={"x-ttft-slo-ms": "60000"})
    _wait_for(lambda: len(backend.jobs) > seen and backend.jobs[-1].request_id in backend.cancelled)
    _wait_for(lambda: backend.active == 0)


# -- issue 15: what the API accepts is what it does (defects 4 and 5, the SLO header cap) ----------
HELLO = [{"role": "user", "content": "hello"}]


def _refused(create, **kwargs) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as refused:
        create(model=MODEL, **kwargs)
    return refused.value


def test_unknown_and_unhonoured_fields_are_refused_naming_them(client, backend):
    create = client.chat.completions.create
    seen = len(backend.jobs)
    unknown = _refused(create, messages=HELLO, extra_body={"frobnicate": 1})
    assert (unknown.code, unknown.param) == ("unknown_parameter", "frobnicate")
    assert "Unrecognized request argument supplied: frobnicate" in unknown.message
    for kwargs, param in (
        ({"response_format": {"type": "json_object"}, "stop": ["}"]}, "stop"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"extra_body": {"best_of": 3}}, "best_of"),
        ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages.0.name"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": data_url(image_bytes(shape(3).image)), "detail": "low"}}]}]}, "messages.0.content.0.image_url.detail"),
    ):
        error = _refused(create, **{"messages": HELLO, **kwargs})
        assert (error.code, error.param) == ("unsupported_parameter", param), error.message
        assert param.split(".")[-1] in error.message
    assert len(backend.jobs) == seen   # refused before any work


def test_no_op_values_cache_salt_and_high_detail_are_served(client, server):
    _, _, trained = server
    sample = shape(23)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": data_url(image_bytes(sample.image)), "detail": "high"}}, {"type": "text", "text": "what is this ?"}]}]
    completion = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, n=1, response_format={"type": "text"}, logit_bias={},
        presence_penalty=0, logprobs=False, extra_body={"cache_salt": "tenant-a"},
    )
    if trained:
        assert completion.choices[0].message.content == sample.answer


def test_sampling_edges_work_or_are_refused_before_any_work(client, backend):
    create = client.chat.completions.create
    for seed in (2**63, 2**64 - 1, -(2**63) - 1):
        assert _refused(create, messages=HELLO, seed=seed).param == "seed"
    greedy = create(model=MODEL, messages=HELLO, temperature=0, max_tokens=6).choices[0].message.content
    for top_p in (1e-300, 5e-324, 4e-7):   # only the top token is left: the greedy answer, at any temperature
        edge = create(model=MODEL, messages=HELLO, temperature=2.0, top_p=top_p, seed=2**63 - 1, max_tokens=6)
        assert edge.choices[0].message.content == greedy
        sampling = backend.jobs[-1].sampling
        assert (sampling.top_p, sampling.seed) == (top_p, 2**63 - 1)
        assert sampling_from_pb(sampling_to_pb(sampling)) == sampling   # the workers sample with the same values


def test_slo_headers_above_the_cap_are_refused(client):
    error = _refused(client.chat.completions.create, messages=HELLO, extra_headers={"x-ttft-slo-ms": "86400000"})
    assert (error.code, error.param) == ("invalid_header", "x-ttft-slo-ms")
