"""The decode prefix cache through real processes: identity, isolation, routing, restarts.

One encoder, one prefill and two decode workers on the demo model: ``on`` keeps a prefix cache
(16-token blocks), ``off`` runs with ``--no-prefix-cache``. The gateway is an in-process
``Orchestrator``; references are ``model.generate()`` of a model loaded here. Multi-turn
conversations about images are sent turn after turn (each turn's prompt is the whole history,
the model's own answers included) to each worker, and every turn's greedy output must be the
same through both and equal ``generate()``. The demo model's image takes positions 2..17, so a
second turn's cached prefix of one block ends inside the image span; a third turn's covers the
image, which the gateway then does not encode. Every test ends with the leak check
(``tests/leaks.py``): every block free or cached, nothing held.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import pytest
import torch
from cluster import DEMO_MODEL, Cluster
from leaks import LONG_LEASES, LeakCheck, orchestrator_counters

from gateway.chat_backend import ChatJob, PreparedImage
from launcher.processes import grpc_serving, wait_serving
from gateway.orchestrator import Orchestrator
from gateway.prefix_routing import PrefixView
from gateway.settings import GatewaySettings
from proto.epd.v1 import epd_pb2 as pb
from runtime.demo_model.shapes import QUESTIONS, draw_shape
from runtime.model.families.base import placeholder_runs
from runtime.model.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 8
IMAGE_TOKEN = json.loads((DEMO_MODEL / "config.json").read_text())["image_token_index"]   # the placeholder
BLOCK = 16


@dataclass
class Stack:
    cluster: Cluster
    encoder: str
    prefill: str
    on: str
    off: str
    model: object
    processor: object
    eos: int


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("prefix"))
    try:
        encoder = cluster.start("encoder")
        on = cluster.start("decode", env={**LONG_LEASES, "EPD_KV_BLOCK_SIZE": str(BLOCK)})
        off = cluster.start("decode", "--no-prefix-cache", env={**LONG_LEASES, "EPD_KV_BLOCK_SIZE": str(BLOCK)})
        prefill = cluster.start("prefill")
        from transformers import AutoModelForImageTextToText, AutoProcessor

        processor = AutoProcessor.from_pretrained(DEMO_MODEL)
        model = AutoModelForImageTextToText.from_pretrained(DEMO_MODEL).eval()
        cluster.wait_healthy()
        yield Stack(cluster, encoder.address, prefill.address, on.address, off.address, model, processor,
                    int(model.generation_config.eos_token_id))
    finally:
        cluster.stop()


@pytest.fixture
async def leak_check(stack):
    check = LeakCheck.of_cluster(stack.cluster).begin()
    yield check
    await check.settled()


@asynccontextmanager
async def gateway(stack: Stack, decode: list[str], placement: str = "colocated"):
    o = Orchestrator(GatewaySettings(encoder_addrs=[stack.encoder], prefill_addrs=[stack.prefill], decode_addrs=decode,
                                     placement=placement, prefill_chunk_tokens=8))
    await o.start()
    try:
        yield o
    finally:
        await o.close()


def image(seed: int):
    return draw_shape(random.Random(seed)).image


class Conversation:
    """A chat whose turns are sent one after another; each turn's prompt holds the whole history."""

    def __init__(self, stack: Stack, salt: str = ""):
        self.stack, self.salt = stack, salt
        self.messages: list[dict] = []
        self.images: list = []

    def ask(self, text: str, with_image=None) -> None:
        content = ([{"type": "image"}] if with_image is not None else []) + [{"type": "text", "text": text}]
        self.messages.append({"role": "user", "content": content})
        if with_image is not None:
            self.images.append(with_image)

    def prompt(self) -> list[int]:
        text = self.stack.processor.apply_chat_template(self.messages, add_generation_prompt=True)
        kwargs = {"images": self.images} if self.images else {}
        return self.stack.processor(text=text, **kwargs)["input_ids"][0]

    def expected(self, ids: list[int]) -> list[int]:
        kwargs = {"images": self.images} if self.images else {}
        text = self.stack.processor.apply_chat_template(self.messages, add_generation_prompt=True)
        enc = self.stack.processor(text=text, return_tensors="pt", **kwargs)
        assert enc["input_ids"][0].tolist() == ids
        with torch.inference_mode():
            out = self.stack.model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids):].tolist()
        return out[: out.index(self.stack.eos)] if self.stack.eos in out else out

    def job(self, ids: list[int]) -> ChatJob:
        now = time.monotonic()
        pngs = []
        for im in self.images:
            buf = io.BytesIO()
            im.save(buf, "PNG")
            pngs.append(PreparedImage(buf.getvalue(), im))
        return ChatJob(uuid.uuid4().hex, list(ids), pngs, MAX_TOKENS, SamplingParams(temperature=0.0), now + 60.0,
                       1000.0, now, cache_salt=self.salt, image_tokens=placeholder_runs(ids, IMAGE_TOKEN),
                       image_token_id=IMAGE_TOKEN)

    def answer(self, tokens: list[int]) -> None:
        self.messages.append({"role": "assistant", "content": self.stack.processor.decode(tokens) or "none"})


