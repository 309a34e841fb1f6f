"""The gateway's chat API end to end (in-process ASGI) against the real demo model.

The backend is ``tests.inprocess_backend.InProcessBackend``: real tokens from
the real model, with hooks to refuse, miss deadlines, hang or fail.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from inprocess_backend import (
    InProcessBackend,
    data_url,
    demo_model_path,
    image_bytes,
    image_message,
    shape,
)

from gateway import offload
from gateway.app import create_app
from gateway.chat_backend import AdmissionRefused
from gateway.detokenize import IncrementalDetokenizer
from gateway.prompt import PromptBuilder
from gateway.settings import GatewaySettings

MODEL = "demo-vlm"


@asynccontextmanager
async def serve(backend: InProcessBackend, prompts: PromptBuilder, **overrides) -> AsyncIterator[httpx.AsyncClient]:
    settings = GatewaySettings(model=str(demo_model_path()[0]), **overrides)
    app = create_app(settings, backend, prompt_builder=prompts)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            yield client


@pytest.fixture
async def client(backend, prompts) -> AsyncIterator[httpx.AsyncClient]:
    async with serve(backend, prompts) as c:
        yield c


def chat(messages, **params) -> dict:
    return {"model": MODEL, "messages": messages, **params}


def text_messages(text: str = "hello") -> list[dict]:
    return [{"role": "user", "content": text}]


def sse_events(body: str) -> list[dict | str]:
    events: list[dict | str] = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# -- the happy paths ------------------------------------------------------------------
async def test_text_only_request_skips_the_encoder(client, backend):
    r = await client.post("/v1/chat/completions", json=chat(text_messages(), temperature=0, max_tokens=6))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    (job,) = backend.jobs
    assert job.images == [] and len(job.token_ids) == usage["prompt_tokens"]
    assert backend.finished == [job.request_id] and backend.cancelled == []  # ran to its end, not cancelled
    assert r.headers["x-request-id"] == body["id"] == job.request_id
    breakdown = json.loads(r.headers["x-epd-ttft-breakdown"])
    assert {"gateway_ms", "queue_ms", "encode_ms", "prefill_ms", "ttft_ms"} <= breakdown.keys()
    assert breakdown["ttft_ms"] >= breakdown["gateway_ms"] >= 0


async def test_image_request_answers_the_picture(client, backend, model):
    _, trained = model
    for seed in (1, 2, 3):
        sample = shape(seed)
        r = await client.post("/v1/chat/completions",
                              json=chat(image_message(data_url(image_bytes(sample.image))), temperature=0))
        assert r.status_code == 200, r.text
        if trained:
            assert r.json()["choices"][0]["message"]["content"] == sample.answer
    assert all(len(job.images) == 1 for job in backend.jobs)
    assert backend.jobs[0].images[0].image.size == shape(1).image.size


async def test_jpeg_and_webp_images_are_accepted(client, model):
    sample = shape(4)
    for fmt, media in (("JPEG", "image/jpeg"), ("WEBP", "image/webp")):
        url = data_url(image_bytes(sample.image, fmt), media)
        r = await client.post("/v1/chat/completions", json=chat(image_message(url), temperature=0))
        assert r.status_code == 200, (fmt, r.text)


async def test_stream_matches_non_stream_and_ends_with_usage_and_done(client, model):
    _, trained = model
    sample = shape(5)
    request = chat(image_message(data_url(image_bytes(sample.image))), temperature=0)
    plain = (await client.post("/v1/chat/completions", json=request)).json()
    r = await client.post("/v1/chat/completions",
                          json={**request, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    if trained:
        assert text == sample.answer
    final, usage = chunks[-2], chunks[-1]
    assert final["choices"][0]["finish_reason"] == "stop" and final["choices"][0]["delta"] == {}
    assert {"gateway_ms", "ttft_ms"} <= final["epd_ttft_breakdown"].keys()
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]
    assert all("usage" not in c for c in chunks[:-1])


async def test_stream_without_include_usage_has_no_usage_chunk(client):
    r = await client.post("/v1/chat/completions", json=chat(text_messages(), temperature=0, stream=True, max_tokens=3))
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])


async def test_concurrent_requests_each_get_their_own_answer(client, backend, model):
    _, trained = model
    samples = [shape(seed) for seed in range(30, 38)]

    async def ask(i: int, sample) -> str:
        request = chat(image_message(data_url(image_bytes(sample.image))), temperature=0, stream=i % 2 == 1)
        r = await client.post("/v1/chat/completions", json=request)
        assert r.status_code == 200, r.text
        if request["stream"]:
            return "".join(e["choices"][0]["delta"].get("content") or "" for e in sse_events(r.text)[:-1] if e["choices"])
        return r.json()["choices"][0]["message"]["content"]

    answers = await asyncio.gather(*(ask(i, s) for i, s in enumerate(samples)))
    if trained:
        assert answers == [s.answer for s in samples]
    assert backend.active == 0 and backend.pool.free_blocks == backend.pool.num_blocks


async def test_same_seed_same_output_with_temperature(client, backend):
    backend.ignore_eos = True

    async def sample(seed: int) -> str:
        r = await client.post("/v1/chat/completions",
                              json=chat(text_messages("describe the image ."), temperature=2.0, seed=seed, max_tokens=12))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    first = await sample(11)
    assert await sample(11) == first
    others = {await sample(seed) for seed in (12, 13, 14)}
    assert others - {first}, "different seeds should not all give the same sampled text"


async def test_max_tokens_gives_finish_reason_length(client, backend):
    backend.ignore_eos = True
    for field in ("max_tokens", "max_completion_tokens"):
        r = await client.post("/v1/chat/completions", json=chat(text_messages(), temperature=0, **{field: 3}))
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 3
        assert backend.jobs[-1].max_tokens == 3


async def test_stop_string_ends_generation_without_the_stop_text(client, backend, model):
    _, trained = model
    if not trained:
        pytest.skip("needs the trained demo model's known answer")
    sample = shape(1)  # "a yellow circle"
    url = data_url(image_bytes(sample.image))
    colour = sample.colour
    # one stop string that spans the boundary between two tokens, one that never occurs
    request = chat(image_message(url), temperature=0, stop=[f"{colour[-2:]} {sample.shape[:2]}", "zzz"])
    r = await client.post("/v1/chat/completions", json=request)
    body = r.json()
    assert body["choices"][0]["message"]["content"] == f"a {colour[:-2]}"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert backend.jobs[-1].request_id in backend.cancelled  # the gateway closed the generator early
    r = await client.post("/v1/chat/completions", json={**request, "stream": True})
    events = sse_events(r.text)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert text == f"a {colour[:-2]}"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert backend.active == 0 and backend.pool.free_blocks == backend.pool.num_blocks


async def test_n_choices_stop_each_on_their_own_and_stream_by_index(client, backend, model):
    """n=3 greedy: three copies of the n=1 reply; a stop string cuts each choice; the stream's chunks
    carry one choice each, with its index, and a finish chunk per choice; usage sums the choices."""
    _, trained = model
    if not trained:
        pytest.skip("needs the trained demo model's known answer")
    sample = shape(1)
    url = data_url(image_bytes(sample.image))
    one = (await client.post("/v1/chat/completions", json=chat(image_message(url), temperature=0))).json()
    r = await client.post("/v1/chat/completions", json=chat(image_message(url), temperature=0, n=3))
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == [one["choices"][0]["message"]["content"]] * 3
    assert body["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    stop = sample.shape[:2]
    r = await client.post("/v1/chat/completions", json=chat(image_message(url), temperature=0, n=3, stop=[stop],
                                                            stream=True))
    events = [e for e in sse_events(r.text) if isinstance(e, dict)]
    texts, finishes = ["", "", ""], [None, None, None]
    for e in events:
        assert len(e["choices"]) <= 1
        for c in e["choices"]:
            assert finishes[c["index"]] is None
            texts[c["index"]] += c["delta"].get("content") or ""
            finishes[c["index"]] = c["finish_reason"]
    assert texts == [f"a {sample.colour} "] * 3 and finishes == ["stop"] * 3
    assert backend.active == 0 and backend.pool.free_blocks == backend.pool.num_blocks


# -- refusals and failures ----------------------------------------------------------------
@pytest.mark.parametrize("status, kind", [(429, "rate_limit_error"), (503, "server_overloaded")])
async def test_admission_refused_maps_to_status_with_retry_after(client, backend, status, kind):
    backend.refuse = AdmissionRefused(status, "prefill queue full", 2.2)
    for stream in (False, True):
        r = await client.post("/v1/chat/completions", json=chat(text_messages(), stream=stream))
        assert r.status_code == status
        assert r.headers["retry-after"] == "3" and r.headers["retry-after-ms"] == "2200"
        error = r.json()["error"]
        assert error["type"] == kind and error["code"] == "admission_refused"
        assert "prefill queue full" in error["message"]


async def test_a_lagging_gateway_loop_sheds_before_any_work(backend, prompts):
    """Time a request spent waiting for the gateway's own loop counts against its TTFT SLO."""
    settings = GatewaySettings(model=str(demo_model_path()[0]))
    app = create_app(settings, backend, prompt_builder=prompts)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            app.state.loop_lag.record(time.monotonic(), 1.0)   # the loop ran 1 s late just now
            ok = await client.post("/v1/chat/completions", json=chat(text_messages()), headers={"x-ttft-slo-ms": "5000"})
            assert ok.status_code == 200
            app.state.loop_lag.record(time.monotonic(), 5.0)
            r = await client.post("/v1/chat/completions", json=chat(text_messages()), headers={"x-ttft-slo-ms": "3000"})
            assert r.status_code == 429 and r.json()["error"]["code"] == "admission_refused"
            assert "backlog" in r.json()["error"]["message"]
            # come back once the 2 s past the deadline have drained, not after the whole 5 s wait
            assert (r.headers["retry-after"], r.headers["retry-after-ms"]) == ("2", "2000")
            await asyncio.sleep(0.3)          # the stall is over: what comes after it waited for nothing
            later = await client.post("/v1/chat/completions", json=chat(text_messages()), headers={"x-ttft-slo-ms": "3000"})
            assert later.status_code == 200
    assert len(backend.jobs) == 2                            # the refused one never reached the backend


