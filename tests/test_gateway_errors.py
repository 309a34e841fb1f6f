"""Every client mistake gets its 4xx and an OpenAI error object before any model work; never a 500."""

from __future__ import annotations

import json
import random
import struct
import zlib
from collections.abc import AsyncIterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from inprocess_backend import InProcessBackend, data_url, demo_model_path, image_bytes, image_message, shape
from PIL import Image
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.settings import GatewaySettings

MODEL = "demo-vlm"
URL_PARAM = "messages.0.content.0.image_url.url"


def make_app(backend, prompts, **overrides):
    return create_app(GatewaySettings(model=str(demo_model_path()[0]), **overrides), backend, prompt_builder=prompts)


async def open_client(app, raise_app_exceptions: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            yield client


@pytest.fixture
async def client(backend, prompts) -> AsyncIterator[httpx.AsyncClient]:
    async for c in open_client(make_app(backend, prompts)):
        yield c


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


# -- images crafted to be bad -----------------------------------------------------------------
def png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header claims ``width`` x ``height`` (CRC fixed): a decompression bomb's header."""
    data = bytearray(image_bytes(Image.new("RGB", (1, 1), (255, 0, 0))))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def noise_png(size: int) -> bytes:
    return image_bytes(Image.frombytes("RGB", (size, size), random.Random(size).randbytes(size * size * 3)))


def mode_png(mode: str) -> bytes:
    return image_bytes(Image.new(mode, (8, 8)))


def with_image(url: str) -> dict:
    return {"model": MODEL, "messages": image_message(url)}


def text_request(**params) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], **params}


def nested(depth: int) -> object:
    value: object = []
    for _ in range(depth):
        value = [value]
    return value


GOOD_PNG = data_url(image_bytes(shape(1).image))

