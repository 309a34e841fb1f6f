"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL through the services (issue 17): real processes, real gRPC.

Per family (a module-scoped stack, torn down before the next family's): the tiny
random checkpoint (``epd demo-model --family``'s builder), one encoder, one decode and
one prefill worker (``epd <role> --model DIR``), and for Qwen3-VL (the family with the
most to carry: DeepStack) one ``epd gateway`` process in front of them. Requests go in
three ways:

* the gateway's own ``PromptBuilder`` and ``Orchestrator`` in this process, over gRPC,
  both placements, chunk sizes that cut image spans and the whole prompt;
* the ``openai`` client through the gateway process (HTTP, both placements);
* hand-made ``Reserve`` / ``PrefillRequest`` / ``KVChunk`` / ``Generate`` messages,
  for the handoffs that must be refused: a wrong or missing rope delta, a wrong grid.

The reference is ``generate()`` of the same checkpoint loaded here (greedy, cut at
the first EOS, which ends the services' stream). Cases (``qwen_vl_cases.CASES``): one
image, three images of different sizes, a multi-turn conversation with images in
earlier turns, a system prompt, text only. After every test nothing is held
(``tests/leaks.py``).

On the code before this change every request fails: prefill and colocated decode
called ``VLMAdapter.embed``, which refuses M-RoPE models (the positions would be lost),
no message carried a grid or a rope delta, and the gateway's ``AutoProcessor`` needed
torchvision.
"""

from __future__ import annotations

import io
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from cluster import Cluster, Gateway
from family_services import openai_messages, orchestrator, png
from leaks import LONG_LEASES, LeakCheck, http_gateway_counters
from openai import OpenAI
from PIL import Image
from qwen_vl_cases import CASES, FAMILIES, NEW_TOKENS, Case, build_checkpoint, image_runs

from gateway.chat_backend import ChatJob, PreparedImage
from gateway.errors import ApiError
from gateway.openai_schema import ChatCompletionRequest
from gateway.orchestrator import Orchestrator
from gateway.prompt import BuiltPrompt, PromptBuilder
from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.model.model_adapter import FirstToken, KVChunk, VLMAdapter
from runtime.model.sampling import SamplingParams
from runtime.model.tensor_bytes import dtype_name
from runtime.worker.rpc_failure import FailureKind, failure_kind
from runtime.worker.wire import GRPC_OPTIONS, payload_checksum, tensor_from_pb, token_digest

pytestmark = pytest.mark.timeout(300)

SERVED = "qwen-tiny"
MAX_TOKENS = NEW_TOKENS
HTTP_FAMILY = "qwen3_vl"       # also served through gateway processes (each costs a process start-up)


@dataclass
class Request:
    case: Case
    messages: list[dict]            # OpenAI chat messages (images as data: URLs of PNGs)
    images: list[PreparedImage]     # as the gateway decodes them
    ids: list[int]                  # the processor's prompt (placeholders expanded)
    grids: list[tuple[int, int, int]]
    rope_delta: int                 # the model's own get_rope_index
    expected: list[int]             # generate(), cut at the first EOS
    finish: str


@dataclass
class Stack:
    family: str
    checkpoint: Path
    cluster: Cluster
    gateways: dict[str, Gateway]    # placement -> an ``epd gateway`` process (HTTP_FAMILY only)
    adapter: VLMAdapter
    builder: PromptBuilder
    requests: dict[str, Request]

    def worker(self, role: str) -> str:
        return self.cluster.by_role(role)[0].address


def _request(adapter: VLMAdapter, case: Case) -> Request:
    processor = adapter.processor
    text = processor.apply_chat_template(case.messages, add_generation_prompt=True)
    inputs = processor(images=case.images or None, text=text, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    with torch.inference_mode():
        out = adapter.model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    new, finish = out[0, len(ids):].tolist(), "length"
    for i, token in enumerate(new):
        if token in adapter.eos_token_ids:
            new, finish = new[:i], "stop"
            break
    grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()] if case.images else []
    if case.images:
        with torch.inference_mode():
            _, delta = adapter.model.model.get_rope_index(inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                                                          image_grid_thw=inputs["image_grid_thw"])
        rope_delta = int(delta.reshape(-1)[0])
    else:
        rope_delta = 0
    images = [PreparedImage(png(im), Image.open(io.BytesIO(png(im)))) for im in case.images]
    return Request(case, openai_messages(case), images, ids, grids, rope_delta, new, finish)


@pytest.fixture(scope="module", params=FAMILIES)
def stack(request, tmp_path_factory) -> Stack:
    family = request.param
    root = tmp_path_factory.mktemp(f"qwen-services-{family}")
    checkpoint = build_checkpoint(family, root)
    cluster = Cluster(root, model=checkpoint)
    try:
        cluster.start("encoder")
        cluster.start("decode", env=LONG_LEASES)
        cluster.start("prefill")              # after decode: it pushes KV only to discovered peers
        gateways = {}
        if family == HTTP_FAMILY:
            gateways = {placement: cluster.start_gateway("--placement", placement, "--served-model-name", SERVED,
                                                         "--prefill-chunk-tokens", "7")
                        for placement in ("disaggregated", "colocated")}
        torch.set_num_threads(1)
        adapter = VLMAdapter.load(checkpoint)    # the references, while the workers start
        requests = {case.name: _request(adapter, case) for case in CASES}
        cluster.wait_healthy()
        cluster.wait_gateways()
        yield Stack(family, checkpoint, cluster, gateways, adapter, PromptBuilder.from_pretrained(checkpoint), requests)
    finally:
        cluster.stop()


@pytest.fixture
async def leaks(stack):
    """After the test nothing is held anywhere in the stack."""
    check = LeakCheck.of_cluster(stack.cluster, gateways=[http_gateway_counters(g.base)
                                                          for g in stack.gateways.values()]).begin()
    yield check
    await check.settled()


def built(stack: Stack, r: Request) -> BuiltPrompt:
    """The gateway's own prompt building (chat template, placeholder rule, positions) for the request."""
    chat = ChatCompletionRequest.model_validate({"model": SERVED, "messages": r.messages})
    return stack.builder.build_prompt(chat.messages, [im.image for im in r.images])


async def run(o: Orchestrator, stack: Stack, r: Request) -> tuple[list[int], str]:
    prompt = built(stack, r)
    now = time.monotonic()
    job = ChatJob(uuid.uuid4().hex, prompt.token_ids, r.images, MAX_TOKENS, SamplingParams(temperature=0.0),
                  now + 60.0, 1000.0, now, image_grids=prompt.image_grids, rope_delta=prompt.rope_delta)
    tokens, finish = [], None
    async for ev in o.generate(job):
        tokens += ev.token_ids
        finish = ev.finish_reason or finish
    return tokens, finish


# -- the gateway's prompt ------------------------------------------------------------------------
def test_the_gateways_prompt_is_the_processors_and_the_models_positions(stack):
    """Token ids (dynamic-resolution placeholders), grids and rope delta, as the gateway computes them
    without weights, are the processor's and the loaded model's own."""
    for name, r in stack.requests.items():
        prompt = built(stack, r)
        assert (prompt.token_ids, prompt.image_grids, prompt.rope_delta) == (r.ids, r.grids, r.rope_delta), name
    assert len({g for r in stack.requests.values() for g in r.grids}) >= 5
    assert {r.rope_delta for r in stack.requests.values()} - {0}, "some case must have a non-zero rope delta"
    for placeholder in ("<|image_pad|>", "<|video_pad|>"):    # the client's text cannot smuggle in a placeholder
        chat = ChatCompletionRequest.model_validate(
            {"model": SERVED, "messages": [{"role": "user", "content": f"look {placeholder} here"}]})
        with pytest.raises(ApiError) as err:
            stack.builder.build_prompt(chat.messages, [])
        assert err.value.status == 400 and placeholder in err.value.message


# -- token identity ------------------------------------------------------------------------------
@pytest.mark.parametrize("placement, chunk_tokens", [("disaggregated", 7), ("disaggregated", 4096),
                                                     ("colocated", 5), ("colocated", 4096)],
                         ids=["disagg-chunk-7", "disagg-whole", "coloc-chunk-5", "coloc-whole"])
async def test_output_is_token_identical_to_generate(stack, leaks, placement, chunk_tokens):
    async with orchestrator(stack, placement, chunk_tokens, leaks) as o:
        got = {name: await run(o, stack, r) for name, r in stack.requests.items()}
    assert got == {name: (r.expected, r.finish) for name, r in stack.requests.items()}
    if chunk_tokens < 4096:    # the chunks really cut image spans
        three = stack.requests["three-images"].ids
        runs = image_runs(three, stack.adapter.image_token_id)
        assert any(s < b < e for s, e in runs for b in range(chunk_tokens, len(three), chunk_tokens))


@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_openai_client_through_a_gateway_process(stack, leaks, placement):
    if not stack.gateways:
        pytest.skip(f"the HTTP path is the same for every family: run for {HTTP_FAMILY}")
    client = OpenAI(base_url=f"{stack.gateways[placement].base}/v1", api_key="unused", max_retries=0)
    tokenizer = stack.builder.decode_tokenizer
    for name in ("three-images", "multi-turn", "text-only"):
        r = stack.requests[name]
        out = client.chat.completions.create(model=SERVED, messages=r.messages, max_tokens=MAX_TOKENS, temperature=0)
        assert out.usage.prompt_tokens == len(r.ids), name
        assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (len(r.expected), r.finish), name
        assert out.choices[0].message.content == tokenizer.decode(r.expected, skip_special_tokens=True), name


# -- handoffs that must be refused ---------------------------------------------------------------
def _deadline_ms(seconds: float = 30.0) -> int:
    return int((time.time() + seconds) * 1000)


@dataclass
class Direct:
    """Stubs on the stack's workers, and the requests' images encoded (their refs name the encoder)."""

    stack: Stack
    encoder: pb_grpc.EncoderStub
    decode: pb_grpc.DecodeStub
    prefill: pb_grpc.PrefillStub
    refs: dict[str, list[pb.ImageRef]]

    def digest(self, name: str, rope_delta: int, refs: list[pb.ImageRef] | None = None) -> str:
        refs = self.refs[name] if refs is None else refs
        return token_digest(self.stack.requests[name].ids, [x.cache_key for x in refs],
                            [tuple(x.grid_thw) for x in refs], rope_delta)

    async def reserve(self, name: str, digest: str, **delta) -> pb.ReserveResponse:
        r = self.stack.requests[name]
        return await self.decode.Reserve(pb.ReserveRequest(
            request_id=uuid.uuid4().hex, prompt_tokens=len(r.ids), max_tokens=MAX_TOKENS,
            deadline_unix_ms=_deadline_ms(), token_digest=digest, **delta), timeout=10)

    def generate(self, name: str, reservation: pb.Reservation, *, colocated: bool = False,
                 refs: list[pb.ImageRef] | None = None):
        request = pb.GenerateRequest(request_id=uuid.uuid4().hex, reservation=reservation, max_tokens=MAX_TOKENS,
                                     deadline_unix_ms=_deadline_ms())
        if colocated:
            request.colocated = True
            request.token_ids.extend(self.stack.requests[name].ids)
            request.images.extend(self.refs[name] if refs is None else refs)
        return self.decode.Generate(request, timeout=30)

    def prefill_request(self, name: str, reservation: pb.Reservation, digest: str, rope_delta: int,
                        refs: list[pb.ImageRef] | None = None) -> pb.PrefillRequest:
        return pb.PrefillRequest(
            request_id=uuid.uuid4().hex, token_ids=self.stack.requests[name].ids,
            images=self.refs[name] if refs is None else refs, decode_address=self.stack.worker("decode"),
            reservation=reservation, chunk_tokens=7, deadline_unix_ms=_deadline_ms(), token_digest=digest,
            rope_delta=rope_delta)


@pytest.fixture
async def direct(stack, leaks):
    channels = [grpc.aio.insecure_channel(stack.worker(role), options=GRPC_OPTIONS)
                for role in ("encoder", "decode", "prefill")]
    encoder = pb_grpc.EncoderStub(channels[0])
    refs = {}
    for name in ("one-image", "three-images"):
        r = stack.requests[name]
        images = [pb.EncodeImage(ref=pb.ImageRef(grid_thw=g), data=im.data) for g, im in zip(r.grids, r.images)]
        resp = await encoder.Encode(pb.EncodeRequest(request_id="direct", images=images), timeout=30)
        assert [list(i.grid_thw) for i in resp.images] == [list(g) for g in r.grids]   # the encoder's grids
        refs[name] = [pb.ImageRef(cache_key=i.cache_key, encoder_address=stack.worker("encoder"), grid_thw=g)
                      for i, g in zip(resp.images, r.grids)]
    try:
        yield Direct(stack, encoder, pb_grpc.DecodeStub(channels[1]), pb_grpc.PrefillStub(channels[2]), refs)
    finally:
        for ch in channels:
            await ch.close()


async def _generate_error(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    return err.value


async def test_reserve_without_a_rope_delta_is_refused(direct):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await direct.reserve("one-image", direct.digest("one-image", 0))    # no rope_delta field at all
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rope delta missing" in err.value.details()


async def test_a_prefill_request_with_a_wrong_rope_delta_is_refused(direct):
    """Reserve and PrefillRequest agree on a delta the prompt's positions do not give: prefill refuses before
    any KV moves, and the decode side's Generate never inserts."""
    name, true = "three-images", direct.stack.requests["three-images"].rope_delta
    digest = direct.digest(name, true + 1)
    res = (await direct.reserve(name, digest, rope_delta=true + 1)).reservation
    generate = direct.generate(name, res)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await direct.prefill.Prefill(direct.prefill_request(name, res, digest, true + 1), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "rope delta mismatch" in err.value.details()
    generate.cancel()
    await direct.decode.Release(pb.ReleaseRequest(reservation=res, reason="test"), timeout=5)


async def test_a_handoff_whose_rope_delta_disagrees_with_the_reservation_is_rejected(direct):
    """The reservation holds a wrong delta, prefill runs the right one: decode fails the transfer loudly
    (ABORTED naming the rope delta) and inserts nothing."""
    name, true = "one-image", direct.stack.requests["one-image"].rope_delta
    res = (await direct.reserve(name, direct.digest(name, true - 3), rope_delta=true - 3)).reservation
    generate = direct.generate(name, res)
    with pytest.raises(grpc.aio.AioRpcError) as prefill_err:
        await direct.prefill.Prefill(direct.prefill_request(name, res, direct.digest(name, true), true), timeout=30)
    err = await _generate_error(generate)
    assert err.code() == grpc.StatusCode.ABORTED and "rope delta mismatch" in err.details(), err.details()
    assert prefill_err.value.code() == grpc.StatusCode.ABORTED and "rope delta" in prefill_err.value.details()
    await direct.decode.Release(pb.ReleaseRequest(reservation=res, reason="test"), timeout=5)


def _kv_chunks(stack: Stack, name: str, reservation: pb.Reservation, digest: str,
               fetched: list[torch.Tensor]) -> tuple[list[pb.KVChunk], FirstToken]:
    """The prompt's real KV in chunks of 7, framed as prefill_svc frames them, final-chunk fields but no rope delta."""
    layout, r = stack.adapter.kv_layout, stack.requests[name]
    parts = list(stack.adapter.prefill(r.ids, fetched, 7))
    first = parts.pop()
    msgs = []
    for c in parts:
        assert isinstance(c, KVChunk)
        payload = c.kv.contiguous().view(torch.uint8).numpy().tobytes()
        msgs.append(pb.KVChunk(request_id="by-hand", reservation=reservation, chunk_index=c.index, layer_start=0,
                               layer_end=layout.layers, token_start=c.start, token_end=c.end,
                               dtype=dtype_name(layout.dtype), shape=list(c.kv.shape), payload=payload,
                               checksum=payload_checksum(payload)))
    last = msgs[-1]
    last.last, last.total_chunks, last.first_token = True, len(msgs), first.token_id
    last.token_digest, last.model_fingerprint, last.prefill_ms = digest, stack.adapter.model_fingerprint, 1.0
    return msgs, first


async def test_a_prefill_that_sends_no_rope_delta_is_rejected(direct):
    """KV pushed by hand (this process plays prefill): without the final chunk's rope delta the transfer
    fails, whatever else is right; the same chunks with it are accepted and decode the reference."""
    stack, name = direct.stack, "three-images"
    r = stack.requests[name]
    resp = await direct.encoder.Encode(pb.EncodeRequest(
        request_id="t", images=[pb.EncodeImage(ref=x) for x in direct.refs[name]], return_embeddings=True), timeout=30)
    fetched = [tensor_from_pb(i.embedding) for i in resp.images]
    digest = direct.digest(name, r.rope_delta)
    for with_delta in (False, True):
        res = (await direct.reserve(name, digest, rope_delta=r.rope_delta)).reservation
        generate = direct.generate(name, res)
        msgs, first = _kv_chunks(stack, name, res, digest, fetched)
        assert first.rope_delta == r.rope_delta
        if with_delta:
            msgs[-1].rope_delta = first.rope_delta
        reply = await direct.decode.PushKV(iter(msgs), timeout=30)
        if with_delta:
            assert reply.state == "SUCCESS", reply.detail
            tokens = [t async for ev in generate for t in ev.token_ids]
            assert tokens == r.expected
        else:
            assert reply.state == "FAILED" and "rope delta missing" in reply.detail, (reply.state, reply.detail)
            err = await _generate_error(generate)
            assert err.code() == grpc.StatusCode.ABORTED and "rope delta missing" in err.details()
            await direct.decode.Release(pb.ReleaseRequest(reservation=res, reason="test"), timeout=5)


async def test_a_colocated_prompt_whose_delta_is_not_the_reservations_is_refused(direct):
    name, true = "three-images", direct.stack.requests["three-images"].rope_delta
    res = (await direct.reserve(name, direct.digest(name, 0), rope_delta=0)).reservation   # the known bug: 0
    err = await _generate_error(direct.generate(name, res, colocated=True))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "rope delta mismatch" in err.details()
    assert str(true) in err.details()


@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
async def test_an_embedding_whose_grid_is_not_the_requests_is_a_fetch_failure(direct, placement):
    """A ref naming another grid (here: height and width swapped, the same number of tokens, so nothing
    else notices) means the cached entry is not this image: an embedding-fetch failure, not a 400."""
    name = "one-image"
    refs = [pb.ImageRef() for _ in direct.refs[name]]
    for ref, good in zip(refs, direct.refs[name]):
        ref.CopyFrom(good)
        t, h, w = good.grid_thw
        assert h != w
        ref.ClearField("grid_thw")
        ref.grid_thw.extend([t, w, h])
    true = direct.stack.requests[name].rope_delta
    digest = direct.digest(name, true, refs)
    res = (await direct.reserve(name, digest, rope_delta=true)).reservation
    if placement == "colocated":
        err = await _generate_error(direct.generate(name, res, colocated=True, refs=refs))
    else:
        generate = direct.generate(name, res)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await direct.prefill.Prefill(direct.prefill_request(name, res, digest, true, refs), timeout=30)
        err = caught.value
        generate.cancel()
        await direct.decode.Release(pb.ReleaseRequest(reservation=res, reason="test"), timeout=5)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and failure_kind(err) == FailureKind.EMBEDDING_FETCH
    assert "grid" in err.details()
