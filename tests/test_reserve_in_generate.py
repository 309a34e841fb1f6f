"""A colocated ``Generate`` that reserves itself (``GenerateRequest.reserve``): one round trip
less before the first token, the same refusals as ``Reserve``, and nothing held on any ending.

Real worker processes (one encoder, one decode worker, the demo model). The first tests play the
gateway by hand against the decode worker; the last runs the gateway's Orchestrator with a
counting wrapper around its decode stub: a colocated request sends no ``Reserve`` at all.
"""

from __future__ import annotations

import time
import uuid

import grpc
import pytest
from cluster import encoder_and_decode
from demo_jobs import demo_processor, make_job, run

from cache.keys import image_content_key
from gateway.orchestrator import Orchestrator
from gateway.settings import GatewaySettings
from leaks import LONG_LEASES, LeakCheck, orchestrator_counters
from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.worker.wire import GRPC_OPTIONS, token_digest

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def processor():
    return demo_processor()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with encoder_and_decode(tmp_path_factory.mktemp("reserve-in-generate"), LONG_LEASES) as cluster:
        yield cluster


async def self_reserving_generate(stack, processor, seed: int, *, max_tokens: int = 8, colocated: bool = True):
    """A Generate carrying the job's image bytes and its own ReserveRequest: (events, error or None)."""
    encoder, decode = stack.by_role("encoder")[0], stack.by_role("decode")[0]
    job, _ = make_job(processor, seed=seed)
    async with grpc.aio.insecure_channel(encoder.address) as ch:
        stats = await pb_grpc.EncoderStub(ch).Stats(pb.StatsRequest(), timeout=5)
    key = image_content_key(job.images[0].image, stats.model_fingerprint, stats.preprocess_digest)
    deadline_ms = int((time.time() + 20) * 1000)
    reserve = pb.ReserveRequest(request_id=job.request_id, prompt_tokens=len(job.token_ids), max_tokens=max_tokens,
                                deadline_unix_ms=deadline_ms, token_digest=token_digest(job.token_ids, [key]))
    ref = pb.ImageRef(cache_key=key, encoder_address=encoder.address, image_data=job.images[0].data)
    events, error = [], None
    async with grpc.aio.insecure_channel(decode.address, options=GRPC_OPTIONS) as ch:
        call = pb_grpc.DecodeStub(ch).Generate(pb.GenerateRequest(
            request_id=job.request_id, max_tokens=max_tokens, colocated=colocated, deadline_unix_ms=deadline_ms,
            token_ids=job.token_ids, images=[ref], chunk_tokens=8, reserve=reserve), timeout=20)
        try:
            async for ev in call:
                events.append(ev)
        except grpc.aio.AioRpcError as exc:
            error = exc
    return events, error


async def test_the_first_event_names_the_reservation_and_nothing_stays_held(stack, processor):
    check = LeakCheck.of_cluster(stack).begin()
    events, error = await self_reserving_generate(stack, processor, seed=71)
    assert error is None and events and events[-1].finish_reason
    first = events[0]
    assert first.HasField("reserved") and first.reserved.reservation.reservation_id
    assert not any(ev.HasField("reserved") for ev in events[1:])
    await check.settled()   # the sequence retired: its reservation freed with it


async def test_a_prompt_that_can_never_fit_is_refused_as_reserve_refuses_it(stack, processor):
    check = LeakCheck.of_cluster(stack).begin()
    events, error = await self_reserving_generate(stack, processor, seed=72, max_tokens=10_000_000)
    assert not events and error is not None
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "can never fit" in error.details()
    await check.settled()


async def test_only_a_colocated_generate_may_reserve_itself(stack, processor):
    check = LeakCheck.of_cluster(stack).begin()
    events, error = await self_reserving_generate(stack, processor, seed=73, colocated=False)
    assert not events and error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    await check.settled()


class CountingDecodeStub:
    """The gateway's stub for the decode worker, counting the Reserve calls it makes."""

    def __init__(self, stub):
        self._stub, self.reserves = stub, 0

    def Reserve(self, *args, **kwargs):
        self.reserves += 1
        return self._stub.Reserve(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._stub, name)


async def test_a_colocated_request_sends_no_reserve(stack, processor):
    encoder, decode = stack.by_role("encoder")[0], stack.by_role("decode")[0]
    orch = Orchestrator(GatewaySettings(encoder_addrs=[encoder.address], decode_addrs=[decode.address],
                                        placement="colocated", colocated_encode_max_ms=1000.0))
    check = LeakCheck.of_cluster(stack, gateways=[orchestrator_counters(orch)]).begin()
    await orch.start()
    try:
        handle = orch.registry.get("decode", decode.address)
        handle.stub = counting = CountingDecodeStub(handle.stub)
        for seed in (74, 74, 75):   # new, then the same image (an encoder-cache hit), then new
            job, answer = make_job(processor, seed=seed)
            assert await run(orch, processor, job) == answer
        assert counting.reserves == 0
        await check.settled()
    finally:
        await orch.close()
