"""API keys: the official ``openai`` client against the gateway under uvicorn on 127.0.0.1.

With keys set, ``/v1/*`` needs ``Authorization: Bearer KEY`` (401 + an OpenAI error
object + ``WWW-Authenticate: Bearer`` otherwise, before the body is read);
``/health`` stays open; ``/metrics`` and ``/status`` need a key unless
``open_metrics_and_status``. Each key is its own cache namespace by default.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
import uvicorn
from inprocess_backend import InProcessBackend, data_url, demo_model_path, image_bytes, image_message, shape

from gateway.app import create_app
from gateway.auth import ApiKeys, bearer_token, effective_cache_salt, tenant_id
from gateway.settings import GatewaySettings

MODEL = "demo-vlm"
KEYS = ["sk-tenant-one", "sk-tenant-two"]


@contextmanager
def served(backend: InProcessBackend, prompts, **overrides) -> Iterator[str]:
    """The app under uvicorn in a background thread; yields its base URL."""
    app = create_app(GatewaySettings(model=str(demo_model_path()[0]), **overrides), backend, prompt_builder=prompts)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def module_backend(model) -> InProcessBackend:
    return InProcessBackend(model[0])


@pytest.fixture(scope="module")
def keyed(module_backend, prompts) -> Iterator[str]:
    with served(module_backend, prompts, api_key=KEYS) as base:
        yield base


def ask(base: str, key: str, **extra) -> openai.types.chat.ChatCompletion:
    with openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30) as client:
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                              max_tokens=2, temperature=0, **extra)


def refused_total(base: str, key: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {key}"}).text
    return {line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("epd:api_key_refused_total{")}


def test_wrong_or_missing_key_is_a_401_the_openai_client_reads(keyed, module_backend):
    jobs_before = len(module_backend.jobs)
    counted = refused_total(keyed, KEYS[0])
    with pytest.raises(openai.AuthenticationError) as wrong:
        ask(keyed, "sk-not-a-key")
    assert wrong.value.status_code == 401
    assert wrong.value.code == "invalid_api_key" and wrong.value.type == "invalid_request_error"
    assert wrong.value.body == {"message": "Incorrect API key provided", "type": "invalid_request_error",
                                "param": None, "code": "invalid_api_key"}
    assert wrong.value.response.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        ask(keyed, KEYS[0] + "x")    # a key with a valid prefix is still wrong
    missing = httpx.post(f"{keyed}/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["code"] == "invalid_api_key"
    for path in ("/v1/models", f"/v1/models/{MODEL}"):
        assert httpx.get(f"{keyed}{path}", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert len(module_backend.jobs) == jobs_before   # nothing reached the backend
    after = refused_total(keyed, KEYS[0])
    assert after["invalid"] - counted["invalid"] == 4 and after["missing"] - counted["missing"] == 1


def test_each_configured_key_is_served(keyed):
    for key in KEYS:
        completion = ask(keyed, key)
        assert completion.usage.completion_tokens >= 1
    with openai.OpenAI(base_url=f"{keyed}/v1", api_key=KEYS[1], max_retries=0) as client:
        assert [m.id for m in client.models.list()] == [MODEL]
    # the scheme is case-insensitive (RFC 7235)
    assert httpx.get(f"{keyed}/v1/models", headers={"Authorization": f"bearer {KEYS[0]}"}).status_code == 200


def test_refused_before_the_body_is_read(keyed):
    """Headers announcing a 10 MB body, and no body: the 401 comes back without the gateway waiting for it."""
    host, port = keyed.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer wrong\r\nContent-Length: 10000000\r\n\r\n")
        answer = sock.recv(65536).decode(errors="replace")
    assert answer.startswith("HTTP/1.1 401"), answer
    assert "invalid_api_key" in answer


def test_health_is_open_metrics_and_status_need_a_key(keyed):
    assert httpx.get(f"{keyed}/health").status_code == 200
    for path in ("/metrics", "/status"):
        closed = httpx.get(f"{keyed}{path}")
        assert closed.status_code == 401 and closed.json()["error"]["code"] == "invalid_api_key", path
        assert httpx.get(f"{keyed}{path}", headers={"Authorization": f"Bearer {KEYS[1]}"}).status_code == 200


def test_metrics_and_status_can_be_opened(module_backend, prompts):
    with served(module_backend, prompts, api_key=KEYS, open_metrics_and_status=True) as base:
        assert httpx.get(f"{base}/metrics").status_code == 200
        assert httpx.get(f"{base}/status").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            ask(base, "wrong")


def test_openapi_declares_the_bearer_scheme_only_with_keys(keyed, module_backend, prompts):
    schema = httpx.get(f"{keyed}/openapi.json").json()
    assert schema["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http", "scheme": "bearer", "description": "one of the gateway's API keys (--api-key)"}
    paths = schema["paths"]
    assert paths["/v1/chat/completions"]["post"]["security"] == [{"bearerAuth": []}]
    assert paths["/metrics"]["get"]["security"] == [{"bearerAuth": []}]
    assert "security" not in paths["/health"]["get"]
    with served(module_backend, prompts) as open_base:
        plain = httpx.get(f"{open_base}/openapi.json").json()
        assert "securitySchemes" not in plain.get("components", {})
        assert "security" not in plain["paths"]["/v1/chat/completions"]["post"]


def test_without_keys_everything_stays_open(module_backend, prompts):
    with served(module_backend, prompts) as base:
        assert ask(base, "anything").usage.completion_tokens >= 1
        assert httpx.get(f"{base}/metrics").status_code == 200
        assert httpx.get(f"{base}/status").status_code == 200


def test_each_key_salts_its_cache_namespace(keyed, module_backend):
    """The job's salt: per key by default, so the same image and cache_salt never share across keys."""
    url = data_url(image_bytes(shape(5).image))

    def salt_of(key: str, **extra) -> str:
        with openai.OpenAI(base_url=f"{keyed}/v1", api_key=key, max_retries=0, timeout=30) as client:
            client.chat.completions.create(model=MODEL, messages=image_message(url), max_tokens=1, **extra)
        return module_backend.jobs[-1].cache_salt

    one, two = salt_of(KEYS[0]), salt_of(KEYS[1])
    assert one and two and one != two
    assert salt_of(KEYS[0]) == one                                          # a key's namespace is stable
    assert salt_of(KEYS[0], extra_body={"cache_salt": "a"}) not in (one, two)
    assert salt_of(KEYS[0], extra_body={"cache_salt": "a"}) != salt_of(KEYS[1], extra_body={"cache_salt": "a"})