async def test_deadline_exceeded_is_504(client, backend):
    backend.deadline_exceeded = True
    for stream in (False, True):
        r = await client.post("/v1/chat/completions", json=chat(text_messages(), stream=stream))
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "deadline_exceeded"


async def test_gateway_deadline_guard_cancels_a_silent_backend(backend, prompts):
    backend.hang_before_first = True
    async with serve(backend, prompts, deadline_grace_ms=0) as client:
        started = time.monotonic()
        r = await client.post("/v1/chat/completions", json=chat(text_messages()), headers={"x-ttft-slo-ms": "150"})
        assert r.status_code == 504
        assert time.monotonic() - started < 3
    assert backend.cancelled == [backend.jobs[0].request_id]
    assert backend.active == 0 and backend.pool.free_blocks == backend.pool.num_blocks


async def test_slo_headers_set_the_job_deadlines(client, backend):
    r = await client.post("/v1/chat/completions", json=chat(text_messages(), max_tokens=1),
                          headers={"x-ttft-slo-ms": "1234", "x-itl-slo-ms": "56.5"})
    assert r.status_code == 200
    job = backend.jobs[0]
    assert job.ttft_deadline_s - job.arrival_s == pytest.approx(1.234)
    assert job.itl_slo_ms == 56.5
    await client.post("/v1/chat/completions", json=chat(text_messages(), max_tokens=1))
    job = backend.jobs[1]
    assert job.ttft_deadline_s - job.arrival_s == pytest.approx(5.0)
    assert job.itl_slo_ms == 1000.0


