"""Every way a request can end early, on the real stack over HTTP, in both placements, and that
each frees exactly what it held: a client that disconnects mid-stream, one that disconnects
before its first token, a stop string that ends the answer early, ``max_tokens`` reached.

Processes (tests/cluster.py): an encoder whose cache is Redis (its own database, flushed at
start, so encodes really take the cross-process lock), a decode worker whose every step waits
``STEP_DELAY_MS`` (a 4-token answer streams for about half a second, so a disconnect or a stop
string lands while the decode worker is still generating), a prefill worker that delays every
KV chunk by ``CHUNK_DELAY_MS`` (a disaggregated first token takes about half a second), and two
``epd gateway`` processes in front of the same workers, one per placement. Clients are the
official ``openai`` client and httpx.

After every test the leak check (``tests/leaks.py``) runs over every worker, both gateways'
counters and the Redis locks; decode leases outlast the module, so only the path that ended a
request can have freed its blocks, and the lease reaper's counter must not move.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import openai
import pytest
import redis
from inprocess_backend import data_url, image_bytes, image_message, shape

from cluster import Cluster, Gateway
from leaks import LONG_LEASES, LeakCheck, http_gateway_counters
from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(240)

REDIS_URL = "redis://127.0.0.1:6379/12"   # this module's own database
STEP_DELAY_MS = 150
CHUNK_DELAY_MS = 150
CHUNK_TOKENS = 8                          # a ~26-token prompt: 4 chunks (prefill steps or KV chunks)
PLACEMENTS = ("colocated", "disaggregated")
MODEL = "demo-vlm"


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[Cluster, dict[str, Gateway]]:
    redis.Redis.from_url(REDIS_URL).flushdb()
    c = Cluster(tmp_path_factory.mktemp("endings"))
    try:
        c.start("encoder", "--redis-url", REDIS_URL)
        c.start("decode", "--redis-url", REDIS_URL, "--faults", f"delay_step_ms={STEP_DELAY_MS}", env=LONG_LEASES)
        c.start("prefill", "--redis-url", REDIS_URL, "--faults", f"delay_chunk_ms={CHUNK_DELAY_MS}")
        c.wait_healthy()
        gateways = {p: c.start_gateway("--placement", p, "--prefill-chunk-tokens", str(CHUNK_TOKENS)) for p in PLACEMENTS}
        c.wait_gateways()
        yield c, gateways
    finally:
        c.stop()


@pytest.fixture(params=PLACEMENTS)
def gateway(request, served) -> Gateway:
    return served[1][request.param]


@pytest.fixture(autouse=True)
def nothing_leaks(served):
    cluster, gateways = served
    check = LeakCheck.of_cluster(cluster, redis_url=REDIS_URL,
                                 gateways=[http_gateway_counters(g.base) for g in gateways.values()]).begin()
    yield
    check.assert_settled()


def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="unused", max_retries=0, timeout=30)


def ask(seed: int, **fields) -> tuple[dict, str]:
    """A chat request about shape ``seed`` (greedy) and its known answer."""
    sample = shape(seed)
    return {"model": MODEL, "temperature": 0, "max_tokens": 8,
            "messages": image_message(data_url(image_bytes(sample.image))), **fields}, sample.answer


def outcomes(gateway: Gateway) -> dict[str, float]:
    """The gateway's request counters: ``success:<finish reason>`` and ``failure:<reason>``."""
    out = {}
    for line in httpx.get(f"{gateway.base}/metrics", timeout=5, trust_env=False).text.splitlines():
        for prefix, kind in (("epd:request_success_total{", "success"), ("epd:request_failure_total{", "failure")):
            if line.startswith(prefix):
                name, value = line.rsplit(" ", 1)
                out[f"{kind}:{name.split('=')[1].split(chr(34))[1]}"] = float(value)
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def worker_stats(role: str, address: str) -> pb.WorkerStats:
    stub = {"decode": pb_grpc.DecodeStub, "prefill": pb_grpc.PrefillStub}[role]
    with grpc.insecure_channel(address) as ch:
        return stub(ch).Stats(pb.StatsRequest(since_sample=2**63), timeout=2.0)