# (id, request body (dict, or bytes as sent), expected status, expected code, expected param)
CASES = [
    ("not-json", b"{'model': ", 400, "invalid_json", None),
    ("json-array", b"[1, 2]", 400, "invalid_json", None),
    ("deep-nesting-unknown-field", json.dumps(text_request()).encode()[:-1] + b', "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     400, "invalid_json", None),
    ("deep-nesting-content", {"model": MODEL, "messages": [{"role": "user", "content": nested(50)}]}, 400, "invalid_value",
     "messages.0.content.0"),
    ("missing-model", {"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_value", "model"),
    ("unknown-model", text_request(model="gpt-4o"), 400, "model_not_found", "model"),
    ("no-messages", {"model": MODEL, "messages": []}, 400, "invalid_value", "messages"),
    ("bad-role", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400, "invalid_value", "messages.0.role"),
    ("tool-role-without-call-id", {"model": MODEL, "messages": [{"role": "tool", "content": "hi"}]}, 400, None,
     "messages.0.tool_call_id"),
    ("content-number", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "invalid_value", "messages.0.content"),
    ("user-without-content", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "invalid_value",
     "messages.0.content"),
    ("unknown-part", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400,
     "invalid_value", "messages.0.content.0"),
    ("text-part-without-text", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "invalid_value", "messages.0.content.0.text"),
    ("image-in-assistant", {"model": MODEL, "messages": [{"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": GOOD_PNG}}]}]}, 400, "invalid_value", "messages.0.content.0"),
    ("placeholder-in-text", {"model": MODEL, "messages": [{"role": "user", "content": "look <image> here"}]}, 400,
     "invalid_value", "messages.0.content"),
    ("temperature-string", text_request(temperature="hot"), 400, "invalid_value", "temperature"),
    ("temperature-high", text_request(temperature=2.5), 400, "invalid_value", "temperature"),
    ("temperature-nan", b'{"model": "demo-vlm", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
     "invalid_value", "temperature"),
    ("top-p-zero", text_request(top_p=0), 400, "invalid_value", "top_p"),
    ("max-tokens-string", text_request(max_tokens="10"), 400, "invalid_value", "max_tokens"),
    ("max-tokens-zero", text_request(max_tokens=0), 400, "invalid_value", "max_tokens"),
    ("max-tokens-huge", text_request(max_tokens=10**12), 400, "invalid_value", "max_tokens"),
    ("max-completion-tokens-huge", text_request(max_completion_tokens=5000), 400, "invalid_value", "max_completion_tokens"),
    ("prompt-plus-max-tokens-over-context", text_request(max_tokens=4095), 400, "context_length_exceeded", "max_tokens"),
    ("seed-float", text_request(seed=1.5), 400, "invalid_value", "seed"),
    ("stream-string", text_request(stream="yes"), 400, "invalid_value", "stream"),
    ("stop-number", text_request(stop=3), 400, "invalid_value", "stop"),
    ("too-many-stops", text_request(stop=["a", "b", "c", "d", "e"]), 400, "invalid_value", "stop"),
    ("n-17", text_request(n=17), 400, "invalid_value", "n"),
    ("n-0", text_request(n=0), 400, "invalid_value", "n"),
    ("logprobs-string", text_request(logprobs="yes"), 400, "invalid_value", "logprobs"),
    ("top-logprobs-21", text_request(logprobs=True, top_logprobs=21), 400, "invalid_value", "top_logprobs"),
    ("top-logprobs-without-logprobs", text_request(top_logprobs=3), 400, "invalid_value", "top_logprobs"),
    ("tool-name", text_request(tools=[{"type": "function", "function": {"name": "no spaces"}}]), 400, "invalid_value",
     "tools.0.function.name"),
    ("tools-twice", text_request(tools=[{"type": "function", "function": {"name": "f"}}] * 2), 400, "invalid_value", "tools"),
    ("tool-choice-unknown-function", text_request(tools=[{"type": "function", "function": {"name": "f"}}],
                                                  tool_choice={"type": "function", "function": {"name": "g"}}), 400,
     "invalid_value", "tool_choice.function.name"),
    ("tool-unknown-field", text_request(tools=[{"type": "function", "function": {"name": "f", "x": 1}}]), 400,
     "unknown_parameter", "tools.0.function.x"),
    ("stream-options-without-stream", text_request(stream_options={"include_usage": True}), 400, "unsupported_parameter",
     "stream_options"),
    # values the workers cannot handle are refused before any work (issue 15, defect 4)
    ("seed-2^63", text_request(seed=2**63), 400, "invalid_value", "seed"),
    ("seed-uint64-max", text_request(seed=2**64 - 1), 400, "invalid_value", "seed"),
    ("seed-below-int64", text_request(seed=-(2**63) - 1), 400, "invalid_value", "seed"),
    ("top-p-negative", text_request(top_p=-1e-300), 400, "invalid_value", "top_p"),
    ("top-p-above-one", text_request(top_p=1.0000001), 400, "invalid_value", "top_p"),
    ("temperature-negative-tiny", text_request(temperature=-5e-324), 400, "invalid_value", "temperature"),
    ("temperature-inf", b'{"model": "demo-vlm", "messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
     400, "invalid_value", "temperature"),
    ("max-tokens-float", text_request(max_tokens=1.0), 400, "invalid_value", "max_tokens"),
    ("max-tokens-bool", text_request(max_tokens=True), 400, "invalid_value", "max_tokens"),
    # fields not honoured, and unknown fields, are refused naming them (issue 15, defect 5)
    ("response-format-schema-missing", text_request(response_format={"type": "json_schema"}), 400, None,
     "response_format.json_schema"),
    ("response-format-uncompilable", text_request(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frob"}}}), 400, "invalid_schema", "response_format.json_schema.schema"),
    ("response-format-with-stop", text_request(response_format={"type": "json_object"}, stop="}"), 400,
     "unsupported_parameter", "stop"),
    ("response-format-with-tools", text_request(response_format={"type": "json_object"},
                                                tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "unsupported_parameter", "response_format"),
    ("logit-bias", text_request(logit_bias={"5": 10}), 400, "unsupported_parameter", "logit_bias"),
    ("n-true", text_request(n=True), 400, "invalid_value", "n"),
    ("presence-penalty-above-2", text_request(presence_penalty=2.5), 400, "invalid_value", "presence_penalty"),
    ("frequency-penalty-below-2", text_request(frequency_penalty=-2.01), 400, "invalid_value", "frequency_penalty"),
    ("tool-choice-required-without-tools", text_request(tool_choice="required"), 400, "invalid_value", "tool_choice"),
    ("functions", text_request(functions=[{"name": "f"}]), 400, "unsupported_parameter", "functions"),
    ("audio", text_request(audio={"voice": "alloy", "format": "wav"}), 400, "unsupported_parameter", "audio"),
    ("modalities-audio", text_request(modalities=["text", "audio"]), 400, "unsupported_parameter", "modalities"),
    ("prediction", text_request(prediction={"type": "content", "content": "x"}), 400, "unsupported_parameter", "prediction"),
    ("store", text_request(store=True), 400, "unsupported_parameter", "store"),
    ("metadata", text_request(metadata={"k": "v"}), 400, "unsupported_parameter", "metadata"),
    ("reasoning-effort", text_request(reasoning_effort="low"), 400, "unsupported_parameter", "reasoning_effort"),
    ("service-tier-flex", text_request(service_tier="flex"), 400, "unsupported_parameter", "service_tier"),
    ("top-k-minus-2", text_request(top_k=-2), 400, "invalid_value", "top_k"),
    ("min-p-above-one", text_request(min_p=1.1), 400, "invalid_value", "min_p"),
    ("repetition-penalty-zero", text_request(repetition_penalty=0), 400, "invalid_value", "repetition_penalty"),
    ("min-tokens-negative", text_request(min_tokens=-1), 400, "invalid_value", "min_tokens"),
    ("min-tokens-above-max-tokens", text_request(min_tokens=9, max_tokens=8), 400, "invalid_value", "min_tokens"),
    ("stop-token-ids-outside-vocab", text_request(stop_token_ids=[10**6]), 400, "invalid_value", "stop_token_ids"),
    ("stop-token-ids-negative", text_request(stop_token_ids=[-1]), 400, "invalid_value", "stop_token_ids.0"),
    ("ignore-eos-string", text_request(ignore_eos="yes"), 400, "invalid_value", "ignore_eos"),
    ("best-of", text_request(best_of=2), 400, "unsupported_parameter", "best_of"),
    ("guided-json", text_request(guided_json={"type": "object"}), 400, "unsupported_parameter", "guided_json"),
    ("unknown-field", text_request(frobnicate=1), 400, "unknown_parameter", "frobnicate"),
    ("unknown-field-null", text_request(frobnicate=None), 400, "unknown_parameter", "frobnicate"),
    ("unknown-stream-option", text_request(stream=True, stream_options={"include_usage": True, "x": 1}), 400,
     "unknown_parameter", "stream_options.x"),
    ("message-name", {"model": MODEL, "messages": [{"role": "user", "content": "hi", "name": "bob"}]}, 400,
     "unsupported_parameter", "messages.0.name"),
    ("message-tool-calls", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}]}, 400,
     None, "messages.1.tool_calls.0.function"),
    ("unknown-message-field", {"model": MODEL, "messages": [{"role": "user", "content": "hi", "mood": "happy"}]}, 400,
     "unknown_parameter", "messages.0.mood"),
    ("unknown-part-field", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]}, 400, "unknown_parameter",
     "messages.0.content.0.cache_control"),
    ("unknown-image-url-field", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": GOOD_PNG, "uuid": "x"}}]}]}, 400, "unknown_parameter",
     "messages.0.content.0.image_url.uuid"),
    ("image-detail-low", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": GOOD_PNG, "detail": "low"}}]}]}, 400, "unsupported_parameter",
     "messages.0.content.0.image_url.detail"),
    ("cache-salt-too-long", text_request(cache_salt="s" * 257), 400, "invalid_value", "cache_salt"),
    ("cache-salt-empty", text_request(cache_salt=""), 400, "invalid_value", "cache_salt"),
    ("cache-salt-number", text_request(cache_salt=5), 400, "invalid_value", "cache_salt"),
    ("huge-field-name", text_request(**{"x" * 5000: 1}), 400, "unknown_parameter", None),
    # a prompt that cannot fit is refused before rendering (issue 15, defect 6)
    ("4-mb-prompt", {"model": MODEL, "messages": [{"role": "user", "content": "hello world " * 350_000}]}, 400,
     "context_length_exceeded", "messages"),
    # images
    ("malformed-base64", with_image("data:image/png;base64,iVBOR!!!not-base64"), 400, "invalid_base64", URL_PARAM),
    ("not-base64-data-url", with_image("data:image/png,rawbytes"), 400, "invalid_data_url", URL_PARAM),
    ("not-an-image-media-type", with_image("data:text/plain;base64,aGVsbG8="), 400, "invalid_image_format", URL_PARAM),
    ("bytes-not-an-image", with_image(data_url(b"hello, I am not a picture")), 400, "invalid_image", URL_PARAM),
    ("gif-not-allowed", with_image(data_url(image_bytes(shape(1).image, "GIF"), "image/gif")), 400, "invalid_image_format",
     URL_PARAM),
    ("decompression-bomb", with_image(data_url(png_claiming(100_000, 100_000))), 400, "image_too_large", URL_PARAM),
    ("over-pixel-limit", with_image(data_url(png_claiming(5000, 5000))), 400, "image_too_large", URL_PARAM),
    ("absurd-dimensions", with_image(data_url(png_claiming(20_000, 1))), 400, "image_too_large", URL_PARAM),
    ("truncated-png", with_image(data_url(noise_png(64)[:6000])), 400, "invalid_image", URL_PARAM),
    ("unsupported-mode", with_image(data_url(mode_png("I;16"))), 400, "invalid_image", URL_PARAM),
    ("ftp-url", with_image("ftp://example.com/x.png"), 400, "invalid_image_url", URL_PARAM),
    ("too-many-images", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}] * 9}]}, 400, "too_many_images", "messages"),
]