async def test_backend_failure_is_5xx_or_an_error_event(client, backend):
    backend.ignore_eos = True
    backend.fail_after_tokens = 2
    r = await client.post("/v1/chat/completions", json=chat(text_messages(), max_tokens=10))
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "backend_failure"
    r = await client.post("/v1/chat/completions", json=chat(text_messages(), max_tokens=10, stream=True))
    assert r.status_code == 200  # headers went out with the first token
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "backend_failure"
    assert backend.active == 0


# -- the other endpoints ----------------------------------------------------------------------
async def test_models_health_status_and_lifespan(backend, prompts):
    assert not backend.started
    async with serve(backend, prompts) as client:
        assert backend.started
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
        assert (await client.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL
        missing = await client.get("/v1/models/other")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert (await client.get("/health")).status_code == 200
        backend.is_healthy = False
        unhealthy = await client.get("/health")
        assert unhealthy.status_code == 503 and "error" in unhealthy.json()
        assert (await client.get("/status")).json()["backend"] == "inprocess"
    assert backend.closed


async def test_metrics_count_requests(client):
    await client.post("/v1/chat/completions", json=chat(text_messages(), max_tokens=2, temperature=0))
    await client.post("/v1/chat/completions", json=chat(text_messages(), model="nope"))
    text = (await client.get("/metrics")).text
    for name in ("epd:time_to_first_token_seconds_bucket", "epd:inter_token_latency_seconds_bucket",
                 "epd:e2e_request_latency_seconds_bucket"):
        assert name in text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("epd:")}
    assert samples["epd:time_to_first_token_seconds_count"] == 1
    assert sum(v for k, v in samples.items() if k.startswith("epd:request_success_total")) == 1
    assert samples['epd:request_failure_total{reason="client_error"}'] == 1
    assert "python_info" in text  # the process-wide registry (the orchestrator's metrics) is rendered too