def test_salting_per_key_can_be_turned_off(module_backend, prompts):
    with served(module_backend, prompts, api_key=KEYS, cache_salt_per_api_key=False) as base:
        salts = []
        for key in KEYS:
            ask(base, key, extra_body={"cache_salt": "shared"})
            salts.append(module_backend.jobs[-1].cache_salt)
            ask(base, key)
            salts.append(module_backend.jobs[-1].cache_salt)
    assert salts == ["shared", "", "shared", ""]


def test_cache_salt_is_validated(keyed):
    r = httpx.post(f"{keyed}/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS[0]}"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "cache_salt": "x" * 257})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


# -- units ----------------------------------------------------------------------------------------
def test_key_matching_and_header_parsing():
    keys = ApiKeys(KEYS)
    assert keys.identify(KEYS[1]) == tenant_id(KEYS[1]) != tenant_id(KEYS[0])
    assert keys.identify("") is None and keys.identify(KEYS[0][:-1]) is None
    assert KEYS[0] not in tenant_id(KEYS[0])
    assert bearer_token(b"Bearer  abc ") == "abc" and bearer_token(b"BEARER abc") == "abc"
    assert bearer_token(b"Basic abc") is None and bearer_token(b"Bearer") is None and bearer_token(None) is None
    assert effective_cache_salt(None, None, True) == "" and effective_cache_salt("s", None, True) == "s"
    assert effective_cache_salt("s", "t", False) == "s"
    # length-prefixed: the tenant/salt boundary cannot be moved
    assert effective_cache_salt("b", "a", True) != effective_cache_salt("", "ab", True)


def test_settings_take_keys_from_the_environment_and_the_command_line(monkeypatch):
    from gateway.server import parse_gateway_args

    monkeypatch.setenv("EPD_API_KEY", "k1, k2")
    assert GatewaySettings().api_key == ["k1", "k2"]
    assert "k1" not in repr(GatewaySettings())
    assert parse_gateway_args(["--api-key", "a", "--api-key", "b"]).api_key == ["a", "b"]
    args = parse_gateway_args(["--open-metrics-and-status", "--no-cache-salt-per-api-key"])
    assert args.api_key == ["k1", "k2"] and args.open_metrics_and_status and not args.cache_salt_per_api_key
    with pytest.raises(ValueError, match="API key"):
        GatewaySettings(api_key=[" padded "])
