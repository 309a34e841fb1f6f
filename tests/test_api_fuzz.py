"""The HTTP API fuzzed from its own OpenAPI schema against the real multi-process stack.

Schemathesis generates requests from ``/openapi.json`` (valid ones and, for the chat endpoint,
malformed ones too) and sends them to a real ``epd serve``: encoder, prefill and decode
processes behind the gateway. Whatever it sends, the answer is never a 5xx: a client's
mistake is a 400-class error object, a valid request is served. The number of examples is
bounded so the module stays within a minute or two of CPU; every generated chat answer is
capped at a few tokens by the served stack's settings.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from cluster import ROOT, free_port

MAX_EXAMPLES = int(os.environ.get("EPD_FUZZ_EXAMPLES", "60"))


@pytest.fixture(scope="module")
def served_base(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("fuzz") / "serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EPD_MAX_TOKENS_LIMIT": "16", "EPD_DEFAULT_MAX_TOKENS": "8",
           "EPD_TTFT_SLO_MS": "30000"}
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "serve", "--port", str(port)], cwd=ROOT,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"epd serve exited:\n{log.read_text()}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"epd serve not healthy:\n{log.read_text()}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def api_schema(served_base):
    return schemathesis.openapi.from_url(f"{served_base}/openapi.json")


# Schemathesis' own pytest integration does not run under pytest 9, so its strategies are driven
# with Hypothesis directly. The chat endpoint gets most examples, valid and malformed; the small
# GET endpoints a few each (they have no body to malform).
CASES = [
    ("POST", "/v1/chat/completions", GenerationMode.POSITIVE, MAX_EXAMPLES),
    ("POST", "/v1/chat/completions", GenerationMode.NEGATIVE, MAX_EXAMPLES),
    ("GET", None, GenerationMode.POSITIVE, 10),
]


@pytest.mark.parametrize(("method", "path", "mode", "examples"), CASES,
                         ids=[f"{m}-{p or 'all'}-{g.value}" for m, p, g, _ in CASES])
def test_no_server_error_for_any_generated_request(api_schema, method, path, mode, examples):
    operations = api_schema.include(method=method, **({"path": path} if path else {}))
    seen: dict[tuple[str, int], int] = {}

    @given(case=operations.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call(timeout=60)
        key = (case.path, response.status_code)
        seen[key] = seen.get(key, 0) + 1
        assert response.status_code < 500, (
            f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}\n"
            f"body: {str(case.body)[:500]}")

    check()
    print(mode.value, sorted(seen.items()))
    assert sum(seen.values()) >= examples // 2, seen   # the generator really sent requests