async def send(o: Orchestrator, job: ChatJob) -> tuple[list[int], dict]:
    tokens, breakdown = [], {}
    async for ev in o.generate(job):
        tokens += ev.token_ids
        breakdown = ev.ttft_breakdown or breakdown
    return tokens, breakdown


def span_of_first_image(ids: list[int]) -> tuple[int, int]:
    start = ids.index(IMAGE_TOKEN)
    return start, start + placeholder_runs(ids, IMAGE_TOKEN)[0]


# -- tests ---------------------------------------------------------------------------------------
async def test_cache_on_is_token_identical_to_cache_off_over_multi_turn_conversations(stack, leak_check):
    x, y, z = image(11), image(12), image(13)
    scripts = [  # (question, image sent with it)
        [(QUESTIONS[0], x), (QUESTIONS[1], None), (QUESTIONS[2], None), (QUESTIONS[3], None)],
        [(QUESTIONS[2], z), (QUESTIONS[0], y), (QUESTIONS[1], None)],          # the conversation changes its image
    ]
    inside_image = covered_image = 0
    async with gateway(stack, [stack.on]) as on, gateway(stack, [stack.off]) as off:
        for script in scripts:
            conv = Conversation(stack)
            for turn, (question, im) in enumerate(script):
                conv.ask(question, im)
                ids = conv.prompt()
                expected = conv.expected(ids)
                tokens_on, b_on = await send(on, conv.job(ids))
                tokens_off, b_off = await send(off, conv.job(ids))
                assert tokens_on == tokens_off == expected, f"turn {turn}"
                assert b_off["cached_tokens"] == 0
                cached = int(b_on["cached_tokens"])
                if turn == 0:
                    assert cached == 0
                else:
                    assert cached > 0 and cached % BLOCK == 0 and cached < len(ids)
                    start, end = span_of_first_image(ids)
                    if start < cached < end:
                        inside_image += 1
                        assert b_on.get("images_prefix_cached", 0) == 0    # its tail is computed: it was encoded
                    elif cached >= end and len(conv.images) == 1:
                        covered_image += 1
                        assert b_on["images_prefix_cached"] == 1             # its KV is there: not encoded
                conv.answer(tokens_on)
    assert inside_image >= 1 and covered_image >= 1


async def test_same_text_with_another_image_or_another_salt_gets_no_hit(stack, leak_check):
    async with gateway(stack, [stack.on]) as o:
        first = Conversation(stack)
        first.ask(QUESTIONS[3], image(21))
        ids = first.prompt()
        tokens, b = await send(o, first.job(ids))
        assert tokens == first.expected(ids) and b["cached_tokens"] == 0

        other = Conversation(stack)
        other.ask(QUESTIONS[3], image(22))                  # the same text, another image
        other_ids = other.prompt()
        assert len(other_ids) == len(ids) and other_ids == ids   # the token ids alone are the same
        tokens, b = await send(o, other.job(other_ids))
        assert b["cached_tokens"] == 0 and tokens == other.expected(other_ids)

        same = Conversation(stack)
        same.ask(QUESTIONS[3], image(21))
        tokens, b = await send(o, same.job(ids))
        assert b["cached_tokens"] == BLOCK                   # the same prompt again: its full block is reused

        salted = Conversation(stack, salt="tenant-b")
        salted.ask(QUESTIONS[3], image(21))
        tokens, b = await send(o, salted.job(ids))
        assert b["cached_tokens"] == 0 and tokens == same.expected(ids)


