"""Qwen3.5 (hybrid: Gated DeltaNet + full attention) through the services: real processes, real gRPC.

The tiny random checkpoint (``epd demo-model --family qwen3_5``), one encoder, one
decode and one prefill worker. Requests go through the gateway's ``PromptBuilder``
and ``Orchestrator`` in this process, both placements, chunks of 1 token, a few
tokens (cutting image spans) and the whole prompt: the prefill worker carries the
linear-attention state chunk to chunk and hands it over on the last chunk
(disaggregated), or the decode worker carries it across its steps (colocated).
The reference is ``generate()`` of the same checkpoint. After every test nothing
is held (``tests/leaks.py``) and every state slot is free on both workers.
"""

from __future__ import annotations

import grpc
import pytest
from family_services import Stack, family_stack, orchestrator, run
from leaks import LeakCheck
from qwen_vl_cases import image_runs

from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.demo_model.qwen3_5 import build_qwen3_5
from runtime.worker.wire import GRPC_OPTIONS

pytestmark = pytest.mark.timeout(300)

BUILDERS = {"qwen3_5": build_qwen3_5}


@pytest.fixture(scope="module", params=list(BUILDERS))
def stack(request, tmp_path_factory) -> Stack:
    with family_stack(tmp_path_factory.mktemp(f"family-services-{request.param}"), request.param,
                      BUILDERS[request.param]) as s:
        yield s


async def _slots(address: str) -> tuple[int, int]:

    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stub = pb_grpc.DecodeStub(channel)
        s = await stub.Stats(pb.StatsRequest(), timeout=5)
    return s.free_state_slots, s.total_state_slots


@pytest.fixture
async def leaks(stack):
    check = LeakCheck.of_cluster(stack.cluster).begin()
    yield check
    await check.settled()
    free, total = await _slots(stack.worker("decode"))
    assert total > 0 and free == total, f"decode state slots held after the test: {free} of {total} free"


@pytest.mark.parametrize("placement, chunk_tokens", [("disaggregated", 1), ("disaggregated", 7), ("disaggregated", 4096),
                                                     ("colocated", 1), ("colocated", 5), ("colocated", 4096)],
                         ids=["disagg-chunk-1", "disagg-chunk-7", "disagg-whole", "coloc-chunk-1", "coloc-chunk-5",
                              "coloc-whole"])
async def test_output_is_token_identical_to_generate(stack, leaks, placement, chunk_tokens):
    async with orchestrator(stack, placement, chunk_tokens, leaks) as o:
        got = {name: await run(o, stack, r) for name, r in stack.requests.items()}
    assert got == {name: (r.expected, r.finish) for name, r in stack.requests.items()}
    if 1 < chunk_tokens < 4096:    # the chunks really cut image spans
        three = stack.requests["three-images"].ids
        runs = image_runs(three, stack.adapter.image_token_id)
        assert any(s < b < e for s, e in runs for b in range(chunk_tokens, len(three), chunk_tokens))


async def test_status_shows_state_slots_and_no_prefix_cache(stack, leaks):

    for role in ("decode", "prefill"):
        async with grpc.aio.insecure_channel(stack.worker(role), options=GRPC_OPTIONS) as channel:
            stub = pb_grpc.DecodeStub(channel) if role == "decode" else pb_grpc.PrefillStub(channel)
            s = await stub.Stats(pb.StatsRequest(), timeout=5)
        assert s.total_state_slots > 0 and s.free_state_slots == s.total_state_slots, role
        if role == "decode":
            assert not s.prefix_cache, "a hybrid model's decode worker keeps no prefix cache"