def started_on_the_workers(cluster: Cluster, placement: str) -> bool:
    """The request holds its decode reservation and is being prefilled: on the decode worker
    (colocated, a prompt chunk at a time) or on the prefill worker (disaggregated)."""
    decode = worker_stats("decode", cluster.by_role("decode")[0].address)
    if decode.reservations_active < 1:
        return False
    if placement == "colocated":
        return decode.queued_prefill_tokens > 0
    return worker_stats("prefill", cluster.by_role("prefill")[0].address).in_flight > 0


# -- the client goes away ---------------------------------------------------------------------

def test_client_gone_mid_stream(gateway):
    body, answer = ask(501)
    before = outcomes(gateway)
    with client(gateway).chat.completions.create(**body, stream=True) as stream:
        for chunk in stream:
            assert chunk.choices[0].finish_reason is None, "the answer ended before the client left"
            if chunk.choices[0].delta.content:
                assert answer.startswith(chunk.choices[0].delta.content.strip())
                break                                    # leaving the block closes the connection
    # the gateway saw the client leave (never a finished request) and closed the request; the
    # leak check then shows the decode worker's sequence retired and its blocks back
    _settle(lambda: delta(before, outcomes(gateway)) == {"failure:cancelled": 1.0},
            lambda: delta(before, outcomes(gateway)))


async def test_client_gone_before_the_first_token(served, gateway):
    cluster = served[0]
    placement = next(p for p, g in served[1].items() if g is gateway)
    body, _ = ask(502, stream=True)
    before = outcomes(gateway)
    async with httpx.AsyncClient(base_url=gateway.base, timeout=30, trust_env=False) as http:
        request = asyncio.create_task(http.post("/v1/chat/completions", json=body))
        end = time.monotonic() + 10
        while not await asyncio.to_thread(started_on_the_workers, cluster, placement):
            assert not request.done(), f"the request ended before the client could leave: {request.result().text}"
            assert time.monotonic() < end, "the request never reached the workers"
            await asyncio.sleep(0.02)
        request.cancel()                                 # the connection closes with no response yet
        with pytest.raises(asyncio.CancelledError):
            await request
    await asyncio.to_thread(_settle, lambda: delta(before, outcomes(gateway)) == {"failure:cancelled": 1.0},
                            lambda: delta(before, outcomes(gateway)))


def _settle(done, show, timeout_s: float = 5.0) -> None:
    """Until ``done()`` (the gateway's counters are updated as the request unwinds)."""
    end = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < end, show()
        time.sleep(0.1)


# -- the answer ends early --------------------------------------------------------------------

def test_stop_string_ends_the_answer_early(gateway):
    sample = shape(503)
    # spans the boundary between the colour's and the shape's tokens; "zzz" never occurs
    body, answer = ask(503, stop=[f"{sample.colour[-2:]} {sample.shape[:2]}", "zzz"])
    expected = f"a {sample.colour[:-2]}"
    assert answer.startswith(expected) and answer != expected
    before = outcomes(gateway)
    c = client(gateway)
    done = c.chat.completions.create(**body)
    assert (done.choices[0].message.content, done.choices[0].finish_reason) == (expected, "stop")
    chunks = list(c.chat.completions.create(**body, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expected
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]
    assert delta(before, outcomes(gateway)) == {"success:stop": 2.0}


def test_max_tokens_reached(gateway):
    body, answer = ask(504, max_tokens=2)
    before = outcomes(gateway)
    c = client(gateway)
    done = c.chat.completions.create(**body)
    assert (done.choices[0].message.content, done.choices[0].finish_reason) == (" ".join(answer.split()[:2]), "length")
    assert done.usage.completion_tokens == 2
    # one token: the first token is also the last (disaggregated: prefill's, with no decode step)
    chunks = list(c.chat.completions.create(**{**body, "max_tokens": 1}, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == answer.split()[0]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 1
    assert delta(before, outcomes(gateway)) == {"success:length": 2.0}