async def test_after_load_every_block_is_free_or_cached(stack, leak_check):
    async with gateway(stack, [stack.on]) as o:
        convs = [Conversation(stack) for _ in range(4)]
        for i, c in enumerate(convs):
            c.ask(QUESTIONS[i], image(30 + i))
        for _ in range(2):
            jobs = [c.job(c.prompt()) for c in convs]
            results = await asyncio.gather(*(send(o, j) for j in jobs))
            for c, (tokens, _) in zip(convs, results):
                c.answer(tokens)
                c.ask(QUESTIONS[0])
        await leak_check.settled()
        await o.registry.refresh()
        on = o.registry.get("decode", stack.on).stats
        assert on.free_blocks == on.total_blocks and on.cached_blocks > 0   # every block free or evictable-cached
        assert on.prefix_cache and on.prefix_cache_hits_total > 0
        assert on.prefix_cache_queries_total >= on.prefix_cache_hits_total
        status = {w["address"]: w for w in o.status()["decode"]}[stack.on]
        assert status["cached_blocks"] == on.cached_blocks and status["prefix_cache_hits_total"] > 0


async def test_the_gateway_routes_to_the_worker_holding_the_prefix_and_forgets_a_restarted_one(stack, leak_check):
    async with gateway(stack, [stack.on]) as pinned, gateway(stack, [stack.on, stack.off]) as both:
        convs = [Conversation(stack) for _ in range(3)]
        for i, c in enumerate(convs):
            c.ask(QUESTIONS[i], image(40 + i))
            tokens, _ = await send(pinned, c.job(c.prompt()))
            c.answer(tokens)
            c.ask(QUESTIONS[(i + 1) % 4])
        await both.registry.refresh()
        for c in convs:
            ids = c.prompt()
            view = PrefixView.of(c.job(ids), _keys(both, c), both.registry.healthy("decode"))
            assert view.cached_tokens(stack.on) > 0 and view.cached_tokens(stack.off) == 0
            tokens, b = await send(both, c.job(ids))
            assert b["cached_tokens"] > 0 and tokens == c.expected(ids)   # it went where the prefix is

        victim = next(w for w in stack.cluster.workers if w.address == stack.on)
        port = int(stack.on.rsplit(":", 1)[1])
        victim.proc.kill()
        victim.proc.wait()
        leak_check.exclude(victim)
        await both.registry.refresh()
        assert both.registry.get("decode", stack.on).prefix_summary == frozenset()
        replacement = stack.cluster.start("decode", env={**LONG_LEASES, "EPD_KV_BLOCK_SIZE": str(BLOCK)}, port=port)
        await asyncio.to_thread(wait_serving, partial(grpc_serving, replacement.address), [replacement.process],
                                90.0, "the restarted decode worker")
        for o in (both, pinned):                          # taken back once its polls succeed (gRPC reconnects)
            end = time.monotonic() + 15.0
            while not o.registry.get("decode", stack.on).healthy:
                assert time.monotonic() < end, "the restarted worker was not taken back"
                await asyncio.sleep(0.2)
        c = convs[0]
        ids = c.prompt()
        view = PrefixView.of(c.job(ids), _keys(both, c), both.registry.healthy("decode"))
        assert view.cached_tokens(stack.on) == 0                      # what it no longer has
        tokens, b = await send(pinned, c.job(ids))
        assert b["cached_tokens"] == 0 and tokens == c.expected(ids)
        assert replacement.address == stack.on


def _keys(o: Orchestrator, c: Conversation) -> list[str]:
    """The images' content keys as the gateway computes them (its encoder step)."""
    from cache.keys import image_content_key

    enc = o.registry.healthy("encoder")[0].stats
    return [image_content_key(im, enc.model_fingerprint, enc.preprocess_digest, c.salt) for im in c.images]


def test_a_worker_without_the_cache_reports_none(stack):
    import grpc

    from proto.epd.v1 import epd_pb2_grpc as pb_grpc
    from runtime.worker.wire import GRPC_OPTIONS

    async def stats():
        async with grpc.aio.insecure_channel(stack.off, options=GRPC_OPTIONS) as ch:
            return await pb_grpc.DecodeStub(ch).Stats(pb.StatsRequest(), timeout=5)

    s = asyncio.run(stats())
    assert not s.prefix_cache and s.cached_blocks == 0 and s.prefix_cache_hits_total == 0