# -- remote images ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def image_server():
    """A local HTTP server: /shape.png, /big.png (over the limit), /slow.png (never finishes), else 404."""
    png = image_bytes(shape(2).image)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/shape.png":
                self._send(png)
            elif self.path == "/big.png":
                self._send(b"\x89PNG" + b"\0" * 50_000)
            elif self.path == "/slow.png":
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                self.wfile.write(png[:10])
                self.wfile.flush()
                time.sleep(2)
            else:
                self.send_error(404)

        def _send(self, body: bytes):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


async def test_remote_images_are_fetched_with_limits(backend, prompts, image_server, model):
    _, trained = model
    # the image server is on loopback: refused by default (tests/test_media_urls.py), allowed by the opt-in
    async with serve(backend, prompts, max_image_bytes=20_000, remote_image_timeout_s=0.5,
                     allow_private_media_urls=True) as client:
        r = await client.post("/v1/chat/completions", json=chat(image_message(f"{image_server}/shape.png"), temperature=0))
        assert r.status_code == 200, r.text
        if trained:
            assert r.json()["choices"][0]["message"]["content"] == shape(2).answer
        for path, code in (("/missing.png", "image_fetch_failed"), ("/big.png", "image_too_large"),
                           ("/slow.png", "image_fetch_timeout")):
            r = await client.post("/v1/chat/completions", json=chat(image_message(f"{image_server}{path}")))
            assert r.status_code == 400, path
            error = r.json()["error"]
            assert error["code"] == code and error["param"] == "messages.0.content.0.image_url.url"
    assert len(backend.jobs) == 1
    async with serve(backend, prompts, allow_remote_images=False) as client:
        r = await client.post("/v1/chat/completions", json=chat(image_message(f"{image_server}/shape.png")))
        assert r.status_code == 400 and r.json()["error"]["code"] == "remote_images_disabled"


