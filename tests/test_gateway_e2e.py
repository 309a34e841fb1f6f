"""The real stack over HTTP: gateway process -> encoder, prefill, decode processes.

The official openai client streams an image question through disaggregated
placement; an infeasible deadline is refused at once with 429 + Retry-After and
no work done; text-only requests never touch the encoder; after every test nothing
stays held (``tests/leaks.py``: workers, the gateway's counters, the lease reaper idle).
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from cluster import Cluster, Gateway
from leaks import LONG_LEASES, LeakCheck, http_gateway_counters
from shape_images import shape_data_url


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[Cluster, Gateway]:
    c = Cluster(tmp_path_factory.mktemp("stack"))
    try:
        c.start("encoder")
        c.start("decode", env=LONG_LEASES)   # before prefill: a worker dials only peers it was told about
        c.start("prefill")
        c.wait_healthy()
        gateway = c.start_gateway("--placement", "disaggregated", "--prefill-chunk-tokens", "8")
        c.wait_gateways()
        yield c, gateway
    finally:
        c.stop()


@pytest.fixture(scope="module")
def stack(served) -> str:
    return served[1].base


@pytest.fixture(autouse=True)
def nothing_leaks(served):
    cluster, gateway = served
    check = LeakCheck.of_cluster(cluster, gateways=[http_gateway_counters(gateway.base)]).begin()
    yield
    check.assert_settled()


def image_part(seed: int) -> tuple[dict, str]:
    url, sample = shape_data_url(seed)
    return {"type": "image_url", "image_url": {"url": url}}, sample.answer


def status(base: str) -> dict:
    time.sleep(0.6)  # the gateway polls worker stats every 0.5 s
    return httpx.get(f"{base}/status").json()


def test_streaming_image_chat_through_the_split(stack):
    client = openai.OpenAI(base_url=f"{stack}/v1", api_key="unused")
    part, answer = image_part(101)
    chunks = list(client.chat.completions.create(
        model="demo-vlm", max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": [part, {"type": "text", "text": "What is in the image?"}]}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() == answer
    breakdown = next(c.model_extra["epd_ttft_breakdown"] for c in chunks if c.model_extra.get("epd_ttft_breakdown"))
    assert breakdown["transfer_bytes"] > 0 and "prefill_ms" in breakdown
    assert chunks[-1].usage.completion_tokens == len(answer.split())
    metrics = httpx.get(f"{stack}/metrics").text
    assert 'epd:placement_total{placement="disaggregated",reason="forced"}' in metrics
    for stage in ("encoder", "prefill", "decode"):
        assert f'epd:queue_depth{{stage="{stage}"}}' in metrics


def test_infeasible_deadline_is_refused_before_any_work(stack):
    before = status(stack)["encoder"][0]["computes"]
    part, _ = image_part(202)
    r = httpx.post(f"{stack}/v1/chat/completions", headers={"x-ttft-slo-ms": "1"}, timeout=30, json={
        "model": "demo-vlm", "max_tokens": 8,
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is in the image?"}]}]})
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1
    # the same wait in milliseconds, which the OpenAI SDKs read first
    assert 0 < int(r.headers["retry-after-ms"]) <= 1000 * int(r.headers["retry-after"])
    assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
    assert status(stack)["encoder"][0]["computes"] == before  # refused before the encoder ran


def _cache_checks(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("epd:gateway_image_cache_checks_total{"):
            name, value = line.rsplit(" ", 1)
            out[name.split('cached="')[1].split('"')[0]] = float(value)
    return out


def test_a_repeated_image_is_a_cache_hit_and_skips_the_encode(stack):
    part, answer = image_part(303)
    body = {"model": "demo-vlm", "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is in the image?"}]}]}
    client = openai.OpenAI(base_url=f"{stack}/v1", api_key="unused")
    checks = [_cache_checks(stack)]
    breakdowns = []
    for _ in range(2):
        chunks = list(client.chat.completions.create(**body))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == answer
        breakdowns.append(next(c.model_extra["epd_ttft_breakdown"] for c in chunks if c.model_extra.get("epd_ttft_breakdown")))
        checks.append(_cache_checks(stack))
    first, second = breakdowns
    assert first["images_cache_hit"] == 0 and first["encode_ms"] > 0
    assert second["images_cache_hit"] == 1 and second["encode_ms"] == 0  # known cached: no Encode RPC at all
    # one miss counted from the first request's Encode, one hit from the second's cache check
    assert checks[1].get("false", 0) - checks[0].get("false", 0) == 1
    assert checks[2].get("true", 0) - checks[1].get("true", 0) == 1


def test_one_new_image_is_one_compute_and_no_cache_hit(stack):
    """A cache hit is a client image that did not need encoding: the prefill worker's fetch of the
    embedding by key (this stack has no Redis, so it asks the encoder) is no hit."""
    before = status(stack)["encoder"][0]
    part, answer = image_part(404)
    r = httpx.post(f"{stack}/v1/chat/completions", timeout=60, json={
        "model": "demo-vlm", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is in the image?"}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].strip() == answer
    after = status(stack)["encoder"][0]
    assert (after["computes"] - before["computes"], after["cache_hits"] - before["cache_hits"]) == (1, 0)


def test_text_only_request_skips_the_encoder(stack):
    before = status(stack)["encoder"][0]
    r = httpx.post(f"{stack}/v1/chat/completions", timeout=30, json={
        "model": "demo-vlm", "max_tokens": 4, "messages": [{"role": "user", "content": "hello what do you see ?"}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    after = status(stack)["encoder"][0]
    assert (after["computes"], after["cache_hits"]) == (before["computes"], before["cache_hits"])


def test_profile_writes_a_service_time_file_the_simulator_reads(stack, tmp_path):
    from runtime.policy import service_times as st
    from runtime.policy.cost_model import CostModel
    from bench.profile_cli import main as profile_main

    out = tmp_path / "times.json"
    assert profile_main(["--base", stack, "--out", str(out), "--prompt-words", "0,60", "--batches", "2",
                         "--repeats", "1"]) == 0
    content = st.load(out)
    assert content.tables.prefill and content.tables.decode_step and content.tables.encode
    assert content.params.kv_bytes_per_token > 0
    model = CostModel.from_file(out)
    assert model.prefill_ms(100) > model.prefill_ms(10) > 0
