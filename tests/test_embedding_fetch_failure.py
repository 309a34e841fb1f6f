"""An embedding that cannot be fetched fails its own request, never the worker that tried; one
that rode inline on the request needs no fetch.

Real worker processes (two encoders, one prefill, one decode, the demo model) and
the gateway's Orchestrator. The encoder that encodes the request's image is killed
the moment its Encode reply reaches the gateway (the one seam: a wrapper around the
gateway's stub for that encoder that kills the process after the real reply), so
the worker that then fetches the embedding by key — decode when colocated, prefill
when disaggregated — finds that encoder gone. That request must end in a clean 503
that names the embedding fetch; the fetching worker must stay healthy in the
gateway's registry and serve the next request correctly, and nothing stays held
(``tests/leaks.py``, the killed encoders left out by name; leases outlast the test).

The registry does not poll on its own here (``poll_s`` is huge): health changes only
through the orchestrator's own verdicts, so "still healthy" means the gateway did
not blame the worker, not that a poll happened to revive it.

With inline embeddings (``EPD_INLINE_EMBEDDING_BYTES``, on by default; the demo model's are a few
KiB) the Encode reply carried the embedding and the gateway handed it on with the request: the
same killed encoder then costs nothing, the request is answered.
"""

from __future__ import annotations

import asyncio

import pytest
from cluster import Cluster
from demo_jobs import demo_processor, make_job, run

from gateway.chat_backend import BackendFailure
from gateway.orchestrator import Orchestrator
from gateway.settings import GatewaySettings
from leaks import LONG_LEASES, LeakCheck, orchestrator_counters

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def processor():
    return demo_processor()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("fetch-failure"))
    try:
        cluster.start("encoder")                     # the stable one
        for _ in CASES:                              # one to kill per test, known to every peer list
            cluster.start("encoder")
        cluster.start("decode", env=LONG_LEASES)
        cluster.start("prefill")
        cluster.wait_healthy()
        yield cluster
    finally:
        cluster.stop()


class KillAfterEncode:
    """The gateway's stub for one encoder: the real Encode, then that encoder process is killed."""

    def __init__(self, stub, proc):
        self._stub, self._proc = stub, proc

    async def Encode(self, request, timeout=None):
        reply = await self._stub.Encode(request, timeout=timeout)
        self._proc.kill()
        await asyncio.to_thread(self._proc.wait)
        return reply

    def __getattr__(self, name):
        return getattr(self._stub, name)


PLACEMENTS = ["colocated", "disaggregated"]
CASES = [(placement, inline) for inline in (False, True) for placement in PLACEMENTS]


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_unfetchable_embedding_is_a_503_for_that_request_and_the_worker_stays_healthy(stack, processor, placement):
    # always fetched by key: what this test is about
    orch, doomed, check = await start_gateway(stack, placement, inline=False)
    prefill, decode = stack.by_role("prefill")[0], stack.by_role("decode")[0]
    try:
        registry = orch.registry

        job, answer = make_job(processor, seed=41)
        with pytest.raises(BackendFailure) as info:
            await run(orch, processor, job)
        assert doomed.proc.poll() is not None, "the encoder should have been killed after encoding"
        assert info.value.status == 503
        assert "could not fetch the request's image embeddings" in str(info.value)
        fetcher = "decode" if placement == "colocated" else "prefill"
        assert registry.get(fetcher, (decode if fetcher == "decode" else prefill).address).healthy, \
            f"the {fetcher} worker was blamed for an embedding that could not be fetched"
        assert registry.get("decode", decode.address).healthy and registry.get("prefill", prefill.address).healthy

        await registry.refresh()              # the gateway learns that the encoder is gone
        assert not registry.get("encoder", doomed.address).healthy
        job, answer = make_job(processor, seed=41)
        assert await run(orch, processor, job) == answer       # the same workers serve the next request

        await check.settled()                  # the failed request freed everything itself, not the reaper
    finally:
        await orch.close()


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_an_embedding_that_came_inline_needs_no_fetch(stack, processor, placement):
    orch, doomed, check = await start_gateway(stack, placement, inline=True)
    try:
        job, answer = make_job(processor, seed=43)
        assert await run(orch, processor, job) == answer   # the encoder died after its reply: nothing asked it again
        assert doomed.proc.poll() is not None, "the encoder should have been killed after encoding"
        await check.settled()
    finally:
        await orch.close()


async def start_gateway(stack, placement: str, *, inline: bool):
    """An orchestrator whose first encoder (the case's own) is killed right after its first Encode
    reply; started, every worker healthy. Returns it, that encoder and the leak check."""
    case = CASES.index((placement, inline))
    encoders = stack.by_role("encoder")
    doomed, stable = encoders[1 + case], encoders[0]
    prefill, decode = stack.by_role("prefill")[0], stack.by_role("decode")[0]
    settings = GatewaySettings(encoder_addrs=[doomed.address, stable.address], prefill_addrs=[prefill.address],
                               decode_addrs=[decode.address], placement=placement, prefill_chunk_tokens=8,
                               inline_embedding_bytes=(1 << 20) if inline else 0,
                               colocated_encode_max_ms=0)   # the image to the encoder, to be fetched from it
    orch = Orchestrator(settings)
    orch.registry.poll_s = 3600.0         # no background polls: only the orchestrator's verdicts change health
    killed = encoders[1: 2 + case]        # this test's doomed encoder and any earlier one
    check = LeakCheck.of_cluster(stack, exclude=[e.address for e in killed], gateways=[orchestrator_counters(orch)]).begin()
    await orch.start()
    try:
        registry = orch.registry
        assert all(h.healthy for role in ("encoder", "prefill", "decode") for h in registry.workers[role].values())
    except BaseException:
        await orch.close()
        raise
    handle = registry.get("encoder", doomed.address)
    handle.stub = KillAfterEncode(handle.stub, doomed.proc)   # ties pick the first encoder: the doomed one
    return orch, doomed, check