@pytest.mark.parametrize("body, status, code, param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_bad_request_is_refused_before_model_work(client, backend, body, status, code, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = await client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    error = assert_error(r, status, code, param)
    assert error["type"] == "invalid_request_error"
    assert backend.jobs == []
    assert len(error["message"]) < 500  # no echo of the offending value


async def test_error_messages_do_not_echo_image_data(client):
    junk = "A" * 100_000 + "!"
    r = await client.post("/v1/chat/completions", json=with_image(f"data:image/png;base64,{junk}"))
    assert "AAAAAAAAAA" not in assert_error(r, 400)["message"]


async def test_image_over_byte_limit(backend, prompts):
    async for client in open_client(make_app(backend, prompts, max_image_bytes=2000)):
        r = await client.post("/v1/chat/completions", json=with_image(data_url(noise_png(64))))
        assert_error(r, 400, "image_too_large", URL_PARAM)
    assert backend.jobs == []


async def test_fewer_images_allowed_by_setting(backend, prompts):
    async for client in open_client(make_app(backend, prompts, limit_images_per_request=0)):
        r = await client.post("/v1/chat/completions", json=with_image(GOOD_PNG))
        assert_error(r, 400, "too_many_images")


async def test_oversized_body_is_413_with_or_without_content_length(backend, prompts):
    async for client in open_client(make_app(backend, prompts, max_body_bytes=4096)):
        big = json.dumps(text_request(padding="x" * 10_000)).encode()
        assert_error(await client.post("/v1/chat/completions", content=big), 413, "request_too_large")

        async def chunked():  # no Content-Length: counted while reading
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000]

        assert_error(await client.post("/v1/chat/completions", content=chunked()), 413, "request_too_large")
        small = await client.post("/v1/chat/completions", json=text_request(max_tokens=1))
        assert small.status_code == 200


