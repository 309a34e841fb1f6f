"""The encoder answers before its Redis write lands; the workers that fetch an embedding by key still get it.

Real processes (one encoder, one decode, one prefill worker; the demo model) sharing the Redis encoder
cache, and the gateway's Orchestrator with inline embeddings off: every request's prompt stage (decode
when colocated, prefill when disaggregated) fetches its image by key right after the Encode reply, from
Redis when the encoder's write-behind has landed, else from that encoder, which holds it in memory
(``cache/embedding_fetch.py``). Each request is a new image: it is answered as the demo model's own
``generate()`` answers it in both placements, its entry then reaches Redis, and nothing is held
afterwards, no encode lock included (``tests/leaks.py``).
"""

from __future__ import annotations

import asyncio
import random

import pytest
import redis
from cluster import DEMO_MODEL, PLACEMENTS, Cluster
from demo_jobs import demo_processor, make_job, model_answer, run

from gateway.orchestrator import Orchestrator
from gateway.settings import GatewaySettings
from runtime.model.model_adapter import VLMAdapter
from leaks import LONG_LEASES, LeakCheck, orchestrator_counters

pytestmark = pytest.mark.timeout(240)

REDIS_URL = "redis://127.0.0.1:6379/0"
ENTRIES = "epd:enc:e:*"   # the workers' encoder cache: the default namespace


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("write-behind"))
    try:
        cluster.start("encoder", "--redis-url", REDIS_URL)
        cluster.start("decode", "--redis-url", REDIS_URL, env=LONG_LEASES)
        cluster.start("prefill", "--redis-url", REDIS_URL)
        cluster.wait_healthy()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def reference() -> VLMAdapter:
    """The demo model in this process: each new image's expected answer is its own ``generate()``."""
    return VLMAdapter.load(DEMO_MODEL)


def entries() -> set[bytes]:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        return set(client.scan_iter(match=ENTRIES, count=1000))
    finally:
        client.close()


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_a_new_image_fetched_by_key_right_after_encode(stack, reference, placement):
    processor = demo_processor()
    address = {role: [w.address for w in stack.by_role(role)] for role in ("encoder", "prefill", "decode")}
    orch = Orchestrator(GatewaySettings(encoder_addrs=address["encoder"], prefill_addrs=address["prefill"],
                                        decode_addrs=address["decode"], placement=placement, prefill_chunk_tokens=8,
                                        inline_embedding_bytes=0))
    check = LeakCheck.of_cluster(stack, redis_url=REDIS_URL, gateways=[orchestrator_counters(orch)]).begin()
    await orch.start()
    try:
        for _ in range(3):
            before = entries()
            seed = random.randrange(1 << 30)   # a new image every run, so its entry is new to Redis
            job, _ = make_job(processor, seed=seed)
            assert await run(orch, processor, job) == model_answer(reference, seed)
            for _ in range(100):                      # the write lands by itself, shortly after
                if entries() - before:
                    break
                await asyncio.sleep(0.05)
            assert len(entries() - before) == 1, "the new image's entry never reached Redis"
        await check.settled()
    finally:
        await orch.close()
