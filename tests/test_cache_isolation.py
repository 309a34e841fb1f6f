"""Tenant isolation of the encoder cache on the real stack: gateway, encoder and decode processes.

The gateway has two API keys and salts per key (the default). An image is a cache
hit only for a request with the same salt (``cache_salt`` and key): the TTFT
breakdown's ``images_cache_hit`` and the encoder's compute count show it, and the
encoder re-derives every salted key from the bytes (a key it cannot re-derive is
refused, so these requests would fail if the salt did not reach it).
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import subprocess
import sys
import time

import httpx
import pytest
from cluster import DEMO_MODEL, ROOT, Cluster, free_port
from runtime.demo_model.shapes import draw_shape

KEYS = ("sk-isolation-one", "sk-isolation-two")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("isolation")
    c = Cluster(tmp)
    e, d = c.start("encoder"), c.start("decode")
    gateway = None
    try:
        c.wait_healthy()
        port = free_port()
        log = tmp / "gateway.log"
        gateway = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", "gateway", "--model", str(DEMO_MODEL), "--port", str(port),
             "--encoder-addrs", e.address, "--decode-addrs", d.address, "--placement", "colocated"],
            cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
            # every image to the encoder, whose compute count the tests read (the salt on the images a
            # colocated decode worker encodes itself: tests/test_colocated_encode.py)
            env={**os.environ, "OMP_NUM_THREADS": "1", "EPD_API_KEY": ",".join(KEYS), "EPD_COLOCATED_ENCODE_MAX_MS": "0"})
        base = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert gateway.poll() is None and time.monotonic() < end, log.read_text()
            time.sleep(0.3)
        yield base
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(timeout=20)
        c.stop()


def ask(base: str, seed: int, key: str, cache_salt: str | None = None) -> dict[str, float]:
    """One image question; returns its TTFT breakdown."""
    sample = draw_shape(random.Random(seed))
    png = io.BytesIO()
    sample.image.save(png, "PNG")
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}}
    body = {"model": "demo-vlm", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is in the image?"}]}]}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].strip() == sample.answer
    return json.loads(r.headers["x-epd-ttft-breakdown"])


def computes(base: str) -> int:
    time.sleep(0.6)  # the gateway polls worker stats every 0.5 s
    status = httpx.get(f"{base}/status", headers={"Authorization": f"Bearer {KEYS[0]}"}).json()
    return sum(w["computes"] for w in status["encoder"])


def test_another_cache_salt_is_a_miss_and_the_same_salt_a_hit(stack):
    before = computes(stack)
    first = ask(stack, 401, KEYS[0], cache_salt="tenant-a")
    second = ask(stack, 401, KEYS[0], cache_salt="tenant-b")
    assert first["images_cache_hit"] == 0 and second["images_cache_hit"] == 0
    assert computes(stack) - before == 2   # each salt got its own encode
    again = ask(stack, 401, KEYS[0], cache_salt="tenant-a")
    assert again["images_cache_hit"] == 1 and again["encode_ms"] == 0
    assert computes(stack) - before == 2


def test_two_api_keys_never_share_an_entry(stack):
    before = computes(stack)
    one = ask(stack, 402, KEYS[0])
    two = ask(stack, 402, KEYS[1])   # same image, no cache_salt: still another namespace
    assert one["images_cache_hit"] == 0 and two["images_cache_hit"] == 0
    assert computes(stack) - before == 2
    assert ask(stack, 402, KEYS[1])["images_cache_hit"] == 1   # its own entry is a hit
    assert computes(stack) - before == 2