@pytest.mark.parametrize("header, value", [("x-ttft-slo-ms", "soon"), ("x-ttft-slo-ms", "-5"), ("x-itl-slo-ms", "nan"),
                                           ("x-itl-slo-ms", "inf")])
async def test_bad_slo_headers(client, backend, header, value):
    r = await client.post("/v1/chat/completions", json=text_request(), headers={header: value})
    assert_error(r, 400, "invalid_header", header)
    assert backend.jobs == []


async def test_known_fields_at_their_no_op_values_are_accepted(client, backend):
    """The values many clients always send: accepted, because they ask for nothing we do not do."""
    body = text_request(
        max_tokens=2, n=1, logprobs=False, top_logprobs=0, presence_penalty=0, frequency_penalty=0.0,
        response_format={"type": "text"}, logit_bias={}, tools=[], tool_choice="none", parallel_tool_calls=True,
        functions=None, function_call=None, modalities=["text"], store=False, metadata={}, service_tier="auto",
        user="u1", safety_identifier="s1", prompt_cache_key="k", cache_salt="tenant-a", top_k=-1, min_p=0,
        repetition_penalty=1.0, min_tokens=0, stop_token_ids=[], ignore_eos=False, skip_special_tokens=True,
        best_of=1, seed=2**63 - 1, top_p=5e-324, temperature=2.0,
    )
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    echoed = {"model": MODEL, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True,
                                                                                "include_obfuscation": False},
              "messages": [{"role": "user", "content": "hi", "name": None},
                           {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": [], "annotations": []},
                           {"role": "user", "content": [{"type": "text", "text": "and?"}, {"type": "image_url", "image_url": {
                               "url": GOOD_PNG, "detail": "high"}}, {"type": "image_url", "image_url": {
                               "url": GOOD_PNG, "detail": "auto"}}]}]}
    r = await client.post("/v1/chat/completions", json=echoed)
    assert r.status_code == 200, r.text
    assert len(backend.jobs) == 2


