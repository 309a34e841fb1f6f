"""LLaVA-OneVision's multi-image form through real processes: one picture, two cache entries; refusals by variant.

One stack (``family_services.family_stack``: encoder, decode and prefill processes of the tiny
``llava_onevision`` checkpoint; the gateway's ``PromptBuilder`` and ``Orchestrator`` in this
process). ``tests/test_families_services.py`` runs the shared cases (one image, three images of
different sizes, a multi-turn conversation with two images) through this family in both
placements against transformers' multi-image reference; here, per placement, a picture sent
alone and then beside another (its single-image tiling, then its one square tile) gives two
encodes under two keys, both held by the encoder, and both replies are transformers'. The
workers refuse, before holding anything, a ref whose layout variant is not the family's rule
for the request's image count (a gateway that would fetch the wrong form), and the encoder an
unknown variant. After every test nothing is held (``tests/leaks.py``).

On the code before layout variants the replies differ from transformers' (every image was
tiled, whatever the prompt) and the keys of both forms were one key.
"""

from __future__ import annotations

import grpc
import pytest
from family_services import Stack, family_stack, orchestrator, png, reference_request, run
from leaks import LeakCheck
from qwen_vl_cases import Case, noise_image, user

from cache.keys import image_content_key
from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.demo_model.llava_anyres import build_llava_anyres
from runtime.model.families.llava_anyres import MULTI_IMAGE
from runtime.worker.wire import GRPC_OPTIONS, tensor_from_pb

pytestmark = pytest.mark.timeout(300)

SEEDS = {"disaggregated": 31, "colocated": 41}


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Stack:
    with family_stack(tmp_path_factory.mktemp("onevision-multi-image"), "llava_onevision", build_llava_anyres) as s:
        yield s


@pytest.fixture
async def leaks(stack):
    check = LeakCheck.of_cluster(stack.cluster).begin()
    yield check
    await check.settled()


@pytest.fixture
async def stubs(stack):
    channels = {role: grpc.aio.insecure_channel(stack.worker(role), options=GRPC_OPTIONS)
                for role in ("encoder", "decode", "prefill")}
    yield pb_grpc.EncoderStub(channels["encoder"]), pb_grpc.DecodeStub(channels["decode"]), \
        pb_grpc.PrefillStub(channels["prefill"])
    for channel in channels.values():
        await channel.close()


@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
async def test_a_picture_alone_and_in_a_pair_is_two_cache_entries_and_both_replies_are_right(
        stack, leaks, stubs, placement):
    encoder = stubs[0]
    x, y = noise_image(60, 40, SEEDS[placement]), noise_image(90, 50, SEEDS[placement] + 1)
    alone = reference_request(stack.adapter, Case("alone", [user(None, "what is in the image ?")], [x]))
    pair = reference_request(stack.adapter, Case("pair", [user(None, "and", None, "compare them .")], [x, y]))
    stats = await encoder.Stats(pb.StatsRequest())
    keys = {v: image_content_key(x, stats.model_fingerprint, stats.preprocess_digest, "", v) for v in ("", MULTI_IMAGE)}
    assert keys[""] != keys[MULTI_IMAGE]
    assert list((await encoder.Cached(pb.CachedRequest(cache_keys=list(keys.values())))).cached) == [False, False]
    decode = stubs[1]

    async def encodes() -> int:   # at the encoder, or on the colocated decode worker from the bytes
        return (await encoder.Stats(pb.StatsRequest())).computes + (await decode.Stats(pb.StatsRequest())).computes

    async with orchestrator(stack, placement, 7, leaks) as o:
        assert await run(o, stack, alone) == (alone.expected, alone.finish)
        computed = await encodes()
        assert await run(o, stack, pair) == (pair.expected, pair.finish)
        # x's entry from the first request was not used for the pair: x and y were both encoded
        assert await encodes() == computed + 2
        assert await run(o, stack, alone) == (alone.expected, alone.finish)   # from the cache: its own form
        assert await encodes() == computed + 2
    assert list((await encoder.Cached(pb.CachedRequest(cache_keys=list(keys.values())))).cached) == [True, True]
    fetched = await encoder.Encode(pb.EncodeRequest(request_id="fetch", return_embeddings=True, images=[
        pb.EncodeImage(ref=pb.ImageRef(cache_key=k, layout_variant=v)) for v, k in keys.items()]))
    rows = [tensor_from_pb(im.embedding).shape[0] for im in fetched.images]
    assert rows == [stack.adapter.image_tokens(*x.size), stack.adapter.image_tokens(*x.size, MULTI_IMAGE)]
    assert [im.layout_variant for im in fetched.images] == ["", MULTI_IMAGE]


async def test_prefill_and_decode_refuse_a_multi_image_prompt_in_the_single_form(stack, leaks, stubs):
    encoder, decode, prefill = stubs
    refs = [pb.ImageRef(cache_key="0" * 64, encoder_address=stack.worker("encoder")) for _ in range(2)]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await prefill.Prefill(pb.PrefillRequest(request_id="wrong-form", token_ids=[1, 2], images=refs), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "encodes every image of a prompt of 2 images as 'multi-image'" in refused.value.details()
    call = decode.Generate(pb.GenerateRequest(request_id="wrong-form", token_ids=[1, 2], images=refs,
                                              colocated=True), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in call:
            pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'multi-image'" in refused.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await encoder.Encode(pb.EncodeRequest(request_id="bogus", images=[pb.EncodeImage(
            ref=pb.ImageRef(layout_variant="square"), data=png(noise_image(8, 8, 1)))]), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'square'" in refused.value.details()