# -- incremental detokenization --------------------------------------------------------------
class ByteTokenizer:
    """Each token id is one byte: multi-byte characters span several tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add([i]) for i in ids]


def test_detokenizer_waits_for_complete_characters():
    text = "né €"
    pieces = feed(IncrementalDetokenizer(ByteTokenizer()), list(text.encode()))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_detokenizer_holds_back_a_possible_stop_and_cuts_at_it():
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=["END"])
    pieces = feed(detok, list(b"abEN"))
    assert "".join(pieces) == "ab"          # "EN" may become "END": held back
    assert detok.add(list(b"x")) == "ENx"   # it did not
    assert detok.add(list(b"yEND tail")) == "y"
    assert detok.stopped and detok.text == "abENxy"
    assert detok.add([65]) == "" and detok.flush() == ""


def test_detokenizer_flush_releases_the_held_tail():
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=["STOP"])
    assert "".join(feed(detok, list(b"okST"))) == "ok"
    assert detok.flush() == "ST" and not detok.stopped


def test_detokenizer_with_the_demo_tokenizer(prompts):
    tokenizer = prompts.tokenizer
    ids = tokenizer("a red square", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = feed(detok, ids + [tokenizer.eos_token_id])
    assert "".join(pieces) + detok.flush() == "a red square"
    detok = IncrementalDetokenizer(tokenizer, stop=["d squ"])
    assert "".join(feed(detok, ids)) == "a re" and detok.stopped


# -- prompt builds run in parallel, at most prompt_workers at once (issue 15, defect 6) ---------------
def _meeting_prompts(prompts: PromptBuilder, parties: int) -> tuple[PromptBuilder, dict]:
    """A real PromptBuilder whose chat template waits for ``parties`` renders in flight; records the peak."""
    proc = copy.deepcopy(prompts.processor)
    barrier = threading.Barrier(parties, timeout=20)
    seen = {"now": 0, "peak": 0}
    lock = threading.Lock()

    class MeetingProcessor(type(proc)):
        def apply_chat_template(self, *args, **kwargs):
            with lock:
                seen["now"] += 1
                seen["peak"] = max(seen["peak"], seen["now"])
            try:
                barrier.wait()
                return super().apply_chat_template(*args, **kwargs)
            finally:
                with lock:
                    seen["now"] -= 1

    proc.__class__ = MeetingProcessor
    return PromptBuilder(proc, prompts.context_length), seen


@pytest.fixture
def threaded_builds(monkeypatch):
    """Every prompt build goes to a thread, as a long prompt's does (a short one runs on the loop: gateway.offload)."""
    monkeypatch.setattr(offload, "INLINE_MAX_TEXT_CHARS", 0)


async def test_prompt_builds_of_concurrent_requests_overlap(backend, prompts, threaded_builds):
    meeting, seen = _meeting_prompts(prompts, parties=2)
    async with serve(backend, meeting, prompt_workers=2) as client:
        replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat(text_messages(), max_tokens=2))
                                         for _ in range(2)))
    assert [r.status_code for r in replies] == [200, 200]
    assert seen["peak"] == 2


async def test_prompt_workers_bounds_the_builds_in_flight(backend, prompts, threaded_builds):
    single, seen = _meeting_prompts(prompts, parties=1)
    async with serve(backend, single, prompt_workers=1) as client:
        replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat(text_messages(), max_tokens=2))
                                         for _ in range(4)))
    assert [r.status_code for r in replies] == [200] * 4
    assert seen["peak"] == 1 and single._processors.size == 1



async def asgi_writes(app, body: dict) -> list[bytes]:
    """The response body of one POST to ``/v1/chat/completions``, as the app wrote it (one entry per write)."""
    payload = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": [(b"host", b"gateway"), (b"content-type", b"application/json"),
                                          (b"content-length", str(len(payload)).encode())],
             "client": ("127.0.0.1", 1), "server": ("gateway", 80)}
    received, writes = False, []

    async def receive():
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.Event().wait()   # the client stays

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            writes.append(message["body"])

    await app(scope, receive, send)
    return writes


async def test_a_stream_writes_the_role_with_the_first_token_and_the_finish_with_the_usage(backend, prompts):
    """Every write goes through the ASGI stack (and is a read for the client): the role chunk rides the
    first token's chunk, the finish chunk the usage chunk, then ``[DONE]``."""
    request = chat(image_message(data_url(image_bytes(shape(5).image))), temperature=0, max_tokens=4,
                   stream=True, stream_options={"include_usage": True})
    app = create_app(GatewaySettings(model=str(demo_model_path()[0])), backend, prompt_builder=prompts)
    async with app.router.lifespan_context(app):
        writes = [sse_events(w.decode()) for w in await asgi_writes(app, request)]
    assert [e["choices"][0]["delta"].keys() for e in writes[0]] == [{"role", "content"}, {"content"}]
    assert writes[0][1]["choices"][0]["delta"]["content"]
    assert [len(w) for w in writes[1:-2]] == [1] * (len(writes) - 3), "one chunk per later token"
    finish, usage = writes[-2]
    assert finish["choices"][0]["finish_reason"] and usage["choices"] == [] and usage["usage"]
    assert writes[-1] == ["[DONE]"]