@pytest.mark.parametrize("header", ["x-ttft-slo-ms", "x-itl-slo-ms"])
async def test_slo_headers_are_capped_by_max_slo_ms(backend, prompts, header):
    async for client in open_client(make_app(backend, prompts)):   # default cap: 120 s
        assert_error(await client.post("/v1/chat/completions", json=text_request(), headers={header: "120000.5"}),
                     400, "invalid_header", header)
        ok = await client.post("/v1/chat/completions", json=text_request(max_tokens=1), headers={header: "120000"})
        assert ok.status_code == 200, ok.text
    async for client in open_client(make_app(backend, prompts, max_slo_ms=2000)):
        error = assert_error(await client.post("/v1/chat/completions", json=text_request(), headers={header: "2001"}),
                             400, "invalid_header", header)
        assert "2000" in error["message"]
    assert len(backend.jobs) == 1


async def test_fastapi_validation_errors_become_400(backend, prompts):
    app = make_app(backend, prompts)

    @app.get("/typed")
    async def typed(count: int) -> dict:
        return {"count": count}

    async for client in open_client(app):
        assert_error(await client.get("/typed", params={"count": "many"}), 400, "invalid_value", "count")
        assert_error(await client.get("/typed"), 400, "invalid_value", "count")


async def test_server_faults_are_500_without_internals(backend, prompts):
    app = make_app(backend, prompts)

    @app.get("/broken")
    async def broken() -> dict:
        raise RuntimeError("secret database password")

    async def generate(job):
        raise RuntimeError("secret internal state")
        yield  # pragma: no cover

    backend.generate = generate
    async for client in open_client(app, raise_app_exceptions=False):
        for r in (await client.get("/broken"), await client.post("/v1/chat/completions", json=text_request())):
            error = assert_error(r, 500, "internal_error")
            assert error["type"] == "server_error" and "secret" not in r.text


# -- property: no client mistake is a 500 --------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20) | JSON}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries(
        {"url": st.sampled_from([GOOD_PNG, "data:image/png;base64,AAAA", "data:,", "x", ""]) | JSON})}),
    JSON,
)
MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | JSON,
    "content": st.text(max_size=20) | st.lists(PART, max_size=3) | JSON,
})
VALID_MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant"]),
    "content": st.sampled_from(["hello", "what is in the image ?", ""]),
})
FIELDS = st.sampled_from(["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
                          "stream", "stream_options", "n", "logprobs", "presence_penalty", "tools", "anything"])


PLAUSIBLE = st.integers(0, 8) | st.floats(0, 2) | st.booleans() | st.none() | st.sampled_from(
    [MODEL, "stop", ["a", "b"], {"include_usage": True}, {"include_usage": "yes"}])


@pytest.fixture(scope="module")
def fuzz_client(model, prompts):
    backend = InProcessBackend(model[0])
    with TestClient(make_app(backend, prompts, max_tokens_limit=8, default_max_tokens=4)) as client:
        yield client, backend


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(VALID_MESSAGE, min_size=1, max_size=2) | st.lists(MESSAGE, max_size=3) | JSON,
       overrides=st.dictionaries(FIELDS.filter(lambda f: f != "model"), PLAUSIBLE, max_size=2)
       | st.dictionaries(FIELDS, JSON, max_size=3))
def test_fuzzed_requests_never_give_a_500(fuzz_client, messages, overrides):
    client, backend = fuzz_client
    jobs_before = len(backend.jobs)
    body = json.dumps({"model": MODEL, "messages": messages, **overrides})  # NaN/Infinity allowed, as some clients send
    r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert len(backend.jobs) == jobs_before
